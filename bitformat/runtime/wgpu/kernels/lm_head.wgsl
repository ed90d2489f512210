// lm_head.wgsl: logits[r] = dot(E[r], x) for the rows of one chunk of the (tied, unquantized)
// token embedding; x is the final RMSNorm output in f32.
//
// Bindings (group 0):
//   0  X_SPACE   X: array<vec4<f32>, ...>   x [DIM] (DIM <= 16384)
//   1  storage, read        E: array<u32>   rows P.row0 .. P.row0 + ROWS of token_embd
//   2  uniform              P: Head         P.row0: the chunk's first row
//   3  storage, read_write  L: array<f32>   logits [vocab]
// Overrides: ROWS, DIM (even unless DTYPE = 0), DTYPE (0: f32, 1: f16, 2: bf16), LANES.
//
// Layout: a row is DIM values, little endian; f16/bf16 rows are DIM/2 words with value 2j in
// the low and 2j+1 in the high half of word j (read with unpack2x16float, no shader-f16
// needed). The embedding is split by rows into chunks no larger than the adapter's
// max_storage_buffer_binding_size; one dispatch per chunk. A workgroup of 64 handles
// 64 / LANES rows; a row's LANES invocations take its words round robin (lm_head_row.wgsl,
// which lm_head_rows.wgsl shares: the screened head's rescoring gets these very bits).

override ROWS: u32;
override DIM: u32;
override DTYPE: u32 = 1u;
override LANES: u32 = 1u;

const WG: u32 = 64u;

struct Head {
    row0: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<X_SPACE> X: XF_TYPE;
@group(0) @binding(1) var<storage, read> E: array<u32>;
@group(0) @binding(2) var<uniform> P: Head;
@group(0) @binding(3) var<storage, read_write> L: array<f32>;

//#include lm_head_row.wgsl

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>) {
    let r = (wid.x + wid.y * nw.x) * (WG / LANES) + li / LANES;
    let lane = li % LANES;
    var part = 0.0;
    if (r < ROWS) {
        part = row_part(r, lane, LANES);
    }
    let acc = lane_total(part, li, lane);
    if (lane == 0u && r < ROWS) {
        L[P.row0 + r] = acc;
    }
}
