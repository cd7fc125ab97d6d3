//! The residency planner: from what the machine has and what the user
//! allows, decide where every byte lives, and predict what a token costs.
//!
//! Order of placement (DESIGN.md, "Memory tiers and the planner"):
//! 1. dense weights and the KV cache reserve are fixed costs, outside the
//!    expert budget (the default budget is what remains of the usable
//!    memory after them, the staging area and a safety margin);
//! 2. pinned experts: the hottest of the usage history, within
//!    `--pin-budget`;
//! 3. cache slots for the rest, per size class, within what remains of
//!    `--ram-budget`.
//!
//! The staging area (a few slots per class, sized from the I/O queue depth)
//! holds reads in flight and experts in use that the cache does not keep,
//! so a budget of zero cached experts still runs; with prefetch on it has
//! room for the predicted experts of the coming layers too, so reading them
//! ahead never takes a slot this layer's misses need. It is outside the
//! budget and the plan says so. Pinned + cache bytes never exceed the
//! budget.
//!
//! The expected disk bytes per token come from the usage history when there
//! is one (each expert's selection rate), otherwise from uniform routing
//! (each expert selected with probability top_k / experts), and the cache's
//! hit rate from Che's approximation of LRU: with per-step request rates
//! `q_e` and `C` slots, the characteristic time `T` solves
//! `sum_e (1 - exp(-q_e T)) = C`, and expert `e` hits with probability
//! `1 - exp(-q_e T)`. Under uniform routing this is exactly `C / N`.

use colibri_model::ModelSpec;
use colibri_model::config::AttentionSpec;
use colibri_model::weights::{AttnWeights, DenseWeights, FfnWeights, Linear, MlaQuery, MlpWeights};
use serde::Serialize;

use super::layout::ExpertLayout;
use super::memory::MemoryLimits;
use super::size::ByteSize;
use super::usage::UsageHistory;

/// KV positions reserved when the user gave no `--ctx` (a model's
/// `max_position_embeddings` can be 128K+, and the cache grows with use).
pub const DEFAULT_KV_RESERVE_POSITIONS: usize = 16_384;

/// Share of the RAM budget pinned by default, when a usage history exists.
/// Modest on purpose: LESSONS.md found static hot lists weak on some models,
/// while a recency cache adapts.
pub const DEFAULT_PIN_SHARE: f64 = 0.25;

/// The safety margin left free by the default budget: 5% of the usable
/// memory, at least 256 MiB and at most 2 GiB.
pub fn safety_margin(usable: u64) -> u64 {
    (usable / 20).clamp(256 << 20, 2 << 30).min(usable)
}

/// Fixed memory costs of a loaded model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Footprint {
    /// Dense weights (attention, norms, embeddings, shared experts, routers).
    pub dense_bytes: u64,
    /// KV cache bytes per position (all layers).
    pub kv_bytes_per_position: u64,
    /// Positions reserved.
    pub kv_reserve_positions: usize,
}

impl Footprint {
    /// The footprint of `spec` with `dense` weights; `ctx` = 0 reserves
    /// [`DEFAULT_KV_RESERVE_POSITIONS`] (or the model's maximum if smaller).
    pub fn of(spec: &ModelSpec, dense: &DenseWeights, ctx: usize) -> Footprint {
        let positions = if ctx > 0 {
            ctx.min(spec.max_position_embeddings)
        } else {
            spec.max_position_embeddings
                .min(DEFAULT_KV_RESERVE_POSITIONS)
        };
        Footprint {
            dense_bytes: dense_bytes(dense),
            kv_bytes_per_position: kv_bytes_per_position(spec),
            kv_reserve_positions: positions,
        }
    }

    /// The KV reserve in bytes.
    pub fn kv_reserve_bytes(&self) -> u64 {
        self.kv_bytes_per_position
            .saturating_mul(self.kv_reserve_positions as u64)
    }
}

