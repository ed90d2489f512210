// quant_prologue.wgsl: a workgroup of WGS invocations turns one input vector into the int8
// activation block in workgroup memory X (layout in matvec_common.wgsl), so that the rows'
// code (rows_<format>.wgsl) reads it as it reads the op-by-op kernels' binding:
//
//     NORM = 1:  y = x / r * g,   r = sqrt(sum(x^2) / COLS + EPS)      (RMSNorm, gains G)
//     NORM = 0:  y = x                                                (families without sub-norms)
//     COMBINE = 1: x = act(A) * U first (gate and up outputs of two separate mat-vecs)
//     s = 127 / max(max|y|, 1e-5),    q = clamp(round(y s), -128, 127)   (round: ties to even)
//
// Two passes over the input (it sits in L2, written by the previous dispatch): the first sums
// x^2 and finds max|x g| together (subgroup reductions, one barrier), so max|y| is taken as
// max|x g| / r (the CPU's max|x / r * g| may differ from it in the last bit of s, moving a q
// only where y s lies on a .5 boundary); the second quantizes 16 values per invocation and
// writes them as one vec4 of words: LAYOUT 0 "plain" (bytes k of word i: q[4i + k]), LAYOUT 1
// "slot16" (byte k of word 4w + g: q[16w + g + 4k]), both starting at word QOFF. Word 0 holds
// s, word 1 the sum of every q, word 4 + b the sum of 256-block b.
//
// The including kernel declares A, U, G (storage, read), the overrides COLS, NORM, COMBINE,
// ACT, EPS, LAYOUT, TRACE, the workgroup array X (XV4 vec4s) and, for TRACE = 1, T (storage,
// read_write): workgroup 0 then writes T[0] = s bits, T[4 + i] = y_i bits and
// T[4 + COLS + i] = plain word i, for tests that compare the quantization with the CPU's.
// Workgroup memory is not zeroed by every driver (lavapipe), so the sums are zeroed here.

const WGS: u32 = 256u;
const QOFF: u32 = 256u;

var<workgroup> red: array<vec2<f32>, 64>;  // (sum, max) per subgroup (subgroups >= 4 lanes)
var<workgroup> bsum: array<atomic<i32>, NBLK>;
var<workgroup> qtotal: atomic<i32>;

// the FFN gate's activation: relu(g)^2 (ACT 0, BitNet 2B-4T) or silu (ACT 1)
fn act(g: f32) -> f32 {
    if (ACT == 0u) {
        let r = max(g, 0.0);
        return r * r;
    }
    return g / (1.0 + exp(-g));
}

fn x_in(i: u32) -> f32 {
    if (COMBINE == 1u) {
        return act(A[i]) * U[i];
    }
    return A[i];
}

// Fills X. Every invocation of the workgroup must call it (it has barriers).
fn quant_prologue(li: u32, wid: u32, sl: u32, sid: u32, ns: u32) {
    let nblk = (COLS + 255u) / 256u;
    for (var b = li; b < nblk; b += WGS) {
        atomicStore(&bsum[b], 0i);
    }
    if (li == 0u) {
        atomicStore(&qtotal, 0i);
    }
    var ss = 0.0;
    var mx = 0.0;
    for (var i = li; i < COLS; i += WGS) {
        let x = x_in(i);
        ss += x * x;
        var y = x;
        if (NORM == 1u) {
            y = x * G[i];
        }
        mx = max(mx, abs(y));
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
    for (var u = li; u < nblk * 16u; u += WGS) {
        var us = 0i;
        var words = vec4<u32>(0u);
        var plain = vec4<u32>(0u);
        for (var k = 0u; k < 16u; k++) {
            let e = u * 16u + k;
            var q = 0i;
            if (e < COLS) {
                var y = x_in(e);
                if (NORM == 1u) {
                    y = y / r * G[e];
                }
                q = i32(clamp(round(y * s), -128.0, 127.0));
                if (trace) {
                    T[4u + e] = bitcast<u32>(y);
                }
            }
            us += q;
            let byte = u32(q) & 0xFFu;
            plain[k >> 2u] |= byte << (8u * (k & 3u));
            words[k & 3u] |= byte << (8u * (k >> 2u));
        }
        if (LAYOUT == 0u) {
            words = plain;
        }
        X[QOFF / 4u + u] = words;
        if (trace) {
            for (var i = 0u; i < 4u; i++) {
                T[4u + COLS + 4u * u + i] = plain[i];
            }
        }
        atomicAdd(&bsum[u / 16u], us);
        atomicAdd(&qtotal, us);
    }
    workgroupBarrier();
    for (var b = li; b < nblk; b += WGS) {
        X[(4u + b) / 4u][(4u + b) % 4u] = bitcast<u32>(atomicLoad(&bsum[b]));
    }
    if (li == 0u) {
        X[0][0] = bitcast<u32>(s);
        X[0][1] = bitcast<u32>(atomicLoad(&qtotal));
        if (trace) {
            T[0] = bitcast<u32>(s);
        }
    }
    workgroupBarrier();
}
