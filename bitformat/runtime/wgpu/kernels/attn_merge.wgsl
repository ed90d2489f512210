// attn_merge.wgsl: the splits of attn_split.wgsl combined, one workgroup per query head:
//
//     M = max_s m_s,   o = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s
//
// The number of splits S follows from the length as the host chose it (WgpuBitNet.splits):
//     S = max(min(ceil(len / SPLIT), SPAR), ceil(len / CMAX))
// (at least SPLIT positions a split, at most SPAR splits unless a split would exceed CMAX).
//
// Bindings (group 0):
//   0  storage, read        PART: array<f32>  [tokens, H, SMAX, HD + 4] (attn_split.wgsl)
//   1  storage, read        ST: array<u32>    the step state (len: after the step or prompt)
//   2  storage, read_write  O: array<f32>     o [tokens, H * HD]
// Grid: (H, tokens).
// Overrides: HD, SMAX, SPLIT, SPAR, CMAX.

override HD: u32;
override SMAX: u32;
override SPLIT: u32 = 32u;
override SPAR: u32 = 32u;
override CMAX: u32 = 256u;

@group(0) @binding(0) var<storage, read> PART: array<f32>;
@group(0) @binding(1) var<storage, read> ST: array<u32>;
@group(0) @binding(2) var<storage, read_write> O: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>) {
    let h = wid.x;
    let tok = wid.y;  // a batched prompt's token (its runs were split for the prompt's end)
    let len = ST[2];
    let S = max(min((len + SPLIT - 1u) / SPLIT, SPAR), (len + CMAX - 1u) / CMAX);
    let b0 = (tok * nw.x + h) * SMAX * (HD + 4u);
    var mx = -3.4028234663852886e38;
    for (var s = 0u; s < S; s++) {
        mx = max(mx, PART[b0 + s * (HD + 4u)]);
    }
    var l = 0.0;
    for (var s = 0u; s < S; s++) {
        let b = b0 + s * (HD + 4u);
        l += PART[b + 1u] * exp(PART[b] - mx);
    }
    for (var d = li; d < HD; d += 64u) {
        var acc = 0.0;
        for (var s = 0u; s < S; s++) {
            let b = b0 + s * (HD + 4u);
            acc += PART[b + 4u + d] * exp(PART[b] - mx);
        }
        O[(tok * nw.x + h) * HD + d] = acc / l;
    }
}