/// KV cache bytes per position (the cache stores f32).
pub fn kv_bytes_per_position(spec: &ModelSpec) -> u64 {
    let per_layer = match &spec.attention {
        AttentionSpec::Gqa {
            num_kv_heads,
            head_dim,
            ..
        } => 2 * num_kv_heads * head_dim,
        AttentionSpec::Mla {
            kv_lora_rank,
            qk_rope_head_dim,
            ..
        } => kv_lora_rank + qk_rope_head_dim,
    };
    (per_layer * 4 * spec.num_layers()) as u64
}

/// Bytes of the dense weights (matrices as stored, vectors as f32).
pub fn dense_bytes(w: &DenseWeights) -> u64 {
    let vec = |v: &[f32]| (v.len() * 4) as u64;
    let opt = |v: &Option<Vec<f32>>| v.as_deref().map_or(0, vec);
    let linear = |l: &Linear| l.w.stored_bytes() as u64 + opt(&l.bias);
    let mlp = |m: &MlpWeights| m.stored_bytes() as u64;
    let mut total = w.embed.stored_bytes() as u64 + vec(&w.norm);
    let tied = std::ptr::eq(
        w.lm_head.data().as_slice().as_ptr(),
        w.embed.data().as_slice().as_ptr(),
    );
    if !tied {
        total += w.lm_head.stored_bytes() as u64;
    }
    for l in &w.layers {
        total += vec(&l.attn_norm) + vec(&l.ffn_norm);
        total += match &l.attn {
            AttnWeights::Gqa(a) => {
                linear(&a.q)
                    + linear(&a.k)
                    + linear(&a.v)
                    + linear(&a.o)
                    + opt(&a.q_norm)
                    + opt(&a.k_norm)
            }
            AttnWeights::Mla(a) => {
                let q = match &a.q {
                    MlaQuery::Direct(q) => linear(q),
                    MlaQuery::LowRank { a, norm, b } => linear(a) + vec(norm) + linear(b),
                };
                q + linear(&a.kv_a)
                    + vec(&a.kv_a_norm)
                    + a.kv_b.stored_bytes() as u64
                    + linear(&a.o)
            }
        };
        total += match &l.ffn {
            FfnWeights::Dense(m) => mlp(m),
            FfnWeights::Moe(m) => {
                m.router.stored_bytes() as u64
                    + opt(&m.selection_bias)
                    + m.shared.as_ref().map_or(0, mlp)
                    + m.shared_gate
                        .as_ref()
                        .map_or(0, |g| g.stored_bytes() as u64)
            }
        };
    }
    total
}

/// Weight bytes one decode token reads: every dense weight once (of the
/// embedding table, one row, unless the output head shares it), plus
/// `top_k` routed experts per MoE layer at that layer's mean expert size
/// as stored. Divided into a measured memory bandwidth, this is the
/// roofline of a decode whose weights are all in RAM.
pub fn decode_bytes_per_token(w: &DenseWeights, layout: &ExpertLayout) -> u64 {
    let tied = std::ptr::eq(
        w.lm_head.data().as_slice().as_ptr(),
        w.embed.data().as_slice().as_ptr(),
    );
    let mut dense = dense_bytes(w);
    if !tied {
        let table = w.embed.stored_bytes() as u64;
        dense = dense - table + table / w.embed.rows.max(1) as u64;
    }
    let mut experts = 0u64;
    for base in layout.base.iter().flatten() {
        let records = &layout.records[*base..*base + layout.experts_per_layer];
        let total: u64 = records.iter().map(|r| r.location.stored_bytes()).sum();
        experts += total * layout.top_k as u64 / layout.experts_per_layer.max(1) as u64;
    }
    dense + experts
}

