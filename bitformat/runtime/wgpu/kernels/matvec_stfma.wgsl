// matvec_stfma.wgsl: y = (sum_k t[r,k] q[k]) * scale / s for an stfma matrix (16 trits per u32,
// code = trit + 1), decoded from its words in registers.
//
// Bindings (group 0):
//   0  X_SPACE   X: activation block (layout in matvec_common.wgsl)
//   1  storage, read        W: array<u32>   the matrix's words, row after row
//   2  uniform              P: Params       (matvec_common.wgsl)
//   3  storage, read_write  Y: array<f32>   output, rows P.row0 .. P.row0 + ROWS
// Overrides: ROWS, COLS (any; rows are ceil(COLS/16) words), MODE, LANES.
//
// Bit layout and the row dot product: rows_stfma.wgsl.

override ROWS: u32;
override COLS: u32;
override MODE: u32 = 0u;
override LANES: u32 = 1u;

@group(0) @binding(0) var<X_SPACE> X: X_TYPE;
@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

//#include rows_stfma.wgsl
//#include matvec_common.wgsl
