// quant_prologue.wgsl: a workgroup of WGS invocations turns one input vector into the int8
// activation block in workgroup memory X (layout in matvec_common.wgsl), so that the rows'
// code (rows_<format>.wgsl) reads it as it reads the op-by-op kernels' binding:
//
//     NORM = 1:  y = x / r * g,   r = sqrt(sum(x^2) / COLS + EPS)      (RMSNorm, gains G)
//     NORM = 0:  y = x                                                (families without sub-norms)
//     COMBINE = 1: x = act(A) * U first (gate and up outputs of two separate mat-vecs)
//     COMBINE = 2: x = one layer's attention output, merged from attn_split.wgsl's runs as
//                  attn_merge.wgsl merges them (the o projection without a merge dispatch):
//                  A is the runs buffer read as vec4s (a run: (m, l, 0, 0), then o as HD / 4
//                  vec4s; SMAX runs a head), U[0].z the step state's length, from which the
//                  number of runs follows as in attn_merge.wgsl (SPLIT, SPAR, CMAX)
//     s = 127 / max(max|y|, 1e-5),    q = clamp(round(y s), -128, 127)   (round: ties to even)
//
// Two passes over the input (it sits in L2, written by the previous dispatch), reading whole
// vec4s so that many loads are in flight: the first sums x^2 and finds max|x g| together
// (subgroup reductions, one barrier), so max|y| is taken as
// max|x g| / r (the CPU's max|x / r * g| may differ from it in the last bit of s, moving a q
// only where y s lies on a .5 boundary); the second quantizes 16 values per invocation and
// writes them as one vec4 of words: LAYOUT 0 "plain" (bytes k of word i: q[4i + k]), LAYOUT 1
// "slot16" (byte k of word 4w + g: q[16w + g + 4k]), both starting at word QOFF, or LAYOUT 2
// both, slot16 after the plain words (the op-by-op kernels' block). Word 0 holds s, word 1
// the sum of every q, word 4 + b the sum of 256-block b.
//
// The including kernel declares A, U, G (storage, read, array<vec4<f32>>: COLS is a multiple
// of 4), the overrides COLS, NORM, COMBINE,
// ACT, EPS, LAYOUT, TRACE, the workgroup array X (XV4 vec4s) and, for TRACE = 1, T (storage,
// read_write): workgroup 0 then writes T[0] = s bits, T[4 + i] = y_i bits and
// T[4 + COLS + i] = plain word i, for tests that compare the quantization with the CPU's.
// Workgroup memory is not zeroed by every driver (lavapipe), so the sums are zeroed here.

const WGS: u32 = 256u;
const QOFF: u32 = 256u;

var<workgroup> red: array<vec2<f32>, 64>;  // (sum, max) per subgroup (subgroups >= 4 lanes)
var<workgroup> bsum: array<atomic<i32>, NBLK>;
var<private> abase: u32;  // first vec4 of this workgroup's input row (batched prefill: token t)

override HD: u32 = 4u;  // COMBINE = 2: head size, runs a head holds, how runs are chosen
override SMAX: u32 = 1u;
override SPLIT: u32 = 32u;
override SPAR: u32 = 32u;
override CMAX: u32 = 256u;
const MAXH: u32 = 128u;  // COMBINE = 2: heads at most (COLS / HD)
var<workgroup> hml: array<vec2<f32>, MAXH>;  // COMBINE = 2: each head's (max m, sum l)
var<private> nrun: u32;

// COMBINE = 2: each head's maximum over its runs and sum of l exp(m - max), into hml
fn merge_heads(li: u32) {
    let len = bitcast<u32>(U[0].z);
    nrun = max(min((len + SPLIT - 1u) / SPLIT, SPAR), (len + CMAX - 1u) / CMAX);
    let rs = HD / 4u + 1u;
    for (var h = li; h < COLS / HD; h += WGS) {
        let b0 = h * SMAX * rs;
        var mx = -3.4028234663852886e38;
        for (var s = 0u; s < nrun; s++) {
            mx = max(mx, A[b0 + s * rs].x);
        }
        var l = 0.0;
        for (var s = 0u; s < nrun; s++) {
            let b = A[b0 + s * rs];
            l += b.y * exp(b.x - mx);
        }
        hml[h] = vec2<f32>(mx, l);
    }
    workgroupBarrier();
}