/// What the planner is told.
#[derive(Clone, Debug)]
pub struct PlanRequest<'a> {
    pub layout: &'a ExpertLayout,
    pub footprint: Footprint,
    pub memory: MemoryLimits,
    /// `--ram-budget` (None: automatic).
    pub ram_budget: Option<u64>,
    /// `--pin-budget` (None: [`DEFAULT_PIN_SHARE`] of the RAM budget when a
    /// usage history exists, else nothing).
    pub pin_budget: Option<u64>,
    /// The usage history, when one exists with data.
    pub usage: Option<&'a UsageHistory>,
    /// Reads in flight at most (sizes the staging area).
    pub queue_depth: usize,
    /// Extra staging slots per class for experts read ahead (0: no
    /// prefetch).
    pub prefetch_slots: usize,
}

/// Where the budget came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetSource {
    /// `--ram-budget`.
    User,
    /// Usable memory minus dense weights, KV reserve, staging and margin.
    Auto,
    /// Usable memory unknown: nothing cached.
    Unknown,
}

/// The placement of one size class.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClassPlan {
    pub slot_bytes: u64,
    /// Routed experts of this size.
    pub experts: usize,
    pub pinned_slots: usize,
    pub cache_slots: usize,
    /// Outside the budget.
    pub staging_slots: usize,
    /// Of the staging slots, those added for prefetch.
    pub prefetch_slots: usize,
    pub layers: Vec<usize>,
}

impl ClassPlan {
    /// Slots of the class's arena.
    pub fn arena_slots(&self) -> usize {
        self.pinned_slots + self.cache_slots + self.staging_slots
    }
}

/// Residency of one MoE layer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerPlan {
    pub layer: usize,
    pub experts: usize,
    pub pinned: usize,
    /// Experts expected in RAM at a time (pinned + expected cache
    /// occupancy): "how many experts of this layer fit".
    pub expected_resident: f64,
}

/// What a decode token is expected to cost at this placement.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Expectation {
    /// `usage_history` or `uniform_routing`.
    pub basis: String,
    /// Human explanation of the basis.
    pub note: String,
    /// Expert selections per token (all layers).
    pub selections_per_token: f64,
    /// Of which expected to be in RAM.
    pub hit_rate: f64,
    /// Expected aligned bytes read from disk per decode token.
    pub bytes_read_per_token: f64,
    /// The same if nothing were cached (every selection read).
    pub cold_bytes_per_token: f64,
}

/// The placement of everything.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub memory: MemoryLimits,
    pub usable_bytes: Option<u64>,
    pub dense_bytes: u64,
    pub kv_reserve_bytes: u64,
    pub kv_reserve_positions: usize,
    pub safety_margin_bytes: u64,
    pub ram_budget_bytes: u64,
    pub ram_budget_source: BudgetSource,
    pub pin_budget_bytes: u64,
    pub pinned_bytes: u64,
    pub cache_bytes: u64,
    /// Outside the budget.
    pub staging_bytes: u64,
    /// Every routed expert in its slot size (what "everything cached" costs).
    pub all_experts_bytes: u64,
    pub routed_experts: usize,
    pub classes: Vec<ClassPlan>,
    pub layers: Vec<LayerPlan>,
    /// (layer, expert) of the experts to pin, hottest first.
    pub pinned: Vec<(usize, usize)>,
    pub queue_depth: usize,
    pub expected: Expectation,
    pub warnings: Vec<String>,
}

impl Plan {
    /// Whether every routed expert has a slot of its own (pinned or
    /// cached), so all can be held in RAM at once.
    pub fn holds_every_expert(&self) -> bool {
        !self.classes.is_empty()
            && self
                .classes
                .iter()
                .all(|c| c.pinned_slots + c.cache_slots >= c.experts)
    }

