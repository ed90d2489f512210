// matvec_common.wgsl: what the five op-by-op row-format mat-vec kernels share. It is pasted into
// each of them where they say `//#include matvec_common.wgsl` (bitformat/runtime/wgpu/device.py),
// after their format's rows_<format>.wgsl (row_dot, row_value), so the bindings it uses are
// declared, and documented, in the including file:
//   X  the activation block (quant_prologue.wgsl), P  the dispatch's Params, Y  the output.
// The helpers x_s, x_sum, x_bsum and xw are shared with fused_matvec.wgsl through act_block.wgsl.
//
// Activation block X, u32 words (NPAD = COLS rounded up to a multiple of 256):
//   0            s = 127 / max(max|x|, 1e-5), f32 bits
//   1            sum of every q (i32)
//   4 + b        sum of q over elements 256b .. 256b + 255 (i32)
//   256 + i      q[4i .. 4i+3]: element 4i + k in byte k, int8 two's complement ("plain")
//   256 + NPAD/4 + 4w + g   "slot16": byte k = q[16w + g + 4k] (for 16-trits-per-word rows)
//   q is 0 past COLS.
//
// Work split: a workgroup of 64 invocations handles 64 / LANES rows; the LANES invocations of
// a row take its units (blocks or words) round robin, and lane 0 adds their partial sums. Every
// partial sum of code*q is an integer below 2^24 in magnitude (COLS <= 32256), so carrying it
// in f32 is exact. MODE: 0 writes y, 1 adds y to Y (the residual), 2 is the fused FFN
// gate/up: the up matrix's rows start at word P.base2 and Y = relu(gate)^2 * up.

const WG: u32 = 64u;
const QOFF: u32 = 256u;

struct Params {
    scale: f32,      // per-tensor scale of the (gate) matrix; unused by tq formats
    out_scale: f32,  // optional extra output scale (upstream llama.cpp `.scale` tensors), else 1
    scale2: f32,     // the same two for the up matrix (MODE 2)
    out_scale2: f32,
    row0: u32,       // first output row of this dispatch (tensors split across bindings)
    base2: u32,      // MODE 2: word where the up matrix's rows start in W
    pad0: u32,
    pad1: u32,
}

var<workgroup> red: array<vec2<f32>, 64>;

//#include act_block.wgsl

fn store(r: u32, y: vec2<f32>) {
    let o = P.row0 + r;
    if (MODE == 0u) {
        Y[o] = y.x;
    } else if (MODE == 1u) {
        Y[o] = Y[o] + y.x;
    } else {
        let g = max(y.x, 0.0);
        Y[o] = g * g * y.y;
    }
}

// Row r of this dispatch, lane `lane` of LANES, after the partial sums `acc` are in.
fn finish(li: u32, r: u32, lane: u32, acc: vec2<f32>) {
    var v = acc;
    if (LANES > 1u) {
        red[li] = acc;
        workgroupBarrier();
        if (lane == 0u) {
            for (var l = 1u; l < LANES; l++) {
                v += red[li + l];
            }
        }
    }
    if (lane == 0u && r < ROWS) {
        store(r, vec2<f32>(row_value(v.x, P.scale) * P.out_scale,
                           row_value(v.y, P.scale2) * P.out_scale2));
    }
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>) {
    let r = (wid.x + wid.y * nw.x) * (WG / LANES) + li / LANES;
    let lane = li % LANES;
    var acc = vec2<f32>(0.0, 0.0);
    if (r < ROWS) {
        acc.x = row_dot(0u, r, lane, LANES);
        if (MODE == 2u) {
            acc.y = row_dot(P.base2, r, lane, LANES);
        }
    }
    finish(li, r, lane, acc);
}
