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
// 64 / LANES rows; a row's LANES invocations take its words round robin.

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

var<workgroup> red: array<f32, 64>;

fn xv(i: u32) -> f32 {
    return X[i >> 2u][i & 3u];
}

fn pair(w: u32) -> vec2<f32> {
    if (DTYPE == 1u) {
        return unpack2x16float(w);
    }
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xFFFF0000u));
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>) {
    let r = (wid.x + wid.y * nw.x) * (WG / LANES) + li / LANES;
    let lane = li % LANES;
    var acc = 0.0;
    if (r < ROWS) {
        // x is read as whole vec4s (4 values: 4 f32 words or 2 f16/bf16 words of the row)
        if (DTYPE == 0u) {
            let row = r * DIM;
            for (var j = lane; j < DIM / 4u; j += LANES) {
                let b = row + 4u * j;
                let e = vec4<f32>(bitcast<f32>(E[b]), bitcast<f32>(E[b + 1u]),
                                  bitcast<f32>(E[b + 2u]), bitcast<f32>(E[b + 3u]));
                acc += dot(e, X[j]);
            }
            for (var j = DIM / 4u * 4u + lane; j < DIM; j += LANES) {
                acc += bitcast<f32>(E[row + j]) * xv(j);
            }
        } else {
            let row = r * (DIM / 2u);
            for (var j = lane; j < DIM / 4u; j += LANES) {
                let xx = X[j];
                acc += dot(pair(E[row + 2u * j]), xx.xy) + dot(pair(E[row + 2u * j + 1u]), xx.zw);
            }
            if (DIM % 4u != 0u && lane == 0u) {  // a last word of two values
                acc += dot(pair(E[row + DIM / 2u - 1u]), vec2<f32>(xv(DIM - 2u), xv(DIM - 1u)));
            }
        }
    }
    if (LANES > 1u) {
        red[li] = acc;
        workgroupBarrier();
        if (lane == 0u) {
            for (var l = 1u; l < LANES; l++) {
                acc += red[li + l];
            }
        }
    }
    if (lane == 0u && r < ROWS) {
        L[P.row0 + r] = acc;
    }
}
