// row_store.wgsl: how a projection's row value is finished and written, shared by the decode
// step's fused_matvec.wgsl and a batched prompt's matmat_i2_s.wgsl so both give the same bits:
//
//     v_r = row_value(row_dot(r), scale(r)) * out_scale(r)   (dot * scale / s: docs/model.md §2)
//     MODE 0: Y[y] = v_r        MODE 1: Y[y] = Y[y] + v_r (the residual)
//     MODE 2: Y[y] = act(v_gate_r) * v_up_r    (gate rows, then up rows from word P.bound.w)
//
// scale(r): the rows may be several matrices stacked (q, k, v: one dispatch): rows below
// P.bound.x take P.scale.x, below P.bound.y P.scale.y, the rest P.scale.z (MODE 2: gate .x,
// up .w); P.oscale likewise (the optional `.scale` tensors of upstream bitnet files).
// The including kernel declares P (uniform FParams), Y (storage, read_write, array<f32>), the
// overrides MODE and ACT, and row_value (rows_<format>.wgsl).

struct FParams {
    scale: vec4<f32>,
    oscale: vec4<f32>,
    bound: vec4<u32>,
}

//#include act.wgsl

fn seg_scale(o: u32) -> vec2<f32> {
    if (o < P.bound.x) {
        return vec2<f32>(P.scale.x, P.oscale.x);
    }
    if (o < P.bound.y) {
        return vec2<f32>(P.scale.y, P.oscale.y);
    }
    return vec2<f32>(P.scale.z, P.oscale.z);
}

// row o of the matrix (P.bound.z + the dispatch's row), its value into Y[y]
fn store_row(o: u32, y: u32, acc: vec2<f32>) {
    if (MODE == 2u) {
        let gate = row_value(acc.x, P.scale.x) * P.oscale.x;
        let up = row_value(acc.y, P.scale.w) * P.oscale.w;
        Y[y] = act(gate) * up;
        return;
    }
    let sc = seg_scale(o);
    let v = row_value(acc.x, sc.x) * sc.y;
    if (MODE == 0u) {
        Y[y] = v;
    } else {
        Y[y] = Y[y] + v;
    }
}
