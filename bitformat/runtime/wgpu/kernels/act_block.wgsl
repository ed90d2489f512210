// act_block.wgsl: reading the int8 activation block X (vec4<u32> words; layout in
// matvec_common.wgsl): a word, the scale s, the sum of all q and the sum of 256-block b.
// XBASE (substituted; 0u unless the kernel holds several blocks: matmat_i2_s.wgsl) is the
// vec4 where the block being read starts.

fn xw(i: u32) -> u32 {
    return X[XBASE + (i >> 2u)][i & 3u];
}

fn x_s() -> f32 {
    return bitcast<f32>(X[XBASE][0]);
}

fn x_sum() -> i32 {
    return bitcast<i32>(X[XBASE][1]);
}

fn x_bsum(b: u32) -> i32 {
    return bitcast<i32>(xw(4u + b));
}
