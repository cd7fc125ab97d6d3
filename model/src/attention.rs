//! Attention over the KV cache for a batch of sequences: grouped-query
//! attention (Qwen, Mixtral, OLMoE) and multi-head latent attention
//! (DeepSeek-V3) in its absorbed form, which caches only the compressed
//! latent and the shared rotary key.
//!
//! Projections run over every row of the batch at once; the attention
//! itself runs per (row, heads of one KV head) in parallel, or, for a long
//! context on more threads than (row, KV head) pairs, over blocks of
//! positions and slices of the value columns ([`attend_split`]). Each
//! (row, head) is computed by the same arithmetic whatever the batch, the
//! grouping and the cut, so neither batching nor the thread count changes
//! a result.

use crate::config::{AttentionSpec, QkNorm};
use crate::error::Result;
use crate::forward::{Model, RowInfo};
use crate::kernels::pool::Parts;
use crate::kernels::{self, KernelSet, Pool, dot_row, matmul, matmul_shared_input};
use crate::kv::{KvCache, KvRows, LayerCache};
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
    scores_into(k, qs, hd, keys, stride, 0..len, scores, len, blk, ahead);
    for s in scores.chunks_exact_mut(len) {
        s.iter_mut().for_each(|x| *x *= scale);
        softmax_inplace(s);
    }
    weighted_into(k, o, per, scores, len, len, values, stride, rows, ahead);
}

/// The scores of the query heads `qs` (`hd` floats each) against the key
/// rows `ts` (`stride` floats apart), head `j`'s score of row `t` at
/// `out[j·out_stride + t − ts.start]`: through the kernel set's grouped
/// dot a block of rows at a time when there are several heads (so that
/// the later heads find the block in the core's caches), each score the
/// bits of a `dot_f32` call whatever the range.
#[allow(clippy::too_many_arguments)]
fn scores_into(
    k: &KernelSet,
    qs: &[f32],
    hd: usize,
    keys: &[f32],
    stride: usize,
    ts: std::ops::Range<usize>,
    out: &mut [f32],
    out_stride: usize,
    blk: &mut Vec<f32>,
    ahead: bool,
) {
    let per = qs.len() / hd;
    match k.dot_f32_rows_group {
        Some(f) if per > 1 => {
            blk.clear();
            blk.resize(per * ROW_BLOCK, 0.0);
            for t0 in ts.clone().step_by(ROW_BLOCK) {
                let b = (ts.end - t0).min(ROW_BLOCK);
                f(
                    qs,
                    per,
                    &keys[t0 * stride..],
                    stride,
                    &mut blk[..per * b],
                    ahead,
                );
                let at = t0 - ts.start;
                for (j, s) in out.chunks_mut(out_stride).take(per).enumerate() {
                    s[at..at + b].copy_from_slice(&blk[j * b..(j + 1) * b]);
                }
            }
        }
        _ => {
            let n = ts.len();
            for (qh, s) in qs.chunks_exact(hd).zip(out.chunks_mut(out_stride)) {
                (k.dot_f32_rows)(qh, &keys[ts.start * stride..], stride, &mut s[..n]);
            }
        }
    }
}

/// The weighted sums of `len` value rows (`stride` floats apart, each
/// read for `o.len() / per` floats) for `per` heads onto `o`, head `j`
/// taking the weights `scores[j·s_stride..][..len]`; each element's sum
/// runs over the rows in order, so its bits are those of one
/// `weighted_rows` call whichever columns the rows start at.
#[allow(clippy::too_many_arguments)]
fn weighted_into(
    k: &KernelSet,
    o: &mut [f32],
    per: usize,
    scores: &[f32],
    s_stride: usize,
    len: usize,
    values: &[f32],
    stride: usize,
    rows: &mut Vec<f32>,
    ahead: bool,
) {
    let w = o.len() / per;
    // Where rows lie farther apart than their length (a caller's
    // interleaved heads, or a slice of each row's columns), a block's value
    // rows are copied side by side for the kernels that take a head at a
    // time: 64 rows at a 2 KiB stride fall into few L1 sets, so each head
    // of the group would read the block from L2 again. (The keys are not
    // copied: the grouped dot is bound by its arithmetic, and copying them
    // cost more than it saved; docs/benchmarks.md.)
    let packed = |src: &[f32], b: usize, rows: &mut Vec<f32>| {
        rows.clear();
        for t in 0..b {
            rows.extend_from_slice(&src[t * stride..t * stride + w]);
        }
    };
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
                    s_stride,
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
                let (v, vstride) = if per > 1 && stride != w {
                    packed(&values[t0 * stride..], t1 - t0, rows);
                    (&rows[..], w)
                } else {
                    (&values[t0 * stride..], stride)
                };
                for (j, oh) in o.chunks_exact_mut(w).enumerate() {
                    let s = &scores[j * s_stride..j * s_stride + len];
                    (k.weighted_rows)(oh, &s[t0..t1], v, vstride);
                }
            }
        }
    }
}

