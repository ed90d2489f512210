// attention.wgsl: causal GQA attention of this step's query over the KV cache, one workgroup
// per query head:
//
//     p_j = softmax_j(q . k_j * INV),  j < S.len;     o = sum_j p_j v_j        (float32)
//
// with k_j, v_j of kv head h / (H / KVH). INV = float32(1 / sqrt(HD)), computed on the host.
//
// Bindings (group 0):
//   0  storage, read        QB: array<f32>  q [H * HD] (after RoPE)
//   1  storage, read        KC: array<f32>  layer K cache [ML, KVH, HD]
//   2  storage, read        VC: array<f32>  layer V cache [ML, KVH, HD]
//   3  storage, read_write  SC: array<f32>  scratch [H, ML]: scores, then probabilities
//   4  storage, read_write  O: array<f32>   output [H * HD]
//   5  uniform              S: Step         S.len = positions to attend to (embed.wgsl)
// Overrides: H, KVH, HD (<= 256), ML (cache length), INV.
//
// The scores live in a storage scratch, not workgroup memory: WebGPU guarantees only 16 KiB of
// workgroup memory, 4096 positions of f32. Steps: scores and their max (barrier), exp and sum
// (barrier), divide by the sum (storage barrier), then each invocation sums p_j v_j for its
// dimensions.

override H: u32;
override KVH: u32;
override HD: u32;
override ML: u32;
override INV: f32;

const WG: u32 = 64u;

struct Step {
    row: u32,
    pos: u32,
    len: u32,
    pad: u32,
}

@group(0) @binding(0) var<storage, read> QB: array<f32>;
@group(0) @binding(1) var<storage, read> KC: array<f32>;
@group(0) @binding(2) var<storage, read> VC: array<f32>;
@group(0) @binding(3) var<storage, read_write> SC: array<f32>;
@group(0) @binding(4) var<storage, read_write> O: array<f32>;
@group(0) @binding(5) var<uniform> S: Step;

var<workgroup> qv: array<f32, 256>;
var<workgroup> red_max: array<f32, 64>;
var<workgroup> red_sum: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let g = h / (H / KVH);
    let n = S.len;
    let sc = h * ML;
    for (var d = t; d < HD; d += WG) {
        qv[d] = QB[h * HD + d];
    }
    workgroupBarrier();

    var m = -3.4028234663852886e38;
    for (var j = t; j < n; j += WG) {
        let k = (j * KVH + g) * HD;
        var dot = 0.0;
        for (var d = 0u; d < HD; d++) {
            dot += qv[d] * KC[k + d];
        }
        let s = dot * INV;
        SC[sc + j] = s;
        m = max(m, s);
    }
    red_max[t] = m;
    workgroupBarrier();
    var mx = -3.4028234663852886e38;
    for (var i = 0u; i < WG; i++) {
        mx = max(mx, red_max[i]);
    }

    var sum = 0.0;
    for (var j = t; j < n; j += WG) {
        let p = exp(SC[sc + j] - mx);
        SC[sc + j] = p;
        sum += p;
    }
    red_sum[t] = sum;
    workgroupBarrier();
    var tot = 0.0;
    for (var i = 0u; i < WG; i++) {
        tot += red_sum[i];
    }
    for (var j = t; j < n; j += WG) {
        SC[sc + j] = SC[sc + j] / tot;
    }
    storageBarrier();
    workgroupBarrier();

    for (var d = t; d < HD; d += WG) {
        var acc = 0.0;
        for (var j = 0u; j < n; j++) {
            acc += SC[sc + j] * VC[(j * KVH + g) * HD + d];
        }
        O[h * HD + d] = acc;
    }
}
