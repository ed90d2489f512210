// screen_sums.wgsl: one row's exact integer sums D1 = c . q1 and D2 = c . q2 of the screened
// head's int8 copy, shared by screen.wgsl (sums back to the host) and screen_step.wgsl (bounds
// on the device). dot4I8Packed is an exact int32 dot product of four signed bytes; |D| <= 127 *
// 127 * width < 2^31 for widths up to 16384 * 8, so every sum is exact in any order. LANES
// invocations share a row; the row's sums end in its lane 0. The including kernel declares X
// (q1 then q2, W4 / 4 vec4 words each), C (the chunk's codes, W4 words a row) and the overrides
// ROWS, W4, LANES.

var<workgroup> red: array<vec2<i32>, 64>;

// every invocation of the workgroup calls it (a barrier where LANES > 1)
fn row_sums(r: u32, lane: u32, li: u32) -> vec2<i32> {
    var d1 = 0;
    var d2 = 0;
    if (r < ROWS) {
        let row = r * W4;
        let half = W4 / 4u;
        for (var j = lane; j < half; j += LANES) {
            let b = row + 4u * j;
            let a = X[j];
            let q = X[half + j];
            let c = vec4<u32>(C[b], C[b + 1u], C[b + 2u], C[b + 3u]);
            d1 += dot4I8Packed(c.x, a.x) + dot4I8Packed(c.y, a.y)
                + dot4I8Packed(c.z, a.z) + dot4I8Packed(c.w, a.w);
            d2 += dot4I8Packed(c.x, q.x) + dot4I8Packed(c.y, q.y)
                + dot4I8Packed(c.z, q.z) + dot4I8Packed(c.w, q.w);
        }
    }
    if (LANES > 1u) {
        red[li] = vec2<i32>(d1, d2);
        workgroupBarrier();
        if (lane == 0u) {
            for (var l = 1u; l < LANES; l++) {
                d1 += red[li + l].x;
                d2 += red[li + l].y;
            }
        }
    }
    return vec2<i32>(d1, d2);
}
