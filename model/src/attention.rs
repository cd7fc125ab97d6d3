//! Attention over the KV cache for a batch of sequences: grouped-query
//! attention (Qwen, Mixtral, OLMoE) and multi-head latent attention
//! (DeepSeek-V3) in its absorbed form, which caches only the compressed
//! latent and the shared rotary key.
//!
//! Projections run over every row of the batch at once; the attention
//! itself runs per (row, heads of one KV head) in parallel. Each (row,
//! head) is computed by the same arithmetic whatever the batch and the
//! grouping, so neither batching nor the thread count changes a result.

use crate::config::{AttentionSpec, QkNorm};
use crate::error::Result;
use crate::forward::{Model, RowInfo};
use crate::kernels::{self, Pool, dot_row, matmul, matmul_shared_input};
use crate::kv::{KvCache, LayerCache};
use crate::ops::{rms_norm_inplace, softmax_inplace};
use crate::rope::Angles;
use crate::weights::{AttnWeights, Linear, MlaQuery};

/// The eps DeepSeek's q_a/kv_a layernorms use (their constructor default,
/// not `rms_norm_eps`).
const MLA_LORA_NORM_EPS: f32 = 1e-6;

pub(crate) fn linear_rows(pool: &Pool, l: &Linear, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; n * l.w.rows];
    matmul(pool, &l.w, x, n, &mut y);
    add_bias(l, &mut y);
    y
}

/// `[q, k, v]` = three linears of the same input, in one pool job when
/// `n == 1` (same results as three [`linear_rows`]).
fn qkv_rows(pool: &Pool, ls: [&Linear; 3], x: &[f32], n: usize) -> [Vec<f32>; 3] {
    let mut ys = ls.map(|l| vec![0.0f32; n * l.w.rows]);
    {
        let [a, b, c] = &mut ys;
        matmul_shared_input(pool, &ls.map(|l| &l.w), x, n, &mut [a, b, c]);
    }
    for (l, y) in ls.iter().zip(ys.iter_mut()) {
        add_bias(l, y);
    }
    ys
}

fn add_bias(l: &Linear, y: &mut [f32]) {
    if let Some(b) = &l.bias {
        for row in y.chunks_exact_mut(l.w.rows) {
            for (v, bb) in row.iter_mut().zip(b) {
                *v += bb;
            }
        }
    }
}

/// Attention of layer `layer` for the normed hidden rows `h` (`n × hidden`).
/// Appends this batch's keys/values to each sequence's cache and returns the
/// output projection (`n × hidden`).
/// Query heads per attention task: all the heads of one KV head (their
/// scores and weighted sums share every key and value load, which a head
/// alone re-reads from memory once the cache outgrows the caches), halved
/// while that leaves fewer tasks than threads. Every head's arithmetic is
/// the same whatever the grouping (`attend_heads`), so the result does not
/// depend on the thread count.
fn heads_per_task(rows: usize, heads: usize, group: usize, threads: usize) -> usize {
    let mut per = group.max(1);
    while per.is_multiple_of(2) && rows * heads / per < threads {
        per /= 2;
    }
    per
}

/// Key and value rows per block of a task: every head of the task takes
/// its scores (or its weighted sum) over a block (64 rows of 128 floats:
/// 32 KiB) while the block is in the core's caches, so the cache is read
/// from memory once per task, not once per head.
const ROW_BLOCK: usize = 64;