    /// Places everything; pure (no I/O).
    pub fn compute(req: &PlanRequest<'_>) -> Plan {
        let layout = req.layout;
        let mut warnings = Vec::new();
        let kv_reserve = req.footprint.kv_reserve_bytes();
        let usable = req.memory.usable();
        let margin = usable.map_or(0, safety_margin);
        let rates = selection_rates(layout, req.usage);
        let have_history = rates.from_history;

        // Staging first: it does not depend on the budget except when the
        // budget caches everything (then it is not needed).
        let queue_depth = req.queue_depth.max(1);
        let staging_per_class = queue_depth + req.prefetch_slots;
        let staging_bytes_max: u64 = layout
            .classes
            .iter()
            .map(|c| c.slot_bytes * staging_per_class.min(c.records) as u64)
            .sum();

        let (ram_budget, source) = match (req.ram_budget, usable) {
            (Some(b), _) => (b, BudgetSource::User),
            (None, Some(u)) => (
                u.saturating_sub(req.footprint.dense_bytes)
                    .saturating_sub(kv_reserve)
                    .saturating_sub(staging_bytes_max)
                    .saturating_sub(margin),
                BudgetSource::Auto,
            ),
            (None, None) => {
                warnings.push(
                    "usable memory unknown (no /proc/meminfo, no cgroup limit): caching no \
                     experts; pass --ram-budget"
                        .into(),
                );
                (0, BudgetSource::Unknown)
            }
        };
        if let (Some(u), BudgetSource::User) = (usable, source) {
            let need = ram_budget
                .saturating_add(req.footprint.dense_bytes)
                .saturating_add(kv_reserve)
                .saturating_add(staging_bytes_max);
            if need > u {
                warnings.push(format!(
                    "--ram-budget {} plus dense weights, KV reserve and staging ({}) exceeds the \
                     usable memory ({})",
                    ByteSize(ram_budget),
                    ByteSize(need),
                    ByteSize(u)
                ));
            }
        }
        let pin_budget = req
            .pin_budget
            .unwrap_or(if have_history {
                (ram_budget as f64 * DEFAULT_PIN_SHARE) as u64
            } else {
                0
            })
            .min(ram_budget);
        if req.pin_budget.is_some_and(|p| p > ram_budget) {
            warnings.push(format!(
                "--pin-budget capped at the RAM budget ({})",
                ByteSize(ram_budget)
            ));
        }

        // Pin the hottest experts (history only: without one, nothing is
        // known to be hot).
        let mut pinned_entry = vec![false; layout.len()];
        let mut pinned = Vec::new();
        let mut pinned_bytes = 0u64;
        let mut class_pinned = vec![0usize; layout.classes.len()];
        if have_history && pin_budget > 0 {
            let mut order: Vec<usize> = (0..layout.len()).filter(|&e| rates.q[e] > 0.0).collect();
            order.sort_by(|&a, &b| rates.q[b].total_cmp(&rates.q[a]).then(a.cmp(&b)));
            for e in order {
                let r = &layout.records[e];
                let bytes = layout.classes[r.class].slot_bytes;
                if pinned_bytes + bytes > pin_budget {
                    continue;
                }
                pinned_bytes += bytes;
                pinned_entry[e] = true;
                class_pinned[r.class] += 1;
                pinned.push((r.layer, r.expert));
            }
        }

        // Cache slots per class, in proportion to the bytes each class is
        // expected to be asked for, then leftovers to whichever class fits.
        let left = ram_budget - pinned_bytes;
        let nclass = layout.classes.len();
        let mut unpinned = vec![0usize; nclass];
        let mut demand = vec![0f64; nclass];
        for (e, r) in layout.records.iter().enumerate() {
            if !pinned_entry[e] {
                unpinned[r.class] += 1;
                demand[r.class] += rates.q[e] * layout.classes[r.class].slot_bytes as f64;
            }
        }
        let total_demand: f64 = demand.iter().sum();
        let mut cache = vec![0usize; nclass];
        let mut spent = 0u64;
        for c in 0..nclass {
            let slot = layout.classes[c].slot_bytes;
            let share = if total_demand > 0.0 {
                demand[c] / total_demand
            } else {
                0.0
            };
            let slots = ((left as f64 * share) / slot as f64).floor() as usize;
            cache[c] = slots.min(unpinned[c]);
            spent += cache[c] as u64 * slot;
        }
        loop {
            let mut grew = false;
            for c in 0..nclass {
                let slot = layout.classes[c].slot_bytes;
                if cache[c] < unpinned[c] && spent + slot <= left {
                    cache[c] += 1;
                    spent += slot;
                    grew = true;
                }
            }
            if !grew {
                break;
            }
        }

        let classes: Vec<ClassPlan> = layout
            .classes
            .iter()
            .enumerate()
            .map(|(c, class)| {
                let uncached = unpinned[c] - cache[c];
                let staging = staging_per_class.min(uncached);
                ClassPlan {
                    slot_bytes: class.slot_bytes,
                    experts: class.records,
                    pinned_slots: class_pinned[c],
                    cache_slots: cache[c],
                    staging_slots: staging,
                    prefetch_slots: staging.saturating_sub(queue_depth),
                    layers: class.layers.clone(),
                }
            })
            .collect();
        let cache_bytes: u64 = classes
            .iter()
            .map(|c| c.cache_slots as u64 * c.slot_bytes)
            .sum();
        let staging_bytes: u64 = classes
            .iter()
            .map(|c| c.staging_slots as u64 * c.slot_bytes)
            .sum();
        debug_assert!(pinned_bytes + cache_bytes <= ram_budget);

        // Expected hits (Che's approximation per class).
        let mut hit = vec![0f64; layout.len()];
        for (c, plan) in classes.iter().enumerate() {
            let members: Vec<usize> = (0..layout.len())
                .filter(|&e| layout.records[e].class == c && !pinned_entry[e])
                .collect();
            let q: Vec<f64> = members.iter().map(|&e| rates.q[e]).collect();
            for (&e, h) in members
                .iter()
                .zip(che_hit_rates(&q, plan.cache_slots as f64))
            {
                hit[e] = h;
            }
        }
        for (e, p) in pinned_entry.iter().enumerate() {
            if *p {
                hit[e] = 1.0;
            }
        }
        let mut selections = 0.0;
        let mut hits = 0.0;
        let mut bytes = 0.0;
        let mut cold = 0.0;
        for (e, r) in layout.records.iter().enumerate() {
            let q = rates.q[e];
            selections += q;
            hits += q * hit[e];
            bytes += q * (1.0 - hit[e]) * r.read_bytes as f64;
            cold += q * r.read_bytes as f64;
        }
        let layers: Vec<LayerPlan> = layout
            .moe_layers()
            .map(|layer| {
                let range = (0..layout.experts_per_layer).filter_map(|x| layout.entry(layer, x));
                let (mut pinned, mut resident) = (0, 0.0);
                for e in range {
                    pinned += usize::from(pinned_entry[e]);
                    resident += hit[e];
                }
                LayerPlan {
                    layer,
                    experts: layout.experts_per_layer,
                    pinned,
                    expected_resident: resident,
                }
            })
            .collect();
        let (basis, note) = if have_history {
            (
                "usage_history",
                format!(
                    "selection rates from the usage history ({} layer steps recorded); cache \
                     hits by Che's approximation of LRU",
                    req.usage.map_or(0, UsageHistory::total_steps)
                ),
            )
        } else {
            (
                "uniform_routing",
                format!(
                    "no usage history: uniform routing assumed (each expert selected with \
                     probability top_k/experts = {}/{}), so the hit rate is the cached fraction",
                    layout.top_k, layout.experts_per_layer
                ),
            )
        };
        Plan {
            memory: req.memory.clone(),
            usable_bytes: usable,
            dense_bytes: req.footprint.dense_bytes,
            kv_reserve_bytes: kv_reserve,
            kv_reserve_positions: req.footprint.kv_reserve_positions,
            safety_margin_bytes: margin,
            ram_budget_bytes: ram_budget,
            ram_budget_source: source,
            pin_budget_bytes: pin_budget,
            pinned_bytes,
            cache_bytes,
            staging_bytes,
            all_experts_bytes: layout
                .records
                .iter()
                .map(|r| layout.classes[r.class].slot_bytes)
                .sum(),
            routed_experts: layout.len(),
            classes,
            layers,
            pinned,
            queue_depth,
            expected: Expectation {
                basis: basis.into(),
                note,
                selections_per_token: selections,
                hit_rate: if selections > 0.0 {
                    hits / selections
                } else {
                    1.0
                },
                bytes_read_per_token: bytes,
                cold_bytes_per_token: cold,
            },
            warnings,
        }
    }

