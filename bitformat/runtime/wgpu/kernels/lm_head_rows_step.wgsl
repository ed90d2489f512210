// lm_head_rows_step.wgsl: lm_head_step.wgsl's logits of listed rows only (the screened head's
// candidates, ascending ids), with the same per-row arithmetic (lm_head_lanes.wgsl), so a
// candidate's logit has the bits the full head gives it. CAND = 1: the candidates the device
// chose (screen_pick.wgsl): IDS[0] their count (above CAP: none, the full head runs), their
// ids from IDS[1] in any order, P.n the rows of this chunk; candidate i's logit goes to L[i]
// if its row is in this chunk (a grid of CAP / RPW workgroups per chunk).
//
// Bindings (group 0):
//   0  storage, read        X: array<vec4<f32>>  x [DIM]
//   1  storage, read        E: array<u32>        rows P.row0 .. of the head (one chunk)
//   2  uniform              P: Rows              row0, n (listed rows in this chunk), first
//   3  storage, read_write  L: array<f32>        L[first + i] = logit of IDS[first + i]
//   4  storage, read        IDS: array<u32>
// Overrides: DIM, DTYPE, RPW, LPR (as the full head's), CAND, CAP. Needs subgroups.

override DIM: u32;
override DTYPE: u32 = 1u;
override LANES: u32 = 1u;  // unused here (lm_head_row.wgsl's lane_total)
override RPW: u32 = 32u;
override LPR: u32 = 32u;
override CAND: u32 = 0u;
override CAP: u32 = 0u;

struct Rows {
    row0: u32,
    n: u32,
    first: u32,
    pad0: u32,
}

@group(0) @binding(0) var<X_SPACE> X: XF_TYPE;
@group(0) @binding(1) var<storage, read> E: array<u32>;
@group(0) @binding(2) var<uniform> P: Rows;
@group(0) @binding(3) var<storage, read_write> L: array<f32>;
@group(0) @binding(4) var<storage, read> IDS: array<u32>;

//#include lm_head_row.wgsl
//#include lm_head_lanes.wgsl

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid3: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(subgroup_size) sgs: u32, @builtin(subgroup_invocation_id) sl: u32,
        @builtin(subgroup_id) sid: u32, @builtin(num_subgroups) ns: u32) {
    let wid = wid3.x + wid3.y * nw.x;
    let lpr = select(min(LPR, sgs), 1u, LPR == 1u);  // a constant 1 where LPR is (CPU adapters)
    let rps = sgs / lpr;
    let lane = sl % lpr;
    for (var k0 = sid * rps; k0 < RPW; k0 += ns * rps) {
        let k = k0 + sl / lpr;
        let i = wid * RPW + k;
        var live = k < RPW && i < P.n;
        var r = 0u;
        var at = P.first + i;
        if (CAND == 1u) {
            let n = IDS[0];
            at = i;
            live = k < RPW && n <= CAP && i < n;
            if (live) {
                r = IDS[1u + i] - P.row0;  // (wraps above u32 for rows before the chunk)
                live = r < P.n;
            }
        } else if (live) {
            r = IDS[P.first + i] - P.row0;
        }
        let acc = row_logit(r, lane, lpr, live);
        if (live && lane == 0u) {
            L[at] = acc;
        }
    }
}
