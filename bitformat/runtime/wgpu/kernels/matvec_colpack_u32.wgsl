// matvec_colpack_u32.wgsl: y = (sum_k t[r,k] q[k]) / s * scale for a colpack_u32 matrix (the
// bitnet-webgpu-poc layout), decoded from its words in registers.
//
// Bindings (group 0):
//   0  X_SPACE   X: activation block (layout in matvec_common.wgsl)
//   1  storage, read        W: array<u32>   the matrix's words, row after row
//   2  uniform              P: Params       (matvec_common.wgsl)
//   3  storage, read_write  Y: array<f32>   output, rows P.row0 .. P.row0 + ROWS
// Overrides: ROWS, COLS (any; rows are ceil(COLS/16) words), MODE, LANES.
//
// Bit layout (docs/formats/colpack_u32.md): word w of a row holds columns 16w + i at bits
// 2i .. 2i+1 with code 0b00 = 0, 0b01 = +1, 0b10 = -1; padding is 0b00. Per g = 0..3 the
// masked slot  s = (word >> 2g) & 0x03030303  holds the codes of columns 16w + g, +4, +8, +12
// (slot16 word 4w + g of the activation block). With a = s & 0x01010101 (the +1 bits) and
// b = (s >> 1) & 0x01010101 (the -1 bits), the signed trit bytes are
//
//     a | ((b << 8) - b)        (b << 8) - b puts 0xFF in each byte whose b is 1, no borrows
//
// (the top byte's carry leaves the word, which u32 wrapping drops), one dot4I8Packed each.
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

fn trits(s: u32) -> u32 {
    let a = s & 0x01010101u;
    let b = (s >> 1u) & 0x01010101u;
    return a | ((b << 8u) - b);
}

fn row_dot(base: u32, r: u32, lane: u32) -> f32 {
    let nw = (COLS + 15u) / 16u;
    let row = base + r * nw;
    let soff = QOFF + (COLS + 255u) / 256u * 64u;
    var acc = 0i;
    for (var w = lane; w < nw; w += LANES) {
        let v = W[row + w];
        let xv = X[soff / 4u + w];  // slot16 words 4w .. 4w+3, one per g
        acc += dot4I8Packed(trits(v), xv.x);
        acc += dot4I8Packed(trits(v >> 2u), xv.y);
        acc += dot4I8Packed(trits(v >> 4u), xv.z);
        acc += dot4I8Packed(trits(v >> 6u), xv.w);
    }
    return f32(acc);
}

fn epilogue(v: vec2<f32>) -> vec2<f32> {
    let s = x_s();
    return vec2<f32>(v.x / s * P.scale * P.out_scale, v.y / s * P.scale2 * P.out_scale2);
}
