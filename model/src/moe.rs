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
    Gated, Pool, Q8Activation, gated_products, gated_products_summed, matmul, matmul_shared_input,
    q8_matmuls, q8_matmuls_here, q8_products,
};
use crate::ops::{accumulator, sigmoid, softmax_inplace, swiglu_inplace, top_k};
use crate::tensor::QMatrix;
use crate::weights::{MlpWeights, MoeWeights};

/// `down(silu(gate x) * up x)` for `n` rows.
pub(crate) fn mlp_rows(pool: &Pool, w: &MlpWeights, x: &[f32], n: usize) -> Vec<f32> {
    if n == 1 {
        let mut ys = gated_products(pool, &[gated(w)], x, swiglu_inplace);
        return ys.pop().unwrap_or_default();
    }
    let inter = w.gate.rows;
    let mut g = vec![0.0f32; n * inter];
    let mut u = vec![0.0f32; n * inter];
    matmul_shared_input(pool, &[&w.gate, &w.up], x, n, &mut [&mut g, &mut u]);
    // Elementwise, so the split across threads (for batches worth
    // splitting) changes no result.
    let gate_rows = |c: usize, gs: &mut [f32], chunk: usize| {
        swiglu_inplace(gs, &u[c * chunk..c * chunk + gs.len()]);
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
    gated_products(pool, &mlps, x, swiglu_inplace)
}

/// A routed row's slots in the order the combine adds them: by expert id
/// (transformers' order), whatever order the router chose them in.
fn combine_order(r: &Routing) -> Vec<usize> {
    let mut order: Vec<usize> = (0..r.experts.len()).collect();
    order.sort_by_key(|&s| r.experts[s]);
    order
}

/// One token's routed experts (all of them, in `group`) through
/// [`gated_products_summed`]: their outputs weighted and summed as the
/// combine does, onto a zeroed accumulator; `None` where that path does
/// not apply (the combine then takes [`mlp_group`]'s outputs).
fn mlp_group_summed(pool: &Pool, group: &ExpertGroup, x: &[f32], r: &Routing) -> Option<Vec<f32>> {
    let mlps: Vec<Gated<'_>> = group.iter().map(|(_, w)| gated(w)).collect();
    let at = |e: usize| group.iter().position(|(id, _)| *id == e);
    let sum = combine_order(r)
        .into_iter()
        .map(|s| Some((at(r.experts[s])?, r.weights[s])))
        .collect::<Option<Vec<_>>>()?;
    let mut y = accumulator(x.len());
    gated_products_summed(pool, &mlps, x, swiglu_inplace, &sum, &mut y)?;
    Some(y)
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
/// k-quants, Q8_0, IQ4_NL, …): a pool task per expert for a group of many
/// ([`q8_group_by_expert`]), else three pool jobs for the whole group
/// ([`q8_group_by_rows`]) instead of three per expert, and each row of
/// `h` quantized once (`hq`, filled on first use) instead of once per
/// expert that takes it. The products are
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
    Some(if group.len() >= EXPERT_TASKS_PER_THREAD * pool.threads() {
        q8_group_by_expert(pool, group, users, hq)
    } else {
        q8_group_by_rows(pool, group, users, hq)
    })
}

/// [`q8_group_rows`] for a group of few experts: every product's rows cut
/// into tasks (every gate and up in one pool job, SwiGLU and the
/// quantization in another, every down product in a third), so that few
/// experts still keep every thread busy.
fn q8_group_by_rows(
    pool: &Pool,
    group: &ExpertGroup,
    users: &[Vec<(usize, usize)>],
    hq: &[Q8Activation],
) -> Vec<Vec<f32>> {
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
        swiglu_q8(g, u, group[i].1.gate.rows)
    });
    let ws: Vec<&QMatrix> = group.iter().map(|(_, w)| &w.down).collect();
    let xs: Vec<Vec<&Q8Activation>> = acts.iter().map(|a| a.iter().collect()).collect();
    q8_matmuls(pool, &ws, &xs)
}

/// Per token (`inter` values of gate and of up each), SwiGLU quantized
/// for the down product.
fn swiglu_q8(g: &[f32], u: &[f32], inter: usize) -> Vec<Q8Activation> {
    let mut a = Vec::new();
    g.chunks_exact(inter)
        .zip(u.chunks_exact(inter))
        .map(|(g, u)| {
            swiglu_into(g, u, &mut a);
            Q8Activation::quantize(&a)
        })
        .collect()
}

