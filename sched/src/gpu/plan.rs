//! The VRAM planner: from what the device has free and what the user
//! allows (`--vram-budget`), decide what lives in device memory, what
//! streams from pinned host memory, and how many expert slots there are.
//! Pure (no CUDA), so `colibri plan` and the tests run it anywhere.
//!
//! Device memory has two parts:
//!
//! * the **working set**, outside the budget and always allocated: scratch
//!   activations for the largest pass, rotary tables, expert-table
//!   metadata, the **staging ring** (a few expert slots per size class that
//!   misses are copied into), and, when any dense block streams, two
//!   **stream buffers** of the largest streamed block;
//! * the **budget**, placed in this order: dense blocks (each layer's
//!   attention, norms, router and shared experts, and the output head:
//!   largest first, so the stream buffers stay small), the KV cache
//!   reserve, then **expert cache slots** per size class.
//!
//! What does not fit is not refused: a dense block that misses the budget
//! streams per layer from pinned RAM, a KV cache beyond its reserve lives
//! in mapped pinned RAM, an expert that is not cached goes through the
//! staging ring. Only when the device cannot hold even the working set is
//! the GPU tier impossible (the CPU tier then runs the model).
//!
//! Never over-committed: the budget (given or automatic) is capped so that
//! working set + budget + a reserve for the driver and other processes fit
//! in the memory free when the plan is made.

use serde::Serialize;

use crate::tier::ByteSize;

/// Device memory left untouched: 5% of the device, at least 256 MiB and at
/// most 2 GiB (the driver, other processes, fragmentation).
pub fn vram_reserve(total: u64) -> u64 {
    (total / 20).clamp(256 << 20, 2 << 30)
}

/// Staging slots per size class (copies in flight while earlier experts
/// compute), at most the class's experts.
pub const DEFAULT_RING_SLOTS: usize = 8;

/// Share of the expert cache pinned with the usage history's hottest
/// experts (as the RAM tier does).
pub const VRAM_PIN_SHARE: f64 = 0.25;

/// One size class of routed experts as the device stores them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExpertClassRequest {
    pub slot_bytes: u64,
    pub experts: usize,
}

/// What the planner is told.
#[derive(Clone, Debug)]
pub struct VramRequest {
    pub device: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// `--vram-budget`; `None`: what is free minus the working set and the
    /// reserve.
    pub budget: Option<u64>,
    /// Dense blocks: one per layer, then the output head (last).
    pub dense_blocks: Vec<u64>,
    pub kv_bytes_per_position: u64,
    pub kv_reserve_positions: usize,
    pub expert_classes: Vec<ExpertClassRequest>,
    pub ring_slots: usize,
    /// Experts of the next MoE layer copied ahead per layer at most.
    pub ahead: usize,
    /// The RAM tier holds every routed expert and this device may read
    /// those without a VRAM slot in place (`GpuOptions::in_place`).
    pub in_place: bool,
    /// Scratch activations, rotary tables and metadata.
    pub scratch_bytes: u64,
    /// Experts the usage history would pin (per class), hottest first
    /// (how many, not which).
    pub pin_candidates: Vec<usize>,
    /// With several devices: the layers this one holds (the other dense
    /// blocks are not placed here). `None`: the whole model.
    pub share: Option<LayerShare>,
}

/// The layers one device holds when several share a model (`--devices`):
/// layers `start..end` of `layers`, and the output head on the last one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LayerShare {
    pub device_index: usize,
    pub devices: usize,
    pub start: usize,
    pub end: usize,
    pub layers: usize,
    pub head: bool,
}

impl LayerShare {
    /// Whether dense block `block` (layers, then the head) lives here.
    pub fn holds_block(&self, block: usize) -> bool {
        if block < self.layers {
            (self.start..self.end).contains(&block)
        } else {
            self.head
        }
    }
}

