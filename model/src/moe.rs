//! The feed-forward half of a layer: dense SwiGLU MLPs, and the MoE block
//! (router, routed experts fetched through an [`ExpertSource`], shared
//! experts).
//!
//! A batch is routed first; the union of chosen experts is fetched once and
//! each expert is applied to every row that chose it, as soon as it is
//! available. Outputs are combined per row in ascending expert order (as
//! transformers does), so arrival order never changes a result.

use crate::config::{MoeSpec, RouterKind};
use crate::error::{ModelError, Result};
use crate::experts::ExpertGroup;
use crate::experts::ExpertSource;
use crate::kernels::{
    Gated, Pool, Q8Activation, gated_products, matmul, matmul_shared_input, q8_matmuls, q8_products,
};
use crate::ops::{accumulator, sigmoid, silu, softmax_inplace, top_k};
use crate::tensor::QMatrix;
use crate::weights::{MlpWeights, MoeWeights};

/// `down(silu(gate x) * up x)` for `n` rows.
pub(crate) fn mlp_rows(pool: &Pool, w: &MlpWeights, x: &[f32], n: usize) -> Vec<f32> {
    if n == 1 {
        let mut ys = gated_products(pool, &[gated(w)], x, swiglu);
        return ys.pop().unwrap_or_default();
    }
    let inter = w.gate.rows;
    let mut g = vec![0.0f32; n * inter];
    let mut u = vec![0.0f32; n * inter];
    matmul_shared_input(pool, &[&w.gate, &w.up], x, n, &mut [&mut g, &mut u]);
    // Elementwise, so the split across threads (for batches worth
    // splitting) changes no result.
    let gate_rows = |c: usize, gs: &mut [f32], chunk: usize| {
        for (gv, uv) in gs.iter_mut().zip(&u[c * chunk..]) {
            *gv = swiglu(*gv, *uv);
        }
    };
    if n >= 8 {
        let chunk = inter.max(1) * n.div_ceil(pool.threads() * 4);
        pool.for_each_chunk_mut(&mut g, chunk, |c, gs| gate_rows(c, gs, chunk));
    } else {
        gate_rows(0, &mut g, 0);
    }
    let mut y = vec![0.0f32; n * w.down.rows];
    matmul(pool, &w.down, &g, n, &mut y);
    y
}

/// One expert for the rows `us` names (`(row, slot)` pairs) of `h`.
fn expert_rows(
    pool: &Pool,
    w: &MlpWeights,
    h: &[f32],
    hidden: usize,
    us: &[(usize, usize)],
) -> Vec<f32> {
    let mut xs = Vec::with_capacity(us.len() * hidden);
    for &(row, _) in us {
        xs.extend_from_slice(&h[row * hidden..(row + 1) * hidden]);
    }
    mlp_rows(pool, w, &xs, us.len())
}

/// [`mlp_rows`] of one token `x` through each expert of `group`, as two
/// pool jobs: every gate and up product with its SwiGLU, then every down
/// product.
fn mlp_group(pool: &Pool, group: &ExpertGroup, x: &[f32]) -> Vec<Vec<f32>> {
    let mlps: Vec<Gated<'_>> = group.iter().map(|(_, w)| gated(w)).collect();
    gated_products(pool, &mlps, x, swiglu)
}

/// SwiGLU's elementwise step: `silu(gate) · up`.
fn swiglu(g: f32, u: f32) -> f32 {
    silu(g) * u
}

fn gated(w: &MlpWeights) -> Gated<'_> {
    Gated {
        gate: &w.gate,
        up: &w.up,
        down: &w.down,
    }
}

/// [`expert_rows`] for every expert of `group`, each on its rows of `h`
/// (`users[i]` for the group's `i`-th expert), when every matrix of the
/// group takes quantized inputs ([`q8_products`]: tiled Q4_0, the
/// k-quants, Q8_0, IQ4_NL, …): two pool jobs for the whole group (every
/// gate and up product, then every down product) instead of three per
/// expert, and each row of `h` quantized once (`hq`, filled on first use)
/// instead of once per expert that takes it. The products are
/// `mlp_rows`'s, bit for bit: the same quantization, kernels and SwiGLU.
/// `None` when some matrix does not.
fn q8_group_rows(
    pool: &Pool,
    group: &ExpertGroup,
    users: &[Vec<(usize, usize)>],
    h: &[f32],
    hidden: usize,
    hq: &mut Vec<Q8Activation>,
) -> Option<Vec<Vec<f32>>> {
    let q8 = |w: &MlpWeights| [&w.gate, &w.up, &w.down].into_iter().all(q8_products);
    if !group.iter().all(|(_, w)| q8(w)) {
        return None;
    }
    if hq.is_empty() {
        *hq = pool.map_collect(h.len() / hidden, |row| {
            Q8Activation::quantize(&h[row * hidden..(row + 1) * hidden])
        });
    }
    let rows_of = |us: &Vec<(usize, usize)>| -> Vec<&Q8Activation> {
        us.iter().map(|&(row, _)| &hq[row]).collect()
    };
    let ws: Vec<&QMatrix> = group.iter().flat_map(|(_, w)| [&w.gate, &w.up]).collect();
    let xs: Vec<Vec<&Q8Activation>> = users
        .iter()
        .flat_map(|us| [rows_of(us), rows_of(us)])
        .collect();
    let gu = q8_matmuls(pool, &ws, &xs);
    // SwiGLU and the down products' quantization, a task per expert.
    let acts: Vec<Vec<Q8Activation>> = pool.map_collect(group.len(), |i| {
        let (g, u) = (&gu[2 * i], &gu[2 * i + 1]);
        let inter = group[i].1.gate.rows;
        g.chunks_exact(inter)
            .zip(u.chunks_exact(inter))
            .map(|(g, u)| {
                let a: Vec<f32> = g.iter().zip(u).map(|(g, u)| swiglu(*g, *u)).collect();
                Q8Activation::quantize(&a)
            })
            .collect()
    });
    let ws: Vec<&QMatrix> = group.iter().map(|(_, w)| &w.down).collect();
    let xs: Vec<Vec<&Q8Activation>> = acts.iter().map(|a| a.iter().collect()).collect();
    Some(q8_matmuls(pool, &ws, &xs))
}