/// One query row of [`attend_split`]: its query heads as projected (each
/// task normalizes and rotates the heads it takes), its rotary angles, its
/// sequence's keys and values of the layer (a vector per KV head), and the
/// positions it attends to, `first..first + len`.
struct SplitRow<'a> {
    q: &'a [f32],
    angles: &'a Angles,
    keys: &'a [KvRows],
    values: &'a [KvRows],
    first: usize,
    len: usize,
    /// Whether the rows come from memory ([`attend_heads`]'s `ahead`).
    ahead: bool,
}

/// Whether a batch's attention runs as [`attend_split`] rather than as a
/// task per group of query heads: when the batch has fewer (row, KV head)
/// pairs than threads (a decode step on many cores, where
/// [`heads_per_task`] splits a KV head's query heads into tasks that each
/// read the whole of its keys and values) and a long context
/// ([`SPLIT_ROWS_PER_THREAD`]).
fn splits_positions(pairs: usize, positions: usize, nkv: usize, threads: usize) -> bool {
    pairs < threads && positions * nkv >= threads * SPLIT_ROWS_PER_THREAD
}

/// (position, KV head) rows per thread from which [`attend_split`]'s
/// three pool jobs beat a task per group of heads. Measured on 16 cores
/// (Qwen3-30B-A3B's 4 KV heads, docs/benchmarks.md): at 2,048 positions
/// the split decoded 22% faster; at 540 it was no faster on 16 threads
/// and slower on 8.
const SPLIT_ROWS_PER_THREAD: usize = 8 * ROW_BLOCK;

/// Slices of a head's `hd` columns for [`attend_split`]'s weighted sums:
/// the fewest (each a whole number of 8-float vectors) that give each of
/// `threads` a (row, KV head, slice) task, else the most there are.
fn column_slices(hd: usize, pairs: usize, threads: usize) -> usize {
    let mut best = 1;
    for d in (1..=hd).filter(|d| hd.is_multiple_of(*d) && (hd / d).is_multiple_of(8)) {
        best = d;
        if pairs * d >= threads {
            break;
        }
    }
    best
}

