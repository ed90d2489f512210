// attn_split.wgsl: one layer's decode attention, split over the cached positions
// (flash-decoding): workgroup (g, s) takes KV head g and the s-th of S = num_workgroups.y runs
// of positions, for all GQ = H / KVH query heads that share that KV head, so each K and V row
// is read once per group. It writes per query head and split the running maximum m, the sum l
// of exp(score - m) and the unnormalized output o = sum exp(score - m) v; attn_merge.wgsl
// combines the splits.
//
// BATCH = 1 runs a prompt's tokens at once (grid z = token t at position ST.pos + t, q from
// row t of QKV, attending to its own positions; kv_write.wgsl has cached every key and value).
//
// Before that it prepares the step's own q and k: (QKN = 1, Qwen3) RMSNorm over each head with
// the q_norm / k_norm gains, then rotate-half RoPE at position S.pos from the host's cos/sin
// table; the workgroup whose run holds the position writes the new key and value to the
// cache. PERM = 1 (llama files, q/k rows in llama.cpp's interleaved order): HF element j of a
// head is read from row 2 (j mod d/2) + j div (d/2), which is the same attention.
//
//     score_j = q . k_j * INV     (INV = float32(1 / sqrt(HD)))
//
// Bindings (group 0):
//   0  storage, read        QKV: array<f32>   q [H * HD], k [KVH * HD], v [KVH * HD]
//   1  storage, read_write  KC: array<vec4<f32>>  layer K cache [ML, KVH, HD]
//   2  storage, read_write  VC: array<vec4<f32>>  layer V cache [ML, KVH, HD]
//   3  storage, read        CS: array<f32>    [ML, HD]: per position cos[HD/2] then sin[HD/2]
//   4  storage, read        ST: array<u32>    the step state: token, pos, len (embed_step.wgsl)
//   5  storage, read_write  PART: array<f32>  [tokens, H, SMAX, HD + 4]: m, l, 0, 0, o[HD]
//                           (a split's record is whole vec4s: fused_matvec.wgsl's COMBINE = 2
//                           reads it as vec4s)
//   6  storage, read        NG: array<f32>    QKN = 1: q_norm gains [HD], k_norm gains [HD]
// Overrides: H, KVH, HD (a multiple of 4, at most 64 vec4s a lane: HD <= 512), ML, INV, QKN,
// PERM, EPS, SMAX, CMAX (the most positions of one split: S is chosen so that
// ceil(len / S) <= CMAX, see attn_merge.wgsl), KVT (the cache type: kv_round.wgsl).
// GQ = H / KVH <= 16.
// Workgroup arrays: QS4 = GQ * HD / 4 vec4s, SCN = GQ * CMAX floats. Needs subgroups.
//
// Work split: the scores take min(8, subgroup size) lanes per position (each a slice of the
// key, its vec4s loaded together and dotted with every head's q), the weighted sum of values
// as many lanes per vec4 of dimensions (each every 8th position): all loads of a lane are
// independent, so a workgroup waits for memory about once per phase.

//#include kv_round.wgsl

override H: u32;
override KVH: u32;
override HD: u32;
override ML: u32;
override INV: f32;
override QKN: u32 = 0u;
override PERM: u32 = 0u;
override EPS: f32 = 1e-6;
override SMAX: u32;
override CMAX: u32 = 256u;
override BATCH: u32 = 0u;  // a batched prompt: grid z = token (kv_write.wgsl wrote its keys)
override QKVS: u32 = 0u;   // BATCH: floats of QKV per token

const WGS: u32 = 256u;

@group(0) @binding(0) var<storage, read> QKV: array<f32>;
@group(0) @binding(1) var<storage, read_write> KC: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> VC: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> CS: array<f32>;
@group(0) @binding(4) var<storage, read> ST: array<u32>;
@group(0) @binding(5) var<storage, read_write> PART: array<f32>;
@group(0) @binding(6) var<storage, read> NG: array<f32>;

