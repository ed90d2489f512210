// rows_tq2_0.wgsl: the dot products of tq2_0 rows with the int8 activations, decoded in
// registers. Pasted into matvec_tq2_0.wgsl (op by op) and fused_matvec.wgsl (the decode
// step); the including kernel binds the activations X.
//
// Bit layout (docs/formats/tq2_0.md): a row is COLS/256 blocks of 66 bytes: qs[64], then d
// (IEEE f16). Block element j = 128h + 32g + m has its code (trit + 1) in qs[32h + m] at bits
// 2g .. 2g+1. Word k of qs (bytes 4k .. 4k+3, h = k / 8) therefore gives, per g,
//
//     (word >> 2g) & 0x03030303 = codes of elements 128h + 32g + 4(k % 8) .. + 3,
//
// four consecutive elements for one dot4I8Packed. Blocks are 66 bytes, so every other block
// starts 2 bytes into a u32: its words are funnel-shifted from two loads (`sh` = 16), and d is
// the high half of the word after qs instead of the low half. sum(t q) over a block is
// sum(c q) minus the block's sum of q from the activation block. A unit of work is one block.

@group(0) @binding(W_BINDING) var<storage, read> W: array<u32>;


// code * q over 4 consecutive words of the same half-block; for each g their activations are
// one aligned vec4 (x4 = the vec4 index for g = 0, then + 2 per g).
fn dot4words(w: vec4<u32>, x4: u32) -> i32 {
    var acc = 0i;
    for (var g = 0u; g < 4u; g++) {
        let xv = X[x4 + 2u * g];
        let sh = 2u * g;
        acc += dot4I8Packed((w.x >> sh) & 0x03030303u, xv.x)
            + dot4I8Packed((w.y >> sh) & 0x03030303u, xv.y)
            + dot4I8Packed((w.z >> sh) & 0x03030303u, xv.z)
            + dot4I8Packed((w.w >> sh) & 0x03030303u, xv.w);
    }
    return acc;
}

fn row_dot(base: u32, r: u32, lane: u32, lanes: u32) -> f32 {
    let nb = COLS / 256u;
    let row = base * 4u + r * nb * 66u;  // byte offset of the row
    var sum = 0.0;
    for (var b = lane; b < nb; b += lanes) {
        let o = row + b * 66u;
        let w0 = o >> 2u;
        let x4 = (QOFF + b * 64u) / 4u;
        // Blocks start 0 or 2 bytes into a word (sh = 0 or 16); adjacent rows differ, so
        // the funnel shift is branch-free: (hi << 16) << (16 - sh) is 0 when sh = 0.
        let sh = (o & 3u) * 8u;
        var acc = 0i;
        var lo = W[w0];
        for (var k = 0u; k < 16u; k += 4u) {  // words k .. k+3: half k / 8, lanes 4(k % 8) ..
            let h1 = W[w0 + k + 1u];
            let h2 = W[w0 + k + 2u];
            let h3 = W[w0 + k + 3u];
            let h4 = W[w0 + k + 4u];
            let w = vec4<u32>((lo >> sh) | ((h1 << 16u) << (16u - sh)),
                              (h1 >> sh) | ((h2 << 16u) << (16u - sh)),
                              (h2 >> sh) | ((h3 << 16u) << (16u - sh)),
                              (h3 >> sh) | ((h4 << 16u) << (16u - sh)));
            acc += dot4words(w, x4 + (k >> 3u) * 8u + (k & 7u) / 4u);
            lo = h4;
        }
        let d = unpack2x16float(lo >> sh).x;  // the f16 right after the codes
        sum += f32(acc - x_bsum(b)) * d;
    }
    return sum;
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

// the row's value: the blocks' d are inside the sum (in float32: WGSL has no float64, so
// unlike the cpu backend the rounding depends on the order; docs/model.md §2), then / s
fn row_value(acc: f32, scale: f32) -> f32 {
    return acc / x_s();
}
