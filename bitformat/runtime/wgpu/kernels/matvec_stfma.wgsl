// matvec_stfma.wgsl: y = (sum_k t[r,k] q[k]) / s * scale for an stfma matrix (16 trits per u32,
// code = trit + 1), decoded from its words in registers.
//
// Bindings (group 0):
//   0  X_SPACE   X: activation block (layout in matvec_common.wgsl)
//   1  storage, read        W: array<u32>   the matrix's words, row after row
//   2  uniform              P: Params       (matvec_common.wgsl)
//   3  storage, read_write  Y: array<f32>   output, rows P.row0 .. P.row0 + ROWS
// Overrides: ROWS, COLS (any; rows are ceil(COLS/16) words), MODE, LANES.
//
// Bit layout (docs/formats/stfma.md): word w of a row holds columns 16w + i at bits 2i .. 2i+1,
// code c = trit + 1, padding past COLS = code 1 (trit 0). Per g = 0..3,
//
//     (word >> 2g) & 0x03030303 = codes of columns 16w + g, + 4, + 8, + 12,
//
// which is exactly slot16 word 4w + g of the activation block (built for this), so each word
// costs four dot4I8Packed. Padding meets q = 0. sum(t q) = sum(c q) - sum(q).
// A unit of work is one word.

override ROWS: u32;
override COLS: u32;
override MODE: u32 = 0u;
override LANES: u32 = 1u;

@group(0) @binding(0) var<X_SPACE> X: X_TYPE;
@group(0) @binding(1) var<storage, read> W: array<u32>;
@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

//#include matvec_common.wgsl

fn row_dot(base: u32, r: u32, lane: u32) -> f32 {
    let nw = (COLS + 15u) / 16u;
    let row = base + r * nw;
    let soff = QOFF + (COLS + 255u) / 256u * 64u;
    var acc = 0i;
    for (var w = lane; w < nw; w += LANES) {
        let v = W[row + w];
        let xv = X[soff / 4u + w];  // slot16 words 4w .. 4w+3, one per g
        acc += dot4I8Packed(v & 0x03030303u, xv.x);
        acc += dot4I8Packed((v >> 2u) & 0x03030303u, xv.y);
        acc += dot4I8Packed((v >> 4u) & 0x03030303u, xv.z);
        acc += dot4I8Packed((v >> 6u) & 0x03030303u, xv.w);
    }
    return f32(acc);
}

fn epilogue(v: vec2<f32>) -> vec2<f32> {
    let s = x_s();
    let sum = f32(x_sum());
    return vec2<f32>((v.x - sum) / s * P.scale * P.out_scale,
                     (v.y - sum) / s * P.scale2 * P.out_scale2);
}
