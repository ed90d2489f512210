// norm_quant.wgsl: RMSNorm of one vector, then (QUANT = 1) per-token int8 quantization into the
// activation block the mat-vec kernels read; or (QUANT = 0) the normalized f32 vector.
//
//     y_i = x_i / sqrt(mean(x^2) + EPS) * gain_i                      float32, as numpy
//     s   = 127 / max(max_i |y_i|, 1e-5)
//     q_i = clamp(round(y_i * s), -128, 127)                          WGSL round: ties to even
//
// COMBINE = 1 feeds the FFN's sub-norm from separate gate and up outputs:
// x_i = max(G_i, 0)^2 * U_i (the path of matrices without a fused gate/up kernel: rans).
//
// Bindings (group 0):
//   0  storage, read        A: array<f32>   x [N]  (COMBINE = 1: gate outputs G)
//   1  storage, read        B: array<f32>   COMBINE = 1: up outputs U [N]; else not read
//   2  storage, read        G: array<f32>   gain [N]
//   3  storage, read_write  Q: array<u32>   QUANT = 1: the activation block (layout below)
//   4  storage, read_write  F: array<f32>   QUANT = 0: y [N]; QUANT = 1 and TRACE = 1: y [N]
// Overrides: N (<= 32256), EPS, QUANT, COMBINE, TRACE.
//
// Activation block Q, u32 words (NPAD = N rounded up to a multiple of 256; 64 KiB in all):
//   0            s, f32 bits
//   1            sum of every q (i32)
//   4 + b        sum of q over elements 256b .. 256b + 255 (i32), b < NPAD / 256
//   256 + i      q[4i .. 4i+3]: element 4i + k in byte k (int8, two's complement)   "plain"
//   256 + NPAD/4 + 4w + g    byte k = q[16w + g + 4k]                            "slot16"
//   q = 0 past N.
//
// One workgroup of 64 invocations: sums and maxima go through workgroup memory, 4 barriers.
// Every invocation adds the 64 partial sums in the same order, so all agree on r and s. The
// quantization takes 16 elements per invocation at a time (the block sums are integers, so
// the order of their atomic adds does not matter); a block of 256 per invocation, as before,
// left 54 of 64 invocations idle at N = 2560 and took 92 us a norm on an H200.

override N: u32;
override EPS: f32;
override QUANT: u32 = 1u;
override COMBINE: u32 = 0u;
override TRACE: u32 = 0u;

const WG: u32 = 64u;

@group(0) @binding(0) var<storage, read> A: array<f32>;
@group(0) @binding(1) var<storage, read> B: array<f32>;
@group(0) @binding(2) var<storage, read> G: array<f32>;
@group(0) @binding(3) var<storage, read_write> Q: array<u32>;
@group(0) @binding(4) var<storage, read_write> F: array<f32>;

var<workgroup> red_ss: array<f32, 64>;
var<workgroup> red_max: array<f32, 64>;
var<workgroup> red_sum: array<i32, 64>;
var<workgroup> blk: array<atomic<i32>, 128>;  // sums per block of 256 (NPAD / 256 <= 126)

fn x_at(i: u32) -> f32 {
    if (COMBINE == 1u) {
        let g = max(A[i], 0.0);
        return g * g * B[i];
    }
    return A[i];
}

// x_at(i), or 0 past N (the load clamped into range, so it need not wait for the test)
fn x_or0(i: u32) -> f32 {
    return select(0.0, x_at(min(i, N - 1u)), i < N);
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) t: u32) {
    atomicStore(&blk[t], 0i);  // (a driver need not zero workgroup memory: the barriers order these)
    atomicStore(&blk[t + WG], 0i);
    // four loads in flight per invocation (a GPU thread stalls at a load's first use), the
    // squares added in the same order as one element at a time (adding 0 * 0 changes no bit)
    var ss = 0.0;
    for (var i = t; i < N; i += 4u * WG) {
        let x0 = x_at(i);
        let x1 = x_or0(i + WG);
        let x2 = x_or0(i + 2u * WG);
        let x3 = x_or0(i + 3u * WG);
        ss += x0 * x0;
        ss += x1 * x1;
        ss += x2 * x2;
        ss += x3 * x3;
    }
    red_ss[t] = ss;
    workgroupBarrier();
    var tot = 0.0;
    for (var j = 0u; j < WG; j++) {
        tot += red_ss[j];
    }
    let r = sqrt(tot / f32(N) + EPS);

    var m = 0.0;
    for (var i = t; i < N; i += 4u * WG) {
        let j1 = i + WG;
        let j2 = i + 2u * WG;
        let j3 = i + 3u * WG;
        let y0 = x_at(i) / r * G[i];
        let y1 = x_or0(j1) / r * G[min(j1, N - 1u)];
        let y2 = x_or0(j2) / r * G[min(j2, N - 1u)];
        let y3 = x_or0(j3) / r * G[min(j3, N - 1u)];
        m = max(m, max(max(abs(y0), abs(y1)), max(abs(y2), abs(y3))));
        if (QUANT == 0u || TRACE == 1u) {
            F[i] = y0;
            if (j1 < N) { F[j1] = y1; }
            if (j2 < N) { F[j2] = y2; }
            if (j3 < N) { F[j3] = y3; }
        }
    }
    if (QUANT == 0u) {
        return;
    }
    red_max[t] = m;
    workgroupBarrier();
    var mx = 0.0;
    for (var j = 0u; j < WG; j++) {
        mx = max(mx, red_max[j]);
    }
    let s = 127.0 / max(mx, 1e-5);

    let npad = (N + 255u) / 256u * 256u;
    let soff = 256u + npad / 4u;
    // one invocation per 16 elements (a word of each layout), their sum into their block's
    for (var u = t; u < npad / 16u; u += WG) {
        let e0 = u * 16u;
        var us = 0i;
        var plain = vec4<u32>(0u);
        var slot = vec4<u32>(0u);
        for (var k = 0u; k < 16u; k++) {
            let e = e0 + k;
            var q = 0i;
            if (e < N) {
                q = i32(clamp(round(x_at(e) / r * G[e] * s), -128.0, 127.0));
            }
            us += q;
            let byte = u32(q) & 0xFFu;
            plain[k >> 2u] |= byte << (8u * (k & 3u));
            slot[k & 3u] |= byte << (8u * (k >> 2u));
        }
        for (var i = 0u; i < 4u; i++) {
            Q[256u + e0 / 4u + i] = plain[i];
            Q[soff + e0 / 4u + i] = slot[i];
        }
        atomicAdd(&blk[u / 16u], us);
    }
    workgroupBarrier();
    var total = 0i;
    for (var b = t; b < npad / 256u; b += WG) {
        let bs = atomicLoad(&blk[b]);
        Q[4u + b] = bitcast<u32>(bs);
        total += bs;
    }
    red_sum[t] = total;
    workgroupBarrier();
    if (t == 0u) {
        var tt = 0i;
        for (var j = 0u; j < WG; j++) {
            tt += red_sum[j];
        }
        Q[0] = bitcast<u32>(s);
        Q[1] = bitcast<u32>(tt);
    }
}