/// The experts one row chose: ids and combine weights, in router order.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// The elementwise functions a router applies to its logits. The CPU tier
/// uses [`RouterMath::CPU`]; the GPU tier has a device-reproducible set
/// (`colibri_sched::gpu::route`), so that a layer routed on the device
/// gives the host's bits.
#[derive(Clone, Copy)]
pub struct RouterMath {
    /// Softmax in place.
    pub softmax: fn(&mut [f32]),
    pub sigmoid: fn(f32) -> f32,
}

impl RouterMath {
    pub const CPU: RouterMath = RouterMath {
        softmax: softmax_inplace,
        sigmoid,
    };
}

/// Routes one row from its router logits.
pub fn route(moe: &MoeSpec, logits: &[f32], selection_bias: Option<&[f32]>) -> Routing {
    route_with(&RouterMath::CPU, moe, logits, selection_bias)
}

/// [`route`] with the given elementwise functions.
pub fn route_with(
    math: &RouterMath,
    moe: &MoeSpec,
    logits: &[f32],
    selection_bias: Option<&[f32]>,
) -> Routing {
    match &moe.router {
        RouterKind::Softmax { norm_topk_prob } => {
            let mut p = logits.to_vec();
            (math.softmax)(&mut p);
            let experts = top_k(&p, moe.top_k);
            let mut weights: Vec<f32> = experts.iter().map(|&e| p[e]).collect();
            if *norm_topk_prob {
                let s: f32 = weights.iter().sum();
                weights.iter_mut().for_each(|w| *w /= s);
            }
            Routing { experts, weights }
        }
        RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        } => {
            let scores: Vec<f32> = logits.iter().map(|&l| (math.sigmoid)(l)).collect();
            let choice: Vec<f32> = match selection_bias {
                Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => scores.clone(),
            };
            let per = moe.num_experts / n_group;
            let group_scores: Vec<f32> = choice
                .chunks_exact(per)
                .map(|g| {
                    let t = top_k(g, 2);
                    g[t[0]] + g[t[1]]
                })
                .collect();
            let groups = top_k(&group_scores, *topk_group);
            let masked: Vec<f32> = choice
                .iter()
                .enumerate()
                .map(|(e, &c)| {
                    if groups.contains(&(e / per)) {
                        c
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let experts = top_k(&masked, moe.top_k);
            let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
            if *norm_topk_prob {
                let s: f32 = weights.iter().sum::<f32>() + 1e-20;
                weights.iter_mut().for_each(|w| *w /= s);
            }
            weights.iter_mut().for_each(|w| *w *= routed_scaling_factor);
            Routing { experts, weights }
        }
    }
}

/// The router logits of every row of `h` (`n × hidden`): `n × experts`.
fn router_logits(pool: &Pool, moe: &MoeSpec, w: &MoeWeights, h: &[f32], n: usize) -> Vec<f32> {
    let mut logits = vec![0.0f32; n * moe.num_experts];
    matmul(pool, &w.router, h, n, &mut logits);
    logits
}

/// The MoE block for `n` rows of normed hidden states.
pub(crate) fn moe_rows(
    pool: &Pool,
    layer: usize,
    moe: &MoeSpec,
    w: &MoeWeights,
    experts: &dyn ExpertSource,
    h: &[f32],
    n: usize,
) -> Result<(Vec<f32>, Vec<Routing>)> {
    let hidden = h.len() / n;
    let logits = router_logits(pool, moe, w, h, n);
    let routing: Vec<Routing> = logits
        .chunks_exact(moe.num_experts)
        .map(|l| route(moe, l, w.selection_bias.as_deref()))
        .collect();
    // Which (row, slot) pairs each expert serves.
    let mut users: std::collections::BTreeMap<usize, Vec<(usize, usize)>> = Default::default();
    for (row, r) in routing.iter().enumerate() {
        for (slot, &e) in r.experts.iter().enumerate() {
            users.entry(e).or_default().push((row, slot));
        }
    }
    let ids: Vec<usize> = users.keys().copied().collect();
    let k = moe.top_k;
    // Each expert's outputs as computed, one row per user; `at[row · k +
    // slot]` says where that pair's row is: (output, row in it).
    let mut outputs: Vec<Vec<f32>> = Vec::new();
    let mut at: Vec<Option<(usize, usize)>> = vec![None; n * k];
    let mut keep = |us: &[(usize, usize)], y: Vec<f32>| {
        for (j, &(row, slot)) in us.iter().enumerate() {
            at[row * k + slot] = Some((outputs.len(), j));
        }
        outputs.push(y);
    };
    // Rows of `h` quantized for tiled experts, once for every group.
    let mut hq: Vec<Q8Activation> = Vec::new();
    let mut done = vec![false; moe.num_experts];
    // The (row, slot) pairs of a delivered expert, checked: requested and
    // not delivered before.
    let mut accept = |e: usize| -> Result<&Vec<(usize, usize)>> {
        let us = users.get(&e).ok_or_else(|| ModelError::Expert {
            layer,
            expert: e,
            reason: "source returned an expert that was not requested".into(),
        })?;
        if std::mem::replace(&mut done[e], true) {
            return Err(ModelError::Expert {
                layer,
                expert: e,
                reason: "source returned the expert twice".into(),
            });
        }
        Ok(us)
    };
    let mut apply = |group: ExpertGroup| -> Result<()> {
        if n == 1 && group.len() > 1 {
            // One token: every expert of the group takes the same input,
            // so the group runs as two pool jobs (every gate and up, then
            // every down) instead of two per expert; each product is the
            // one `mlp_rows` computes.
            let users = group
                .iter()
                .map(|(e, _)| accept(*e).cloned())
                .collect::<Result<Vec<_>>>()?;
            let ys = mlp_group(pool, &group, h);
            for (us, y) in users.iter().zip(ys) {
                keep(us, y);
            }
            return Ok(());
        }
        if n > 1 {
            let users = group
                .iter()
                .map(|(e, _)| accept(*e).cloned())
                .collect::<Result<Vec<_>>>()?;
            if let Some(ys) = q8_group_rows(pool, &group, &users, h, hidden, &mut hq) {
                for (us, y) in users.iter().zip(ys) {
                    keep(us, y);
                }
                return Ok(());
            }
            for ((_, ew), us) in group.iter().zip(&users) {
                keep(us, expert_rows(pool, ew, h, hidden, us));
            }
            return Ok(());
        }
        for (e, ew) in group {
            let us = accept(e)?;
            keep(us, expert_rows(pool, &ew, h, hidden, us));
        }
        Ok(())
    };
    // Before fetching: a prefetching source submits its reads of later
    // layers' predicted experts together with this layer's demand reads.
    experts.moe_input(layer, h, &logits, n);
    experts.fetch_groups(layer, &ids, &mut apply)?;
    if let Some(missing) = ids.iter().find(|&&e| !done[e]) {
        return Err(ModelError::Expert {
            layer,
            expert: *missing,
            reason: "source never delivered the expert".into(),
        });
    }

    let mut out = accumulator(n * hidden);
    for (row, r) in routing.iter().enumerate() {
        let y = &mut out[row * hidden..(row + 1) * hidden];
        let mut order: Vec<usize> = (0..r.experts.len()).collect();
        order.sort_by_key(|&s| r.experts[s]);
        for s in order {
            let wgt = r.weights[s];
            // Every chosen expert was delivered (checked above).
            let (b, j) = at[row * k + s].ok_or_else(|| ModelError::Expert {
                layer,
                expert: r.experts[s],
                reason: "no output for a routed row".into(),
            })?;
            let src = &outputs[b][j * hidden..(j + 1) * hidden];
            for (yv, sv) in y.iter_mut().zip(src) {
                *yv += sv * wgt;
            }
        }
    }
    if let Some(shared) = &w.shared {
        let s = mlp_rows(pool, shared, h, n);
        let gates = match &w.shared_gate {
            Some(g) => {
                let mut gl = vec![0.0f32; n];
                matmul(pool, g, h, n, &mut gl);
                Some(gl)
            }
            None => None,
        };
        for row in 0..n {
            let gate = gates.as_ref().map(|g| sigmoid(g[row]));
            let y = &mut out[row * hidden..(row + 1) * hidden];
            for (yv, sv) in y.iter_mut().zip(&s[row * hidden..(row + 1) * hidden]) {
                *yv += match gate {
                    Some(g) => g * sv,
                    None => *sv,
                };
            }
        }
    }
    Ok((out, routing))
}
