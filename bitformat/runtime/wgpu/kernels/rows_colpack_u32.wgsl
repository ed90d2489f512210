// rows_colpack_u32.wgsl: the dot products of colpack_u32 rows with the int8 activations, decoded in
// registers. Pasted into matvec_colpack_u32.wgsl (op by op) and fused_matvec.wgsl (the decode
// step); the including kernel binds the activations X.
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

@group(0) @binding(W_BINDING) var<storage, read> W: array<u32>;


fn trits(s: u32) -> u32 {
    let a = s & 0x01010101u;
    let b = (s >> 1u) & 0x01010101u;
    return a | ((b << 8u) - b);
}

fn row_dot(base: u32, r: u32, lane: u32, lanes: u32) -> f32 {
    let nw = (COLS + 15u) / 16u;
    let row = base + r * nw;
    let soff = SLOT_OFF;
    var acc = 0i;
    for (var w = lane; w < nw; w += lanes) {
        let v = W[row + w];
        let xv = X[soff / 4u + w];  // slot16 words 4w .. 4w+3, one per g
        acc += dot4I8Packed(trits(v), xv.x);
        acc += dot4I8Packed(trits(v >> 2u), xv.y);
        acc += dot4I8Packed(trits(v >> 4u), xv.z);
        acc += dot4I8Packed(trits(v >> 6u), xv.w);
    }
    return f32(acc);
}

// no early loads for these rows (rows_i2_s.wgsl has them): row_dot_pre is row_dot
struct Pre {
    unused: u32,
}

fn row_pre(base: u32, r: u32, lane: u32, lanes: u32) -> Pre {
    return Pre(0u);
}

fn row_dot_pre(p: Pre, base: u32, r: u32, lane: u32, lanes: u32) -> f32 {
    return row_dot(base, r, lane, lanes);
}

// the row's value: dot * scale / s (one arithmetic, runtime/backend.py; signed trits)
fn row_value(acc: f32, scale: f32) -> f32 {
    return acc * scale / x_s();
}