    /// Expert bytes committed against the budget (pinned + cache).
    pub fn committed_bytes(&self) -> u64 {
        self.pinned_bytes + self.cache_bytes
    }

    /// Cache slots over all classes.
    pub fn cache_slots(&self) -> usize {
        self.classes.iter().map(|c| c.cache_slots).sum()
    }

    /// A human-readable rendering (`colibri plan`).
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let b = ByteSize;
        let opt = |v: Option<u64>| v.map_or("unknown".to_string(), |v| ByteSize(v).to_string());
        let _ = writeln!(s, "memory");
        let _ = writeln!(
            s,
            "  MemAvailable {}, cgroup limit {}{} -> usable {}",
            opt(self.memory.mem_available),
            opt(self.memory.cgroup_limit),
            self.memory
                .cgroup_file
                .as_ref()
                .map_or(String::new(), |f| format!(" ({})", f.display())),
            opt(self.usable_bytes)
        );
        let _ = writeln!(s, "outside the expert budget");
        let _ = writeln!(
            s,
            "  dense weights      {:>12}",
            b(self.dense_bytes).to_string()
        );
        let _ = writeln!(
            s,
            "  KV cache reserve   {:>12}  ({} positions, one sequence)",
            b(self.kv_reserve_bytes).to_string(),
            self.kv_reserve_positions
        );
        let prefetch_slots: usize = self.classes.iter().map(|c| c.prefetch_slots).sum();
        let _ = writeln!(
            s,
            "  staging slots      {:>12}  ({} slots: reads in flight and experts in use that \
             the cache does not keep; sized from queue depth {}{})",
            b(self.staging_bytes).to_string(),
            self.classes.iter().map(|c| c.staging_slots).sum::<usize>(),
            self.queue_depth,
            if prefetch_slots > 0 {
                format!(", {prefetch_slots} of them for experts read ahead")
            } else {
                String::new()
            }
        );
        let _ = writeln!(
            s,
            "  safety margin      {:>12}",
            b(self.safety_margin_bytes).to_string()
        );
        let _ = writeln!(
            s,
            "expert budget {} ({})",
            b(self.ram_budget_bytes),
            match self.ram_budget_source {
                BudgetSource::User => "--ram-budget",
                BudgetSource::Auto => "usable memory minus everything above",
                BudgetSource::Unknown => "usable memory unknown",
            }
        );
        let _ = writeln!(
            s,
            "  pinned experts     {:>12}  ({} experts, pin budget {})",
            b(self.pinned_bytes).to_string(),
            self.pinned.len(),
            b(self.pin_budget_bytes)
        );
        let _ = writeln!(
            s,
            "  cache slots        {:>12}  ({} slots)",
            b(self.cache_bytes).to_string(),
            self.cache_slots()
        );
        let _ = writeln!(
            s,
            "  committed          {:>12}  of {} (all {} routed experts would take {})",
            b(self.committed_bytes()).to_string(),
            b(self.ram_budget_bytes),
            self.routed_experts,
            b(self.all_experts_bytes)
        );
        let _ = writeln!(s, "slot size classes");
        for c in &self.classes {
            let _ = writeln!(
                s,
                "  {:>12} x {:>6} experts: {} pinned, {} cache, {} staging (layers {})",
                b(c.slot_bytes).to_string(),
                c.experts,
                c.pinned_slots,
                c.cache_slots,
                c.staging_slots,
                compact_ranges(&c.layers)
            );
        }
        let _ = writeln!(s, "experts per MoE layer expected in RAM");
        for l in &self.layers {
            let _ = writeln!(
                s,
                "  layer {:>3}: {:>7.1} of {} ({} pinned)",
                l.layer, l.expected_resident, l.experts, l.pinned
            );
        }
        let e = &self.expected;
        let _ = writeln!(s, "expected per decode token");
        let _ = writeln!(
            s,
            "  {:.1} expert selections, hit rate {:.1}%, {} read from disk (cold: {})",
            e.selections_per_token,
            e.hit_rate * 100.0,
            b(e.bytes_read_per_token as u64),
            b(e.cold_bytes_per_token as u64)
        );
        let _ = writeln!(s, "  {}", e.note);
        for w in &self.warnings {
            let _ = writeln!(s, "warning: {w}");
        }
        s
    }
}

