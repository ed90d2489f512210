// rows_stfma.wgsl: the dot products of stfma rows with the int8 activations, decoded in
// registers. Pasted into matvec_stfma.wgsl (op by op) and fused_matvec.wgsl (the decode
// step); the including kernel binds the activations X.
//
// Bit layout (docs/formats/stfma.md): word w of a row holds columns 16w + i at bits 2i .. 2i+1,
// code c = trit + 1, padding past COLS = code 1 (trit 0). Per g = 0..3,
//
//     (word >> 2g) & 0x03030303 = codes of columns 16w + g, + 4, + 8, + 12,
//
// which is exactly slot16 word 4w + g of the activation block (built for this), so each word
// costs four dot4I8Packed. Padding meets q = 0. sum(t q) = sum(c q) - sum(q).
// A unit of work is one word.

@group(0) @binding(W_BINDING) var<storage, read> W: array<u32>;


fn row_dot(base: u32, r: u32, lane: u32, lanes: u32) -> f32 {
    let nw = (COLS + 15u) / 16u;
    let row = base + r * nw;
    let soff = SLOT_OFF;
    var acc = 0i;
    for (var w = lane; w < nw; w += lanes) {
        let v = W[row + w];
        let xv = X[soff / 4u + w];  // slot16 words 4w .. 4w+3, one per g
        acc += dot4I8Packed(v & 0x03030303u, xv.x);
        acc += dot4I8Packed((v >> 2u) & 0x03030303u, xv.y);
        acc += dot4I8Packed((v >> 4u) & 0x03030303u, xv.z);
        acc += dot4I8Packed((v >> 6u) & 0x03030303u, xv.w);
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

// the row's value: dot * scale / s (one arithmetic, runtime/backend.py); codes are trit + 1,
// so sum(t q) = sum(c q) - sum(q)
fn row_value(acc: f32, scale: f32) -> f32 {
    return (acc - f32(x_sum())) * scale / x_s();
}
