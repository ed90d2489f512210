// lm_head_step.wgsl: the decode step's LM head over one chunk of the (unquantized) head rows,
// with the first half of the greedy argmax: logits[r] = dot(E[r], x) as lm_head.wgsl computes
// them (lm_head_row.wgsl), LPR lanes of a subgroup per row, and per workgroup the largest of its
// RPW logits and its row (the lowest row among equal values; NaN never wins) written to
// PT[P.pbase + workgroup], which argmax_step.wgsl reduces. GATE = 1 (the screened head's
// step): only where the screen did not hold, G[0] (the candidate count) above CAP; otherwise
// every row is skipped (argmax_screen.wgsl then ignores PT).
//
// Bindings (group 0):
//   0  storage, read        X: array<vec4<f32>>  x [DIM] (the final RMSNorm's output)
//   1  storage, read        E: array<u32>        rows P.row0 .. P.row0 + ROWS of the head
//   2  uniform              P: HeadStep          row0, pbase
//   3  storage, read_write  L: array<f32>        logits [vocab]
//   4  storage, read_write  PT: array<vec2<u32>> (value bits, row) per workgroup
//   5  storage, read        G: array<u32>        GATE = 1: G[0] the candidate count
// Overrides: ROWS, DIM, DTYPE (0 f32, 1 f16, 2 bf16), RPW (<= 256), LPR, GATE, CAP. Needs
// subgroups.

override ROWS: u32;
override DIM: u32;
override DTYPE: u32 = 1u;
override LANES: u32 = 1u;  // unused here (lm_head_row.wgsl's lane_total)
override RPW: u32 = 32u;
override LPR: u32 = 32u;
override GATE: u32 = 0u;
override CAP: u32 = 0u;

struct HeadStep {
    row0: u32,
    pbase: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<X_SPACE> X: XF_TYPE;
@group(0) @binding(1) var<storage, read> E: array<u32>;
@group(0) @binding(2) var<uniform> P: HeadStep;
@group(0) @binding(3) var<storage, read_write> L: array<f32>;
@group(0) @binding(4) var<storage, read_write> PT: array<vec2<u32>>;
@group(0) @binding(5) var<storage, read> G: array<u32>;

//#include lm_head_row.wgsl
//#include lm_head_lanes.wgsl

var<workgroup> best: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid3: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>, @builtin(subgroup_size) sgs: u32,
        @builtin(subgroup_invocation_id) sl: u32, @builtin(subgroup_id) sid: u32,
        @builtin(num_subgroups) ns: u32) {
    let wid = wid3.x + wid3.y * nw.x;
    let lpr = select(min(LPR, sgs), 1u, LPR == 1u);  // a constant 1 where LPR is (CPU adapters)
    let rps = sgs / lpr;
    let lane = sl % lpr;
    let run = GATE == 0u || G[0] > CAP;
    for (var k0 = sid * rps; k0 < RPW; k0 += ns * rps) {
        let k = k0 + sl / lpr;
        let r = wid * RPW + k;
        let live = run && k < RPW && r < ROWS;
        let acc = row_logit(r, lane, lpr, live);
        if (lane == 0u && k < RPW) {
            if (live) {
                L[P.row0 + r] = acc;
            }
            best[k] = acc;
        }
    }
    workgroupBarrier();
    if (li == 0u) {
        var v = -3.4028234663852886e38;
        var at = 0xFFFFFFFFu;
        for (var k = 0u; k < min(RPW, ROWS - min(ROWS, wid * RPW)); k++) {
            let w = best[k];
            if (w > v || (at == 0xFFFFFFFFu && w == v)) {
                v = w;
                at = k;
            }
        }
        PT[P.pbase + wid] = vec2<u32>(bitcast<u32>(v), select(P.row0 + wid * RPW + at,
                                                               0xFFFFFFFFu, at == 0xFFFFFFFFu));
    }
}
