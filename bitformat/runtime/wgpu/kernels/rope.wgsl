// rope.wgsl: rotate-half RoPE on q (in place) and k at this step's position, and store k and v
// in the layer's KV cache.
//
//     (x_i, x_{i+d/2}) -> (x_i c_i - x_{i+d/2} s_i,  x_{i+d/2} c_i + x_i s_i),  i < d/2
//
// c, s come from a host table (numpy's float32 cos/sin of pos * inv_freq, the CPU path's own
// values: WGSL's cos/sin guarantee only an absolute error of 2^-11).
//
// Bindings (group 0):
//   0  storage, read_write  QB: array<f32>  q [H * HD], rotated in place
//   1  storage, read        KB: array<f32>  k [KVH * HD]
//   2  storage, read        VB: array<f32>  v [KVH * HD]
//   3  storage, read        CS: array<f32>  [ML, HD]: per position cos[HD/2] then sin[HD/2]
//   4  storage, read_write  KC: array<f32>  layer K cache [ML, KVH, HD]
//   5  storage, read_write  VC: array<f32>  layer V cache [ML, KVH, HD]
//   6  uniform              S: Step         S.pos (embed.wgsl)
// Overrides: H, KVH, HD. One invocation per rotated pair of q, then of k, then per v value.

override H: u32;
override KVH: u32;
override HD: u32;

struct Step {
    row: u32,
    pos: u32,
    len: u32,
    pad: u32,
}

@group(0) @binding(0) var<storage, read_write> QB: array<f32>;
@group(0) @binding(1) var<storage, read> KB: array<f32>;
@group(0) @binding(2) var<storage, read> VB: array<f32>;
@group(0) @binding(3) var<storage, read> CS: array<f32>;
@group(0) @binding(4) var<storage, read_write> KC: array<f32>;
@group(0) @binding(5) var<storage, read_write> VC: array<f32>;
@group(0) @binding(6) var<uniform> S: Step;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let half = HD / 2u;
    let nq = H * half;
    let nk = KVH * half;
    let kv = KVH * HD;
    var t = gid.x;
    let cs = S.pos * HD;
    if (t < nq) {
        let i = t % half;
        let base = (t / half) * HD;
        let c = CS[cs + i];
        let s = CS[cs + half + i];
        let x1 = QB[base + i];
        let x2 = QB[base + half + i];
        QB[base + i] = x1 * c - x2 * s;
        QB[base + half + i] = x2 * c + x1 * s;
        return;
    }
    t -= nq;
    if (t < nk) {
        let i = t % half;
        let base = (t / half) * HD;
        let c = CS[cs + i];
        let s = CS[cs + half + i];
        let x1 = KB[base + i];
        let x2 = KB[base + half + i];
        let o = S.pos * kv + base;
        KC[o + i] = x1 * c - x2 * s;
        KC[o + half + i] = x2 * c + x1 * s;
        return;
    }
    t -= nk;
    if (t < kv) {
        VC[S.pos * kv + t] = VB[t];
    }
}
