// lm_head_lanes.wgsl: a head row's logit as every kernel of a device with subgroups computes it
// (lm_head_step.wgsl for the full head, lm_head_rows_step.wgsl for the screened head's
// candidates, so both give the same bits): lm_head_row.wgsl's per-lane chains over `lpr`
// lanes, then added by subgroup shuffles (xor butterfly). Every lane of the subgroup must call
// it; lanes whose row is not live pass live = false and get 0.

fn row_logit(r: u32, lane: u32, lpr: u32, live: bool) -> f32 {
    var acc = 0.0;
    if (live) {
        acc = row_part(r, lane, lpr);
    }
    for (var o = lpr / 2u; o > 0u; o >>= 1u) {
        acc += subgroupShuffleXor(acc, o);
    }
    return acc;
}
