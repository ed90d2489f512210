// argmax_step.wgsl: the greedy token from lm_head_step.wgsl's per-workgroup maxima (the lowest
// row among equal values, as numpy.argmax; NaN never chosen: lm_head_step.wgsl leaves it out),
// written to R (R[0] the row, R[1] its logit's bits) and, STEP = 1, into the step state for
// the next decode step (argmax_best.wgsl), so the next step runs without the host.
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

//#include argmax_best.wgsl

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    let b = parts_best(t);
    choose(t, bitcast<f32>(b.x), b.y);
}
