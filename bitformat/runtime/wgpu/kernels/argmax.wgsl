// argmax.wgsl: the index of the largest logit (the lowest index among equal maxima, as
// numpy.argmax), so greedy decoding downloads 4 bytes per token instead of the logits.
//
// Bindings (group 0):
//   0  storage, read        L: array<f32>   logits [N]
//   1  storage, read_write  R: array<u32>   R[0] = index, R[1] = the logit's f32 bits
// Overrides: N. One workgroup of 256: each invocation scans a strided share (ascending, keeping
// the first maximum), then invocation 0 merges the 256 candidates by (value, lower index).
// NaN logits are never chosen over numbers (numpy would return the first NaN).

override N: u32;

const WG: u32 = 256u;

@group(0) @binding(0) var<storage, read> L: array<f32>;
@group(0) @binding(1) var<storage, read_write> R: array<u32>;

var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    var bv = -3.4028234663852886e38;
    var bi = 0xFFFFFFFFu;
    for (var i = t; i < N; i += WG) {
        let v = L[i];
        if (v > bv || bi == 0xFFFFFFFFu && v == bv) {
            bv = v;
            bi = i;
        }
    }
    best_v[t] = bv;
    best_i[t] = bi;
    workgroupBarrier();
    if (t == 0u) {
        var v = best_v[0];
        var k = best_i[0];
        for (var j = 1u; j < WG; j++) {
            let w = best_v[j];
            let i = best_i[j];
            if (w > v || (w == v && i < k)) {
                v = w;
                k = i;
            }
        }
        R[0] = select(k, 0u, k == 0xFFFFFFFFu);
        R[1] = bitcast<u32>(v);
    }
}
