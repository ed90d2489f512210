// rows_i2_s.wgsl: the dot products of i2_s rows (bitnet.cpp I2_S) with the int8 activations,
// decoded from the packed words in registers. Pasted into matvec_i2_s.wgsl (op by op) and
// fused_matvec.wgsl (the decode step); the including kernel binds W and the activations X.
//
// Bit layout (docs/formats/i2_s.md): each block of BLK values of a row is BLK/4 bytes; byte m
// holds elements m, m + BLK/4, m + BLK/2, m + 3BLK/4 ("groups" g = 0..3) at shifts 6, 4, 2, 0,
// code c = trit + 1. So for word j of a block (bytes 4j .. 4j+3):
//
//     (word >> (6 - 2g)) & 0x03030303 = codes of elements g*BLK/4 + 4j .. + 3, one per byte,
//
// four consecutive elements: one dot4I8Packed with one plain activation word. The codes are
// trit + 1, so sum(t q) = sum(c q) - sum(q), with sum(q) from the activation block.
// A unit of work is one vec4 of words (16 bytes, 64 codes: half a BLK = 128 block, a whole
// BLK = 64 block), so a 2560-wide row is 40 units however many lanes share it.

@group(0) @binding(W_BINDING) var<storage, read> W: array<vec4<u32>>;

// code * q over words w (4 consecutive words of one block): for group g the activations
// are one aligned vec4 of activation words (xv), one component per word.
fn dot4words(w: vec4<u32>, sh: u32, xv: vec4<u32>) -> i32 {
    return dot4I8Packed((w.x >> sh) & 0x03030303u, xv.x)
        + dot4I8Packed((w.y >> sh) & 0x03030303u, xv.y)
        + dot4I8Packed((w.z >> sh) & 0x03030303u, xv.z)
        + dot4I8Packed((w.w >> sh) & 0x03030303u, xv.w);
}

// unit u of a row: words 4j .. 4j+3 of block b (BLK / 64 units per block)
fn unit_dot(w: vec4<u32>, u: u32) -> i32 {
    let upb = BLK / 64u;
    let b = u / upb;
    let x4 = XBASE + (QOFF + b * (BLK / 4u)) / 4u + u % upb;  // group 0's activation vec4
    return dot4words(w, 6u, X[x4]) + dot4words(w, 4u, X[x4 + upb])
        + dot4words(w, 2u, X[x4 + 2u * upb]) + dot4words(w, 0u, X[x4 + 3u * upb]);
}

// sum of code * q over the units u0, u0 + lanes, ... of the row starting at vec4 `row`; two
// units in flight
fn units_dot(row: u32, u0: u32, lanes: u32) -> i32 {
    let n = COLS / 64u;
    var acc = 0i;
    var u = u0;
    for (; u + lanes < n; u += 2u * lanes) {
        let w0 = W[row + u];
        let w1 = W[row + u + lanes];
        acc += unit_dot(w0, u) + unit_dot(w1, u + lanes);
    }
    if (u < n) {
        acc += unit_dot(W[row + u], u);
    }
    return acc;
}

// sum of code * q over row r (first word `base`), lane `lane` of `lanes`
fn row_dot(base: u32, r: u32, lane: u32, lanes: u32) -> f32 {
    return f32(units_dot(base / 4u + r * (COLS / 64u), lane, lanes));
}

// The fused kernels load a lane's first NPRE units of a row before they quantize the
// activations (row_pre; I2S_PRE substituted by the host: tuning pre, default 2), so those
// loads are in flight while the prologue works; row_dot_pre finishes the row. More units
// ahead cost registers: all of a lane's units (pre=16) ran the 2B-4T step at 3.36 ms against
// 2.50 with 2 on an H200 (docs/benchmarks.md).
const NPRE: u32 = I2S_PRE;

struct Pre {
    w: array<vec4<u32>, NPRE>,
}

fn row_pre(base: u32, r: u32, lane: u32, lanes: u32) -> Pre {
    let n = COLS / 64u;
    let row = base / 4u + r * n;
    var p: Pre;
    for (var i = 0u; i < NPRE; i++) {
        p.w[i] = W[row + min(lane + i * lanes, n - 1u)];
    }
    return p;
}

fn row_dot_pre(p: Pre, base: u32, r: u32, lane: u32, lanes: u32) -> f32 {
    let n = COLS / 64u;
    let row = base / 4u + r * n;
    var acc = 0i;
    for (var i = 0u; i < NPRE; i++) {
        if (lane + i * lanes < n) {
            acc += unit_dot(p.w[i], lane + i * lanes);
        }
    }
    return f32(acc + units_dot(row, lane + NPRE * lanes, lanes));
}

// the row's value: dot * scale / s (one arithmetic, runtime/backend.py); codes are trit + 1,
// so sum(t q) = sum(c q) - sum(q)
fn row_value(acc: f32, scale: f32) -> f32 {
    return (acc - f32(x_sum())) * scale / x_s();
}
