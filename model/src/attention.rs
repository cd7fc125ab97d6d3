//! Attention over the KV cache for a batch of sequences: grouped-query
//! attention (Qwen, Mixtral, OLMoE) and multi-head latent attention
//! (DeepSeek-V3) in its absorbed form, which caches only the compressed
//! latent and the shared rotary key.
//!
//! Projections run over every row of the batch at once; the attention
//! itself runs per (row, head) in parallel. Each (row, head) is computed by
//! the same code whatever the batch, so batching never changes a result.

use crate::config::{AttentionSpec, QkNorm};
use crate::error::Result;
use crate::forward::{Model, RowInfo};
use crate::kernels::{self, Pool, dot_row, matmul, matmul_shared_input};
use crate::kv::{KvCache, LayerCache};
use crate::ops::{rms_norm_inplace, softmax_inplace};
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
pub(crate) fn attention(
    model: &Model,
    layer: usize,
    pool: &Pool,
    h: &[f32],
    rows: &[RowInfo],
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
            let (mut cos, mut sin, mut tmp) = (Vec::new(), Vec::new(), Vec::new());
            for (i, ri) in rows.iter().enumerate() {
                let qr = &mut q[i * nh * hd..(i + 1) * nh * hd];
                let kr = &mut k[i * nkv * hd..(i + 1) * nkv * hd];
                let vr = &mut v[i * nkv * hd..(i + 1) * nkv * hd];
                match qk_norm {
                    QkNorm::None => {}
                    QkNorm::PerHead => {
                        let (qn, kn) = (
                            w.q_norm.as_deref().unwrap_or(&[]),
                            w.k_norm.as_deref().unwrap_or(&[]),
                        );
                        qr.chunks_exact_mut(hd)
                            .for_each(|x| rms_norm_inplace(x, qn, eps));
                        kr.chunks_exact_mut(hd)
                            .for_each(|x| rms_norm_inplace(x, kn, eps));
                    }
                    QkNorm::Full => {
                        rms_norm_inplace(qr, w.q_norm.as_deref().unwrap_or(&[]), eps);
                        rms_norm_inplace(kr, w.k_norm.as_deref().unwrap_or(&[]), eps);
                    }
                }
                if let Some(c) = clip_qkv {
                    for x in qr.iter_mut().chain(kr.iter_mut()).chain(vr.iter_mut()) {
                        *x = x.clamp(-c, *c);
                    }
                }
                model.rope.cos_sin(ri.pos, &mut cos, &mut sin);
                qr.chunks_exact_mut(hd)
                    .for_each(|x| model.rope.apply(x, &cos, &sin, &mut tmp));
                kr.chunks_exact_mut(hd)
                    .for_each(|x| model.rope.apply(x, &cos, &sin, &mut tmp));
            }
            for (i, ri) in rows.iter().enumerate() {
                if let LayerCache::Gqa { k: kc, v: vc } = &mut caches[ri.seq].layers[layer] {
                    kc.extend_from_slice(&k[i * nkv * hd..(i + 1) * nkv * hd]);
                    vc.extend_from_slice(&v[i * nkv * hd..(i + 1) * nkv * hd]);
                }
            }
            let scale = (hd as f32).powf(-0.5);
            let window = model.spec.layers[layer].sliding_window;
            let group = nh / nkv;
            // A task takes the heads of one KV head together (their scores
            // share every key load) when that still leaves every thread
            // several tasks, else one head; the arithmetic per head is the
            // same either way.
            let per = if n * nkv >= 4 * pool.threads() {
                group
            } else {
                1
            };
            let mut out = vec![0.0f32; n * nh * hd];
            let caches: &[&mut KvCache] = caches;
            pool.for_each_chunk_mut(&mut out, per * hd, |idx, o| {
                let (i, h0) = (idx / (nh / per), idx % (nh / per) * per);
                let ri = rows[i];
                let LayerCache::Gqa { k: kc, v: vc } = &caches[ri.seq].layers[layer] else {
                    return;
                };
                let qg = &q[i * nh * hd + h0 * hd..i * nh * hd + (h0 + per) * hd];
                let kvh = h0 / group;
                let first = window.map_or(0, |wdw| (ri.pos + 1).saturating_sub(wdw));
                let len = ri.pos + 1 - first;
                let k = kernels::kernels();
                let (keys, values) = (
                    &kc[(first * nkv + kvh) * hd..],
                    &vc[(first * nkv + kvh) * hd..],
                );
                let mut scores = vec![0.0f32; per * len];
                match k.dot_f32_rows_group {
                    Some(f) if per > 1 => f(qg, per, keys, nkv * hd, &mut scores),
                    _ => {
                        for (qh, s) in qg.chunks_exact(hd).zip(scores.chunks_exact_mut(len)) {
                            (k.dot_f32_rows)(qh, keys, nkv * hd, s);
                        }
                    }
                }
                for (oh, s) in o.chunks_exact_mut(hd).zip(scores.chunks_exact_mut(len)) {
                    s.iter_mut().for_each(|x| *x *= scale);
                    softmax_inplace(s);
                    (k.weighted_rows)(oh, s, values, nkv * hd);
                }
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
            let (mut cos, mut sin, mut tmp) = (Vec::new(), Vec::new(), Vec::new());
            for (i, ri) in rows.iter().enumerate() {
                let row = &mut ckv[i * (r + dr)..(i + 1) * (r + dr)];
                let (lat, pe) = row.split_at_mut(r);
                rms_norm_inplace(lat, &w.kv_a_norm, MLA_LORA_NORM_EPS);
                model.rope.cos_sin(ri.pos, &mut cos, &mut sin);
                model.rope.apply(pe, &cos, &sin, &mut tmp);
                for head in 0..nh {
                    let qh = &mut q[i * nh * qk + head * qk..i * nh * qk + (head + 1) * qk];
                    model.rope.apply(&mut qh[dn..], &cos, &sin, &mut tmp);
                }
                if let LayerCache::Mla { latent, k_pe } = &mut caches[ri.seq].layers[layer] {
                    latent.extend_from_slice(&row[..r]);
                    k_pe.extend_from_slice(&row[r..]);
                }
            }
            let scale = model.attn_scale;
            let mut out = vec![0.0f32; n * nh * dv];
            let caches: &[&mut KvCache] = caches;
            let kv_b = &w.kv_b;
            pool.for_each_chunk_mut(&mut out, dv, |idx, o| {
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