// COMBINE = 2: elements 4j .. 4j+3 of the merged attention output
fn merged4(j: u32) -> vec4<f32> {
    let hv = HD / 4u;
    let rs = hv + 1u;
    let h = j / hv;
    let m = hml[h];
    var acc = vec4<f32>(0.0);
    for (var s = 0u; s < nrun; s++) {
        let run = (h * SMAX + s) * rs;  // (m, l, 0, 0), then o
        acc += A[run + 1u + j % hv] * exp(A[run].x - m.x);
    }
    return acc / m.y;
}

//#include act.wgsl

fn act4(g: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(act(g.x), act(g.y), act(g.z), act(g.w));
}

// elements 4j .. 4j+3 of the input (COLS is a multiple of 4; 0 past COLS)
fn x4(j: u32) -> vec4<f32> {
    if (4u * j >= COLS) {
        return vec4<f32>(0.0);
    }
    if (COMBINE == 1u) {
        return act4(A[abase + j]) * U[abase + j];
    }
    if (COMBINE == 2u) {
        return merged4(j);
    }
    return A[abase + j];
}

fn g4(j: u32) -> vec4<f32> {
    if (NORM == 0u || 4u * j >= COLS) {
        return vec4<f32>(1.0);
    }
    return G[j];
}

fn pack4(q: vec4<i32>) -> u32 {
    let b = vec4<u32>(q) & vec4<u32>(0xFFu);
    return b.x | (b.y << 8u) | (b.z << 16u) | (b.w << 24u);
}

// sum of v over aligned groups of `seg` lanes (a power of two <= the subgroup size)
fn seg_sum(v: i32, seg: u32) -> i32 {
    var t = v;
    for (var o = seg / 2u; o > 0u; o >>= 1u) {
        t += subgroupShuffleXor(t, o);
    }
    return t;
}

// Fills X. Every invocation of the workgroup must call it (it has barriers).
// Invocation (sid, sl) takes units u = k WGS + sid sgs + sl (16 values each): neighbouring
// lanes hold neighbouring units, so a block's 16 units are 16 lanes of one subgroup (or 2 x 8,
// ...) and its sum needs one atomic per subgroup segment. The first PF units of an
// invocation stay in registers between the two passes (COLS <= PF * 4096 reads x and g once).
const PF: u32 = 2u;

override SKIPQ: u32 = 0u;  // 1: no quantization at all (timing experiments only: wrong values)

