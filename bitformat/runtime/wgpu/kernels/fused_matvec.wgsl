// fused_matvec.wgsl: one projection of the decode step in one dispatch. Every workgroup
// normalizes and quantizes the input vector itself (quant_prologue.wgsl: RMSNorm or plain
// absmax, int8, into workgroup memory), then computes its rows' dot products with the format's
// code (rows_<format>.wgsl, pasted as ROWS_INCLUDE), LPR lanes of a subgroup per row, reduced
// by subgroup shuffles, and finishes each row as row_store.wgsl says (MODE 0 store, 1 the
// residual add, 2 act(gate) * up; stacked matrices each with their own scales).
//
// Bindings (group 0):
//   0  storage, read        A: array<vec4<f32>>  the input x [COLS] (COMBINE = 1: gate outputs;
//                           COMBINE = 2: attention's runs, quant_prologue.wgsl)
//   1  storage, read        U: array<vec4<f32>>  COMBINE = 1: up outputs [COLS]; COMBINE = 2:
//                           the step state; else unused
//   2  storage, read        G: array<vec4<f32>>  RMSNorm gains [COLS] (NORM = 1)
//   3  uniform              P: FParams
//   4  storage, read_write  Y: array<f32>   output, rows P.bound.z .. (a chunk's first row)
//   5  storage, read_write  T: array<u32>   TRACE = 1: the quantization (quant_prologue.wgsl)
//   6  storage, read        W: the rows (rows_<format>.wgsl)
// Overrides: ROWS (rows of this dispatch), COLS, MODE, ACT, NORM, COMBINE (and for 2: HD, SMAX,
// SPLIT, SPAR, CMAX), EPS, LAYOUT (0 plain,
// 1 slot16 activations), RPW (rows per workgroup), LPR (lanes per row, a power of two; fewer
// if the subgroup is smaller), TRACE, and the format's own (BLK for i2_s).
//
// Batched prefill (YS > 0): grid z is the token; its input is row z of A (and U), its output
// starts at float z * YS of Y, and each workgroup quantizes its token's input.
//
// Workgroups of WGS = 256 invocations; the rows of workgroup w are w * RPW .. + RPW - 1, taken
// by the subgroups sgs / LPR at a time. Needs the `subgroup` feature (any order of the lanes'
// partial sums is exact: they are integers below 2^24, or for tq formats the f32 sums of
// d-scaled integers that the op-by-op kernel adds in another order too).

override ROWS: u32;
override COLS: u32;
override MODE: u32 = 0u;
override ACT: u32 = 0u;
override NORM: u32 = 1u;
override COMBINE: u32 = 0u;
override EPS: f32 = 1e-5;
override LAYOUT: u32 = 0u;
override RPW: u32 = 8u;
override LPR: u32 = 32u;
override TRACE: u32 = 0u;
override BLK: u32 = 128u;
override YS: u32 = 0u;  // batched prefill: output floats per token (grid z = token)

@group(0) @binding(0) var<storage, read> A: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> U: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> G: array<vec4<f32>>;
@group(0) @binding(3) var<uniform> P: FParams;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;
@group(0) @binding(5) var<storage, read_write> T: array<u32>;

var<workgroup> X: array<vec4<u32>, XV4>;

//#include quant_prologue.wgsl
//#include act_block.wgsl
//#include ROWS_INCLUDE
//#include row_store.wgsl

var<private> ybase: u32;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid3: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>, @builtin(subgroup_size) sgs: u32,
        @builtin(subgroup_invocation_id) sl: u32, @builtin(subgroup_id) sid: u32,
        @builtin(num_subgroups) ns: u32) {
    let wid = wid3.x + wid3.y * nw.x;
    abase = wid3.z * (COLS / 4u);
    ybase = wid3.z * YS;
    let lpr = select(min(LPR, sgs), 1u, LPR == 1u);  // a constant 1 where LPR is (CPU adapters)
    let rps = sgs / lpr;  // rows a subgroup takes at once
    let lane = sl % lpr;
    // the first rows' first weights are loaded before the activations are ready
    let k1 = sid * rps + sl / lpr;
    let r1 = min(wid * RPW + k1, ROWS - 1u);
    let pre = row_pre(0u, r1, lane, lpr);
    var pre2 = pre;
    if (MODE == 2u) {
        pre2 = row_pre(P.bound.w, r1, lane, lpr);
    }
    quant_prologue(li, wid + wid3.z, sl, sid, ns, sgs);
    for (var k0 = sid * rps; k0 < RPW; k0 += ns * rps) {
        let k = k0 + sl / lpr;
        let r = wid * RPW + k;
        let live = k < RPW && r < ROWS;
        var acc = vec2<f32>(0.0, 0.0);
        if (live) {
            if (k == k1) {
                acc.x = row_dot_pre(pre, 0u, r, lane, lpr);
                if (MODE == 2u) {
                    acc.y = row_dot_pre(pre2, P.bound.w, r, lane, lpr);
                }
            } else {
                acc.x = row_dot(0u, r, lane, lpr);
                if (MODE == 2u) {
                    acc.y = row_dot(P.bound.w, r, lane, lpr);
                }
            }
        }
        for (var o = lpr / 2u; o > 0u; o >>= 1u) {
            acc += vec2<f32>(subgroupShuffleXor(acc.x, o), subgroupShuffleXor(acc.y, o));
        }
        if (live && lane == 0u) {
            store_row(P.bound.z + r, ybase + P.bound.z + r, acc);
        }
    }
}
