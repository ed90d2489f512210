// kv_round.wgsl: a key or value as the KV cache's type holds it (runtime/kvquant.py).
// KVT = 0: float32, as it is. KVT = 1: rounded to the nearest float16 (ties to even, as
// numpy's astype(np.float16) and the cpu kernels' fptrunc), kept in a float32 slot: the
// float16 step at x's exponent is a power of two, so scaling by it is exact and round() (ties
// to even in WGSL) picks the neighbour; magnitudes from 65520 up become infinities, below
// 2^-14 the step is float16's subnormal one, 2^-24.

override KVT: u32 = 0u;

fn kv_round(x: f32) -> f32 {
    if (KVT == 0u) {
        return x;
    }
    let a = abs(x);
    if (a >= 65520.0) {
        return bitcast<f32>((bitcast<u32>(x) & 0x80000000u) | 0x7f800000u);
    }
    let e = max(i32(bitcast<u32>(a) >> 23u) - 127, -14);
    return round(x * ldexp(1.0, 10 - e)) * ldexp(1.0, e - 10);
}