/// Attention of the query heads `qs` (`hd` floats each) over `len` cached
/// positions, into `o` (as long as `qs`, zeroed): keys and values are rows
/// `stride` floats apart. The scores (through the kernel set's grouped dot
/// when there are several heads), scaled, the softmax, then the weighted
/// sum of the values; scores and sums one block of rows at a time. Each
/// head gets the bits it gets alone: the grouped dot equals a dot per head,
/// and `weighted_rows` continues each element's sum across blocks.
/// `ahead`: the rows come from memory (a decode step's; a prompt's rows
/// were just written), so the grouped kernels ask for rows ahead of those
/// they read (hints: the same bits either way).
///
/// Public for `benches/kernels.rs -- --attention`.
#[allow(clippy::too_many_arguments)]
pub fn attend_heads(
    qs: &[f32],
    hd: usize,
    keys: &[f32],
    values: &[f32],
    stride: usize,
    len: usize,
    scale: f32,
    o: &mut [f32],
    ahead: bool,
) {
    SCRATCH.with_borrow_mut(|(scores, blk, rows)| {
        attend_heads_in(
            qs, hd, keys, values, stride, len, scale, o, scores, blk, rows, ahead,
        )
    })
}

thread_local! {
    /// `attend_heads`'s buffers (scores, a block's scores, a block's value
    /// rows), kept per thread: a long context's scores are hundreds of
    /// KiB, which a fresh allocation would map and fault in on every call.
    #[allow(clippy::type_complexity)]
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// [`attend_heads`] with its buffers.
#[allow(clippy::too_many_arguments)]
fn attend_heads_in(
    qs: &[f32],
    hd: usize,
    keys: &[f32],
    values: &[f32],
    stride: usize,
    len: usize,
    scale: f32,
    o: &mut [f32],
    scores: &mut Vec<f32>,
    blk: &mut Vec<f32>,
    rows: &mut Vec<f32>,
    ahead: bool,
) {
    let k = kernels::kernels();
    let per = qs.len() / hd;
    // Every score is written below before it is read.
    scores.clear();
    scores.resize(per * len, 0.0);
    // Where rows lie farther apart than their length (a caller's
    // interleaved heads; the KV cache keeps each head's rows side by
    // side), a block's value rows are copied side by side for the kernels
    // that take a head at a time: 64 rows at a 2 KiB stride fall into few
    // L1 sets, so each head of the group would read the block from L2
    // again. (The keys are not copied: the grouped dot is bound by its
    // arithmetic, and copying them cost more than it saved;
    // docs/benchmarks.md.)
    let packed = |src: &[f32], b: usize, rows: &mut Vec<f32>| {
        rows.clear();
        for t in 0..b {
            rows.extend_from_slice(&src[t * stride..t * stride + hd]);
        }
    };
    match k.dot_f32_rows_group {
        Some(f) if per > 1 => {
            // A block of key rows at a time, so that the group's later
            // queries find them in the core's caches.
            blk.clear();
            blk.resize(per * ROW_BLOCK, 0.0);
            for t0 in (0..len).step_by(ROW_BLOCK) {
                let b = (len - t0).min(ROW_BLOCK);
                f(
                    qs,
                    per,
                    &keys[t0 * stride..],
                    stride,
                    &mut blk[..per * b],
                    ahead,
                );
                for (j, s) in scores.chunks_exact_mut(len).enumerate() {
                    s[t0..t0 + b].copy_from_slice(&blk[j * b..(j + 1) * b]);
                }
            }
        }
        _ => {
            for (qh, s) in qs.chunks_exact(hd).zip(scores.chunks_exact_mut(len)) {
                (k.dot_f32_rows)(qh, keys, stride, s);
            }
        }
    }
    for s in scores.chunks_exact_mut(len) {
        s.iter_mut().for_each(|x| *x *= scale);
        softmax_inplace(s);
    }
    match k.weighted_rows_group {
        // The group's heads share each load of a value row, four at a
        // time, read in place (no copy); a block of rows at a time, so
        // the second four heads find it in the core's caches.
        Some(f) if per > 1 => {
            for t0 in (0..len).step_by(ROW_BLOCK) {
                let b = (len - t0).min(ROW_BLOCK);
                f(
                    o,
                    per,
                    &scores[t0..],
                    len,
                    b,
                    &values[t0 * stride..],
                    stride,
                    ahead,
                );
            }
        }
        _ => {
            for t0 in (0..len).step_by(ROW_BLOCK) {
                let t1 = (t0 + ROW_BLOCK).min(len);
                let (v, vstride) = if per > 1 && stride != hd {
                    packed(&values[t0 * stride..], t1 - t0, rows);
                    (&rows[..], hd)
                } else {
                    (&values[t0 * stride..], stride)
                };
                for (oh, s) in o.chunks_exact_mut(hd).zip(scores.chunks_exact(len)) {
                    (k.weighted_rows)(oh, &s[t0..t1], v, vstride);
                }
            }
        }
    }
}

pub(crate) fn attention(
    model: &Model,
    layer: usize,
    pool: &Pool,
    h: &[f32],
    rows: &[RowInfo],
    angles: &[Angles],
    caches: &mut [&mut KvCache],
) -> Result<Vec<f32>> {
    let n = rows.len();
    match (&model.spec.attention, &model.weights.layers[layer].attn) {
        (
            AttentionSpec::Gqa {
                num_heads,
                num_kv_heads,
                head_dim,
                qk_norm,
                clip_qkv,
                ..
            },
            AttnWeights::Gqa(w),
        ) => {
            let (nh, nkv, hd) = (*num_heads, *num_kv_heads, *head_dim);
            let eps = model.spec.rms_norm_eps;
            let [mut q, mut k, mut v] = qkv_rows(pool, [&w.q, &w.k, &w.v], h, n);
            let (qn, kn) = (
                w.q_norm.as_deref().unwrap_or(&[]),
                w.k_norm.as_deref().unwrap_or(&[]),
            );
            // Keys and values here, each row's before it is cached; each
            // query head in the task that attends with it (below), by the
            // same operations in the same order: norm, clip, rotation.
            let mut tmp = Vec::new();
            for (i, a) in angles.iter().enumerate() {
                let qr = &mut q[i * nh * hd..(i + 1) * nh * hd];
                let kr = &mut k[i * nkv * hd..(i + 1) * nkv * hd];
                let vr = &mut v[i * nkv * hd..(i + 1) * nkv * hd];
                match qk_norm {
                    QkNorm::None => {}
                    QkNorm::PerHead => kr
                        .chunks_exact_mut(hd)
                        .for_each(|x| rms_norm_inplace(x, kn, eps)),
                    QkNorm::Full => {
                        // Over every head of the row at once.
                        rms_norm_inplace(qr, qn, eps);
                        rms_norm_inplace(kr, kn, eps);
                    }
                }
                if let Some(c) = clip_qkv {
                    for x in kr.iter_mut().chain(vr.iter_mut()) {
                        *x = x.clamp(-c, *c);
                    }
                }
                kr.chunks_exact_mut(hd)
                    .for_each(|x| model.rope.apply(x, &a.cos, &a.sin, &mut tmp));
            }
            let query_heads = |qs: &mut [f32], a: &Angles| {
                let mut tmp = Vec::new();
                for x in qs.chunks_exact_mut(hd) {
                    if *qk_norm == QkNorm::PerHead {
                        rms_norm_inplace(x, qn, eps);
                    }
                    if let Some(c) = clip_qkv {
                        x.iter_mut().for_each(|v| *v = v.clamp(-c, *c));
                    }
                    model.rope.apply(x, &a.cos, &a.sin, &mut tmp);
                }
            };
            for (i, ri) in rows.iter().enumerate() {
                if let LayerCache::Gqa { k: kc, v: vc } = &mut caches[ri.seq].layers[layer] {
                    let at = i * nkv * hd;
                    for (h, (kh, vh)) in kc.iter_mut().zip(vc.iter_mut()).enumerate() {
                        kh.extend_from_slice(&k[at + h * hd..at + (h + 1) * hd]);
                        vh.extend_from_slice(&v[at + h * hd..at + (h + 1) * hd]);
                    }
                }
            }
            let scale = (hd as f32).powf(-0.5);
            let window = model.spec.layers[layer].sliding_window;
            let group = nh / nkv;
            let per = heads_per_task(n, nh, group, pool.threads());
            // A sequence's rows in this batch: one (a decode step) reads a
            // cache the weights have evicted since; several (a prompt's
            // chunk) mostly rows they just wrote.
            let mut fed = vec![0usize; caches.len()];
            for r in rows {
                fed[r.seq] += 1;
            }
            let caches: &[&mut KvCache] = caches;
            let out = pool.zeroed_chunks(n * nh * hd, per * hd, |idx, o| {
                let (i, h0) = (idx / (nh / per), idx % (nh / per) * per);
                let ri = rows[i];
                let kvh = h0 / group;
                let LayerCache::Gqa { k: kc, v: vc } = &caches[ri.seq].layers[layer] else {
                    return;
                };
                let (Some(kc), Some(vc)) = (kc.get(kvh), vc.get(kvh)) else {
                    return;
                };
                let first = window.map_or(0, |wdw| (ri.pos + 1).saturating_sub(wdw));
                let mut qs = q[i * nh * hd + h0 * hd..i * nh * hd + (h0 + per) * hd].to_vec();
                query_heads(&mut qs, &angles[i]);
                attend_heads(
                    &qs,
                    hd,
                    &kc[first * hd..],
                    &vc[first * hd..],
                    hd,
                    ri.pos + 1 - first,
                    scale,
                    o,
                    fed[ri.seq] == 1,
                );
            });
            Ok(linear_rows(pool, &w.o, &out, n))
        }
        (
            AttentionSpec::Mla {
                num_heads,
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
                ..
            },
            AttnWeights::Mla(w),
        ) => {
            let (nh, r, dn, dr, dv) = (
                *num_heads,
                *kv_lora_rank,
                *qk_nope_head_dim,
                *qk_rope_head_dim,
                *v_head_dim,
            );
            let qk = dn + dr;
            let mut q = match &w.q {
                MlaQuery::Direct(l) => linear_rows(pool, l, h, n),
                MlaQuery::LowRank { a, norm, b } => {
                    let mut qa = linear_rows(pool, a, h, n);
                    qa.chunks_exact_mut(a.w.rows)
                        .for_each(|x| rms_norm_inplace(x, norm, MLA_LORA_NORM_EPS));
                    linear_rows(pool, b, &qa, n)
                }
            };
            let mut ckv = linear_rows(pool, &w.kv_a, h, n);
            let mut tmp = Vec::new();
            for (i, (ri, a)) in rows.iter().zip(angles).enumerate() {
                let row = &mut ckv[i * (r + dr)..(i + 1) * (r + dr)];
                let (lat, pe) = row.split_at_mut(r);
                rms_norm_inplace(lat, &w.kv_a_norm, MLA_LORA_NORM_EPS);
                model.rope.apply(pe, &a.cos, &a.sin, &mut tmp);
                for head in 0..nh {
                    let qh = &mut q[i * nh * qk + head * qk..i * nh * qk + (head + 1) * qk];
                    model.rope.apply(&mut qh[dn..], &a.cos, &a.sin, &mut tmp);
                }
                if let LayerCache::Mla { latent, k_pe } = &mut caches[ri.seq].layers[layer] {
                    latent.extend_from_slice(&row[..r]);
                    k_pe.extend_from_slice(&row[r..]);
                }
            }
            let scale = model.attn_scale;
            let caches: &[&mut KvCache] = caches;
            let kv_b = &w.kv_b;
            let out = pool.zeroed_chunks(n * nh * dv, dv, |idx, o| {
                let (i, head) = (idx / nh, idx % nh);
                let ri = rows[i];
                let LayerCache::Mla { latent, k_pe } = &caches[ri.seq].layers[layer] else {
                    return;
                };
                let ks = kernels::kernels();
                let qh = &q[i * nh * qk + head * qk..i * nh * qk + (head + 1) * qk];
                let (q_nope, q_pe) = qh.split_at(dn);
                // Absorb W_uk into the query: qa = W_uk_hᵀ q_nope.
                let base = head * (dn + dv);
                let mut qa = vec![0.0f32; r];
                let mut scratch = Vec::new();
                for (j, &qj) in q_nope.iter().enumerate() {
                    kernels::row_axpy(kv_b, base + j, qj, &mut qa, &mut scratch);
                }
                let mut scores: Vec<f32> = (0..=ri.pos)
                    .map(|t| {
                        let c = &latent[t * r..(t + 1) * r];
                        let p = &k_pe[t * dr..(t + 1) * dr];
                        ((ks.dot_f32)(&qa, c) + (ks.dot_f32)(q_pe, p)) * scale
                    })
                    .collect();
                softmax_inplace(&mut scores);
                let mut ctx = vec![0.0f32; r];
                for (t, s) in scores.iter().enumerate() {
                    for (cc, lv) in ctx.iter_mut().zip(&latent[t * r..(t + 1) * r]) {
                        *cc += s * lv;
                    }
                }
                // Apply W_uv to the attended latent.
                for (j, oj) in o.iter_mut().enumerate() {
                    *oj = dot_row(ks, kv_b, base + dn + j, &ctx);
                }
            });
            Ok(linear_rows(pool, &w.o, &out, n))
        }
        _ => Err(crate::ModelError::Invalid(
            "attention weights do not match the spec".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rand_vec(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    /// The heads of a KV head computed together give every head the bits
    /// it gets alone, for lengths around the value block and head sizes
    /// around the vector widths.
    #[test]
    fn grouped_heads_give_each_head_its_own_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for hd in [8usize, 72, 128] {
            for group in [2usize, 3, 4, 8] {
                for len in [1usize, 5, 63, 64, 65, 130, 300] {
                    let stride = 2 * hd + 8; // another KV head in between
                    let keys = rand_vec(&mut rng, (len - 1) * stride + hd);
                    let values = rand_vec(&mut rng, (len - 1) * stride + hd);
                    let qs = rand_vec(&mut rng, group * hd);
                    let scale = (hd as f32).powf(-0.5);
                    let mut together = vec![0.0f32; group * hd];
                    attend_heads(
                        &qs,
                        hd,
                        &keys,
                        &values,
                        stride,
                        len,
                        scale,
                        &mut together,
                        len % 2 == 0,
                    );
                    assert!(together.iter().all(|x| x.is_finite()));
                    assert!(together.iter().any(|&x| x != 0.0));
                    for h in 0..group {
                        // The head alone, unblocked: one dot per key, one
                        // weighted sum over every value row.
                        let k = kernels::kernels();
                        let q = &qs[h * hd..(h + 1) * hd];
                        let mut sc = vec![0.0f32; len];
                        (k.dot_f32_rows)(q, &keys, stride, &mut sc);
                        sc.iter_mut().for_each(|x| *x *= scale);
                        softmax_inplace(&mut sc);
                        let mut alone = vec![0.0f32; hd];
                        (k.weighted_rows)(&mut alone, &sc, &values, stride);
                        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&together[h * hd..(h + 1) * hd]),
                            bits(&alone),
                            "hd {hd} group {group} len {len} head {h}"
                        );
                    }
                }
            }
        }
    }

    /// A task's heads share one KV head; there are as many tasks as
    /// threads whenever halving the groups can make it so.
    #[test]
    fn heads_per_task_divides_the_group_and_feeds_the_threads() {
        for (rows, heads, group, threads, want) in [
            (1, 32, 8, 2, 8),
            (1, 32, 8, 8, 4),
            (1, 32, 8, 16, 2),
            (1, 32, 8, 64, 1),
            (512, 32, 8, 16, 8),
            (1, 12, 6, 4, 3),
            (1, 16, 1, 4, 1),
        ] {
            let per = heads_per_task(rows, heads, group, threads);
            assert_eq!(
                per, want,
                "{rows} rows {heads} heads group {group} {threads} threads"
            );
            assert_eq!(group % per, 0);
        }
    }
}