/// "1-3, 5, 7-9".
fn compact_ranges(v: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}

struct Rates {
    q: Vec<f64>,
    from_history: bool,
}

/// Per-step selection probability of every entry.
fn selection_rates(layout: &ExpertLayout, usage: Option<&UsageHistory>) -> Rates {
    let uniform = if layout.experts_per_layer > 0 {
        layout.top_k as f64 / layout.experts_per_layer as f64
    } else {
        0.0
    };
    let usable = usage.filter(|u| u.total_steps() > 0);
    let q = layout
        .records
        .iter()
        .map(|r| {
            usable
                .and_then(|u| u.rate(r.layer, r.expert))
                .unwrap_or(uniform)
        })
        .collect();
    Rates {
        q,
        from_history: usable.is_some(),
    }
}

/// Che's approximation: per-entry hit probability of an LRU cache of
/// `capacity` entries under independent requests with per-step rates `q`.
pub fn che_hit_rates(q: &[f64], capacity: f64) -> Vec<f64> {
    let active = q.iter().filter(|&&x| x > 0.0).count() as f64;
    if capacity <= 0.0 || active == 0.0 {
        return vec![0.0; q.len()];
    }
    if capacity >= active {
        return q.iter().map(|&x| if x > 0.0 { 1.0 } else { 0.0 }).collect();
    }
    let occupancy = |t: f64| q.iter().map(|&x| 1.0 - (-x * t).exp()).sum::<f64>();
    let mut hi = 1.0;
    while occupancy(hi) < capacity && hi < 1e30 {
        hi *= 2.0;
    }
    let mut lo = 0.0;
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if occupancy(mid) < capacity {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let t = 0.5 * (lo + hi);
    q.iter().map(|&x| 1.0 - (-x * t).exp()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn che_is_exact_for_uniform_rates_and_favours_hot_experts() {
        let q = vec![0.25; 8];
        for (c, want) in [(0.0, 0.0), (2.0, 0.25), (4.0, 0.5), (8.0, 1.0), (9.0, 1.0)] {
            for h in che_hit_rates(&q, c) {
                assert!((h - want).abs() < 1e-9, "{c}: {h}");
            }
        }
        let h = che_hit_rates(&[0.9, 0.5, 0.1, 0.01], 2.0);
        assert!(h[0] > h[1] && h[1] > h[2] && h[2] > h[3]);
        assert!((h.iter().sum::<f64>() - 2.0).abs() < 1e-6);
    }

    #[test]
    fn compact_ranges_reads_well() {
        assert_eq!(compact_ranges(&[1, 2, 3, 5, 7, 8]), "1-3, 5, 7-8");
        assert_eq!(compact_ranges(&[]), "");
    }

    #[test]
    fn margin_is_clamped() {
        assert_eq!(safety_margin(1 << 40), 2 << 30);
        assert_eq!(safety_margin(1 << 30), 256 << 20);
        assert_eq!(safety_margin(100 << 20), 100 << 20);
        assert_eq!(safety_margin(16 << 30), (16u64 << 30) / 20);
    }
}