/// Grouped-query attention of a batch with few (row, KV head) pairs, in
/// three pool jobs that cut each KV head's work finer than its heads: the
/// scores over blocks of positions (each task reads its block of keys once
/// for every head of the KV head), each head's softmax, and the weighted
/// sums over slices of the value columns. Every score, softmax and sum is
/// the arithmetic [`attend_heads`] does (the same kernels; each element's
/// sum over the positions in order), so the output has its bits. Returns
/// `rows × nh × hd` floats.
#[allow(clippy::too_many_arguments)]
fn attend_split(
    pool: &Pool,
    rows: &[SplitRow<'_>],
    nh: usize,
    nkv: usize,
    hd: usize,
    scale: f32,
    query_heads: &(dyn Fn(&mut [f32], &Angles) + Sync),
) -> Vec<f32> {
    let k = kernels::kernels();
    let group = nh / nkv;
    let threads = pool.threads();
    // Row i's scores: head h's at off[i] + h · len.
    let mut off = Vec::with_capacity(rows.len());
    let mut total = 0;
    for r in rows {
        off.push(total);
        total += nh * r.len;
    }
    let positions: usize = rows.iter().map(|r| r.len).sum();
    // Blocks of positions, four per thread.
    let chunk = (positions * nkv)
        .div_ceil(4 * threads)
        .next_multiple_of(ROW_BLOCK)
        .max(ROW_BLOCK);
    let mut tasks = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        for g in 0..nkv {
            for t0 in (0..r.len).step_by(chunk) {
                tasks.push((i, g, t0));
            }
        }
    }
    let mut scores: Vec<f32> = Vec::with_capacity(total);
    {
        let parts = Parts::over_uninit(&mut scores.spare_capacity_mut()[..total]);
        pool.run(tasks.len(), &|t| {
            let (i, g, t0) = tasks[t];
            let r = &rows[i];
            let (h0, t1) = (g * group, (t0 + chunk).min(r.len));
            let mut qs = r.q[h0 * hd..(h0 + group) * hd].to_vec();
            query_heads(&mut qs, r.angles);
            let mut out = vec![0.0f32; group * (t1 - t0)];
            SCRATCH.with_borrow_mut(|(_, blk, _)| {
                let keys = &r.keys[g][r.first * hd..];
                scores_into(
                    k,
                    &qs,
                    hd,
                    keys,
                    hd,
                    t0..t1,
                    &mut out,
                    t1 - t0,
                    blk,
                    r.ahead,
                );
            });
            // SAFETY: task (row, KV head, block) alone writes its heads'
            // scores of its positions: the tasks cut each (row, KV head)'s
            // positions into disjoint blocks.
            unsafe { parts.put_rows(off[i] + h0 * r.len + t0, r.len, &out, t1 - t0) };
        });
        // Every (row, head, position) belongs to one task.
        assert!(parts.complete(), "every score written");
    }
    // SAFETY: the first `total` elements were all written just above
    // (`complete`, the parts disjoint), within the capacity.
    unsafe { scores.set_len(total) };

    // Each (row, head)'s softmax.
    let mut heads: Vec<&mut [f32]> = Vec::with_capacity(rows.len() * nh);
    let mut rest = &mut scores[..];
    for r in rows {
        for _ in 0..nh {
            let (s, tail) = rest.split_at_mut(r.len);
            heads.push(s);
            rest = tail;
        }
    }
    pool.for_each_chunk_mut(&mut heads, 1, |_, s| {
        let s = &mut *s[0];
        s.iter_mut().for_each(|x| *x *= scale);
        softmax_inplace(s);
    });

    // The weighted sums, a slice of the value columns per task.
    let d = column_slices(hd, rows.len() * nkv, threads);
    let w = hd / d;
    let mut out: Vec<f32> = Vec::with_capacity(rows.len() * nh * hd);
    let scores = &scores;
    {
        let parts = Parts::over_uninit(&mut out.spare_capacity_mut()[..rows.len() * nh * hd]);
        pool.run(rows.len() * nkv * d, &|t| {
            let (i, g, c) = (t / (nkv * d), t / d % nkv, t % d);
            let r = &rows[i];
            let mut o = vec![0.0f32; group * w];
            SCRATCH.with_borrow_mut(|(_, _, buf)| {
                let s = &scores[off[i] + g * group * r.len..];
                let v = &r.values[g][r.first * hd + c * w..];
                weighted_into(k, &mut o, group, s, r.len, r.len, v, hd, buf, r.ahead);
            });
            // SAFETY: task (row, KV head, slice) alone writes its slice of
            // its heads' outputs: the tasks cut each head into disjoint slices.
            unsafe { parts.put_rows(i * nh * hd + g * group * hd + c * w, hd, &o, w) };
        });
        assert!(parts.complete(), "every output written");
    }
    // SAFETY: as for the scores.
    unsafe { out.set_len(rows.len() * nh * hd) };
    out
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
                        kh.extend_from_slice(&k[at + h * hd..at + (h + 1) * hd])?;
                        vh.extend_from_slice(&v[at + h * hd..at + (h + 1) * hd])?;
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
            let first = |ri: &RowInfo| window.map_or(0, |wdw| (ri.pos + 1).saturating_sub(wdw));
            let positions: usize = rows.iter().map(|ri| ri.pos + 1 - first(ri)).sum();
            // Few (row, KV head) pairs for many threads: the positions and
            // the value columns cut over the threads instead.
            let split: Option<Vec<SplitRow<'_>>> =
                if splits_positions(n * nkv, positions, nkv, pool.threads()) {
                    rows.iter()
                        .enumerate()
                        .map(|(i, ri)| match &caches[ri.seq].layers[layer] {
                            LayerCache::Gqa { k: kc, v: vc }
                                if kc.len() == nkv && vc.len() == nkv =>
                            {
                                Some(SplitRow {
                                    q: &q[i * nh * hd..(i + 1) * nh * hd],
                                    angles: &angles[i],
                                    keys: kc,
                                    values: vc,
                                    first: first(ri),
                                    len: ri.pos + 1 - first(ri),
                                    ahead: fed[ri.seq] == 1,
                                })
                            }
                            _ => None,
                        })
                        .collect()
                } else {
                    None
                };
            let out = match split {
                Some(split) => attend_split(pool, &split, nh, nkv, hd, scale, &query_heads),
                None => pool.zeroed_chunks(n * nh * hd, per * hd, |idx, o| {
                    let (i, h0) = (idx / (nh / per), idx % (nh / per) * per);
                    let ri = rows[i];
                    let kvh = h0 / group;
                    let LayerCache::Gqa { k: kc, v: vc } = &caches[ri.seq].layers[layer] else {
                        return;
                    };
                    let (Some(kc), Some(vc)) = (kc.get(kvh), vc.get(kvh)) else {
                        return;
                    };
                    let first = first(&ri);
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
                }),
            };
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
                    latent.extend_from_slice(&row[..r])?;
                    k_pe.extend_from_slice(&row[r..])?;
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

    /// The attention cut over positions and value columns gives every
    /// head the bits of a task per KV head ([`attend_heads`]): rows of
    /// different lengths, windows that start past position 0, head sizes
    /// whose column slices are 8, 16, 24 and 32 floats wide, and thread
    /// counts that leave some threads without a task.
    #[test]
    fn split_attention_has_the_bits_of_a_task_per_kv_head() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        // Stands in for the query norm and rotation: any per-head
        // transform the tasks must each apply the same way.
        let query_heads = |qs: &mut [f32], a: &Angles| {
            for (x, c) in qs.iter_mut().zip(a.cos.iter().cycle()) {
                *x = *x * c + 0.25;
            }
        };
        for (nh, nkv, hd) in [
            (32usize, 4usize, 128usize),
            (8, 2, 24),
            (6, 3, 16),
            (4, 1, 72),
        ] {
            let group = nh / nkv;
            let scale = (hd as f32).powf(-0.5);
            for (lens, firsts) in [
                (vec![1usize], vec![0usize]),
                (vec![65], vec![0]),
                (vec![700], vec![0]),
                (vec![300, 1100], vec![0, 37]),
                (vec![129, 64, 9], vec![5, 0, 2]),
            ] {
                // Per row: (keys, values), a vector per KV head.
                type Heads = Vec<KvRows>;
                let caches: Vec<(Heads, Heads)> = lens
                    .iter()
                    .zip(&firsts)
                    .map(|(&len, &first)| {
                        let n = (first + len) * hd;
                        let heads = |rng: &mut rand_chacha::ChaCha8Rng| {
                            (0..nkv)
                                .map(|_| {
                                    let mut rows = KvRows::new();
                                    rows.extend_from_slice(&rand_vec(rng, n)).unwrap();
                                    rows
                                })
                                .collect::<Vec<_>>()
                        };
                        (heads(&mut rng), heads(&mut rng))
                    })
                    .collect();
                let qs: Vec<Vec<f32>> = lens.iter().map(|_| rand_vec(&mut rng, nh * hd)).collect();
                let angles: Vec<Angles> = lens
                    .iter()
                    .map(|_| Angles {
                        cos: rand_vec(&mut rng, hd / 2),
                        sin: Vec::new(),
                    })
                    .collect();
                let rows: Vec<SplitRow<'_>> = (0..lens.len())
                    .map(|i| SplitRow {
                        q: &qs[i],
                        angles: &angles[i],
                        keys: &caches[i].0,
                        values: &caches[i].1,
                        first: firsts[i],
                        len: lens[i],
                        ahead: i % 2 == 0,
                    })
                    .collect();
                // A task per KV head, on the calling thread.
                let mut want = vec![0.0f32; lens.len() * nh * hd];
                for (i, r) in rows.iter().enumerate() {
                    for g in 0..nkv {
                        let h0 = g * group;
                        let mut q = r.q[h0 * hd..(h0 + group) * hd].to_vec();
                        query_heads(&mut q, r.angles);
                        let at = i * nh * hd + h0 * hd;
                        attend_heads(
                            &q,
                            hd,
                            &r.keys[g][r.first * hd..],
                            &r.values[g][r.first * hd..],
                            hd,
                            r.len,
                            scale,
                            &mut want[at..at + group * hd],
                            r.ahead,
                        );
                    }
                }
                assert!(want.iter().any(|&x| x != 0.0));
                for threads in [2, 5, 16] {
                    let pool = Pool::new(threads).unwrap();
                    let got = attend_split(&pool, &rows, nh, nkv, hd, scale, &query_heads);
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&got) == bits(&want),
                        "{nh} heads, {nkv} KV heads of {hd}, lengths {lens:?}, {threads} threads"
                    );
                }
            }
        }
    }

    #[test]
    fn column_slices_are_whole_vectors_and_feed_the_threads() {
        for (hd, pairs, threads, want) in [
            (128, 4, 16, 4),
            (128, 4, 8, 2),
            (128, 4, 4, 1),
            (128, 1, 64, 16),
            (24, 2, 5, 3),
            (16, 2, 8, 2),
            (72, 1, 2, 3),
            (12, 1, 8, 1),
        ] {
            assert_eq!(
                column_slices(hd, pairs, threads),
                want,
                "hd {hd}, {pairs} pairs, {threads} threads"
            );
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
