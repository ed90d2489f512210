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
// dot4I8Packed is an exact int32 dot product of four signed bytes; |D| <= 127 * 127 * width
// < 2^31 for widths up to 16384 * 8, so every sum is exact in any order. The host turns the
// sums into bounds in float64 (runtime/head.py: bounds_from_sums).

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

var<workgroup> red: array<vec2<i32>, 64>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>) {
    let r = (wid.x + wid.y * nw.x) * (WG / LANES) + li / LANES;
    let lane = li % LANES;
    var d1 = 0;
    var d2 = 0;
    if (r < ROWS) {
        let row = r * W4;
        let half = W4 / 4u;
        for (var j = lane; j < half; j += LANES) {
            let b = row + 4u * j;
            let a = X[j];
            let q = X[half + j];
            let c = vec4<u32>(C[b], C[b + 1u], C[b + 2u], C[b + 3u]);
            d1 += dot4I8Packed(c.x, a.x) + dot4I8Packed(c.y, a.y)
                + dot4I8Packed(c.z, a.z) + dot4I8Packed(c.w, a.w);
            d2 += dot4I8Packed(c.x, q.x) + dot4I8Packed(c.y, q.y)
                + dot4I8Packed(c.z, q.z) + dot4I8Packed(c.w, q.w);
        }
    }
    if (LANES > 1u) {
        red[li] = vec2<i32>(d1, d2);
        workgroupBarrier();
        if (lane == 0u) {
            for (var l = 1u; l < LANES; l++) {
                d1 += red[li + l].x;
                d2 += red[li + l].y;
            }
        }
    }
    if (lane == 0u && r < ROWS) {
        D[2u * (P.row0 + r)] = d1;
        D[2u * (P.row0 + r) + 1u] = d2;
    }
}
