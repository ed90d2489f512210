// rows_tq1_0.wgsl: the dot products of tq1_0 rows with the int8 activations, decoded in
// registers. Pasted into matvec_tq1_0.wgsl (op by op) and fused_matvec.wgsl (the decode
// step); the including kernel binds the activations X.
//
// Bit layout (docs/formats/tq1_0.md): a row is COLS/256 blocks of 54 bytes: qs[48], qh[4], d
// (IEEE f16). A byte holds 5 (qh: 4) base-3 digits, digit k read as c = (q * 3) >> 8 with
// q = byte * 3^k mod 256. The digits of one byte step through
//
//     t = v * 3;  c = t >> 8;  v = t & 0xFF        (v starts as the byte)
//
// which this kernel runs on two bytes at once in 16-bit lanes (v*3 < 2^10 never reaches the
// next lane): even bytes in `ev`, odd bytes in `od`, giving four codes per step, one per byte
// of the word, packed back as c_even | c_odd << 8 for one dot4I8Packed:
//
//     qs word k < 8  (bytes 4k..4k+3):   digit n -> elements 32n + 4k .. + 3        (n = 0..4)
//     qs word 8 + k  (bytes 32+4k ..):    digit n -> elements 160 + 16n + 4k .. + 3  (n = 0..4)
//     qh word        (bytes 48..51):      digit n -> elements 240 + 4n .. + 3         (n = 0..3)
//
// Codes are trit + 1; the block's sum of q is subtracted. 54-byte blocks start 2 bytes into a
// u32 every other time: those words are funnel-shifted from two loads (sh = 16).

@group(0) @binding(W_BINDING) var<storage, read> W: array<u32>;


// code * q over the 5 digits of 4 consecutive qs words: digit i of the four words meets the
// activations X[x4 + i * step4] (one aligned vec4, a component per word).
fn dot4words(w: vec4<u32>, x4: u32, step4: u32) -> i32 {
    var ev = w & vec4<u32>(0x00FF00FFu);
    var od = (w >> vec4<u32>(8u)) & vec4<u32>(0x00FF00FFu);
    var acc = 0i;
    for (var i = 0u; i < 5u; i++) {
        let te = ev * 3u;
        let to = od * 3u;
        let c = ((te >> vec4<u32>(8u)) & vec4<u32>(0x00030003u)) | (to & vec4<u32>(0x03000300u));
        ev = te & vec4<u32>(0x00FF00FFu);
        od = to & vec4<u32>(0x00FF00FFu);
        let xv = X[x4 + i * step4];
        acc += dot4I8Packed(c.x, xv.x) + dot4I8Packed(c.y, xv.y) + dot4I8Packed(c.z, xv.z)
            + dot4I8Packed(c.w, xv.w);
    }
    return acc;
}

// The qh word: its 4 digits meet the 4 words of X[x4].
fn dot_qh(w: u32, x4: u32) -> i32 {
    var ev = w & 0x00FF00FFu;
    var od = (w >> 8u) & 0x00FF00FFu;
    let xv = X[x4];
    var acc = 0i;
    for (var i = 0u; i < 4u; i++) {
        let te = ev * 3u;
        let to = od * 3u;
        ev = te & 0x00FF00FFu;
        od = to & 0x00FF00FFu;
        acc += dot4I8Packed(((te >> 8u) & 0x00030003u) | (to & 0x03000300u), xv[i]);
    }
    return acc;
}

fn funnel(lo: u32, hi: u32, sh: u32) -> u32 {
    return (lo >> sh) | ((hi << 16u) << (16u - sh));  // (hi << 16) << 16 = 0 when sh = 0
}

fn row_dot(base: u32, r: u32, lane: u32, lanes: u32) -> f32 {
    let nb = COLS / 256u;
    let row = base * 4u + r * nb * 54u;  // byte offset of the row
    var sum = 0.0;
    for (var b = lane; b < nb; b += lanes) {
        let o = row + b * 54u;
        let w0 = o >> 2u;
        let x4 = (QOFF + b * 64u) / 4u;
        // Blocks start 0 or 2 bytes into a word (sh = 0 or 16) and adjacent rows differ, so
        // every word is funnel-shifted from two loads, branch-free.
        let sh = (o & 3u) * 8u;
        var lo = W[w0];
        var acc = 0i;
        for (var k = 0u; k < 12u; k += 4u) {
            let h1 = W[w0 + k + 1u];
            let h2 = W[w0 + k + 2u];
            let h3 = W[w0 + k + 3u];
            let h4 = W[w0 + k + 4u];
            let w = vec4<u32>(funnel(lo, h1, sh), funnel(h1, h2, sh), funnel(h2, h3, sh),
                              funnel(h3, h4, sh));
            if (k < 8u) {  // qs[4k ..]: digit i -> elements 32i + 4k ..: words 8i + k
                acc += dot4words(w, x4 + k / 4u, 2u);
            } else {       // qs[32 ..]: digit i -> elements 160 + 16i ..: words 40 + 4i
                acc += dot4words(w, x4 + 10u, 1u);
            }
            lo = h4;
        }
        let h = W[w0 + 13u];
        acc += dot_qh(funnel(lo, h, sh), x4 + 15u);  // qh: elements 240 + 4i ..: word 60 + i
        let d = unpack2x16float(h >> sh).x;  // the f16 right after qh
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
