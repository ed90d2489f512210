// screen_prep.wgsl: the screened head's input on the device, the first of its greedy decode
// step (docs/exact-head.md, "The screened head on the device"): the final hidden state x (the
// f32 bits the full head reads) times the column scales, x' = x c, split into two int8 vectors
// q1, q2 with x' ~ (254 q1 + q2) p, and float32 upper bounds on ||x'|| and ||x' - (254 q1 + q2)
// p|| whose rounding is accounted for (below). It also starts the step's selection: the
// largest lower bound's key (SP[4]) and the candidate count (IDS[0]) are reset, the count to
// NONE where the bound does not hold (x' not finite, zero or outside [2^-60, 2^100], or logits
// that could overflow), which sends the step to the full head.
//
// Bindings (group 0):
//   0  storage, read        XF: array<f32>        x [DIM]
//   1  storage, read        CS: array<f32>        column scales [DIM] (powers of two)
//   2  storage, read_write  XQ: array<u32>        q1 (W4 words of 4 int8) then q2 (W4 words)
//   3  storage, read_write  SP: array<u32>        p, ||x'|| bound, ||x' - x^|| bound, ok, key
//   4  storage, read_write  IDS: array<u32>       IDS[0]: the candidate count
// Overrides: DIM, W4 (words per vector: the screen's padded width / 4), KS (1 / (1 - gamma_DIM)
// with margin, rounded up), SQN (sqrt(DIM), rounded up), ENORM (the largest row norm of the
// screen's rows, rounded up). One workgroup of 256.
//
// The rounding, with u = 2^-23 (one ulp: round to nearest or the directed roundings Vulkan
// allows). x' = x c is exact (c a power of two) but for flushed subnormals (< 2^-126 each:
// the 2^-100 added to both norms). The norms are of x' 2^-e, where 2^-e scales the largest
// |x'| into [0.5, 1): no square overflows. A sum of DIM squares in any order is within
// gamma_DIM = DIM u / (1 - DIM u) of its value (KS), squares under 2^-126 lose less than that
// each (DIM 2^-124 added); sqrt is within a few ulps (2^-16). The residual r = x' - t p (t =
// 254 q1 + q2, an exact integer in f32) as evaluated is within u |t p| + u |r| + 2^-125 of the
// exact one, so its norm within 2 u sqrt(DIM) m + 2^-100 plus a relative 2^-18 (m = max |x'|).

override DIM: u32;
override W4: u32;
override KS: f32;
override SQN: f32;
override ENORM: f32;

const NONE: u32 = 0xFFFFFFFFu;

@group(0) @binding(0) var<storage, read> XF: array<f32>;
@group(0) @binding(1) var<storage, read> CS: array<f32>;
@group(0) @binding(2) var<storage, read_write> XQ: array<u32>;
@group(0) @binding(3) var<storage, read_write> SP: array<u32>;
@group(0) @binding(4) var<storage, read_write> IDS: array<u32>;

var<workgroup> rmax: array<f32, 256>;
var<workgroup> rbad: array<u32, 256>;
var<workgroup> rx: array<f32, 256>;
var<workgroup> rr: array<f32, 256>;

fn code(v: f32) -> i32 {
    return i32(clamp(round(v), -127.0, 127.0));
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    var m = 0.0;
    var bad = 0u;
    for (var k = t; k < DIM; k += 256u) {
        let v = XF[k] * CS[k];
        bad |= u32((bitcast<u32>(v) & 0x7F800000u) == 0x7F800000u);  // NaN or infinity
        m = max(m, abs(v));
    }
    rmax[t] = m;
    rbad[t] = bad;
    workgroupBarrier();
    for (var o = 128u; o > 0u; o >>= 1u) {
        if (t < o) {
            rmax[t] = max(rmax[t], rmax[t + o]);
            rbad[t] |= rbad[t + o];
        }
        workgroupBarrier();
    }
    m = rmax[0];
    bad = rbad[0];
    let live = bad == 0u && m >= 8.673617e-19 && m <= 1.2676506e30;  // 2^-60, 2^100
    let mm = select(1.0, m, live);
    let e = frexp(mm).exp;  // mm 2^-e in [0.5, 1)
    let s = 127.0 / mm;
    let p = mm / 32258.0;  // 127 * 254: any p serves, the bound is of the p used
    var sx = 0.0;
    var sr = 0.0;
    for (var w = t; w < W4; w += 256u) {
        var w1 = 0u;
        var w2 = 0u;
        for (var j = 0u; j < 4u; j++) {
            let k = 4u * w + j;
            if (k < DIM) {
                let v = XF[k] * CS[k];
                let y = v * s;
                let a = code(y);
                let b = code((y - f32(a)) * 254.0);
                let r = v - f32(254 * a + b) * p;
                let vs = ldexp(v, -e);
                let rs = ldexp(r, -e);
                sx += vs * vs;
                sr += rs * rs;
                w1 |= (u32(a) & 0xFFu) << (8u * j);
                w2 |= (u32(b) & 0xFFu) << (8u * j);
            }
        }
        XQ[w] = w1;
        XQ[W4 + w] = w2;
    }
    rx[t] = sx;
    rr[t] = sr;
    workgroupBarrier();
    for (var o = 128u; o > 0u; o >>= 1u) {
        if (t < o) {
            rx[t] += rx[t + o];
            rr[t] += rr[t + o];
        }
        workgroupBarrier();
    }
    if (t == 0u) {
        let tiny = f32(DIM) * 4.7019774e-38;  // DIM 2^-124
        let nx = ldexp(sqrt((rx[0] + tiny) * KS) * 1.0000153, e) + 7.888609e-31;  // 2^-16, 2^-100
        let ndx = ldexp(sqrt((rr[0] + tiny) * KS) * 1.0000153, e) * 1.0000038
            + SQN * mm * 2.3841858e-7 + 7.888609e-31;  // 2^-18, 2 u = 2^-22
        // the logits stay below 2^120 (ENORM ||x'|| bounds |e . x|; inf fails the test)
        let ok = live && ENORM * nx * 2.0 <= 1.329228e36;
        SP[0] = bitcast<u32>(p);
        SP[1] = bitcast<u32>(nx);
        SP[2] = bitcast<u32>(ndx);
        SP[3] = u32(ok);
        SP[4] = 0u;  // the largest lower bound's key (screen_step.wgsl), below every value
        IDS[0] = select(NONE, 0u, ok);
    }
}
