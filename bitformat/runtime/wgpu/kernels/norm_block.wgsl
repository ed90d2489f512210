// norm_block.wgsl: one workgroup normalizes one vector for the kernels that read the activation
// block from a binding (the rans mat-vecs) or the f32 vector (the LM head):
//
//     QUANT = 1: the int8 activation block (quant_prologue.wgsl) copied to Q
//     QUANT = 0: F[i] = y_i = x_i / r * g_i  (the final RMSNorm; NORM = 1)
//
// Bindings (group 0):
//   0  storage, read        A: array<vec4<f32>>  x [COLS] (COMBINE = 1: gate outputs)
//   1  storage, read        U: array<vec4<f32>>  COMBINE = 1: up outputs; else unused
//   2  storage, read        G: array<vec4<f32>>  gains [COLS]
//   3  storage, read_write  Q: array<vec4<u32>>  QUANT = 1: the activation block
//   4  storage, read_write  F: array<vec4<f32>>  QUANT = 0: y [COLS]
//   5  storage, read_write  T: array<u32>   TRACE = 1 (quant_prologue.wgsl)
// Overrides: COLS, QUANT, NORM, COMBINE, ACT, EPS, LAYOUT, TRACE. One workgroup of 256 per
// vector (grid z: vector z of A into block z of Q / row z of F).

override COLS: u32;
override QUANT: u32 = 1u;
override NORM: u32 = 1u;
override COMBINE: u32 = 0u;
override ACT: u32 = 0u;
override EPS: f32 = 1e-5;
override LAYOUT: u32 = 0u;
override TRACE: u32 = 0u;

@group(0) @binding(0) var<storage, read> A: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> U: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> G: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Q: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> F: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> T: array<u32>;

var<workgroup> X: array<vec4<u32>, XV4>;

//#include quant_prologue.wgsl

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(subgroup_size) sgs: u32, @builtin(subgroup_invocation_id) sl: u32,
        @builtin(subgroup_id) sid: u32, @builtin(num_subgroups) ns: u32) {
    abase = wid.z * (COLS / 4u);  // batched: one workgroup per token
    if (QUANT == 0u) {
        var ss = 0.0;
        for (var j = li; j < COLS / 4u; j += WGS) {
            let x = A[abase + j];
            ss += dot(x, x);
        }
        let part = subgroupAdd(ss);
        if (sl == 0u) {
            red[sid] = vec2<f32>(part, 0.0);
        }
        workgroupBarrier();
        var tot = 0.0;
        for (var j = 0u; j < ns; j++) {
            tot += red[j].x;
        }
        let r = sqrt(tot / f32(COLS) + EPS);
        for (var j = li; j < COLS / 4u; j += WGS) {
            F[abase + j] = A[abase + j] / r * G[j];
        }
        return;
    }
    quant_prologue(li, wid.z, sl, sid, ns, sgs);
    for (var i = li; i < XV4; i += WGS) {
        Q[wid.z * XV4 + i] = X[i];
    }
}
