// matmat_i2_s.wgsl: one projection of a batched prompt over i2_s rows, TPW tokens a workgroup:
// each weight unit a lane loads is dotted with all of its tokens' activations, so the weights
// are read once per TPW tokens instead of once per token (fused_matvec.wgsl with YS > 0 runs a
// workgroup per token, each quantizing its input again). The activation blocks come from one
// norm_block.wgsl dispatch over the chunk (grid z = token, LAYOUT 0), the same quantization as
// fused_matvec's prologue, and every row value is computed as fused_matvec computes it:
//
//     v = row_value(sum of the lanes' integer dots, scale) * out_scale    (rows_i2_s.wgsl)
//     MODE 0: Y = v    MODE 1: Y = Y + v    MODE 2: Y = act(v_gate) * v_up
//
// so a prompt gives the same bits batched or token by token.
//
// Bindings (group 0):
//   0  storage, read        Q: array<vec4<u32>>  activation blocks, XV4 vec4s per token
//   1  storage, read        ST: array<u32>       the step state: the chunk's tokens are
//                                                ST[2] - ST[1]
//   2  uniform              P: FParams (row_store.wgsl)
//   3  storage, read_write  Y: array<f32>        token t's outputs start at float t * YS
//   4  storage, read        W: the rows (rows_i2_s.wgsl)
// Overrides: ROWS, COLS, MODE, ACT, RPW, LPR, YS, BLK. Substituted: XV4, TPW_N (tokens a
// workgroup), TXV4 (= TPW_N * XV4). Grid: x (and y) the row groups, z the token groups.

override ROWS: u32;
override COLS: u32;
override MODE: u32 = 0u;
override ACT: u32 = 0u;
override RPW: u32 = 32u;
override LPR: u32 = 8u;
override YS: u32;
override BLK: u32 = 128u;

const WGS: u32 = 256u;
const QOFF: u32 = 256u;
const TPW: u32 = TPW_N;

@group(0) @binding(0) var<storage, read> Q: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ST: array<u32>;
@group(0) @binding(2) var<uniform> P: FParams;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

var<workgroup> X: array<vec4<u32>, TXV4>;
var<private> xb: u32;  // the vec4 where the block being read starts (XBASE)

//#include act_block.wgsl
//#include rows_i2_s.wgsl
//#include row_store.wgsl

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid3: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>, @builtin(subgroup_size) sgs: u32,
        @builtin(subgroup_invocation_id) sl: u32, @builtin(subgroup_id) sid: u32,
        @builtin(num_subgroups) ns: u32) {
    let wid = wid3.x + wid3.y * nw.x;
    let t0 = wid3.z * TPW;
    let nt = min(TPW, ST[2] - ST[1] - t0);  // this workgroup's tokens
    for (var i = li; i < nt * XV4; i += WGS) {
        X[i] = Q[t0 * XV4 + i];
    }
    workgroupBarrier();
    let lpr = select(min(LPR, sgs), 1u, LPR == 1u);
    let rps = sgs / lpr;
    let lane = sl % lpr;
    let n = COLS / 64u;
    for (var k0 = sid * rps; k0 < RPW; k0 += ns * rps) {
        let k = k0 + sl / lpr;
        let r = wid * RPW + k;
        let live = k < RPW && r < ROWS;
        var ia: array<i32, TPW>;
        var ib: array<i32, TPW>;
        for (var t = 0u; t < TPW; t++) {
            ia[t] = 0i;
            ib[t] = 0i;
        }
        if (live) {
            let row = r * n;
            let row2 = P.bound.w / 4u + r * n;
            for (var u = lane; u < n; u += lpr) {
                let w = W[row + u];
                var w2 = vec4<u32>(0u);
                if (MODE == 2u) {
                    w2 = W[row2 + u];
                }
                for (var t = 0u; t < TPW; t++) {
                    if (t < nt) {
                        xb = t * XV4;
                        ia[t] += unit_dot(w, u);
                        if (MODE == 2u) {
                            ib[t] += unit_dot(w2, u);
                        }
                    }
                }
            }
        }
        for (var t = 0u; t < TPW; t++) {
            var acc = vec2<f32>(f32(ia[t]), f32(ib[t]));
            for (var o = lpr / 2u; o > 0u; o >>= 1u) {
                acc += vec2<f32>(subgroupShuffleXor(acc.x, o), subgroupShuffleXor(acc.y, o));
            }
            if (live && lane == 0u && t < nt) {
                xb = t * XV4;  // token t's block, for row_value
                store_row(P.bound.z + r, (t0 + t) * YS + P.bound.z + r, acc);
            }
        }
    }
}
