// kv_write.wgsl: a batched prompt's keys and values into the layer's KV cache: token t (grid
// z) at position ST.pos + t, KV head g (grid x): (QKN = 1) RMSNorm over the head with the
// k_norm gains, rotate-half RoPE from the host's cos/sin table, then K; V as it is.
// The same arithmetic as attn_split.wgsl's key of a decode step.
//
// Bindings (group 0):
//   0  storage, read        QKV: array<f32>   per token: q [H * HD], k [KVH * HD], v [KVH * HD]
//   1  storage, read_write  KC: array<f32>    layer K cache [ML, KVH, HD]
//   2  storage, read_write  VC: array<f32>    layer V cache [ML, KVH, HD]
//   3  storage, read        CS: array<f32>    [ML, HD]: per position cos[HD/2] then sin[HD/2]
//   4  storage, read        ST: array<u32>    the step state (pos: the prompt's first position)
//   5  storage, read        NG: array<f32>    QKN = 1: q_norm gains [HD], k_norm gains [HD]
// Overrides: H, KVH, HD, QKN, PERM, EPS, QKVS (floats of QKV per token), KVT (the cache type:
// kv_round.wgsl). Workgroups of 64.

//#include kv_round.wgsl

override H: u32;
override KVH: u32;
override HD: u32;
override QKN: u32 = 0u;
override PERM: u32 = 0u;
override EPS: f32 = 1e-6;
override QKVS: u32;

@group(0) @binding(0) var<storage, read> QKV: array<f32>;
@group(0) @binding(1) var<storage, read_write> KC: array<f32>;
@group(0) @binding(2) var<storage, read_write> VC: array<f32>;
@group(0) @binding(3) var<storage, read> CS: array<f32>;
@group(0) @binding(4) var<storage, read> ST: array<u32>;
@group(0) @binding(5) var<storage, read> NG: array<f32>;

var<workgroup> red: array<f32, 64>;

fn ix(j: u32) -> u32 {
    if (PERM == 1u) {
        let half = HD / 2u;
        return 2u * (j % half) + j / half;
    }
    return j;
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let g = wid.x;
    let tok = wid.z;
    let pos = ST[1] + tok;
    let kvd = KVH * HD;
    let half = HD / 2u;
    let src = tok * QKVS + H * HD + g * HD;
    var r = 1.0;
    if (QKN == 1u) {
        var ss = 0.0;
        for (var i = li; i < HD; i += 64u) {
            let x = QKV[src + i];
            ss += x * x;
        }
        red[li] = ss;
        workgroupBarrier();
        var tot = 0.0;
        for (var i = 0u; i < 64u; i++) {
            tot += red[i];
        }
        r = sqrt(tot / f32(HD) + EPS);
    }
    for (var i = li; i < half; i += 64u) {
        var x1 = QKV[src + ix(i)];
        var x2 = QKV[src + ix(i + half)];
        if (QKN == 1u) {
            x1 = x1 / r * NG[HD + i];
            x2 = x2 / r * NG[HD + i + half];
        }
        let c = CS[pos * HD + i];
        let sn = CS[pos * HD + half + i];
        let b = pos * kvd + g * HD;
        KC[b + i] = kv_round(x1 * c - x2 * sn);
        KC[b + i + half] = kv_round(x2 * c + x1 * sn);
    }
    for (var d = li; d < HD; d += 64u) {
        VC[pos * kvd + g * HD + d] = kv_round(QKV[src + kvd + d]);
    }
}
