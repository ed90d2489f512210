// screen_pick.wgsl: the screened head's greedy candidates on the device: every row whose upper
// bound reaches the largest lower bound (screen_step.wgsl's key in SP[4]) is appended to IDS
// (IDS[0] the count, the ids from IDS[1], in no particular order; at most CAP of them are
// written, a larger count sends the step to the full head). Nothing is appended where
// screen_prep.wgsl found the bound does not hold (SP[3] = 0; it set the count to NONE).
//
// Bindings (group 0):
//   0  storage, read        LH: array<vec2<f32>>   (lo, hi) per row
//   1  storage, read        SP: array<u32>         ..., ok, key
//   2  storage, read_write  IDS: array<atomic<u32>>
// Overrides: V (rows), CAP. Workgroups of 256, one row an invocation.

override V: u32;
override CAP: u32;

@group(0) @binding(0) var<storage, read> LH: array<vec2<f32>>;
@group(0) @binding(1) var<storage, read> SP: array<u32>;
@group(0) @binding(2) var<storage, read_write> IDS: array<atomic<u32>>;

// the value of screen_step.wgsl's key
fn unkey(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k & 0x7FFFFFFFu, (k & 0x80000000u) != 0u));
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let v = (wid.x + wid.y * nw.x) * 256u + li;
    if (v < V && SP[3] == 1u && LH[v].y >= unkey(SP[4])) {
        let i = atomicAdd(&IDS[0], 1u);
        if (i < CAP) {
            atomicStore(&IDS[1u + i], v);
        }
    }
}
