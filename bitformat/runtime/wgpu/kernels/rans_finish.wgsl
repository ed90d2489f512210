// rans_finish.wgsl: for rans matrices cut into pieces (p > 1), turn each live row's integer
// sum (added up by the p lanes of its pieces with atomicAdd) into its output.
//
// Bindings (group 0):
//   0  X_SPACE   X: activation block (word 0: s)
//   1  storage, read        M: array<u32>         metadata (rans_common.wgsl)
//   2  uniform              RP: RansParams        (rans_common.wgsl)
//   3  storage, read        ACC: array<i32>       per-live-row sums
//   4  storage, read_write  Y: array<f32>         output
// Overrides: MODE (0: write, 1: add to Y). One invocation per live row.

override MODE: u32 = 0u;

@group(0) @binding(0) var<X_SPACE> X: X_TYPE;
@group(0) @binding(1) var<storage, read> M: array<u32>;
@group(0) @binding(2) var<uniform> RP: RansParams;
@group(0) @binding(3) var<storage, read> ACC: array<i32>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;

//#include rans_common.wgsl

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = (wid.x + wid.y * nw.x) * 64u + li;
    if (i >= RP.L) {
        return;
    }
    let y = out_value(ACC[i], bitcast<f32>(X[0][0]));
    let o = RP.row0 + M[RP.off_lrows + i];
    if (MODE == 1u) {
        Y[o] = Y[o] + y;
    } else {
        Y[o] = y;
    }
}
