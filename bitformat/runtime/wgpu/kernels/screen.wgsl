// screen.wgsl: the screened head's int8 screen (docs/exact-head.md): for every row of one
// chunk of the int8 copy of the head, the exact integer sums D1 = c . q1 and D2 = c . q2.
//
// Bindings (group 0):
//   0  X_SPACE   X: array<vec4<u32>, ...>   q1 (W4 words of 4 int8) then q2 (W4 words)
//   1  storage, read        C: array<u32>   rows P.row0 .. P.row0 + ROWS: W4 words of 4 int8
//   2  uniform              P: Screen       P.row0: the chunk's first row
//   3  storage, read_write  D: array<i32>   D[2 v] = D1, D[2 v + 1] = D2 of row v
// Overrides: ROWS, W4 (words per row: the padded width / 4, a multiple of 16), LANES.
//
// The sums are exact (screen_sums.wgsl); the host turns them into bounds in float64
// (runtime/head.py: bounds_from_sums).

override ROWS: u32;
override W4: u32;
override LANES: u32 = 1u;

const WG: u32 = 64u;

struct Screen {
    row0: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<X_SPACE> X: X_TYPE;
@group(0) @binding(1) var<storage, read> C: array<u32>;
@group(0) @binding(2) var<uniform> P: Screen;
@group(0) @binding(3) var<storage, read_write> D: array<i32>;

//#include screen_sums.wgsl

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>) {
    let r = (wid.x + wid.y * nw.x) * (WG / LANES) + li / LANES;
    let lane = li % LANES;
    let d = row_sums(r, lane, li);
    if (lane == 0u && r < ROWS) {
        D[2u * (P.row0 + r)] = d.x;
        D[2u * (P.row0 + r) + 1u] = d.y;
    }
}
