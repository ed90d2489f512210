// embed_step.wgsl: h = E[token] for the token in the step state (F32, F16 or BF16 -> f32,
// exact), one dispatch per embedding chunk; a chunk that does not hold the token writes nothing.
//
// The step state ST (u32 words) is what the decode step reads instead of host values:
//   0  token   the id this step embeds (argmax_step.wgsl writes the next one)
//   1  pos     its position
//   2  len     positions in the KV cache after this step (pos + 1)
//   4 + t   BATCH = 1 (a batched prompt, grid z = t): the prompt's ids; pos is its first
//           position and len the cache's length after it
//
// Bindings (group 0):
//   0  storage, read        E: array<u32>   rows P.x .. P.x + P.y of the embedding
//   1  uniform              P: vec4<u32>    first row, rows
//   2  storage, read        ST: array<u32>
//   3  storage, read_write  H: array<f32>   h [DIM]
// Overrides: DIM, DTYPE (0 f32, 1 f16, 2 bf16).

override DIM: u32;
override DTYPE: u32 = 1u;
override BATCH: u32 = 0u;

@group(0) @binding(0) var<storage, read> E: array<u32>;
@group(0) @binding(1) var<uniform> P: vec4<u32>;
@group(0) @binding(2) var<storage, read> ST: array<u32>;
@group(0) @binding(3) var<storage, read_write> H: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    var tok = ST[0];
    var hb = 0u;
    if (BATCH == 1u) {  // a batched prompt: token z of the ids after the state, row z of H
        tok = ST[4u + gid.z];
        hb = gid.z * DIM;
    }
    if (i >= DIM || tok < P.x || tok - P.x >= P.y) {
        return;
    }
    let row = tok - P.x;
    if (DTYPE == 0u) {
        H[hb + i] = bitcast<f32>(E[row * DIM + i]);
        return;
    }
    let w = E[row * (DIM / 2u) + i / 2u];
    let half = select(w & 0xFFFFu, w >> 16u, (i & 1u) == 1u);
    if (DTYPE == 1u) {
        H[hb + i] = unpack2x16float(half).x;
    } else {
        H[hb + i] = bitcast<f32>(half << 16u);
    }
}