fn quant_prologue(li: u32, wid: u32, sl: u32, sid: u32, ns: u32, sgs: u32) {
    if (SKIPQ == 1u) {
        workgroupBarrier();
        return;
    }
    let nblk = (COLS + 255u) / 256u;
    let nu = nblk * 16u;
    let ub = sid * sgs + sl;
    for (var b = li; b < nblk; b += WGS) {
        atomicStore(&bsum[b], 0i);
    }
    if (COMBINE == 2u) {
        merge_heads(li);
    }
    // pass 1: sum of squares and max |x g|
    var xs: array<vec4<f32>, 8>;
    var gs: array<vec4<f32>, 8>;
    var ss = 0.0;
    var mx = 0.0;
    for (var k = 0u; k < PF; k++) {
        let u = k * WGS + ub;
        for (var i = 0u; i < 4u; i++) {
            xs[4u * k + i] = x4(4u * u + i);
            gs[4u * k + i] = g4(4u * u + i);
        }
        for (var i = 0u; i < 4u; i++) {
            let x = xs[4u * k + i];
            let y = abs(x * gs[4u * k + i]);
            ss += dot(x, x);
            mx = max(mx, max(max(y.x, y.y), max(y.z, y.w)));
        }
    }
    for (var j = PF * WGS * 4u + 4u * ub; j < COLS / 4u; j += WGS * 4u) {
        for (var i = 0u; i < 4u; i++) {
            let x = x4(j + i);
            let y = abs(x * g4(j + i));
            ss += dot(x, x);
            mx = max(mx, max(max(y.x, y.y), max(y.z, y.w)));
        }
    }
    let part = vec2<f32>(subgroupAdd(ss), subgroupMax(mx));
    if (sl == 0u) {
        red[sid] = part;
    }
    workgroupBarrier();
    var tot = vec2<f32>(0.0, 0.0);
    for (var j = 0u; j < ns; j++) {
        tot.x += red[j].x;
        tot.y = max(tot.y, red[j].y);
    }
    var r = 1.0;
    if (NORM == 1u) {
        r = sqrt(tot.x / f32(COLS) + EPS);
    }
    let s = 127.0 / max(tot.y / r, 1e-5);
    let trace = TRACE == 1u && wid == 0u;
    let seg = min(16u, sgs);
    // pass 2: quantize, one vec4 of activation words per unit
    for (var k = 0u; k < (nu + WGS - 1u) / WGS; k++) {
        let u = k * WGS + ub;
        var plain = vec4<u32>(0u);
        var qs: array<vec4<i32>, 4>;
        var us = 0i;
        for (var i = 0u; i < 4u; i++) {
            var x: vec4<f32>;
            var g: vec4<f32>;
            if (k < PF) {
                x = xs[4u * k + i];
                g = gs[4u * k + i];
            } else {
                x = x4(4u * u + i);
                g = g4(4u * u + i);
            }
            var y = x;
            if (NORM == 1u) {
                y = x / r * g;
            }
            let q = vec4<i32>(clamp(round(y * s), vec4<f32>(-128.0), vec4<f32>(127.0)));
            qs[i] = q;
            plain[i] = pack4(q);
            us += q.x + q.y + q.z + q.w;
            if (trace) {
                for (var c = 0u; c < 4u; c++) {
                    let e = 16u * u + 4u * i + c;
                    if (e < COLS) {
                        T[4u + e] = bitcast<u32>(y[c]);
                    }
                }
            }
        }
        var words = plain;
        if (LAYOUT >= 1u) {  // slot16: word g holds q[16u + g + 4k] in byte k
            for (var g = 0u; g < 4u; g++) {
                words[g] = pack4(vec4<i32>(qs[0][g], qs[1][g], qs[2][g], qs[3][g]));
            }
        }
        let bs = seg_sum(us, seg);
        if (u < nu) {
            X[QOFF / 4u + u] = words;
            if (LAYOUT == 2u) {  // both: plain here, slot16 after all the plain words
                X[QOFF / 4u + u] = plain;
                X[QOFF / 4u + nu + u] = words;
            }
            if (trace) {
                for (var i = 0u; i < 4u; i++) {
                    T[4u + COLS + 4u * u + i] = plain[i];
                }
            }
            if (sl % seg == 0u) {
                atomicAdd(&bsum[u / 16u], bs);
            }
        }
    }
    workgroupBarrier();
    for (var b = li; b < nblk; b += WGS) {
        X[(4u + b) / 4u][(4u + b) % 4u] = bitcast<u32>(atomicLoad(&bsum[b]));
    }
    if (li == 0u) {
        var total = 0i;
        for (var b = 0u; b < nblk; b++) {
            total += atomicLoad(&bsum[b]);
        }
        X[0][0] = bitcast<u32>(s);
        X[0][1] = bitcast<u32>(total);
        if (trace) {
            T[0] = bitcast<u32>(s);
        }
    }
    workgroupBarrier();
}
