// lm_head_row.wgsl: one row's dot(E[row], x) as lm_head.wgsl and lm_head_rows.wgsl both compute
// it (pasted into each with //#include, so the per-row arithmetic is the same text): the
// `lanes` invocations of a row take its vec4 steps round robin, each summing its share in one
// f32 chain (acc += dot(e.xy, x.xy) + dot(e.zw, x.zw) per step of 4 values, f16/bf16 rows);
// then lane 0 adds lanes 1 .. LANES-1 in order (lane_total; lm_head_step.wgsl adds them by
// subgroup shuffles instead). The including kernel declares X (x [DIM] as vec4<f32>), E (the
// chunk's rows as u32 words) and the overrides DIM, DTYPE, LANES. docs/exact-head.md bounds
// this sum's rounding for the screened head (any order of the DIM products).

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

// lane's share of row r (r: the row inside the chunk E holds)
fn row_part(r: u32, lane: u32, lanes: u32) -> f32 {
    var acc = 0.0;
    // x is read as whole vec4s (4 values: 4 f32 words or 2 f16/bf16 words of the row)
    if (DTYPE == 0u) {
        let row = r * DIM;
        for (var j = lane; j < DIM / 4u; j += lanes) {
            let b = row + 4u * j;
            let e = vec4<f32>(bitcast<f32>(E[b]), bitcast<f32>(E[b + 1u]),
                              bitcast<f32>(E[b + 2u]), bitcast<f32>(E[b + 3u]));
            acc += dot(e, X[j]);
        }
        for (var j = DIM / 4u * 4u + lane; j < DIM; j += lanes) {
            acc += bitcast<f32>(E[row + j]) * xv(j);
        }
    } else {
        let row = r * (DIM / 2u);
        for (var j = lane; j < DIM / 4u; j += lanes) {
            let xx = X[j];
            acc += dot(pair(E[row + 2u * j]), xx.xy) + dot(pair(E[row + 2u * j + 1u]), xx.zw);
        }
        if (DIM % 4u != 0u && lane == 0u) {  // a last word of two values
            acc += dot(pair(E[row + DIM / 2u - 1u]), vec2<f32>(xv(DIM - 2u), xv(DIM - 1u)));
        }
    }
    return acc;
}

// the row's sum in lane 0 (every invocation of the workgroup calls this: it has a barrier)
fn lane_total(part: f32, li: u32, lane: u32) -> f32 {
    var acc = part;
    if (LANES > 1u) {
        red[li] = acc;
        workgroupBarrier();
        if (lane == 0u) {
            for (var l = 1u; l < LANES; l++) {
                acc += red[li + l];
            }
        }
    }
    return acc;
}
