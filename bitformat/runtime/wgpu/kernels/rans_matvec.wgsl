// rans_matvec.wgsl: y = (sum_k t[r,k] q[k]) * scale / s for a rans matrix, decoding its rANS
// streams in registers: one invocation (lane) per stream, the 64-bit coder state as two u32.
//
// Bindings (group 0):
//   0  X_SPACE   X: activation block (word 0: s; layout in matvec_common.wgsl)
//   1  storage, read        WS: array<u32>        the tensor's stream words (all S streams)
//   2  storage, read        M: array<u32>         metadata (rans_common.wgsl)
//   3  uniform              RP: RansParams        (rans_common.wgsl)
//   4  X_SPACE   XL: array<vec4<u32>, ...>        x_live by 5-column group (rans_gather.wgsl)
//   5  storage, read_write  Y: array<f32>         output rows (p = 1)
//   6  storage, read_write  ACC: array<atomic<i32>>  per-live-row sums (p > 1)
// Overrides: MODE (0: write, 1: add to Y), SHARED (1: copy the T <= 4 lookup tables into
// workgroup memory first; 0: read them from M).
//
// Streams (docs/formats/rans.md): stream s = (row group g = s / p, piece j = s % p) covers live
// rows g k .. min(L, g k + k) - 1, live columns cuts[j] .. cuts[j+1] - 1 of each, row after row;
// a row segment is ceil(len / 5) symbols of 5 trits (81 c0 + 27 c1 + 9 c2 + 3 c3 + c4, c = trit
// + 1, column order; the last padded with zero trits) coded with the row's table. Words are in
// constriction's order: the lane starts at the stream's last word and walks down:
//
//     init:    state = words[end-1]; if more: state = state << 32 | words[end-2]
//     decode:  q = state & 0xFFFFFF;  sym = lut[q >> 12];  f, c = table[sym] (units << 12)
//              state = (state >> 24) * f + q - c
//              if state < 2^32 and words remain: state = state << 32 | next word down
//
// With state = hi:lo, state >> 24 = (hi >> 24) : ((lo >> 24) | (hi << 8)), and the product
// with f is a 32x32 -> 64-bit multiply (mul_wide) plus (hi >> 24) * f in the high word.
// Row segments start at multiples of 5 (piece cuts are), so symbol n of a segment starting at
// live column c0 covers columns 5m .. 5m+4 with m = c0 / 5 + n, which is XL[m]: one aligned
// vec4 read gives the symbol's four packed activations, the fifth and their sum, and
//     sum_k t_k x_k = dot4I8Packed(c0 | c1 << 8 | c2 << 16 | c3 << 24, XL[m].x)
//                     + c4 XL[m].y - XL[m].z                          (t = c - 1)
// Padding digits (zero trits) meet x = 0 past C, so no masking is needed. The final-state
// check (state 0, every word read) is left to the CPU reader at load.

override MODE: u32 = 0u;
override SHARED: u32 = 0u;

@group(0) @binding(0) var<X_SPACE> X: X_TYPE;
@group(0) @binding(1) var<storage, read> WS: array<u32>;
@group(0) @binding(2) var<storage, read> M: array<u32>;
@group(0) @binding(3) var<uniform> RP: RansParams;
@group(0) @binding(4) var<X_SPACE> XL: X_TYPE;
@group(0) @binding(5) var<storage, read_write> Y: array<f32>;
@group(0) @binding(6) var<storage, read_write> ACC: array<atomic<i32>>;

//#include rans_common.wgsl

var<workgroup> wlut: array<u32, 4096>;  // up to 4 tables of 4096 byte entries (16 KiB)

fn mul_wide(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xFFFFu;
    let a1 = a >> 16u;
    let b0 = b & 0xFFFFu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xFFFFu) + (p10 & 0xFFFFu);
    return vec2<u32>((p00 & 0xFFFFu) | (mid << 16u),
                     p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u));
}

fn lut(t: u32, i: u32) -> u32 {
    var w: u32;
    if (SHARED == 1u) {
        w = wlut[t * 1024u + (i >> 2u)];
    } else {
        w = M[RP.off_lut + t * 1024u + (i >> 2u)];
    }
    return (w >> ((i & 3u) * 8u)) & 0xFFu;
}

// x of live column i (single-trit streams)
fn xl(i: u32) -> i32 {
    let v = XL[i / 5u];
    let k = i % 5u;
    if (k == 4u) {
        return bitcast<i32>(v.y);
    }
    return bitcast<i32>(v.x << (24u - 8u * k)) >> 24u;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    if (SHARED == 1u) {
        for (var i = li; i < RP.T * 1024u; i += 64u) {
            wlut[i] = M[RP.off_lut + i];
        }
        workgroupBarrier();
    }
    let s = (wid.x + wid.y * nw.x) * 64u + li;
    if (s >= RP.S) {
        return;
    }
    let g = s / RP.p;
    let j = s % RP.p;
    let r_begin = g * RP.k;
    let r_end = min(RP.L, r_begin + RP.k);
    let c0 = M[RP.off_cuts + j];
    let c1 = M[RP.off_cuts + j + 1u];
    let nsym = (c1 - c0 + RP.group - 1u) / RP.group;
    let start = M[RP.off_off + s];
    var pos = M[RP.off_off + s + 1u];
    var lo = 0u;
    var hi = 0u;
    if (pos > start) {
        pos -= 1u;
        lo = WS[pos];
        if (pos > start) {
            pos -= 1u;
            hi = lo;
            lo = WS[pos];
        }
    }
    let sx = bitcast<f32>(X[0][0]);
    for (var rr = r_begin; rr < r_end; rr++) {
        var t = 0u;
        if (RP.T > 1u) {
            t = (M[RP.off_cls + (rr >> 3u)] >> ((rr & 7u) * 4u)) & 15u;
        }
        let tab = RP.off_tab + t * 243u;
        var acc = 0i;
        var at = c0;
        for (var n = 0u; n < nsym; n++) {
            let q = lo & 0xFFFFFFu;
            let sym = lut(t, q >> 12u);
            let e = M[tab + sym];
            let f = (e & 0xFFFFu) << 12u;
            let c = (e >> 16u) << 12u;
            let m = mul_wide((lo >> 24u) | (hi << 8u), f);
            lo = m.x + (q - c);
            hi = m.y + (hi >> 24u) * f + select(0u, 1u, lo < m.x);
            if (hi == 0u && pos > start) {
                pos -= 1u;
                hi = lo;
                lo = WS[pos];
            }
            if (RP.group == 1u) {
                acc += (i32(sym) - 1) * xl(at);
                at += 1u;
            } else {
                let d0 = sym / 81u;
                let r0 = sym - 81u * d0;
                let d1 = r0 / 27u;
                let r1 = r0 - 27u * d1;
                let d2 = r1 / 9u;
                let r2 = r1 - 9u * d2;
                let d3 = r2 / 3u;
                let d4 = r2 - 3u * d3;
                let v = XL[at / 5u];
                acc += dot4I8Packed(d0 | (d1 << 8u) | (d2 << 16u) | (d3 << 24u), v.x)
                    + i32(d4) * bitcast<i32>(v.y) - bitcast<i32>(v.z);
                at += 5u;
            }
        }
        if (RP.p == 1u) {
            let o = RP.row0 + M[RP.off_lrows + rr];
            let y = out_value(acc, sx);
            if (MODE == 1u) {
                Y[o] = Y[o] + y;
            } else {
                Y[o] = y;
            }
        } else {
            atomicAdd(&ACC[rr], acc);
        }
    }
}
