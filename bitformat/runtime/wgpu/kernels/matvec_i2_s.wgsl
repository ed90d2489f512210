// matvec_i2_s.wgsl: y = (sum_k t[r,k] q[k]) * scale / s for an i2_s matrix (bitnet.cpp I2_S),
// decoded from its packed words in registers.
//
// Bindings (group 0):
//   0  X_SPACE   X: activation block (layout in matvec_common.wgsl)
//   1  storage, read        W: array<u32>   the matrix's packed bytes, row after row (no tail)
//   2  uniform              P: Params       (matvec_common.wgsl)
//   3  storage, read_write  Y: array<f32>   output, rows P.row0 .. P.row0 + ROWS
// Overrides: ROWS, COLS (a multiple of BLK), BLK (128: x86 layout, 64: ARM layout), MODE, LANES.
//
// Bit layout and the row dot product: rows_i2_s.wgsl.

override ROWS: u32;
override COLS: u32;
override BLK: u32 = 128u;
override MODE: u32 = 0u;
override LANES: u32 = 1u;

@group(0) @binding(0) var<X_SPACE> X: X_TYPE;
@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

//#include rows_i2_s.wgsl
//#include matvec_common.wgsl