/// Splits `layer_bytes` (each layer's weights: dense block and routed
/// experts) into `devices` consecutive ranges of about equal bytes, the
/// output head (`head_bytes`) counted on the last: every layer's experts
/// are equally likely to be routed, so bytes are the expected load. Each
/// range has at least one layer; `devices` is capped at the layer count.
pub fn split_layers(
    layer_bytes: &[u64],
    head_bytes: u64,
    devices: usize,
) -> Vec<std::ops::Range<usize>> {
    let n = layer_bytes.len();
    let d = devices.clamp(1, n.max(1));
    let total: u128 = layer_bytes.iter().map(|&b| b as u128).sum::<u128>() + head_bytes as u128;
    let mut prefix = Vec::with_capacity(n + 1);
    prefix.push(0u128);
    for &b in layer_bytes {
        prefix.push(prefix[prefix.len() - 1] + b as u128);
    }
    let mut cuts = vec![0usize];
    for k in 1..d {
        let target = total * k as u128 / d as u128;
        // The cut whose prefix is nearest the target, leaving at least one
        // layer to every range before and after it.
        let lo = cuts[k - 1] + 1;
        let hi = n - (d - k);
        let best = (lo..=hi)
            .min_by_key(|&i| prefix[i].abs_diff(target))
            .unwrap_or(lo);
        cuts.push(best);
    }
    cuts.push(n);
    cuts.windows(2).map(|w| w[0]..w[1]).collect()
}

/// Where the budget came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VramBudgetSource {
    User,
    /// The user's budget did not fit and was capped.
    UserCapped,
    Auto,
}

/// The placement of one expert size class.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VramClassPlan {
    pub slot_bytes: u64,
    pub experts: usize,
    pub cache_slots: usize,
    pub pinned_slots: usize,
    pub ring_slots: usize,
}

/// The placement.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct VramPlan {
    pub device: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub reserve_bytes: u64,
    pub budget_bytes: u64,
    pub budget_source: VramBudgetSource,
    /// Per dense block (layers, then the head): in VRAM or streamed.
    pub dense_resident: Vec<bool>,
    pub dense_resident_bytes: u64,
    pub dense_streamed_bytes: u64,
    /// Two buffers of the largest streamed block (working set).
    pub stream_buffer_bytes: u64,
    pub kv_bytes_per_position: u64,
    /// KV cache bytes granted in VRAM; beyond them, mapped pinned RAM.
    pub kv_vram_bytes: u64,
    pub kv_reserve_positions: usize,
    pub classes: Vec<VramClassPlan>,
    pub cache_bytes: u64,
    pub ring_bytes: u64,
    pub scratch_bytes: u64,
    /// Working set: scratch + ring + stream buffers.
    pub working_set_bytes: u64,
    /// With several devices: the layers this device holds.
    pub share: Option<LayerShare>,
    /// Experts of the next MoE layer copied ahead per layer at most.
    pub ahead: usize,
    /// Experts without a VRAM slot are read in place from pinned RAM
    /// (when not every one is cached).
    pub in_place: bool,
    pub warnings: Vec<String>,
}