var<workgroup> qs: array<vec4<f32>, QS4>;
var<workgroup> sc: array<f32, SCN>;
var<workgroup> ml: array<vec2<f32>, 64>;

// where HF element j of a head is stored
fn ix(j: u32) -> u32 {
    if (PERM == 1u) {
        let half = HD / 2u;
        return 2u * (j % half) + j / half;
    }
    return j;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nw: vec3<u32>, @builtin(subgroup_size) sgs: u32,
        @builtin(subgroup_invocation_id) sl: u32, @builtin(subgroup_id) sid: u32,
        @builtin(num_subgroups) ns: u32) {
    let gq = H / KVH;
    let g = wid.x;
    let s = wid.y;
    let tok = wid.z;
    var pos = ST[1];
    var len = ST[2];
    if (BATCH == 1u) {
        pos += tok;
        len = pos + 1u;
    }
    let qb = tok * QKVS;
    let run = (len + nw.y - 1u) / nw.y;
    let j0 = min(s * run, len);
    let n = min(len, j0 + run) - j0;
    let kvd = KVH * HD;
    let half = HD / 2u;
    let mine = BATCH == 0u && pos >= j0 && pos < j0 + n;

    // q of the group's heads (and the new key, in the run that holds it): norm, RoPE
    let nh = gq + select(0u, 1u, mine);
    for (var hh = sid; hh < nh; hh += ns) {
        var src = qb + (g * gq + hh) * HD;
        var goff = 0u;
        if (hh == gq) {
            src = H * HD + g * HD;
            goff = HD;
        }
        var r = 1.0;
        if (QKN == 1u) {
            var ss = 0.0;
            for (var i = sl; i < HD; i += sgs) {
                let x = QKV[src + i];
                ss += x * x;
            }
            r = sqrt(subgroupAdd(ss) / f32(HD) + EPS);
        }
        for (var i = sl; i < half; i += sgs) {
            var x1 = QKV[src + ix(i)];
            var x2 = QKV[src + ix(i + half)];
            if (QKN == 1u) {
                x1 = x1 / r * NG[goff + i];
                x2 = x2 / r * NG[goff + i + half];
            }
            let c = CS[pos * HD + i];
            let sn = CS[pos * HD + half + i];
            let o1 = x1 * c - x2 * sn;
            let o2 = x2 * c + x1 * sn;
            if (hh < gq) {
                let b = hh * HD;
                qs[(b + i) / 4u][(b + i) % 4u] = o1;
                qs[(b + i + half) / 4u][(b + i + half) % 4u] = o2;
            } else {
                let b = pos * kvd + g * HD;
                KC[(b + i) / 4u][(b + i) % 4u] = kv_round(o1);
                KC[(b + i + half) / 4u][(b + i + half) % 4u] = kv_round(o2);
            }
        }
    }
    if (mine) {
        for (var d = li; d < HD; d += WGS) {
            let e = pos * kvd + g * HD + d;
            VC[e / 4u][e % 4u] = kv_round(QKV[H * HD + kvd + g * HD + d]);
        }
    }
    storageBarrier();
    workgroupBarrier();

    // scores: TPP lanes per position (HD / TPP dimensions each, every K vec4 loaded once for
    // all the group's heads), added by subgroup shuffles
    let tpp = min(8u, sgs);
    let dpl = HD / (4u * tpp);  // vec4s of a key per lane
    let per = ns * (sgs / tpp);  // positions a pass of the workgroup covers
    let c = sl % tpp;
    for (var j0p = 0u; j0p < n; j0p += per) {
        let j = j0p + sid * (sgs / tpp) + sl / tpp;
        let live = j < n;
        var ks: array<vec4<f32>, 16>;
        let kb = ((j0 + min(j, n - 1u)) * kvd + g * HD) / 4u + c * dpl;
        for (var d = 0u; d < dpl; d++) {
            ks[d] = KC[kb + d];
        }
        for (var hh = 0u; hh < gq; hh++) {
            var dt = 0.0;
            for (var d = 0u; d < dpl; d++) {
                dt += dot(qs[hh * HD / 4u + c * dpl + d], ks[d]);
            }
            for (var o = tpp / 2u; o > 0u; o >>= 1u) {
                dt += subgroupShuffleXor(dt, o);
            }
            if (live && c == 0u) {
                sc[hh * CMAX + j] = dt * INV;
            }
        }
    }
    workgroupBarrier();

    // the softmax of each head over the run: its maximum and the sum of exp(score - max)
    for (var hh = sid; hh < gq; hh += ns) {
        var lmax = -3.4028234663852886e38;
        for (var j = sl; j < n; j += sgs) {
            lmax = max(lmax, sc[hh * CMAX + j]);
        }
        let m = subgroupMax(lmax);
        var lsum = 0.0;
        for (var j = sl; j < n; j += sgs) {
            let p = exp(sc[hh * CMAX + j] - m);
            sc[hh * CMAX + j] = p;
            lsum += p;
        }
        let l = subgroupAdd(lsum);
        if (sl == 0u) {
            ml[hh] = vec2<f32>(m, l);
        }
    }
    workgroupBarrier();

    // o = sum_j p_j v_j: PG lanes per vec4 of dimensions, each taking every PG-th position,
    // added by subgroup shuffles
    let pg = min(8u, sgs);
    let p = sl % pg;
    let chunks = ns * (sgs / pg);
    for (var dc0 = 0u; dc0 < HD / 4u; dc0 += chunks) {
        let dc = dc0 + sid * (sgs / pg) + sl / pg;
        let live = dc < HD / 4u;
        var acc: array<vec4<f32>, 16>;
        for (var hh = 0u; hh < gq; hh++) {
            acc[hh] = vec4<f32>(0.0);
        }
        if (live) {
            // four positions' values loaded together, then added in position order
            let vb = (j0 * kvd + g * HD) / 4u + dc;
            let vs = kvd / 4u;
            var j = p;
            for (; j + 3u * pg < n; j += 4u * pg) {
                let v0 = VC[vb + j * vs];
                let v1 = VC[vb + (j + pg) * vs];
                let v2 = VC[vb + (j + 2u * pg) * vs];
                let v3 = VC[vb + (j + 3u * pg) * vs];
                for (var hh = 0u; hh < gq; hh++) {
                    acc[hh] += sc[hh * CMAX + j] * v0;
                    acc[hh] += sc[hh * CMAX + j + pg] * v1;
                    acc[hh] += sc[hh * CMAX + j + 2u * pg] * v2;
                    acc[hh] += sc[hh * CMAX + j + 3u * pg] * v3;
                }
            }
            for (; j < n; j += pg) {
                let v = VC[vb + j * vs];
                for (var hh = 0u; hh < gq; hh++) {
                    acc[hh] += sc[hh * CMAX + j] * v;
                }
            }
        }
        for (var hh = 0u; hh < gq; hh++) {
            var a = acc[hh];
            for (var o = pg / 2u; o > 0u; o >>= 1u) {
                a += vec4<f32>(subgroupShuffleXor(a.x, o), subgroupShuffleXor(a.y, o),
                               subgroupShuffleXor(a.z, o), subgroupShuffleXor(a.w, o));
            }
            if (live && p == 0u) {
                let base = ((tok * H + g * gq + hh) * SMAX + s) * (HD + 4u);
                for (var k = 0u; k < 4u; k++) {
                    PART[base + 4u + 4u * dc + k] = a[k];
                }
                if (dc == 0u) {
                    PART[base] = ml[hh].x;
                    PART[base + 1u] = ml[hh].y;
                    PART[base + 2u] = 0.0;
                    PART[base + 3u] = 0.0;
                }
            }
        }
    }
}
