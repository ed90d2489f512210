// argmax_step.wgsl: the greedy token from lm_head_step.wgsl's per-workgroup maxima (the lowest
// row among equal values, as numpy.argmax; NaN never chosen), written to R (R[0] the row,
// R[1] its logit's bits) and, STEP = 1, into the step state for the next decode step: token
// = the row, pos = len (the position after the last one run, a decode step's or a batched
// prompt's), len + 1, so the next step runs without the host.
//
// Bindings (group 0):
//   0  storage, read        PT: array<vec2<u32>>  (value bits, row) [N]
//   1  storage, read_write  R: array<u32>
//   2  storage, read_write  ST: array<u32>         token, pos, len (embed_step.wgsl)
// Overrides: N, STEP. One workgroup of 256.

override N: u32;
override STEP: u32 = 1u;

@group(0) @binding(0) var<storage, read> PT: array<vec2<u32>>;
@group(0) @binding(1) var<storage, read_write> R: array<u32>;
@group(0) @binding(2) var<storage, read_write> ST: array<u32>;

var<workgroup> bv: array<f32, 256>;
var<workgroup> bi: array<u32, 256>;

fn better(w: f32, i: u32, v: f32, k: u32) -> bool {
    return i != 0xFFFFFFFFu && (k == 0xFFFFFFFFu || w > v || (w == v && i < k));
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
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
