// matvec_i2_s.wgsl: y = (sum_k t[r,k] q[k]) / s * scale for an i2_s matrix (bitnet.cpp I2_S),
// decoded from its packed words in registers.
//
// Bindings (group 0):
//   0  X_SPACE   X: activation block (layout in matvec_common.wgsl)
//   1  storage, read        W: array<u32>   the matrix's packed bytes, row after row (no tail)
//   2  uniform              P: Params       (matvec_common.wgsl)
//   3  storage, read_write  Y: array<f32>   output, rows P.row0 .. P.row0 + ROWS
// Overrides: ROWS, COLS (a multiple of BLK), BLK (128: x86 layout, 64: ARM layout), MODE, LANES.
//
// Bit layout (docs/formats/i2_s.md): each block of BLK values of a row is BLK/4 bytes; byte m
// holds elements m, m + BLK/4, m + BLK/2, m + 3BLK/4 ("groups" g = 0..3) at shifts 6, 4, 2, 0,
// code c = trit + 1. So for word j of a block (bytes 4j .. 4j+3):
//
//     (word >> (6 - 2g)) & 0x03030303 = codes of elements g*BLK/4 + 4j .. + 3, one per byte,
//
// four consecutive elements: one dot4I8Packed with one plain activation word. The codes are
// trit + 1, so sum(t q) = sum(c q) - sum(q), with sum(q) from the activation block.
// A unit of work is one block (BLK/16 words).

override ROWS: u32;
override COLS: u32;
override BLK: u32 = 128u;
override MODE: u32 = 0u;
override LANES: u32 = 1u;

@group(0) @binding(0) var<X_SPACE> X: X_TYPE;
@group(0) @binding(1) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

//#include matvec_common.wgsl

// code * q over words w (4 consecutive words of one block): for group g the activations
// are one aligned vec4 of activation words (x4 = its index), one component per word.
fn dot4words(w: vec4<u32>, sh: u32, xv: vec4<u32>) -> i32 {
    return dot4I8Packed((w.x >> sh) & 0x03030303u, xv.x)
        + dot4I8Packed((w.y >> sh) & 0x03030303u, xv.y)
        + dot4I8Packed((w.z >> sh) & 0x03030303u, xv.z)
        + dot4I8Packed((w.w >> sh) & 0x03030303u, xv.w);
}

fn row_dot(base: u32, r: u32, lane: u32) -> f32 {
    let wpb = BLK / 16u;  // words per block (8 or 4), so blocks hold whole vec4s of words
    let row = base + r * (COLS / 16u);
    var acc = 0i;
    for (var b = lane; b < COLS / BLK; b += LANES) {
        let w0 = row + b * wpb;
        let x4 = (QOFF + b * (BLK / 4u)) / 4u;  // vec4 index of the block's activations
        for (var j = 0u; j < wpb; j += 4u) {
            let w = W[(w0 + j) / 4u];
            let xj = x4 + j / 4u;
            acc += dot4words(w, 6u, X[xj]);
            acc += dot4words(w, 4u, X[xj + wpb / 4u]);
            acc += dot4words(w, 2u, X[xj + wpb / 2u]);
            acc += dot4words(w, 0u, X[xj + 3u * wpb / 4u]);
        }
    }
    return f32(acc);
}

fn epilogue(v: vec2<f32>) -> vec2<f32> {
    let s = x_s();
    let sum = f32(x_sum());
    return vec2<f32>((v.x - sum) / s * P.scale * P.out_scale,
                     (v.y - sum) / s * P.scale2 * P.out_scale2);
}
