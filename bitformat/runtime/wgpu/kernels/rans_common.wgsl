// rans_common.wgsl: the per-tensor parameters and metadata layout shared by rans_gather,
// rans_matvec and rans_finish (pasted where they say `//#include rans_common.wgsl`).
//
// RP (uniform) holds the tensor's geometry (docs/formats/rans.md) and where each section of
// the metadata buffer M (array<u32>, built once at load from the tensor's bytes) starts:
//   M[off_off + s]        word offset of stream s in the stream words, s = 0 .. S (S + 1 entries)
//   M[off_lrows + i]      matrix row of live row i (L entries)
//   M[off_lcols + c]      matrix column of live column c (C entries)
//   M[off_cls + i / 8]    class (table) of live row i in bits 4(i % 8) .. +3 (only if T > 1)
//   M[off_tab + 243 t + sym]   table t: cumulative units << 16 | frequency units of sym
//   M[off_lut + 1024 t + i / 4] table t: byte i % 4 = the symbol of quantile unit i (0 .. 4095)
//   M[off_cuts + j]       first live column of piece j (p + 1 entries, the last = C)

struct RansParams {
    rows: u32,       // matrix rows
    L: u32,          // live rows
    C: u32,          // live columns
    S: u32,          // streams
    k: u32,          // live rows per stream
    p: u32,          // pieces per row
    T: u32,          // tables
    group: u32,      // trits per symbol: 5 or 1
    off_off: u32,
    off_lrows: u32,
    off_lcols: u32,
    off_cls: u32,
    off_tab: u32,
    off_lut: u32,
    off_cuts: u32,
    row0: u32,       // first output row (always 0: rans tensors are not split)
    scale: f32,      // per-tensor scale
    out_scale: f32,  // optional extra output scale, else 1
    pad0: u32,
    pad1: u32,
}

fn out_value(acc: i32, s: f32) -> f32 {
    return f32(acc) * RP.scale / s * RP.out_scale;
}