impl VramPlan {
    /// Places everything; `Err` when the device cannot hold the working set.
    pub fn compute(req: &VramRequest) -> Result<VramPlan, String> {
        let mut warnings = Vec::new();
        let reserve = vram_reserve(req.total_bytes);
        let available = req.free_bytes.saturating_sub(reserve);
        let ring: Vec<usize> = req
            .expert_classes
            .iter()
            .map(|c| req.ring_slots.max(1).min(c.experts.max(1)))
            .collect();
        let ring_bytes: u64 = req
            .expert_classes
            .iter()
            .zip(&ring)
            .map(|(c, &r)| c.slot_bytes * r as u64)
            .sum();
        let fixed = req.scratch_bytes + ring_bytes;
        // Blocks another device holds take nothing here.
        let dense_blocks: Vec<u64> = req
            .dense_blocks
            .iter()
            .enumerate()
            .map(|(i, &b)| match &req.share {
                Some(s) if !s.holds_block(i) => 0,
                _ => b,
            })
            .collect();
        let largest_block = dense_blocks.iter().copied().max().unwrap_or(0);
        if fixed > available {
            return Err(format!(
                "{} has {} free ({} kept in reserve); the GPU tier's working set (scratch {}, \
                 staging ring {}) needs {}",
                req.device,
                ByteSize(req.free_bytes),
                ByteSize(reserve),
                ByteSize(req.scratch_bytes),
                ByteSize(ring_bytes),
                ByteSize(fixed)
            ));
        }
        // The most the budget can be if nothing streams, and if something
        // does (then the stream buffers come out of what is free too).
        let room_all = available - fixed;
        let (mut budget, mut source) = match req.budget {
            Some(b) => (b, VramBudgetSource::User),
            None => (room_all, VramBudgetSource::Auto),
        };
        if budget > room_all {
            warnings.push(format!(
                "--vram-budget {} is more than {} can give after its working set and reserve; \
                 capped at {}",
                ByteSize(budget),
                req.device,
                ByteSize(room_all)
            ));
            budget = room_all;
            source = VramBudgetSource::UserCapped;
        }

        // Dense blocks, largest first, while they fit the budget and leave
        // room for the stream buffers the rest would need.
        let place = |budget: u64| -> (Vec<bool>, u64, u64) {
            let mut order: Vec<usize> = (0..dense_blocks.len()).collect();
            order.sort_by(|&a, &b| dense_blocks[b].cmp(&dense_blocks[a]).then(a.cmp(&b)));
            let mut resident = vec![false; dense_blocks.len()];
            let mut used = 0u64;
            for i in order {
                let b = dense_blocks[i];
                if used + b <= budget {
                    used += b;
                    resident[i] = true;
                }
            }
            let streamed_max = dense_blocks
                .iter()
                .zip(&resident)
                .filter(|(_, r)| !**r)
                .map(|(b, _)| *b)
                .max()
                .unwrap_or(0);
            (resident, used, 2 * streamed_max)
        };
        let (mut resident, mut dense_used, mut stream_buf) = place(budget);
        if stream_buf > 0 && budget + stream_buf > room_all {
            // Something streams: its buffers come out of the free memory,
            // so the budget shrinks until both fit.
            let shrunk = room_all.saturating_sub(2 * largest_block).min(budget);
            if shrunk < budget {
                if source != VramBudgetSource::Auto {
                    warnings.push(format!(
                        "--vram-budget lowered to {} to leave room for two dense stream buffers \
                         ({})",
                        ByteSize(shrunk),
                        ByteSize(2 * largest_block)
                    ));
                    source = VramBudgetSource::UserCapped;
                }
                budget = shrunk;
                (resident, dense_used, stream_buf) = place(budget);
            }
            if fixed + stream_buf > available {
                return Err(format!(
                    "{} has {} free ({} kept in reserve); the GPU tier needs {} for its working \
                     set and two dense stream buffers",
                    req.device,
                    ByteSize(req.free_bytes),
                    ByteSize(reserve),
                    ByteSize(fixed + stream_buf)
                ));
            }
        }
        let dense_total: u64 = dense_blocks.iter().sum();

        let kv_reserve = req
            .kv_bytes_per_position
            .saturating_mul(req.kv_reserve_positions as u64);
        let kv_vram = kv_reserve.min(budget - dense_used);
        let mut left = budget - dense_used - kv_vram;

        // Expert cache slots, in proportion to each class's bytes, then
        // leftovers to whichever class still fits.
        let total_demand: u64 = req
            .expert_classes
            .iter()
            .map(|c| c.slot_bytes * c.experts as u64)
            .sum();
        let mut cache: Vec<usize> = req
            .expert_classes
            .iter()
            .map(|c| {
                if total_demand == 0 || c.slot_bytes == 0 {
                    return 0;
                }
                let share = (c.slot_bytes * c.experts as u64) as f64 / total_demand as f64;
                (((left as f64 * share) / c.slot_bytes as f64).floor() as usize).min(c.experts)
            })
            .collect();
        let spent: u64 = req
            .expert_classes
            .iter()
            .zip(&cache)
            .map(|(c, &n)| c.slot_bytes * n as u64)
            .sum();
        left -= spent.min(left);
        loop {
            let mut grew = false;
            for (c, n) in req.expert_classes.iter().zip(cache.iter_mut()) {
                if *n < c.experts && c.slot_bytes > 0 && c.slot_bytes <= left {
                    *n += 1;
                    left -= c.slot_bytes;
                    grew = true;
                }
            }
            if !grew {
                break;
            }
        }
        let classes: Vec<VramClassPlan> = req
            .expert_classes
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let pins = req.pin_candidates.get(i).copied().unwrap_or(0);
                let pin_cap = (cache[i] as f64 * VRAM_PIN_SHARE).floor() as usize;
                VramClassPlan {
                    slot_bytes: c.slot_bytes,
                    experts: c.experts,
                    cache_slots: cache[i],
                    pinned_slots: pins.min(pin_cap),
                    ring_slots: ring[i],
                }
            })
            .collect();
        let cache_bytes = classes
            .iter()
            .map(|c| c.slot_bytes * c.cache_slots as u64)
            .sum::<u64>();
        debug_assert!(dense_used + kv_vram + cache_bytes <= budget);
        debug_assert!(fixed + stream_buf + budget <= available);
        Ok(VramPlan {
            device: req.device.clone(),
            total_bytes: req.total_bytes,
            free_bytes: req.free_bytes,
            reserve_bytes: reserve,
            budget_bytes: budget,
            budget_source: source,
            dense_resident: resident,
            dense_resident_bytes: dense_used,
            dense_streamed_bytes: dense_total - dense_used,
            stream_buffer_bytes: stream_buf,
            kv_bytes_per_position: req.kv_bytes_per_position,
            kv_vram_bytes: kv_vram,
            kv_reserve_positions: req.kv_reserve_positions,
            classes,
            cache_bytes,
            ring_bytes,
            scratch_bytes: req.scratch_bytes,
            working_set_bytes: fixed + stream_buf,
            share: req.share.clone(),
            ahead: req.ahead,
            in_place: req.in_place,
            warnings,
        })
    }

    /// Whether the expert cache has a slot for every routed expert (the
    /// GPU tier then loads them all at start and routes on the device;
    /// `ExpertCache::preload_all` asks the same of the real cache).
    pub fn every_expert_cached(&self) -> bool {
        !self.classes.is_empty() && self.classes.iter().all(|c| c.cache_slots >= c.experts)
    }

    /// Device bytes this plan allocates at most (working set + budget in
    /// use): never more than what was free minus the reserve.
    pub fn committed_bytes(&self) -> u64 {
        self.working_set_bytes + self.dense_resident_bytes + self.kv_vram_bytes + self.cache_bytes
    }

    /// Whether dense block `block` (layers, then the head) is this
    /// device's (always, with one device).
    pub fn holds_block(&self, block: usize) -> bool {
        self.share.as_ref().is_none_or(|sh| sh.holds_block(block))
    }

    /// Dense blocks this device holds, and how many of them are in VRAM.
    pub fn held_blocks(&self) -> (usize, usize) {
        let held = (0..self.dense_resident.len()).filter(|&b| self.holds_block(b));
        let (mut all, mut resident) = (0, 0);
        for b in held {
            all += 1;
            resident += usize::from(self.dense_resident[b]);
        }
        (all, resident)
    }

    /// Expert cache slots over all classes.
    pub fn cache_slots(&self) -> usize {
        self.classes.iter().map(|c| c.cache_slots).sum()
    }

    /// For humans (`colibri plan`).
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let b = ByteSize;
        let mut s = String::new();
        let (blocks, resident) = self.held_blocks();
        let streamed = blocks - resident;
        let _ = writeln!(s, "GPU tier: {}", self.device);
        if let Some(sh) = &self.share {
            let _ = writeln!(
                s,
                "  device {} of {}: layers {}..{} of {}{}",
                sh.device_index + 1,
                sh.devices,
                sh.start,
                sh.end,
                sh.layers,
                if sh.head { " and the output head" } else { "" }
            );
        }
        let _ = writeln!(
            s,
            "  device memory {} total, {} free, {} kept in reserve",
            b(self.total_bytes),
            b(self.free_bytes),
            b(self.reserve_bytes)
        );
        let _ = writeln!(s, "  working set (outside the VRAM budget)");
        let _ = writeln!(
            s,
            "    scratch            {:>12}  (activations of the largest pass, rotary tables, \
             expert tables)",
            b(self.scratch_bytes).to_string()
        );
        let _ = writeln!(
            s,
            "    staging ring       {:>12}  ({} slots: misses are copied host-to-device here \
             while earlier experts compute)",
            b(self.ring_bytes).to_string(),
            self.classes.iter().map(|c| c.ring_slots).sum::<usize>()
        );
        let _ = writeln!(
            s,
            "    stream buffers     {:>12}  (two of the largest streamed dense block)",
            b(self.stream_buffer_bytes).to_string()
        );
        let _ = writeln!(
            s,
            "  VRAM budget {} ({})",
            b(self.budget_bytes),
            match self.budget_source {
                VramBudgetSource::User => "--vram-budget",
                VramBudgetSource::UserCapped => "--vram-budget, capped to fit",
                VramBudgetSource::Auto => "free memory minus the working set and the reserve",
            }
        );
        let _ = writeln!(
            s,
            "    dense weights      {:>12}  ({} of {} blocks in VRAM; {} streamed per step from \
             pinned RAM: {})",
            b(self.dense_resident_bytes).to_string(),
            blocks - streamed,
            blocks,
            streamed,
            b(self.dense_streamed_bytes)
        );
        let _ = writeln!(
            s,
            "    KV cache           {:>12}  ({} positions; beyond that, mapped pinned RAM)",
            b(self.kv_vram_bytes).to_string(),
            self.kv_vram_bytes
                .checked_div(self.kv_bytes_per_position)
                .unwrap_or(0)
        );
        let _ = writeln!(
            s,
            "    expert cache       {:>12}  ({} slots)",
            b(self.cache_bytes).to_string(),
            self.cache_slots()
        );
        for c in &self.classes {
            let _ = writeln!(
                s,
                "      {:>12} x {:>6} experts: {} cache ({} pinned), {} staging",
                b(c.slot_bytes).to_string(),
                c.experts,
                c.cache_slots,
                c.pinned_slots,
                c.ring_slots
            );
        }
        let routing = if self.every_expert_cached() {
            "every routed expert is loaded at start: layers route on the device and a decode \
             step runs as one CUDA graph"
                .to_string()
        } else if self.in_place {
            format!(
                "every routed expert is loaded into pinned RAM at start; decode steps either \
                 route on the device and read experts without a VRAM slot in place (one CUDA \
                 graph per step; missed experts promoted into the cache, {} per step once it \
                 is full) or route on the host and copy them (up to {} copied ahead), whichever \
                 is measured faster",
                super::experts::PROMOTE_PER_PASS,
                self.ahead
            )
        } else if self.ahead > 0 && self.cache_slots() > 0 {
            format!(
                "routing decisions on the host from device logits; while a layer computes, up \
                 to {} experts that the next layer's router picks for its input are copied \
                 into the cache ahead",
                self.ahead
            )
        } else {
            "routing decisions on the host from device logits".to_string()
        };
        let _ = writeln!(
            s,
            "  committed {} of {} usable; embeddings stay in RAM (one row per token); {routing}",
            b(self.committed_bytes()),
            b(self.free_bytes.saturating_sub(self.reserve_bytes)),
        );
        for w in &self.warnings {
            let _ = writeln!(s, "warning: {w}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn req(budget: Option<u64>) -> VramRequest {
        VramRequest {
            device: "test GPU".into(),
            total_bytes: 24 * GIB,
            free_bytes: 23 * GIB,
            budget,
            dense_blocks: vec![100 * MIB; 8].into_iter().chain([600 * MIB]).collect(),
            kv_bytes_per_position: 64 << 10,
            kv_reserve_positions: 4096,
            expert_classes: vec![
                ExpertClassRequest {
                    slot_bytes: 9 * MIB,
                    experts: 1024,
                },
                ExpertClassRequest {
                    slot_bytes: 5 * MIB,
                    experts: 512,
                },
            ],
            ring_slots: DEFAULT_RING_SLOTS,
            ahead: 3,
            in_place: false,
            scratch_bytes: 300 * MIB,
            pin_candidates: vec![],
            share: None,
        }
    }

    fn within(p: &VramPlan) {
        assert!(
            p.dense_resident_bytes + p.kv_vram_bytes + p.cache_bytes <= p.budget_bytes,
            "{p:?}"
        );
        assert!(
            p.committed_bytes() <= p.free_bytes - p.reserve_bytes,
            "{p:?}"
        );
    }

    #[test]
    fn a_large_budget_holds_everything() {
        let p = VramPlan::compute(&req(None)).unwrap();
        within(&p);
        assert!(p.dense_resident.iter().all(|r| *r));
        assert_eq!(p.stream_buffer_bytes, 0);
        assert_eq!(p.kv_vram_bytes, (64 << 10) * 4096);
        assert_eq!(p.classes[0].cache_slots, 1024);
        assert_eq!(p.classes[1].cache_slots, 512);
        assert_eq!(p.budget_source, VramBudgetSource::Auto);
        assert!(p.every_expert_cached());
        assert!(
            p.render().contains("layers route on the device"),
            "{}",
            p.render()
        );
    }

    #[test]
    fn a_zero_budget_streams_everything_and_still_runs() {
        let p = VramPlan::compute(&req(Some(0))).unwrap();
        within(&p);
        assert!(p.dense_resident.iter().all(|r| !*r));
        assert_eq!(p.stream_buffer_bytes, 2 * 600 * MIB);
        assert_eq!(p.kv_vram_bytes, 0);
        assert_eq!(p.cache_slots(), 0);
        assert_eq!(p.classes[0].ring_slots, DEFAULT_RING_SLOTS);
        assert!(p.render().contains("0 of 9 blocks in VRAM"));
        assert!(!p.every_expert_cached());
        assert!(p.render().contains("routing decisions on the host"));
        // No cache slot: nothing can be copied ahead, and the plan says so.
        assert!(!p.render().contains("copied into the cache ahead"));
    }

    #[test]
    fn a_partial_budget_places_dense_then_kv_then_experts() {
        let p = VramPlan::compute(&req(Some(GIB))).unwrap();
        within(&p);
        // The head (600 MiB) goes first, then four 100 MiB layers.
        assert!(p.dense_resident[8]);
        assert_eq!(p.dense_resident.iter().filter(|r| **r).count(), 5);
        assert_eq!(p.stream_buffer_bytes, 200 * MIB);
        assert_eq!(p.kv_vram_bytes, GIB - 1000 * MIB);
        assert_eq!(p.cache_slots(), 0);
        let p = VramPlan::compute(&req(Some(4 * GIB))).unwrap();
        within(&p);
        assert!(p.cache_slots() > 0);
        assert!(
            p.render().contains("up to 3 experts"),
            "the plan does not say experts are copied ahead: {}",
            p.render()
        );
        // Slots go in proportion to each class's bytes.
        let c = &p.classes;
        let r0 = c[0].cache_slots as f64 / c[0].experts as f64;
        let r1 = c[1].cache_slots as f64 / c[1].experts as f64;
        assert!((r0 - r1).abs() < 0.05, "{r0} vs {r1}");
    }

    #[test]
    fn never_over_commits_the_device() {
        for budget in [None, Some(0), Some(GIB), Some(20 * GIB), Some(100 * GIB)] {
            let mut r = req(budget);
            for free in [2 * GIB, 3 * GIB, 8 * GIB, 23 * GIB] {
                r.free_bytes = free;
                if let Ok(p) = VramPlan::compute(&r) {
                    within(&p);
                    if budget.is_some_and(|b| b > p.budget_bytes) {
                        assert_eq!(p.budget_source, VramBudgetSource::UserCapped);
                        assert!(!p.warnings.is_empty());
                    }
                }
            }
        }
    }

    #[test]
    fn a_device_too_small_for_the_working_set_is_refused_with_the_numbers() {
        let mut r = req(None);
        r.free_bytes = 400 * MIB;
        let e = VramPlan::compute(&r).unwrap_err();
        assert!(e.contains("working set"), "{e}");
        assert!(e.contains("test GPU"), "{e}");
    }

    #[test]
    fn pins_take_at_most_a_share_of_the_cache() {
        let mut r = req(Some(4 * GIB));
        r.pin_candidates = vec![10_000, 0];
        let p = VramPlan::compute(&r).unwrap();
        assert_eq!(
            p.classes[0].pinned_slots,
            (p.classes[0].cache_slots as f64 * VRAM_PIN_SHARE) as usize
        );
        assert_eq!(p.classes[1].pinned_slots, 0);
    }

    #[test]
    fn layers_split_by_bytes_with_the_head_on_the_last_device() {
        // Equal layers, no head: equal halves, thirds.
        assert_eq!(split_layers(&[10; 48], 0, 2), vec![0..24, 24..48]);
        assert_eq!(split_layers(&[10; 48], 0, 3), vec![0..16, 16..32, 32..48]);
        // A head worth 8 layers pulls the cut forward.
        assert_eq!(split_layers(&[10; 48], 80, 2), vec![0..28, 28..48]);
        // Uneven layers (a dense first layer is light).
        assert_eq!(split_layers(&[1, 10, 10, 10, 10], 0, 2), vec![0..3, 3..5]);
        // Every device gets at least one layer; more devices than layers
        // are capped.
        assert_eq!(split_layers(&[1, 1, 1000], 0, 3), vec![0..1, 1..2, 2..3]);
        assert_eq!(split_layers(&[5, 5], 0, 4), vec![0..1, 1..2]);
        assert_eq!(split_layers(&[5, 5], 0, 1), vec![0..2]);
    }

    #[test]
    fn a_share_places_only_its_own_blocks() {
        let mut r = req(Some(GIB));
        r.share = Some(LayerShare {
            device_index: 0,
            devices: 2,
            start: 0,
            end: 4,
            layers: 8,
            head: false,
        });
        let p = VramPlan::compute(&r).unwrap();
        within(&p);
        // Four 100 MiB layer blocks, not the other four nor the head.
        assert_eq!(p.dense_resident_bytes, 400 * MIB);
        assert_eq!(p.dense_streamed_bytes, 0);
        assert!(p.render().contains("layers 0..4 of 8"), "{}", p.render());
        assert!(p.render().contains("4 of 4 blocks"), "{}", p.render());
        r.share = Some(LayerShare {
            device_index: 1,
            devices: 2,
            start: 4,
            end: 8,
            layers: 8,
            head: true,
        });
        r.budget = Some(500 * MIB);
        let p = VramPlan::compute(&r).unwrap();
        within(&p);
        // The 600 MiB head does not fit 500 MiB: it streams; the layers stay.
        assert_eq!(p.dense_resident_bytes, 400 * MIB);
        assert_eq!(p.dense_streamed_bytes, 600 * MIB);
        assert_eq!(p.stream_buffer_bytes, 1200 * MIB);
    }
}
