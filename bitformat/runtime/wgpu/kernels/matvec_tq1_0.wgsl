// matvec_tq1_0.wgsl: y = sum_b d_b (sum_{k in b} t[r,k] q[k]) / s for a TQ1_0 matrix (ggml
// type 34), decoded from its base-3 bytes in registers.
//
// Bindings (group 0):
//   0  X_SPACE   X: activation block (layout in matvec_common.wgsl)
//   1  storage, read        W: array<u32>   the matrix's bytes, row after row, + 4 bytes of padding
//   2  uniform              P: Params       (matvec_common.wgsl; scale/scale2 unused)
//   3  storage, read_write  Y: array<f32>   output, rows P.row0 .. P.row0 + ROWS
// Overrides: ROWS, COLS (a multiple of 256), MODE, LANES.
//
// Bit layout and the row dot product: rows_tq1_0.wgsl.

override ROWS: u32;
override COLS: u32;
override MODE: u32 = 0u;
override LANES: u32 = 1u;

@group(0) @binding(0) var<X_SPACE> X: X_TYPE;
@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

//#include rows_tq1_0.wgsl
//#include matvec_common.wgsl
