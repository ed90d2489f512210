// embed.wgsl: h = the embedding row of this step's token, as f32.
//
// Bindings (group 0):
//   0  storage, read        E: array<u32>   the rows of one chunk of token_embd (see lm_head.wgsl)
//   1  uniform              S: Step         S.row: the token's row inside that chunk
//   2  storage, read_write  H: array<f32>   h [DIM]
// Overrides: DIM, DTYPE (0: f32, one value per word; 1: f16 and 2: bf16, two values per word,
// the lower-addressed value in the low 16 bits). f16 -> f32 and bf16 -> f32 are exact.

override DIM: u32;
override DTYPE: u32 = 1u;

struct Step {
    row: u32,  // the token's row in the bound embedding chunk
    pos: u32,  // position of the token (0-based)
    len: u32,  // positions in the KV cache after this step (pos + 1)
    pad: u32,
}

@group(0) @binding(0) var<storage, read> E: array<u32>;
@group(0) @binding(1) var<uniform> S: Step;
@group(0) @binding(2) var<storage, read_write> H: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= DIM) {
        return;
    }
    if (DTYPE == 0u) {
        H[i] = bitcast<f32>(E[S.row * DIM + i]);
        return;
    }
    let w = E[S.row * (DIM / 2u) + i / 2u];
    let half = select(w & 0xFFFFu, w >> 16u, (i & 1u) == 1u);
    if (DTYPE == 1u) {
        H[i] = unpack2x16float(half).x;
    } else {
        H[i] = bitcast<f32>(half << 16u);
    }
}
