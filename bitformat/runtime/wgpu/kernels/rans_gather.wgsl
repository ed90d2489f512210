// rans_gather.wgsl: prepare a rans mat-vec: gather the int8 activations of the live columns,
// five columns (one 5-trit symbol) per vec4, zero the output rows (MODE 0: dead rows stay 0)
// and, for matrices cut into pieces (p > 1), the integer accumulators.
//
// XL[m] (u32 x 4) for live columns 5m .. 5m+4 (q = 0 past C):
//   .x  q[5m .. 5m+3] as int8 bytes (byte k = column 5m + k)
//   .y  q[5m + 4] (i32)
//   .z  q[5m] + ... + q[5m + 4] (i32): a symbol's codes are trit + 1
//   .w  0
//
// Bindings (group 0):
//   0  X_SPACE   X: activation block (layout in matvec_common.wgsl; the plain q words)
//   1  storage, read        M: array<u32>         metadata (rans_common.wgsl)
//   2  uniform              RP: RansParams        (rans_common.wgsl)
//   3  storage, read_write  XL: array<vec4<u32>>  x_live by symbol [ceil(C / 5) + 1]
//   4  storage, read_write  Y: array<f32>         output (MODE 0: rows are zeroed)
//   5  storage, read_write  ACC: array<i32>       per-live-row sums (p > 1: zeroed)
// Overrides: MODE. One invocation per index up to max(ceil(C / 5) + 1, rows, L).

override MODE: u32 = 0u;

const QOFF: u32 = 256u;

@group(0) @binding(0) var<X_SPACE> X: X_TYPE;
@group(0) @binding(1) var<storage, read> M: array<u32>;
@group(0) @binding(2) var<uniform> RP: RansParams;
@group(0) @binding(3) var<storage, read_write> XL: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;
@group(0) @binding(5) var<storage, read_write> ACC: array<i32>;

//#include rans_common.wgsl

fn q_at(c: u32) -> i32 {
    let i = QOFF + (c >> 2u);
    let w = X[i >> 2u][i & 3u];
    return bitcast<i32>(w << (24u - 8u * (c & 3u))) >> 24u;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = (wid.x + wid.y * nw.x) * 64u + li;
    if (i <= RP.C / 5u + 1u) {
        var v = vec4<u32>(0u);
        var sum = 0i;
        for (var k = 0u; k < 5u; k++) {
            let c = 5u * i + k;
            var q = 0i;
            if (c < RP.C) {
                q = q_at(M[RP.off_lcols + c]);
            }
            sum += q;
            if (k < 4u) {
                v.x |= (bitcast<u32>(q) & 0xFFu) << (8u * k);
            } else {
                v.y = bitcast<u32>(q);
            }
        }
        v.z = bitcast<u32>(sum);
        XL[i] = v;
    }
    if (MODE == 0u && i < RP.rows) {
        Y[RP.row0 + i] = 0.0;
    }
    if (RP.p > 1u && i < RP.L) {
        ACC[i] = 0;
    }
}
