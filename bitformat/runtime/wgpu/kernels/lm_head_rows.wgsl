// lm_head_rows.wgsl: the screened head's rescoring (docs/exact-head.md): lm_head.wgsl's logits
// of listed rows only, with the very same per-row code (lm_head_row.wgsl).
//
// Bindings (group 0):
//   0  X_SPACE   X: array<vec4<f32>, ...>   x [DIM]
//   1  storage, read        E: array<u32>   rows P.row0 .. of one chunk of the head
//   2  uniform              P: Rows         this chunk's P.n candidates: IDS[P.first ..]
//   3  storage, read_write  L: array<f32>   L[P.first + i] = logit of row IDS[P.first + i]
//   4  storage, read        IDS: array<u32> the candidates' (global) row ids, ascending
// Overrides: DIM, DTYPE, LANES (as lm_head.wgsl).

override DIM: u32;
override DTYPE: u32 = 1u;
override LANES: u32 = 1u;

const WG: u32 = 64u;

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

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>) {
    let i = (wid.x + wid.y * nw.x) * (WG / LANES) + li / LANES;
    let lane = li % LANES;
    var part = 0.0;
    if (i < P.n) {
        part = row_part(IDS[P.first + i] - P.row0, lane, LANES);
    }
    let acc = lane_total(part, li, lane);
    if (lane == 0u && i < P.n) {
        L[P.first + i] = acc;
    }
}
