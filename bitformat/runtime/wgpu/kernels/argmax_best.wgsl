// argmax_best.wgsl: the greedy choice's reduction over one workgroup of 256, shared by
// argmax_step.wgsl and argmax_screen.wgsl: each invocation brings its best (value, row) pair,
// the lowest row wins among equal values (as numpy.argmax), a row of NONE never wins (NaN is
// left out by the callers), and the winner is written as the step's token: R[0] the row (0
// where there is none), R[1] its value's bits and, STEP = 1, into the step state for the next
// decode step (token = the row, pos = len: the position after the last one run, len + 1), so
// the next step runs without the host. The including kernel declares PT (lm_head_step.wgsl's
// per-workgroup (value bits, row) pairs, N of them), R and ST (storage, read_write,
// array<u32>) and the overrides N and STEP.

var<workgroup> bv: array<f32, 256>;
var<workgroup> bi: array<u32, 256>;

fn better(w: f32, i: u32, v: f32, k: u32) -> bool {
    return i != 0xFFFFFFFFu && (k == 0xFFFFFFFFu || w > v || (w == v && i < k));
}

// invocation t's best of the per-workgroup maxima PT: (value bits, row)
fn parts_best(t: u32) -> vec2<u32> {
    var v = -3.4028234663852886e38;
    var k = 0xFFFFFFFFu;
    for (var j = t; j < N; j += 256u) {
        let p = PT[j];
        let w = bitcast<f32>(p.x);
        if (better(w, p.y, v, k)) {
            v = w;
            k = p.y;
        }
    }
    return vec2<u32>(bitcast<u32>(v), k);
}

// every invocation of the workgroup calls it (barriers); invocation 0 writes the token
fn choose(t: u32, v: f32, k: u32) {
    bv[t] = v;
    bi[t] = k;
    workgroupBarrier();
    for (var o = 128u; o > 0u; o >>= 1u) {
        if (t < o && better(bv[t + o], bi[t + o], bv[t], bi[t])) {
            bv[t] = bv[t + o];
            bi[t] = bi[t + o];
        }
        workgroupBarrier();
    }
    if (t == 0u) {
        let id = select(bi[0], 0u, bi[0] == 0xFFFFFFFFu);
        R[0] = id;
        R[1] = bitcast<u32>(bv[0]);
        if (STEP == 1u) {
            ST[0] = id;  // the next step embeds it at the position after the last one run
            ST[1] = ST[2];
            ST[2] = ST[2] + 1u;
        }
    }
}