/// One token's SwiGLU into `a` (its memory reused).
fn swiglu_into(g: &[f32], u: &[f32], a: &mut Vec<f32>) {
    a.clear();
    a.extend_from_slice(g);
    swiglu_inplace(a, u);
}

/// Experts a group needs per pool thread for [`q8_group_by_expert`]:
/// enough that tasks of different sizes even out between the threads.
const EXPERT_TASKS_PER_THREAD: usize = 4;

/// A [`q8_group_by_expert`] task's buffers, kept per thread so that a
/// prompt's thousands of expert tasks allocate nothing but their outputs:
/// the gate and up results (SwiGLU formed in the gate's half), and the
/// down product's quantized inputs (whose five vectors each were allocated
/// per token).
#[derive(Default)]
struct ExpertScratch {
    gate_up: Vec<f32>,
    acts: Vec<Q8Activation>,
}

thread_local! {
    static EXPERT_SCRATCH: std::cell::RefCell<ExpertScratch> =
        std::cell::RefCell::new(ExpertScratch::default());
}

/// [`q8_group_rows`] for a group of many experts (a prompt's layer, or a
/// decode's 8 experts on 2 threads): one pool task per expert, the largest first, computing its gate and up,
/// SwiGLU and the down product's quantization, and its down product, so
/// that the gate and up results stay in the core's cache and the layer
/// takes one pool job instead of three. The same kernels and
/// quantization: the same bits.
fn q8_group_by_expert(
    pool: &Pool,
    group: &ExpertGroup,
    users: &[Vec<(usize, usize)>],
    hq: &[Q8Activation],
) -> Vec<Vec<f32>> {
    let mut order: Vec<usize> = (0..group.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(users[i].len()));
    let done = pool.map_collect(order.len(), |t| {
        let i = order[t];
        let w = &group[i].1;
        let xs: Vec<&Q8Activation> = users[i].iter().map(|&(row, _)| &hq[row]).collect();
        let inter = w.gate.rows;
        EXPERT_SCRATCH.with_borrow_mut(|sc| {
            let need = 2 * xs.len() * inter;
            if sc.gate_up.len() < need {
                sc.gate_up.resize(need, 0.0);
            }
            // Every element is written by the products: what an earlier
            // task left is overwritten, never read.
            let (g, u) = sc.gate_up[..need].split_at_mut(need / 2);
            q8_matmuls_here(&[&w.gate, &w.up], &xs, &mut [&mut *g, &mut *u]);
            if sc.acts.len() < xs.len() {
                sc.acts.resize_with(xs.len(), Q8Activation::default);
            }
            for ((g, u), q) in g
                .chunks_exact_mut(inter)
                .zip(u.chunks_exact(inter))
                .zip(&mut sc.acts)
            {
                swiglu_inplace(g, u);
                q.quantize_from(g);
            }
            let acts: Vec<&Q8Activation> = sc.acts[..xs.len()].iter().collect();
            let mut y = vec![0.0f32; xs.len() * w.down.rows];
            q8_matmuls_here(&[&w.down], &acts, &mut [&mut y]);
            y
        })
    });
    let mut ys: Vec<Vec<f32>> = vec![Vec::new(); group.len()];
    for (&i, y) in order.iter().zip(done) {
        ys[i] = y;
    }
    ys
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
    let route_row = |row: usize| {
        let l = &logits[row * moe.num_experts..(row + 1) * moe.num_experts];
        route(moe, l, w.selection_bias.as_deref())
    };
    // A prompt's rows routed on the pool (on the calling thread alone they
    // took 1.3% of a 512-token prefill while the others waited).
    let routing: Vec<Routing> = if n < 2 * pool.threads() {
        (0..n).map(route_row).collect()
    } else {
        pool.map_collect(n, route_row)
    };
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
    // One token whose experts all came in one group through the two-job
    // path: its routed experts' weighted sum, formed inside the down job
    // (`gated_products_summed`) instead of by the combine below.
    let mut summed: Option<Vec<f32>> = None;
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
    let mut compute = |group: &ExpertGroup| -> Result<()> {
        if n == 1 && group.len() > 1 {
            // One token: every expert of the group takes the same input.
            // Enough experts for every thread (a decode's 8 on 2 threads)
            // run a pool task each, gate to down ([`q8_group_by_expert`]):
            // one job where the row split takes two, and 2–3.5 points of
            // the roofline more in a warm decode (docs/benchmarks.md).
            // Fewer run as two pool jobs (every gate and up, then every
            // down) instead of two per expert. Each product is the one
            // `mlp_rows` computes either way.
            let users = group
                .iter()
                .map(|(e, _)| accept(*e).cloned())
                .collect::<Result<Vec<_>>>()?;
            let ys = if group.len() >= EXPERT_TASKS_PER_THREAD * pool.threads() {
                q8_group_rows(pool, group, &users, h, hidden, &mut hq)
            } else {
                None
            };
            let ys = match ys {
                Some(ys) => ys,
                None => {
                    if group.len() == ids.len()
                        && let Some(y) = mlp_group_summed(pool, group, h, &routing[0])
                    {
                        summed = Some(y);
                        return Ok(());
                    }
                    mlp_group(pool, group, h)
                }
            };
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
            if let Some(ys) = q8_group_rows(pool, group, &users, h, hidden, &mut hq) {
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
            let us = accept(*e)?;
            keep(us, expert_rows(pool, ew, h, hidden, us));
        }
        Ok(())
    };
    // A decode step's serial work between jobs is what its workers wait
    // for; a prompt's is a small share of its time.
    let decode_step = n < 2 * pool.threads();
    let mut undelivered = ids.len();
    let mut apply = |group: ExpertGroup| -> Result<()> {
        let result = compute(&group);
        // The layer's last group (a warm decode's only one) releases its
        // leases while the workers run the next job's last tasks. An
        // earlier group's slots may be needed for this layer's reads
        // still to come: those go now.
        undelivered = undelivered.saturating_sub(group.len());
        if undelivered == 0 && decode_step {
            crate::kernels::pool::defer_drop(group);
        }
        result
    };
    // The previous layer's last experts, if still leased (put off as
    // above): their slots may be needed now.
    crate::kernels::pool::drop_deferred();
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

    // Where each routed (row, slot) pair's output row is: every one was
    // delivered (checked above), so the combine below cannot miss one.
    // Where the experts' sum was formed in their job there is none.
    let mut place = vec![(0usize, 0usize); n * k];
    for (row, r) in routing.iter().enumerate().filter(|_| summed.is_none()) {
        for (s, &e) in r.experts.iter().enumerate() {
            place[row * k + s] = at[row * k + s].ok_or_else(|| ModelError::Expert {
                layer,
                expert: e,
                reason: "no output for a routed row".into(),
            })?;
        }
    }
    let shared = match &w.shared {
        Some(shared) => {
            let s = mlp_rows(pool, shared, h, n);
            let gates = match &w.shared_gate {
                Some(g) => {
                    let mut gl = vec![0.0f32; n];
                    matmul(pool, g, h, n, &mut gl);
                    Some(gl)
                }
                None => None,
            };
            Some((s, gates))
        }
        None => None,
    };
    // A row's experts in id order, then the shared expert.
    let routed = |row: usize, y: &mut [f32]| {
        let r = &routing[row];
        for s in combine_order(r) {
            let wgt = r.weights[s];
            let (b, j) = place[row * k + s];
            let src = &outputs[b][j * hidden..(j + 1) * hidden];
            for (yv, sv) in y.iter_mut().zip(src) {
                *yv += sv * wgt;
            }
        }
    };
    let add_shared = |row: usize, y: &mut [f32]| {
        if let Some((s, gates)) = &shared {
            let gate = gates.as_ref().map(|g| sigmoid(g[row]));
            for (yv, sv) in y.iter_mut().zip(&s[row * hidden..(row + 1) * hidden]) {
                *yv += match gate {
                    Some(g) => g * sv,
                    None => *sv,
                };
            }
        }
    };
    let combine = |row: usize, y: &mut [f32]| {
        routed(row, y);
        add_shared(row, y);
    };
    let out = if let Some(mut y) = summed {
        add_shared(0, &mut y);
        y
    } else if n < 2 * pool.threads() {
        let mut out = accumulator(n * hidden);
        for (row, y) in out.chunks_exact_mut(hidden).enumerate() {
            combine(row, y);
        }
        out
    } else {
        // A prompt's rows split over the pool (the calling thread combined
        // them alone while the others waited).
        let per = n.div_ceil(4 * pool.threads());
        pool.zeroed_chunks(n * hidden, per * hidden, |c, ys| {
            for (j, y) in ys.chunks_exact_mut(hidden).enumerate() {
                combine(c * per + j, y);
            }
        })
    };
    if decode_step {
        // The experts' rows the workers wrote: freed where this thread
        // next waits.
        crate::kernels::pool::defer_drop(outputs);
    }
    Ok((out, routing))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::WeightFormat;
    use crate::kernels::q4_0_tiles_run_here;
    use crate::kernels::tests::{q4_matrix, rand_vec, tiled};
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;

    fn q8_0_matrix(rng: &mut impl rand::Rng, rows: usize, cols: usize) -> QMatrix {
        let w = rand_vec(rng, rows * cols);
        let bytes: Vec<u8> = w
            .chunks(cols)
            .flat_map(|r| crate::quant::quantize_q8_0(r).unwrap())
            .collect();
        let data = crate::tensor::Bytes::from_vec(bytes);
        QMatrix::new("t", rows, cols, WeightFormat::Q8_0, data, None).unwrap()
    }

    /// A group of many experts computed a task per expert gives every
    /// expert the bits of the row-split jobs and of `expert_rows` (the
    /// f32-input path), whatever the thread count: tiled Q4_0 experts
    /// (where the tile kernels run) and Q8_0 ones, 1 to 40 tokens each
    /// (the AMX kernel's passes, its rests and the AVX-512 tiles).
    #[test]
    fn a_task_per_expert_gives_the_row_split_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(91);
        let (hidden, inter, n) = (128, 96, 48);
        let counts = [40, 1, 2, 3, 5, 9, 10, 11, 15, 16, 17, 20, 26, 33];
        let group: ExpertGroup = counts
            .iter()
            .enumerate()
            .map(|(e, _)| {
                let tile = q4_0_tiles_run_here() && e % 3 != 2;
                let m = |rng: &mut rand_chacha::ChaCha8Rng, rows, cols| {
                    if tile {
                        tiled(&q4_matrix(rng, rows, cols))
                    } else {
                        q8_0_matrix(rng, rows, cols)
                    }
                };
                let w = MlpWeights {
                    gate: m(&mut rng, inter, hidden),
                    up: m(&mut rng, inter, hidden),
                    down: m(&mut rng, hidden, inter),
                };
                (e, Arc::new(w))
            })
            .collect();
        assert!(
            group
                .iter()
                .all(|(_, w)| { [&w.gate, &w.up, &w.down].into_iter().all(q8_products) })
        );
        let h = rand_vec(&mut rng, n * hidden);
        let users: Vec<Vec<(usize, usize)>> = counts
            .iter()
            .map(|&c| {
                let mut rows: Vec<usize> = (0..n).collect();
                rows.shuffle(&mut rng);
                rows[..c].iter().map(|&r| (r, 0)).collect()
            })
            .collect();
        let hq: Vec<Q8Activation> = h.chunks_exact(hidden).map(Q8Activation::quantize).collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let one = Pool::new(1).unwrap();
        let want: Vec<Vec<f32>> = group
            .iter()
            .zip(&users)
            .map(|((_, w), us)| expert_rows(&one, w, &h, hidden, us))
            .collect();
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            let by_expert = q8_group_by_expert(&pool, &group, &users, &hq);
            let by_rows = q8_group_by_rows(&pool, &group, &users, &hq);
            for (i, w) in want.iter().enumerate() {
                assert_eq!(w.len(), counts[i] * hidden);
                assert_eq!(
                    bits(&by_expert[i]),
                    bits(w),
                    "expert {i}, {threads} threads"
                );
                assert_eq!(bits(&by_rows[i]), bits(w), "expert {i}, {threads} threads");
            }
            // A group this size takes a task per expert on up to 3 threads.
            let mut hq2 = Vec::new();
            let got = q8_group_rows(&pool, &group, &users, &h, hidden, &mut hq2).unwrap();
            assert_eq!(
                got.iter().map(|y| bits(y)).collect::<Vec<_>>(),
                by_expert.iter().map(|y| bits(y)).collect::<Vec<_>>()
            );
        }
    }

    /// One token's 8 experts, all in one group, through the two jobs with
    /// the weighted sum formed in the down job (what `moe_rows` runs where
    /// the experts are fewer than 4 per thread) give the bits of the
    /// combine over each expert's own output, on 1 to 3 threads.
    #[test]
    fn one_token_summed_in_the_down_job_gives_the_combine_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(93);
        let (hidden, inter) = (256, 192);
        let tile = q4_0_tiles_run_here();
        let m = |rng: &mut rand_chacha::ChaCha8Rng, rows, cols| {
            if tile {
                tiled(&q4_matrix(rng, rows, cols))
            } else {
                q8_0_matrix(rng, rows, cols)
            }
        };
        // Delivered in one order, routed in another, combined by id.
        let ids = [40, 3, 17, 8, 120, 55, 9, 71];
        let group: ExpertGroup = ids
            .iter()
            .map(|&e| {
                let w = MlpWeights {
                    gate: m(&mut rng, inter, hidden),
                    up: m(&mut rng, inter, hidden),
                    down: m(&mut rng, hidden, inter),
                };
                (e, Arc::new(w))
            })
            .collect();
        let mut experts = ids.to_vec();
        experts.shuffle(&mut rng);
        let weights: Vec<f32> = (0..8).map(|_| rng.random_range(0.01f32..0.5)).collect();
        let r = Routing { experts, weights };
        let h = rand_vec(&mut rng, hidden);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        // The combine's sum over each expert's own output.
        let outs = mlp_group(&Pool::new(1).unwrap(), &group, &h);
        let mut want = accumulator(hidden);
        for s in combine_order(&r) {
            let at = ids.iter().position(|&e| e == r.experts[s]).unwrap();
            for (y, v) in want.iter_mut().zip(&outs[at]) {
                *y += v * r.weights[s];
            }
        }
        assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|&v| v != 0.0));
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            let got = mlp_group_summed(&pool, &group, &h, &r).unwrap();
            assert_eq!(bits(&got), bits(&want), "{threads} threads");
        }
        // A routed expert missing from the group, or down matrices of two
        // layouts: not summed in the job (the combine does it).
        let mut other = r.clone();
        other.experts[0] = 1000;
        assert!(mlp_group_summed(&Pool::new(2).unwrap(), &group, &h, &other).is_none());
        if tile {
            let mut mixed = group.clone();
            let w = MlpWeights {
                gate: m(&mut rng, inter, hidden),
                up: m(&mut rng, inter, hidden),
                down: q8_0_matrix(&mut rng, hidden, inter),
            };
            mixed[5] = (mixed[5].0, Arc::new(w));
            assert!(mlp_group_summed(&Pool::new(2).unwrap(), &mixed, &h, &r).is_none());
        }
    }

    /// One token through a decode's 8 experts: a task per expert (what
    /// `moe_rows` runs where the experts are at least 4 per thread) gives
    /// the bits of the two row-split jobs (`mlp_group`), on 1 to 3
    /// threads, for tiled Q4_0 and Q8_0 experts.
    #[test]
    fn one_token_by_expert_gives_the_two_job_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(92);
        let (hidden, inter) = (256, 192);
        let group: ExpertGroup = (0..8)
            .map(|e| {
                let tile = q4_0_tiles_run_here() && e % 2 == 0;
                let m = |rng: &mut rand_chacha::ChaCha8Rng, rows, cols| {
                    if tile {
                        tiled(&q4_matrix(rng, rows, cols))
                    } else {
                        q8_0_matrix(rng, rows, cols)
                    }
                };
                let w = MlpWeights {
                    gate: m(&mut rng, inter, hidden),
                    up: m(&mut rng, inter, hidden),
                    down: m(&mut rng, hidden, inter),
                };
                (10 + 3 * e, Arc::new(w))
            })
            .collect();
        let h = rand_vec(&mut rng, hidden);
        let users: Vec<Vec<(usize, usize)>> = (0..8).map(|slot| vec![(0, slot)]).collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let want: Vec<Vec<u32>> = mlp_group(&Pool::new(1).unwrap(), &group, &h)
            .iter()
            .map(|y| bits(y))
            .collect();
        assert!(
            want.iter()
                .all(|y| y.iter().any(|&b| f32::from_bits(b) != 0.0))
        );
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            let mut hq = Vec::new();
            let got = q8_group_rows(&pool, &group, &users, &h, hidden, &mut hq).unwrap();
            let got: Vec<Vec<u32>> = got.iter().map(|y| bits(y)).collect();
            assert_eq!(got, want, "{threads} threads");
            let two_jobs: Vec<Vec<u32>> = mlp_group(&pool, &group, &h)
                .iter()
                .map(|y| bits(y))
                .collect();
            assert_eq!(two_jobs, want, "{threads} threads, two jobs");
        }
    }
}
