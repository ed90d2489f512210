// argmax_screen.wgsl: the screened head's greedy token: the argmax of its candidates' logits
// (lm_head_rows_step.wgsl, CAND = 1: the full head's own per-row arithmetic) where the screen
// held (IDS[0] <= CAP), else of the full head's per-workgroup maxima (lm_head_step.wgsl, which
// ran only then) as argmax_step.wgsl takes it. The lowest row among equal values, NaN never
// chosen: the full head's choice either way, since every row that can reach the largest
// logit is a candidate. R[0] the row, R[1] its logit's bits, R[2] the candidate count (NONE:
// the full head ran); STEP = 1 also writes the state for the next decode step.
//
// Bindings (group 0):
//   0  storage, read        LC: array<f32>         candidate i's logit
//   1  storage, read        IDS: array<u32>        count, then the candidates' ids
//   2  storage, read        PT: array<vec2<u32>>   (value bits, row) [N]
//   3  storage, read_write  R: array<u32>
//   4  storage, read_write  ST: array<u32>         token, pos, len (embed_step.wgsl)
// Overrides: N, CAP, STEP. One workgroup of 256.

override N: u32;
override CAP: u32;
override STEP: u32 = 1u;

@group(0) @binding(0) var<storage, read> LC: array<f32>;
@group(0) @binding(1) var<storage, read> IDS: array<u32>;
@group(0) @binding(2) var<storage, read> PT: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read_write> R: array<u32>;
@group(0) @binding(4) var<storage, read_write> ST: array<u32>;

//#include argmax_best.wgsl

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    let n = IDS[0];
    var v = -3.4028234663852886e38;
    var k = 0xFFFFFFFFu;
    if (n <= CAP) {
        for (var j = t; j < n; j += 256u) {
            let w = LC[j];
            let i = IDS[1u + j];
            if (w == w && better(w, i, v, k)) {  // (w == w: NaN never wins)
                v = w;
                k = i;
            }
        }
    } else {
        let b = parts_best(t);
        v = bitcast<f32>(b.x);
        k = b.y;
    }
    choose(t, v, k);
    if (t == 0u) {
        R[2] = n;
    }
}
