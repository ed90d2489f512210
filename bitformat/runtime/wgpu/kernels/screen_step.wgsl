// screen_step.wgsl: screen.wgsl's exact integer sums (screen_sums.wgsl) for every row of one chunk of the int8
// copy of the head, turned into float32 bounds lo <= l_v <= hi on the device (the screened
// head's greedy decode step, docs/exact-head.md, "The screened head on the device"): the
// bounds go to LH[v], and each workgroup's largest lo into SP[4] by atomicMax on an
// order-preserving key, which screen_pick.wgsl reads.
//
// Bindings (group 0):
//   0  X_SPACE   X: array<vec4<u32>, ...>   q1 then q2 (screen_prep.wgsl)
//   1  storage, read        C: array<u32>   rows P.row0 .. P.row0 + ROWS: W4 words of 4 int8
//   2  uniform              P: Screen       P.row0: the chunk's first row
//   3  storage, read_write  LH: array<vec2<f32>>  (lo, hi) of row v
//   4  storage, read        T: array<vec4<f32>>   per row: d (the int8 step), A, N (the
//                                                 bound's terms per unit of ||x'|| and of
//                                                 ||x' - x^||, rounded up), 0
//   5  storage, read_write  SP: array<atomic<u32>> p, ||x'|| bound, ||x' - x^|| bound, ok, key
// Overrides: ROWS, W4, LANES, SLACK (the bound's absolute slack, rounded up).
//
// The host's bound (runtime/head.py: bounds_from_sums) in float32: with X = 254 D1 + D2 and
// W = d (254 |D1| + |D2|) p, a = d X p is within 6 u W of its exact value (D1 and D2 rounded
// to f32, three products and a sum, d rounded to f32 once at load; u = 2^-23), so
// b = (A ||x'|| + N ||x' - x^|| + SLACK + 2^-18 W + 2^-120) (1 + 2^-18) covers the bound, the
// rounding of its own few positive terms, of lo = a - b and hi = a + b, and underflow.

override ROWS: u32;
override W4: u32;
override LANES: u32 = 1u;
override SLACK: f32 = 0.0;

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
@group(0) @binding(3) var<storage, read_write> LH: array<vec2<f32>>;
@group(0) @binding(4) var<storage, read> T: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> SP: array<atomic<u32>>;

//#include screen_sums.wgsl

var<workgroup> top: array<f32, 64>;

// f32 bits -> a u32 that orders as the values do (-0 just below +0)
fn key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>) {
    let r = (wid.x + wid.y * nw.x) * (WG / LANES) + li / LANES;
    let lane = li % LANES;
    let d = row_sums(r, lane, li);
    var lo = -3.4028234663852886e38;
    if (lane == 0u && r < ROWS) {
        let v = P.row0 + r;
        let t = T[v];
        let p = bitcast<f32>(atomicLoad(&SP[0]));
        let nx = bitcast<f32>(atomicLoad(&SP[1]));
        let ndx = bitcast<f32>(atomicLoad(&SP[2]));
        let f1 = f32(d.x);
        let f2 = f32(d.y);
        let a = t.x * (254.0 * f1 + f2) * p;
        let w = t.x * (254.0 * abs(f1) + abs(f2)) * p;
        let b = (t.y * nx + t.z * ndx + SLACK + w * 3.8146973e-6 + 7.5231638e-37) * 1.0000038;
        lo = a - b;
        LH[v] = vec2<f32>(lo, a + b);
    }
    top[li] = lo;
    workgroupBarrier();
    for (var o = 32u; o > 0u; o >>= 1u) {
        if (li < o) {
            top[li] = max(top[li], top[li + o]);
        }
        workgroupBarrier();
    }
    if (li == 0u) {
        atomicMax(&SP[4], key(top[0]));
    }
}
