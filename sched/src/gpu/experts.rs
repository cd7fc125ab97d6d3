//! A layer's routed experts on the GPU: the VRAM expert cache, the staging
//! ring, and the grouped launches over both.
//!
//! One MoE layer for `n` rows (each choosing `k` experts):
//!
//! 1. the rows are grouped by expert (the union of the batch's choices,
//!    ascending): expert `e`'s users get consecutive **pair** rows in
//!    launch order;
//! 2. **hits** (experts in VRAM cache slots) are leased and launched first,
//!    as one chunk, while
//! 3. **misses** are asked of the expert source (the RAM tier: its reads
//!    land in pinned arenas registered with CUDA). Each arriving expert is
//!    copied host-to-device on the copy stream straight from those bytes
//!    into the next **staging ring** slot (the copy stream first waits for
//!    the kernels that last read the slot: its "consumed" event); the RAM
//!    lease is held until the copy's "filled" event has passed, then
//!    dropped. Every `ring / 2` arrivals form a chunk: the compute stream
//!    waits for the chunk's copies and launches gate, up (pointer-table
//!    matvecs over the chunk's experts, wherever their slots are), SwiGLU
//!    and down, then — where the cache has room or an idle expert to evict
//!    — **promotes** each missed expert into a cache slot by a
//!    device-to-device copy on the compute stream; the chunk's "consumed"
//!    event frees its ring slots. So copies of one chunk overlap the
//!    kernels of the previous one;
//! 4. the pair outputs are gathered back to (row, slot) order and combined
//!    in ascending expert order (`moe_combine`).
//!
//! Every expert's output rows are computed by the same kernel arithmetic
//! whatever its slot, its chunk or the arrival order, so none of this
//! changes a bit of the result.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use colibri_cuda::{
    BufView, CudaDevice, DeviceBuffer, DeviceRouter, Event, HostBuffer, KernelSet, MatvecTable,
    MoeRoutePlan, WeightFormat as DevFormat,
};
use colibri_model::experts::{ExpertSource, ExpertWeights};
use colibri_model::moe::Routing;
use colibri_model::source::MatrixLocation;
use colibri_model::tensor::{Bytes, QMatrix};
use colibri_model::{Model, ModelError};

use super::plan::{ExpertClassRequest, VramPlan};
use super::slots::{Reserve, SlotRef, VramCache, VramResidency};
use super::weights::TENSOR_ALIGN;
use super::{Dims, GpuError, cuda_format};
use crate::tier::ExpertLayout;

mod in_place;

use in_place::DeviceTable;
pub(crate) use in_place::{InPlaceCounters, PROMOTE_PER_PASS};

/// One stored matrix of an expert as the device sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatShape {
    pub format: DevFormat,
    pub rows: usize,
    pub cols: usize,
    pub bytes: usize,
    /// FP8: (block, f32 scale count).
    pub scales: Option<(usize, usize)>,
}

impl MatShape {
    fn of_matrix(m: &QMatrix) -> Result<MatShape, GpuError> {
        Ok(MatShape {
            format: cuda_format(m.format)?,
            rows: m.rows,
            cols: m.cols,
            bytes: m.stored_bytes(),
            scales: m.scales().map(|s| (s.block, s.scales.len())),
        })
    }

    fn of_location(m: &MatrixLocation) -> Result<MatShape, GpuError> {
        Ok(MatShape {
            format: cuda_format(m.format)?,
            rows: m.rows,
            cols: m.cols,
            bytes: m.extent.len as usize,
            scales: m.scales.as_ref().map(|s| (s.block, s.scales.len())),
        })
    }
}

/// Where gate, up and down (and their FP8 scales) sit in a device slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    pub mats: [MatShape; 3],
    pub off: [usize; 3],
    pub scale_off: [usize; 3],
    /// Bytes a slot needs (padded for the kernels' word over-reads).
    pub slot_bytes: usize,
}

impl ExpertShape {
    pub fn new(mats: [MatShape; 3]) -> ExpertShape {
        let mut at = 0usize;
        let mut place = |bytes: usize| {
            let o = at.next_multiple_of(TENSOR_ALIGN);
            at = o + bytes;
            o
        };
        let off = [
            place(mats[0].bytes),
            place(mats[1].bytes),
            place(mats[2].bytes),
        ];
        let mut scale_off = [0; 3];
        for (i, m) in mats.iter().enumerate() {
            if let Some((_, n)) = m.scales {
                scale_off[i] = place(4 * n);
            }
        }
        ExpertShape {
            mats,
            off,
            scale_off,
            slot_bytes: (at + 16).next_multiple_of(TENSOR_ALIGN),
        }
    }

    /// Gate, up and down at `at` bytes from the slot's start (the first
    /// at 0), where the RAM tier's slot holds them relative to each other
    /// (`ExpertRecord::slot_offsets`), so that an expert moves to the
    /// device in one copy even when its matrices were separate reads (a
    /// GGUF's stacked `*_exps` tensors). `None` where that layout would not
    /// do: FP8 scales (copied apart), a matrix off a 16-byte boundary
    /// (the kernels' widest loads), overlapping matrices, or gaps of more
    /// than an eighth of the matrices' bytes or `MIRROR_SLACK` (16 KiB), whichever
    /// is larger (VRAM spent on nothing).
    pub fn mirroring(mats: [MatShape; 3], at: [usize; 3]) -> Option<ExpertShape> {
        if mats.iter().any(|m| m.scales.is_some())
            || at.iter().min() != Some(&0)
            || at.iter().any(|o| o % MIRROR_ALIGN != 0)
        {
            return None;
        }
        let mut order = [0, 1, 2];
        order.sort_by_key(|&i| at[i]);
        if order
            .windows(2)
            .any(|p| at[p[0]] + mats[p[0]].bytes > at[p[1]])
        {
            return None;
        }
        let end = (0..3).map(|i| at[i] + mats[i].bytes).max()?;
        let bytes: usize = mats.iter().map(|m| m.bytes).sum();
        if end - bytes > (bytes / 8).max(MIRROR_SLACK) {
            return None;
        }
        Some(ExpertShape {
            mats,
            off: at,
            scale_off: [0; 3],
            slot_bytes: (end + 16).next_multiple_of(TENSOR_ALIGN),
        })
    }

    fn of_weights(w: &ExpertWeights) -> Result<ExpertShape, GpuError> {
        Ok(ExpertShape::new([
            MatShape::of_matrix(&w.gate)?,
            MatShape::of_matrix(&w.up)?,
            MatShape::of_matrix(&w.down)?,
        ]))
    }

    /// Whether `w` is stored as `self` describes.
    fn holds(&self, w: &ExpertWeights) -> bool {
        ExpertShape::of_weights(w).is_ok_and(|got| got.mats == self.mats)
    }
}

/// Size classes of expert slots: layers whose experts need the same slot
/// size share one.
#[derive(Clone, Debug, Default)]
pub(crate) struct Classes {
    pub slot_bytes: Vec<usize>,
    pub experts: Vec<usize>,
    pub layer_class: Vec<Option<usize>>,
}

impl Classes {
    pub fn of(shapes: &[Option<ExpertShape>], per_layer: usize) -> Classes {
        let mut sizes: Vec<usize> = shapes.iter().flatten().map(|s| s.slot_bytes).collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        sizes.dedup();
        let layer_class: Vec<Option<usize>> = shapes
            .iter()
            .map(|s| s.and_then(|s| sizes.iter().position(|&b| b == s.slot_bytes)))
            .collect();
        let mut experts = vec![0usize; sizes.len()];
        for c in layer_class.iter().flatten() {
            experts[*c] += per_layer;
        }
        Classes {
            slot_bytes: sizes,
            experts,
            layer_class,
        }
    }

    pub fn requests(&self) -> Vec<ExpertClassRequest> {
        self.slot_bytes
            .iter()
            .zip(&self.experts)
            .map(|(&b, &n)| ExpertClassRequest {
                slot_bytes: b as u64,
                experts: n,
            })
            .collect()
    }

    /// How many of `pinned` (the RAM tier's hottest experts) fall in each
    /// class.
    pub fn count_pins(
        &self,
        pinned: &[(usize, usize)],
        _shapes: &[Option<ExpertShape>],
    ) -> Vec<usize> {
        let mut n = vec![0usize; self.slot_bytes.len()];
        for &(layer, _) in pinned {
            if let Some(Some(c)) = self.layer_class.get(layer) {
                n[*c] += 1;
            }
        }
        n
    }
}

fn uniform(
    layer: usize,
    shapes: impl Iterator<Item = Result<ExpertShape, GpuError>>,
) -> Result<Option<ExpertShape>, GpuError> {
    let mut first: Option<ExpertShape> = None;
    for s in shapes {
        let s = s?;
        match first {
            None => first = Some(s),
            Some(f) if f == s => {}
            Some(f) => {
                return Err(GpuError::Unsupported(format!(
                    "layer {layer}: routed experts of different formats or shapes ({:?} vs {:?}); \
                     the GPU tier groups a layer's experts into one launch",
                    f.mats, s.mats
                )));
            }
        }
    }
    Ok(first)
}

/// The device alignment a mirrored matrix keeps (see
/// [`ExpertShape::mirroring`]).
const MIRROR_ALIGN: usize = 16;

/// Gaps a mirrored slot may always hold: the alignment slack of four
/// 4 KiB-aligned reads, whatever the expert's size.
const MIRROR_SLACK: usize = 16 << 10;

/// Per-layer expert shapes from the RAM tier's layout: each layer's slots
/// mirror its RAM slots ([`ExpertShape::mirroring`]) where every expert of
/// the layer places its matrices alike, else the matrices packed one after
/// another. Mirrored slots are then widened to the largest mirrored slot
/// among the layers whose packed slots are the same size, so that a gap
/// of a few KiB that varies from layer to layer does not split a size
/// class.
pub(crate) fn shapes_from_layout(
    model: &Model,
    layout: &ExpertLayout,
) -> Result<Vec<Option<ExpertShape>>, GpuError> {
    let shapes: Vec<Option<(ExpertShape, usize)>> = (0..model.spec.num_layers())
        .map(|l| {
            let Some(base) = layout.base.get(l).copied().flatten() else {
                return Ok(None);
            };
            let recs = &layout.records[base..base + layout.experts_per_layer];
            let packed = uniform(
                l,
                recs.iter().map(|r| {
                    let m = r.location.matrices();
                    Ok(ExpertShape::new([
                        MatShape::of_location(m[0])?,
                        MatShape::of_location(m[1])?,
                        MatShape::of_location(m[2])?,
                    ]))
                }),
            )?;
            let Some(packed) = packed else {
                return Ok(None);
            };
            let mirrored = recs.iter().try_fold(None::<ExpertShape>, |same, r| {
                let lo = r.slot_offsets.iter().min().copied()?;
                let at = r
                    .slot_offsets
                    .map(|o| usize::try_from(o - lo).unwrap_or(usize::MAX));
                let s = ExpertShape::mirroring(packed.mats, at)?;
                match same {
                    Some(f) if f != s => None,
                    _ => Some(Some(s)),
                }
            });
            Ok(Some(match mirrored.flatten() {
                Some(m) => (m, packed.slot_bytes),
                None => (packed, packed.slot_bytes),
            }))
        })
        .collect::<Result<_, GpuError>>()?;
    let mut widest: BTreeMap<usize, usize> = BTreeMap::new();
    for (s, packed) in shapes.iter().flatten() {
        let w = widest.entry(*packed).or_insert(0);
        *w = (*w).max(s.slot_bytes);
    }
    Ok(shapes
        .into_iter()
        .map(|s| {
            s.map(|(mut s, packed)| {
                s.slot_bytes = widest.get(&packed).copied().unwrap_or(s.slot_bytes);
                s
            })
        })
        .collect())
}

/// Per-layer expert shapes from a source that is not the RAM tier (every
/// expert resident in a memory map): expert 0 of each layer.
pub(crate) fn shapes_from_source(
    model: &Model,
    source: &dyn ExpertSource,
) -> Result<Vec<Option<ExpertShape>>, GpuError> {
    let spec = &model.spec;
    (0..spec.num_layers())
        .map(|l| {
            if spec.layers[l].ffn != colibri_model::config::FfnKind::Moe || spec.moe.is_none() {
                return Ok(None);
            }
            let mut shape = None;
            source.fetch(l, &[0], &mut |_, w| {
                shape = Some(ExpertShape::of_weights(&w));
                Ok(())
            })?;
            shape.transpose()
        })
        .collect()
}

struct RingSlot {
    filled: Option<Event>,
    consumed: Option<Arc<Event>>,
    lease: Option<Arc<ExpertWeights>>,
}

struct Ring {
    buf: DeviceBuffer<u8>,
    slot_bytes: usize,
    slots: Vec<RingSlot>,
    next: usize,
}

/// Where one chunk's launch tables lie in the packed metadata (bytes): the
/// chunk of launch indices `i0..i1` and pair rows `p0..p1` starts at
/// `56·i0 + 8·p0` and holds six pointer tables of `m = i1 − i0` u64s
/// (gate, up, down, their FP8 scales), then `m` token offsets and `m`
/// counts (u32), then the chunk's `p1 − p0` pair rows (u32). Chunks of a
/// layer never overlap (each ends before `56·i1 + 8·p1`), so the host
/// fills and uploads each with one copy.
#[derive(Clone, Copy, Debug)]
struct MetaLayout {
    base: usize,
    m: usize,
    pairs: usize,
}

impl MetaLayout {
    fn new(i0: usize, i1: usize, p0: usize, p1: usize) -> MetaLayout {
        MetaLayout {
            base: 56 * i0 + 8 * p0,
            m: i1 - i0,
            pairs: p1 - p0,
        }
    }

    fn ptrs(&self, t: usize) -> std::ops::Range<usize> {
        let a = self.base + 8 * self.m * t;
        a..a + 8 * self.m
    }

    fn off(&self) -> std::ops::Range<usize> {
        let a = self.base + 48 * self.m;
        a..a + 4 * self.m
    }

    fn cnt(&self) -> std::ops::Range<usize> {
        let a = self.base + 52 * self.m;
        a..a + 4 * self.m
    }

    fn pair_rows(&self) -> std::ops::Range<usize> {
        let a = self.base + 56 * self.m;
        a..a + 4 * self.pairs
    }

    fn all(&self) -> std::ops::Range<usize> {
        self.base..self.pair_rows().end
    }

    /// Bytes of packed metadata for `experts` launch indices and `pairs`
    /// pair rows.
    fn bytes(experts: usize, pairs: usize) -> usize {
        56 * experts + 8 * pairs
    }
}

/// Device and pinned-host buffers of the MoE step, sized for the largest
/// pass.
pub(crate) struct MoeBufs {
    pub xin: DeviceBuffer<f32>,
    pub eg: DeviceBuffer<f32>,
    pub eu: DeviceBuffer<f32>,
    pub ea: DeviceBuffer<f32>,
    /// The expert outputs, packed by expert (pair rows); the combine reads
    /// them through the pair row of each (row, slot).
    pub eo: DeviceBuffer<f32>,
    /// The launch tables, packed per chunk ([`MetaLayout`]).
    d_meta: DeviceBuffer<u8>,
    h_meta: HostBuffer,
    /// The combine's inputs, three arrays of `nk` words for a pass of `nk`
    /// (row, slot) pairs: pair row, expert id, weight.
    d_comb: DeviceBuffer<u8>,
    h_comb: HostBuffer,
    /// The host's tables, by launch index (six pointer tables of `experts`
    /// entries, offsets, counts) and pair row.
    t_ptrs: Vec<u64>,
    t_off: Vec<u32>,
    t_cnt: Vec<u32>,
    t_pairs: Vec<u32>,
}

impl MoeBufs {
    /// Device bytes (for the planner) and allocation share one list.
    fn sizes(d: &Dims) -> [(usize, usize); 5] {
        let e = d.experts.max(1);
        let pairs = d.max_rows * d.top_k.max(1);
        [
            (pairs * d.hidden, 4),                 // xin
            (pairs * d.moe_inter.max(1), 4 * 3),   // eg, eu, ea
            (pairs * d.hidden, 4),                 // eo
            (MetaLayout::bytes(e, pairs) + 16, 1), // launch tables
            (pairs, 4 * 3),                        // combine idx, ids, weights
        ]
    }

    pub fn device_bytes(d: &Dims) -> u64 {
        if d.experts == 0 {
            return 0;
        }
        MoeBufs::sizes(d).iter().map(|&(n, b)| (n * b) as u64).sum()
    }

    pub fn new(dev: &CudaDevice, d: &Dims) -> Result<MoeBufs, GpuError> {
        let e = d.experts.max(1);
        let pairs = d.max_rows * d.top_k.max(1);
        let inter = d.moe_inter.max(1);
        let z = |n: usize| super::zeros::<f32>(dev, n);
        let meta = MetaLayout::bytes(e, pairs) + 16;
        Ok(MoeBufs {
            xin: z(pairs * d.hidden)?,
            eg: z(pairs * inter)?,
            eu: z(pairs * inter)?,
            ea: z(pairs * inter)?,
            eo: z(pairs * d.hidden)?,
            d_meta: super::zeros::<u8>(dev, meta)?,
            h_meta: dev.alloc_host(meta)?,
            d_comb: super::zeros::<u8>(dev, 12 * pairs)?,
            h_comb: dev.alloc_host(12 * pairs)?,
            t_ptrs: vec![0; 6 * e],
            t_off: vec![0; e],
            t_cnt: vec![0; e],
            t_pairs: vec![0; pairs],
        })
    }

    /// Bytes of array `which` of the combine's inputs for `nk` pairs (the
    /// three arrays lie back to back, so they go up in one copy).
    fn comb_range(&self, which: usize, nk: usize) -> std::ops::Range<usize> {
        let a = 4 * nk * which;
        a..a + 4 * nk
    }

    /// The pair row (row of `eo`) of each of `nk` (row, slot) pairs: every
    /// entry is below `nk` once the layer's routing is written (the host
    /// checks its table before uploading it; moe_route_plan assigns each
    /// pair one of the nk rows).
    pub fn comb_slot_rows(&self, nk: usize) -> Result<BufView<'_, u32>, GpuError> {
        Ok(self.d_comb.view(self.comb_range(0, nk))?.cast::<u32>()?)
    }

    /// The combine's expert ids of `nk` (row, slot) pairs.
    pub fn comb_ids(&self, nk: usize) -> Result<BufView<'_, u32>, GpuError> {
        Ok(self.d_comb.view(self.comb_range(1, nk))?.cast::<u32>()?)
    }

    /// The combine's weights of `nk` (row, slot) pairs.
    pub fn comb_w(&self, nk: usize) -> Result<BufView<'_, f32>, GpuError> {
        Ok(self.d_comb.view(self.comb_range(2, nk))?.cast::<f32>()?)
    }
}

/// Launch-order bookkeeping of one layer.
#[derive(Default)]
struct Launch {
    /// Experts and pairs assigned so far.
    i: usize,
    p: usize,
    /// Where the current chunk began.
    i0: usize,
    p0: usize,
    /// Ring slots (and experts) of the current chunk.
    ring: Vec<(usize, usize)>,
}

/// Counters of the expert side.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ExpertCounters {
    pub copied: u64,
    pub h2d_bytes: u64,
    /// Host-to-device copies that moved the staged and ahead-copied
    /// experts (one per expert where its slot mirrors its RAM slot).
    pub h2d_copies: u64,
    pub promotions: u64,
    /// MoE layers routed and planned on the device (the device table
    /// knows where every expert is).
    pub device_routed: u64,
    /// Experts of the next MoE layer copied into cache slots ahead of its
    /// routing ([`ExpertTier::stage_ahead`]), their bytes (also in
    /// `h2d_bytes`), and how many of them a layer then used.
    pub ahead_copied: u64,
    pub ahead_bytes: u64,
    pub ahead_used: u64,
}

/// An expert copied ahead into a cache slot whose copy may still run: the
/// copy's event, and the RAM lease its source bytes need until then.
struct Ahead {
    slot: SlotRef,
    done: Event,
    _lease: Arc<ExpertWeights>,
}

/// The VRAM expert cache and staging rings of every size class.
pub(crate) struct ExpertTier {
    classes: Classes,
    shapes: Vec<Option<ExpertShape>>,
    per_layer: usize,
    cache: VramCache,
    cache_bufs: Vec<Option<DeviceBuffer<u8>>>,
    rings: Vec<Ring>,
    /// RAM leases held at most for copies in flight (the RAM tier must
    /// keep slots for its reads).
    max_held: usize,
    held: VecDeque<(usize, usize)>,
    pub counters: ExpertCounters,
    /// Set once the device can find every routed expert (all pinned in
    /// cache slots, or read in place from RAM where they have none), for
    /// routing on the device.
    table: Option<DeviceTable>,
    pub in_place: InPlaceCounters,
    /// Experts of the next layer to copy ahead per MoE layer at most (0:
    /// none).
    ahead_max: usize,
    /// Copies ahead that may still be running.
    ahead: Vec<Ahead>,
    /// Entries copied ahead and not used since (to count the used ones).
    ahead_unused: std::collections::HashSet<u32>,
    /// Host-routed MoE layers begun so far, and per class and cache slot
    /// the one that last issued kernels reading or writing the slot. Each
    /// such layer begins after a full compute-stream sync (its router
    /// read-back), so a slot last touched by an earlier layer has no
    /// kernel pending.
    layer_seq: u64,
    slot_touched: Vec<Vec<u64>>,
}

impl ExpertTier {
    pub fn new(
        dev: &CudaDevice,
        classes: Classes,
        shapes: &[Option<ExpertShape>],
        per_layer: usize,
        plan: &VramPlan,
        max_held: usize,
        ahead_max: usize,
    ) -> Result<ExpertTier, GpuError> {
        let class_of: Vec<u16> = (0..shapes.len() * per_layer)
            .map(|entry| {
                classes
                    .layer_class
                    .get(entry / per_layer.max(1))
                    .copied()
                    .flatten()
                    .map_or(u16::MAX, |c| c as u16)
            })
            .collect();
        let slots: Vec<usize> = plan.classes.iter().map(|c| c.cache_slots).collect();
        let mut cache_bufs = Vec::new();
        let mut rings = Vec::new();
        for (c, cp) in plan.classes.iter().enumerate() {
            let sb = classes.slot_bytes[c];
            cache_bufs.push(if cp.cache_slots > 0 {
                Some(dev.alloc::<u8>(cp.cache_slots * sb)?)
            } else {
                None
            });
            rings.push(Ring {
                buf: dev.alloc::<u8>(cp.ring_slots.max(1) * sb)?,
                slot_bytes: sb,
                slots: (0..cp.ring_slots.max(1))
                    .map(|_| RingSlot {
                        filled: None,
                        consumed: None,
                        lease: None,
                    })
                    .collect(),
                next: 0,
            });
        }
        let ring_min = rings.iter().map(|r| r.slots.len()).min().unwrap_or(1);
        Ok(ExpertTier {
            cache: VramCache::new(class_of, &slots),
            classes,
            shapes: shapes.to_vec(),
            per_layer,
            cache_bufs,
            rings,
            max_held: max_held.clamp(1, ring_min),
            held: VecDeque::new(),
            counters: ExpertCounters::default(),
            table: None,
            in_place: InPlaceCounters::default(),
            ahead_max,
            ahead: Vec::new(),
            ahead_unused: std::collections::HashSet::new(),
            layer_seq: 0,
            slot_touched: slots.iter().map(|&n| vec![0; n]).collect(),
        })
    }

    /// Whether experts of MoE layer `layer` can be copied ahead (copies
    /// ahead are on and its size class has cache slots): otherwise the
    /// guess is not worth its router product.
    pub fn can_stage_ahead(&self, layer: usize) -> bool {
        self.ahead_max > 0
            && matches!(self.classes.layer_class.get(layer), Some(Some(c)) if self.cache.slots(*c) > 0)
    }

    /// Copies the first of `guesses` (experts of MoE layer `layer`, most
    /// likely first) that are neither in VRAM nor on their way there but
    /// are in pinned RAM now ([`ExpertSource::peek`]) into cache slots, on
    /// the copy stream behind every copy issued so far, at most
    /// `ahead_max` of them. Called once a layer's own copies are
    /// issued, so the bus carries the next layer's likely experts while
    /// this layer computes and the next one's attention runs, instead of
    /// idling until its routing is known. The layer then finds them as
    /// hits. A guess never changes a result: a slot holds an expert's exact
    /// bytes whichever way they came, and the kernels read them only after
    /// the copy's event.
    pub fn stage_ahead(
        &mut self,
        dev: &CudaDevice,
        layer: usize,
        guesses: &[usize],
        source: &dyn ExpertSource,
    ) -> Result<(), GpuError> {
        self.reap_ahead()?;
        let (Some(Some(shape)), Some(Some(class))) = (
            self.shapes.get(layer).copied(),
            self.classes.layer_class.get(layer).copied(),
        ) else {
            return Ok(());
        };
        if !self.can_stage_ahead(layer) {
            return Ok(());
        }
        let sb = self.classes.slot_bytes[class];
        let mut issued = 0;
        let mut ordered = false;
        for &e in guesses {
            if issued == self.ahead_max {
                break;
            }
            let entry = (layer * self.per_layer + e) as u32;
            if e >= self.per_layer || self.cache.residency(entry) != VramResidency::Absent {
                continue;
            }
            let Some(w) = source.peek(layer, e) else {
                continue;
            };
            if !shape.holds(&w) {
                continue;
            }
            let slot = match self.cache.reserve(entry) {
                Reserve::Slot { slot, evicted } => {
                    if let Some(v) = evicted {
                        self.ahead_unused.remove(&v);
                    }
                    slot
                }
                _ => break,
            };
            let copied = (|| -> Result<(Event, Copied), GpuError> {
                if !ordered && self.slot_touched[class][slot.slot] == self.layer_seq {
                    // This layer's kernels may still read the slot's old
                    // expert: the copies start after them. (The least
                    // recently used slots an eviction takes are older.)
                    dev.copy_wait(&dev.record_compute()?)?;
                    ordered = true;
                }
                let buf = self.cache_bufs[class]
                    .as_mut()
                    .ok_or_else(|| GpuError::Internal("a cache slot without cache".into()))?;
                // SAFETY: `w` is kept in `self.ahead` until the event has
                // passed; the slot is reserved for this entry, its former
                // readers are ordered before the copy (the wait above),
                // and its next readers wait for the event (lease in
                // `moe_layer`, promotion in `flush`).
                unsafe { copy_expert_event(dev, &shape, &w, buf, slot.slot * sb) }
            })();
            match copied {
                Ok((done, Copied { bytes, copies, .. })) => {
                    self.cache.complete(entry, 0, false);
                    self.ahead.push(Ahead {
                        slot,
                        done,
                        _lease: w,
                    });
                    self.ahead_unused.insert(entry);
                    self.counters.ahead_copied += 1;
                    self.counters.ahead_bytes += bytes;
                    self.counters.h2d_bytes += bytes;
                    self.counters.h2d_copies += copies;
                    issued += 1;
                }
                Err(err) => {
                    self.cache.abort(entry);
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    /// Forgets the copies ahead that have completed (and their RAM leases).
    fn reap_ahead(&mut self) -> Result<(), GpuError> {
        let mut i = 0;
        while i < self.ahead.len() {
            if self.ahead[i].done.is_complete()? {
                self.ahead.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Makes the compute stream wait for a copy ahead into `slot` still in
    /// flight, if any (before a kernel reads the slot or a promotion
    /// overwrites it).
    fn order_after_ahead(&self, dev: &CudaDevice, slot: SlotRef) -> Result<(), GpuError> {
        for a in self.ahead.iter().filter(|a| a.slot == slot) {
            dev.compute_wait(&a.done)?;
        }
        Ok(())
    }

    pub fn cache_stats(&self) -> super::VramCacheStats {
        self.cache.stats()
    }

    /// When the cache has a slot for every routed expert of the model,
    /// loads them all (pinned: nothing is ever evicted) and records their
    /// addresses for device-side routing. Returns how many were loaded
    /// (0 when they do not all fit; the cache then fills on demand).
    pub fn preload_all(
        &mut self,
        dev: &CudaDevice,
        source: &dyn ExpertSource,
    ) -> Result<usize, GpuError> {
        let per = self.per_layer;
        let layers = self.shapes.len();
        for (c, &need) in self.classes.experts.iter().enumerate() {
            if self.cache.slots(c) < need {
                return Ok(0);
            }
        }
        if per == 0 || self.shapes.iter().all(|s| s.is_none()) {
            return Ok(0);
        }
        let mut loaded = 0;
        let ids: Vec<usize> = (0..per).collect();
        for layer in 0..layers {
            let Some(shape) = self.shapes[layer] else {
                continue;
            };
            let Some(class) = self.classes.layer_class[layer] else {
                continue;
            };
            let sb = self.classes.slot_bytes[class];
            for chunk in ids.chunks(16) {
                let mut failure = None;
                let res = source.fetch(layer, chunk, &mut |e, w| {
                    let entry = (layer * per + e) as u32;
                    let got = match ExpertShape::of_weights(&w) {
                        Ok(got) => got,
                        Err(err) => {
                            let msg = err.to_string();
                            failure = Some(err);
                            return Err(ModelError::Invalid(msg));
                        }
                    };
                    if got.mats != shape.mats {
                        let err = GpuError::Unsupported(format!(
                            "layer {layer} expert {e}: stored as {:?}, the layer's other experts \
                             as {:?}",
                            got.mats, shape.mats
                        ));
                        let msg = err.to_string();
                        failure = Some(err);
                        return Err(ModelError::Invalid(msg));
                    }
                    let Reserve::Slot { slot, .. } = self.cache.reserve(entry) else {
                        return Ok(());
                    };
                    let r = (|| -> Result<(), GpuError> {
                        let buf = self.cache_bufs[slot.class]
                            .as_mut()
                            .ok_or_else(|| GpuError::Internal("preload without cache".into()))?;
                        // SAFETY: `w` stays alive until the event below has
                        // been waited for; the slot is reserved and read by
                        // no kernel yet.
                        let copied = unsafe { copy_expert(dev, &shape, &w, buf, slot.slot * sb)? };
                        // Copies on one stream complete in order: the last
                        // one's event covers the expert.
                        if let Some(ev) = copied.last {
                            ev.synchronize()?;
                        }
                        Ok(())
                    })();
                    match r {
                        Ok(()) => {
                            self.cache.complete(entry, 0, true);
                            loaded += 1;
                            Ok(())
                        }
                        Err(err) => {
                            self.cache.abort(entry);
                            let msg = err.to_string();
                            failure = Some(err);
                            Err(ModelError::Invalid(msg))
                        }
                    }
                });
                if let Err(e) = res {
                    return Err(failure.take().unwrap_or(GpuError::Model(e)));
                }
            }
        }
        dev.synchronize()?;
        // Every expert must now be resident; record where.
        let mut table = vec![0u64; layers * per * 6];
        for layer in 0..layers {
            let Some(shape) = self.shapes[layer] else {
                continue;
            };
            for e in 0..per {
                let entry = (layer * per + e) as u32;
                let (VramResidency::Resident { .. }, Some(s)) =
                    (self.cache.residency(entry), self.cache.slot_of(entry))
                else {
                    return Err(GpuError::Internal(format!(
                        "layer {layer} expert {e} is not resident after the preload"
                    )));
                };
                let base = self.cache_slot_ptr(s)?;
                let t = &mut table[(layer * per + e) * 6..(layer * per + e + 1) * 6];
                for m in 0..3 {
                    t[m] = base + shape.off[m] as u64;
                    if shape.mats[m].scales.is_some() {
                        t[3 + m] = base + shape.scale_off[m] as u64;
                    }
                }
            }
        }
        self.table = Some(DeviceTable::resident(dev, table)?);
        Ok(loaded)
    }

    pub fn residency(&self, layer: usize, expert: usize) -> Option<VramResidency> {
        if expert >= self.per_layer {
            return None;
        }
        let e = layer * self.per_layer + expert;
        (e < self.cache.entries()).then(|| self.cache.residency(e as u32))
    }

    fn cache_slot_ptr(&self, s: SlotRef) -> Result<u64, GpuError> {
        let buf = self.cache_bufs[s.class]
            .as_ref()
            .ok_or_else(|| GpuError::Internal("cache slot of a class without cache".into()))?;
        Ok(buf.as_view().device_ptr() + (s.slot * self.classes.slot_bytes[s.class]) as u64)
    }

    /// Drops every RAM lease held for a copy (after the compute stream,
    /// which waited for those copies, has been synchronized).
    pub fn release_leases(&mut self) {
        for r in &mut self.rings {
            for s in &mut r.slots {
                s.lease = None;
            }
        }
        self.held.clear();
        self.ahead.clear();
    }

    /// MoE layer `layer` for `n` rows when every expert is resident: the
    /// router `logits` are routed and the launches planned on the device
    /// (kernels/moe.cu), then the same expert launches and gathers as
    /// [`Self::moe_layer`] run, so the host issues the layer without
    /// waiting for anything. Expert outputs go to `bufs.eo` (pair rows),
    /// the combine's slot rows, ids and weights to `bufs` as there.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_layer_resident(
        &mut self,
        dev: &CudaDevice,
        kern: &KernelSet,
        dims: &Dims,
        layer: usize,
        n: usize,
        logits: BufView<'_, f32>,
        router: DeviceRouter,
        bias: Option<BufView<'_, f32>>,
        h: BufView<'_, f32>,
        bufs: &mut MoeBufs,
    ) -> Result<(), GpuError> {
        let shape = self
            .shapes
            .get(layer)
            .copied()
            .flatten()
            .ok_or_else(|| GpuError::Internal(format!("layer {layer} has no expert shape")))?;
        let fp8 = shape.mats.iter().any(|m| m.scales.is_some());
        let per = self.per_layer;
        let k = dims.top_k;
        let nk = n * k;
        let tl = per.min(nk);
        let lay = MetaLayout::new(0, tl, 0, nk);
        // Every address in the table is device memory unless experts are
        // read in place from pinned RAM.
        let in_vram = !self.table.as_ref().is_some_and(|t| t.reads_ram());
        {
            let t = self.table.as_mut().ok_or_else(|| {
                GpuError::Internal("device routing without an expert table".into())
            })?;
            // Reading in place, the routed ids go to the log the host
            // reads back after the pass (the combine reads them there).
            let (table, log) = t.parts(layer * per * 6..(layer + 1) * per * 6, layer, nk)?;
            let meta = bufs.d_meta.view_mut(lay.all())?;
            let (ptrs, rest) = meta.split_at(48 * tl)?;
            let (off, rest) = rest.split_at(4 * tl)?;
            let (cnt, pairs) = rest.split_at(4 * tl)?;
            let comb = bufs.d_comb.view_mut(0..12 * nk)?;
            let (pair_of, rest) = comb.split_at(4 * nk)?;
            let (ids, weights) = rest.split_at(4 * nk)?;
            let ids = match log {
                Some(l) => l,
                None => ids.cast::<u32>()?,
            };
            // SAFETY: the table holds the addresses of this layer's
            // experts: their cache slots, pinned for the tier's life
            // (preload_all), or where each is now, VRAM slot or pinned RAM
            // held for the tier's life, neither of which changes while a
            // pass runs (in_place).
            unsafe {
                kern.moe_route_plan(
                    dev,
                    MoeRoutePlan {
                        logits,
                        rows: n,
                        experts: per,
                        k,
                        router,
                        bias,
                        expert_ptrs: table,
                        ids,
                        weights: weights.cast::<f32>()?,
                        ptrs: ptrs.cast::<u64>()?,
                        ptr_stride: tl,
                        tok_off: off.cast::<u32>()?,
                        tok_cnt: cnt.cast::<u32>()?,
                        table_len: tl,
                        pairs: pairs.cast::<u32>()?,
                        pair_of: pair_of.cast::<u32>()?,
                    },
                )?;
            }
        }
        // SAFETY: moe_route_plan wrote the tables (stream order) with the
        // resident slots' addresses and pair rows < n; launch indices past
        // the used experts have no tokens.
        unsafe {
            run_chunk(
                dev, kern, dims, &shape, fp8, h, n, bufs, &lay, 0, n, in_vram,
            )?
        };
        self.counters.device_routed += 1;
        Ok(())
    }

    /// Copies expert `w` into ring slot `r` of `class`; returns the slot's
    /// device address.
    fn stage(
        &mut self,
        dev: &CudaDevice,
        class: usize,
        shape: &ExpertShape,
        w: Arc<ExpertWeights>,
    ) -> Result<(usize, u64), GpuError> {
        let ring = &mut self.rings[class];
        let r = ring.next;
        ring.next = (r + 1) % ring.slots.len();
        let sb = ring.slot_bytes;
        {
            let slot = &mut ring.slots[r];
            if let Some(lease) = slot.lease.take() {
                if let Some(f) = &slot.filled {
                    f.synchronize()?;
                }
                drop(lease);
                self.held.retain(|&(c, s)| (c, s) != (class, r));
            }
            if let Some(c) = &slot.consumed {
                dev.copy_wait(c)?;
            }
        }
        // SAFETY: `w` is kept in the ring slot until this copy's event has
        // been waited for; the ring slot's previous readers were waited
        // for above (copy_wait).
        let Copied {
            last,
            bytes,
            copies,
        } = unsafe { copy_expert(dev, shape, &w, &mut ring.buf, r * sb)? };
        let base = ring.buf.as_view().device_ptr() + (r * sb) as u64;
        let slot = &mut ring.slots[r];
        slot.filled = last;
        slot.lease = Some(w);
        self.held.push_back((class, r));
        while self.held.len() > self.max_held {
            if let Some((c, s)) = self.held.pop_front() {
                let slot = &mut self.rings[c].slots[s];
                if let Some(f) = &slot.filled {
                    f.synchronize()?;
                }
                slot.lease = None;
            }
        }
        self.counters.copied += 1;
        self.counters.h2d_bytes += bytes;
        self.counters.h2d_copies += copies;
        Ok((r, base))
    }

    /// The routed experts of MoE layer `layer` for `n` rows of normed hidden
    /// states `h`: expert outputs into `bufs.eo` (one pair row per (row,
    /// slot), packed by expert) and the combine metadata (each pair's row,
    /// expert id, weight) uploaded to `bufs`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_layer(
        &mut self,
        dev: &CudaDevice,
        kern: &KernelSet,
        dims: &Dims,
        layer: usize,
        routing: &[Routing],
        h: BufView<'_, f32>,
        bufs: &mut MoeBufs,
        source: &dyn ExpertSource,
    ) -> Result<(), GpuError> {
        let n = routing.len();
        let k = dims.top_k;
        let ne = self.per_layer;
        let shape = self
            .shapes
            .get(layer)
            .copied()
            .flatten()
            .ok_or_else(|| GpuError::Internal(format!("layer {layer} has no expert shape")))?;
        let class = self.classes.layer_class[layer]
            .ok_or_else(|| GpuError::Internal(format!("layer {layer} has no slot class")))?;
        let mut users: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        let ids_at = bufs.comb_range(1, n * k);
        let w_at = bufs.comb_range(2, n * k);
        {
            let comb = bufs.h_comb.as_mut_slice();
            for (row, r) in routing.iter().enumerate() {
                if r.experts.len() != k {
                    return Err(GpuError::Internal(format!(
                        "row {row} routed to {} experts, not {k}",
                        r.experts.len()
                    )));
                }
                for (slot, &e) in r.experts.iter().enumerate() {
                    if e >= ne {
                        return Err(ModelError::Expert {
                            layer,
                            expert: e,
                            reason: "routed to an expert the model does not have".into(),
                        }
                        .into());
                    }
                    users.entry(e).or_default().push((row, slot));
                    let at = ids_at.start + 4 * (row * k + slot);
                    comb[at..at + 4].copy_from_slice(&(e as u32).to_ne_bytes());
                }
                if r.weights.len() != k {
                    return Err(GpuError::Internal(format!(
                        "row {row} has {} routing weights, not {k}",
                        r.weights.len()
                    )));
                }
                for (slot, w) in r.weights.iter().enumerate() {
                    let at = w_at.start + 4 * (row * k + slot);
                    comb[at..at + 4].copy_from_slice(&w.to_ne_bytes());
                }
            }
        }
        // The caller synchronized the compute stream for this layer's
        // routing: every kernel of earlier layers is done.
        self.layer_seq += 1;
        let mut pair_of = vec![u32::MAX; n * k];
        let mut hits = Vec::new();
        let mut misses = Vec::new();
        for &e in users.keys() {
            let entry = (layer * ne + e) as u32;
            match self.cache.lease(entry) {
                Some(s) => {
                    if self.ahead_unused.remove(&entry) {
                        self.counters.ahead_used += 1;
                    }
                    hits.push((e, s));
                }
                None => misses.push(e),
            }
        }
        let mut launch = Launch::default();
        let fp8 = shape.mats.iter().any(|m| m.scales.is_some());

        // Hits: one chunk, computed while the misses are fetched.
        let result = (|| -> Result<(), GpuError> {
            for &(e, s) in &hits {
                self.order_after_ahead(dev, s)?;
                self.slot_touched[s.class][s.slot] = self.layer_seq;
                let base = self.cache_slot_ptr(s)?;
                assign(
                    bufs,
                    &shape,
                    &users[&e],
                    k,
                    ne,
                    base,
                    &mut launch,
                    &mut pair_of,
                );
            }
            self.flush(
                dev,
                kern,
                dims,
                &shape,
                fp8,
                class,
                layer,
                h,
                n,
                bufs,
                &mut launch,
            )?;

            // Misses: staged as they arrive, a chunk every ring/2 arrivals.
            let chunk = (self.rings[class].slots.len() / 2).max(1);
            let mut delivered = 0usize;
            let mut failure: Option<GpuError> = None;
            let res = source.fetch(layer, &misses, &mut |e, w| {
                let got = match ExpertShape::of_weights(&w) {
                    Ok(got) => got,
                    Err(err) => {
                        let msg = err.to_string();
                        failure = Some(err);
                        return Err(ModelError::Invalid(msg));
                    }
                };
                if got.mats != shape.mats {
                    let err = GpuError::Unsupported(format!(
                        "layer {layer} expert {e}: stored as {:?}, the layer's other experts as \
                         {:?}",
                        got.mats, shape.mats
                    ));
                    let msg = err.to_string();
                    failure = Some(err);
                    return Err(ModelError::Invalid(msg));
                }
                let users_e = users.get(&e).ok_or_else(|| ModelError::Expert {
                    layer,
                    expert: e,
                    reason: "source returned an expert that was not requested".into(),
                })?;
                let step = (|| -> Result<(), GpuError> {
                    let (r, base) = self.stage(dev, class, &shape, w)?;
                    assign(
                        bufs,
                        &shape,
                        users_e,
                        k,
                        ne,
                        base,
                        &mut launch,
                        &mut pair_of,
                    );
                    launch.ring.push((r, e));
                    if launch.ring.len() >= chunk {
                        self.flush(
                            dev,
                            kern,
                            dims,
                            &shape,
                            fp8,
                            class,
                            layer,
                            h,
                            n,
                            bufs,
                            &mut launch,
                        )?;
                    }
                    Ok(())
                })();
                if let Err(err) = step {
                    let msg = err.to_string();
                    failure = Some(err);
                    return Err(ModelError::Invalid(msg));
                }
                delivered += 1;
                Ok(())
            });
            if let Some(f) = failure {
                return Err(f);
            }
            res?;
            if delivered != misses.len() {
                return Err(GpuError::Internal(format!(
                    "layer {layer}: the expert source delivered {delivered} of {} experts",
                    misses.len()
                )));
            }
            self.flush(
                dev,
                kern,
                dims,
                &shape,
                fp8,
                class,
                layer,
                h,
                n,
                bufs,
                &mut launch,
            )?;
            Ok(())
        })();
        for &(e, _) in &hits {
            self.cache.release((layer * ne + e) as u32);
        }
        result?;
        if launch.p != n * k || pair_of.contains(&u32::MAX) {
            return Err(GpuError::Internal(format!(
                "layer {layer}: {} of {} expert rows computed",
                launch.p,
                n * k
            )));
        }

        // Back to (row, slot) order for the combine: the pair rows, ids and
        // weights go up in one copy (the three arrays lie back to back).
        let nk = n * k;
        let idx_at = bufs.comb_range(0, nk);
        {
            let comb = bufs.h_comb.as_mut_slice();
            for (j, p) in pair_of.iter().enumerate() {
                let at = idx_at.start + 4 * j;
                comb[at..at + 4].copy_from_slice(&p.to_ne_bytes());
            }
        }
        let all = 0..bufs.comb_range(2, nk).end;
        // SAFETY: the host metadata is written only between the router
        // read-back of a layer (a full compute-stream sync) and this
        // upload, which the next layer's read-back waits for.
        unsafe {
            dev.upload_async(
                &bufs.h_comb.as_slice()[all.clone()],
                bufs.d_comb.view_mut(all)?,
            )?;
        }
        Ok(())
    }

    /// Launches the current chunk: gather its rows, gate/up/SwiGLU/down,
    /// promote its staged experts into the cache, free its ring slots.
    #[allow(clippy::too_many_arguments)]
    fn flush(
        &mut self,
        dev: &CudaDevice,
        kern: &KernelSet,
        dims: &Dims,
        shape: &ExpertShape,
        fp8: bool,
        class: usize,
        layer: usize,
        h: BufView<'_, f32>,
        n: usize,
        bufs: &mut MoeBufs,
        launch: &mut Launch,
    ) -> Result<(), GpuError> {
        let (i0, i1, p0, p1) = (launch.i0, launch.i, launch.p0, launch.p);
        if i1 == i0 {
            return Ok(());
        }
        let e = dims.experts.max(1);
        for &(r, _) in &launch.ring {
            if let Some(f) = &self.rings[class].slots[r].filled {
                dev.compute_wait(f)?;
            }
        }
        // The chunk's tables, packed into its own stretch of the pinned
        // metadata and uploaded with one copy.
        let lay = MetaLayout::new(i0, i1, p0, p1);
        {
            let h = bufs.h_meta.as_mut_slice();
            let mut put = |at: usize, bytes: &[u8]| h[at..at + bytes.len()].copy_from_slice(bytes);
            for t in 0..6 {
                for (j, v) in bufs.t_ptrs[t * e + i0..t * e + i1].iter().enumerate() {
                    put(lay.ptrs(t).start + 8 * j, &v.to_ne_bytes());
                }
            }
            for (j, v) in bufs.t_off[i0..i1].iter().enumerate() {
                put(lay.off().start + 4 * j, &v.to_ne_bytes());
            }
            for (j, v) in bufs.t_cnt[i0..i1].iter().enumerate() {
                put(lay.cnt().start + 4 * j, &v.to_ne_bytes());
            }
            for (j, v) in bufs.t_pairs[p0..p1].iter().enumerate() {
                put(lay.pair_rows().start + 4 * j, &v.to_ne_bytes());
            }
        }
        // SAFETY: the chunk's stretch of the pinned metadata is written only
        // here, and chunks of one layer never share bytes (MetaLayout); the
        // next layer writes it again only after its router read-back, a
        // full compute-stream sync that this upload precedes.
        unsafe {
            dev.upload_async(
                &bufs.h_meta.as_slice()[lay.all()],
                bufs.d_meta.view_mut(lay.all())?,
            )?;
        }
        let max_tok = bufs.t_cnt[i0..i1].iter().copied().max().unwrap_or(0) as usize;
        // SAFETY: every pointer of the chunk's tables is a slot (cache or
        // ring) holding this layer's shape of expert, copied or resident
        // before the launch in stream order (the compute stream waited for
        // the ring copies above); pair rows are rows < n of h.
        unsafe {
            run_chunk(
                dev, kern, dims, shape, fp8, h, n, bufs, &lay, p0, max_tok, true,
            )?
        };

        // Promote the chunk's staged experts into the cache where there is
        // room (device-to-device, compute stream: after the launches above
        // read the ring slot, before its "consumed" event).
        let sb = self.classes.slot_bytes[class];
        for &(r, ex) in &launch.ring {
            let entry = (layer * self.per_layer + ex) as u32;
            if let Reserve::Slot { slot, evicted } = self.cache.reserve(entry) {
                if let Some(v) = evicted {
                    self.ahead_unused.remove(&v);
                }
                self.slot_touched[slot.class][slot.slot] = self.layer_seq;
                let copied = (|| -> Result<(), GpuError> {
                    self.order_after_ahead(dev, slot)?;
                    let buf = self.cache_bufs[slot.class]
                        .as_mut()
                        .ok_or_else(|| GpuError::Internal("promotion without cache".into()))?;
                    let src = self.rings[class].buf.view(r * sb..(r + 1) * sb)?;
                    let dst = buf.view_mut(slot.slot * sb..(slot.slot + 1) * sb)?;
                    dev.copy(src, dst)?;
                    Ok(())
                })();
                match copied {
                    Ok(()) => {
                        self.cache.complete(entry, 0, false);
                        self.counters.promotions += 1;
                    }
                    Err(e) => {
                        self.cache.abort(entry);
                        return Err(e);
                    }
                }
            }
        }
        if !launch.ring.is_empty() {
            let done = Arc::new(dev.record_compute()?);
            for &(r, _) in &launch.ring {
                self.rings[class].slots[r].consumed = Some(Arc::clone(&done));
            }
        }
        launch.ring.clear();
        launch.i0 = launch.i;
        launch.p0 = launch.p;
        Ok(())
    }

    /// Loads the hottest experts of the usage history into pinned cache
    /// slots (the plan's share), before the first step.
    pub fn preload_pinned(
        &mut self,
        dev: &CudaDevice,
        pinned: &[(usize, usize)],
        source: &dyn ExpertSource,
        plan: &VramPlan,
    ) -> Result<usize, GpuError> {
        let mut budget: Vec<usize> = plan.classes.iter().map(|c| c.pinned_slots).collect();
        let mut by_layer: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for &(layer, expert) in pinned {
            let Some(Some(c)) = self.classes.layer_class.get(layer) else {
                continue;
            };
            if budget[*c] > 0 && expert < self.per_layer {
                budget[*c] -= 1;
                by_layer.entry(layer).or_default().push(expert);
            }
        }
        let mut loaded = 0;
        for (layer, mut ids) in by_layer {
            ids.sort_unstable();
            ids.dedup();
            let Some(shape) = self.shapes.get(layer).copied().flatten() else {
                continue;
            };
            let sb = match self.classes.layer_class[layer] {
                Some(c) => self.classes.slot_bytes[c],
                None => continue,
            };
            let mut failure = None;
            let res = source.fetch(layer, &ids, &mut |e, w| {
                let entry = (layer * self.per_layer + e) as u32;
                if !shape.holds(&w) {
                    return Ok(());
                }
                let Reserve::Slot { slot, .. } = self.cache.reserve(entry) else {
                    return Ok(());
                };
                let r = (|| -> Result<(), GpuError> {
                    let buf = self.cache_bufs[slot.class]
                        .as_mut()
                        .ok_or_else(|| GpuError::Internal("pin without cache".into()))?;
                    // SAFETY: `w` is alive until the synchronize below; the
                    // slot is reserved and read by no kernel yet.
                    let copied = unsafe { copy_expert(dev, &shape, &w, buf, slot.slot * sb)? };
                    if let Some(ev) = copied.last {
                        ev.synchronize()?;
                    }
                    Ok(())
                })();
                match r {
                    Ok(()) => {
                        self.cache.complete(entry, 0, true);
                        loaded += 1;
                        Ok(())
                    }
                    Err(err) => {
                        self.cache.abort(entry);
                        let msg = err.to_string();
                        failure = Some(err);
                        Err(ModelError::Invalid(msg))
                    }
                }
            });
            if let Err(e) = res {
                return Err(failure.take().unwrap_or(GpuError::Model(e)));
            }
        }
        dev.synchronize()?;
        Ok(loaded)
    }
}

/// What [`copy_expert`] issued: the last copy's event, the bytes and the
/// number of host-to-device copies.
struct Copied {
    last: Option<Event>,
    bytes: u64,
    copies: u64,
}

/// Copies expert `w`'s matrices and FP8 scales on the copy stream into the
/// slot at byte `at` of `buf`, laid out as `shape`; returns the last copy's
/// event (its stream's copies complete in order) and the bytes copied.
///
/// # Safety
/// `w` must stay alive until the event has completed, and the slot must be
/// neither read nor written by another stream until then.
unsafe fn copy_expert(
    dev: &CudaDevice,
    shape: &ExpertShape,
    w: &ExpertWeights,
    buf: &mut DeviceBuffer<u8>,
    at_slot: usize,
) -> Result<Copied, GpuError> {
    let mats = [&w.gate, &w.up, &w.down];
    let srcs = [
        stored_bytes(mats[0])?,
        stored_bytes(mats[1])?,
        stored_bytes(mats[2])?,
    ];
    // One copy when the three matrices lie in one host buffer exactly as
    // the slot places them relative to each other (a packed record, or a
    // RAM-tier slot whose separate reads the slot's shape mirrors: see
    // `ExpertShape::mirroring`), whatever lies between them included.
    if mats.iter().all(|m| m.scales().is_none())
        && let Some((span, at)) =
            Bytes::common_span([mats[0].data(), mats[1].data(), mats[2].data()])
    {
        let first = (0..3).min_by_key(|&i| shape.off[i]).unwrap_or(0);
        let mirrored = (0..3).all(|i| shape.off[i].checked_sub(shape.off[first]) == Some(at[i]));
        if mirrored && shape.off[first] + span.len() <= shape.slot_bytes {
            let o = at_slot + shape.off[first];
            let dst = buf.view_mut(o..o + span.len())?;
            // SAFETY: `span` is memory of the one storage that `w`'s
            // matrices are views of (common_span), which the caller keeps
            // alive until the event; the slot is untouched by others until
            // then.
            let done = unsafe { dev.copy_host_ptr_async(span.as_ptr(), dst)? };
            return Ok(Copied {
                last: Some(done),
                bytes: span.len() as u64,
                copies: 1,
            });
        }
    }
    let mut out = Copied {
        last: None,
        bytes: 0,
        copies: 0,
    };
    for (i, m) in mats.iter().enumerate() {
        let src = srcs[i];
        let o = at_slot + shape.off[i];
        let dst = buf.view_mut(o..o + src.len())?;
        // SAFETY: the caller keeps `w` (which owns `src`) and the slot
        // untouched until the event.
        out.last = Some(unsafe { dev.copy_host_ptr_async(src.as_ptr(), dst)? });
        out.bytes += src.len() as u64;
        out.copies += 1;
        if let Some(s) = m.scales() {
            let sbytes = bytemuck_f32(&s.scales);
            let o = at_slot + shape.scale_off[i];
            let dst = buf.view_mut(o..o + sbytes.len())?;
            // SAFETY: as above; the scales are owned by `w` too.
            out.last = Some(unsafe { dev.copy_host_ptr_async(sbytes.as_ptr(), dst)? });
            out.bytes += sbytes.len() as u64;
            out.copies += 1;
        }
    }
    Ok(out)
}

/// [`copy_expert`], with an event even when there was nothing to copy.
///
/// # Safety
/// As [`copy_expert`].
unsafe fn copy_expert_event(
    dev: &CudaDevice,
    shape: &ExpertShape,
    w: &ExpertWeights,
    buf: &mut DeviceBuffer<u8>,
    at: usize,
) -> Result<(Event, Copied), GpuError> {
    // SAFETY: the caller's contract is copy_expert's.
    let mut copied = unsafe { copy_expert(dev, shape, w, buf, at)? };
    let done = match copied.last.take() {
        Some(d) => d,
        None => dev.record_copy()?,
    };
    Ok((done, copied))
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; any byte view of it is valid.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Gives expert `e` (its slot at device address `base`) the next launch
/// index and its users the next pair rows.
#[allow(clippy::too_many_arguments)]
fn assign(
    bufs: &mut MoeBufs,
    shape: &ExpertShape,
    users: &[(usize, usize)],
    k: usize,
    per_layer: usize,
    base: u64,
    launch: &mut Launch,
    pair_of: &mut [u32],
) {
    let e = per_layer.max(1);
    let i = launch.i;
    for m in 0..3 {
        bufs.t_ptrs[m * e + i] = base + shape.off[m] as u64;
        bufs.t_ptrs[(3 + m) * e + i] = if shape.mats[m].scales.is_some() {
            base + shape.scale_off[m] as u64
        } else {
            0
        };
    }
    bufs.t_off[i] = launch.p as u32;
    bufs.t_cnt[i] = users.len() as u32;
    for (j, &(row, slot)) in users.iter().enumerate() {
        bufs.t_pairs[launch.p + j] = row as u32;
        pair_of[row * k + slot] = (launch.p + j) as u32;
    }
    launch.i += 1;
    launch.p += users.len();
}

/// One chunk's expert FFN: gather its pair rows of `h` into `xin`, then
/// gate and up (pointer-table matvecs), SwiGLU, down into `eo`.
/// `down_in_vram`: every down address is device memory, so the gate/up
/// launch may ask L2 for the down matrices ahead.
///
/// # Safety
/// The chunk's tables in `bufs.d_meta` (at `lay`) must be written (in
/// stream order) before these launches, their pointers must be slots
/// holding this layer's shape of expert, and their pair rows rows < n of
/// `h` in `p0 .. p0 + lay.pairs`.
#[allow(clippy::too_many_arguments)]
unsafe fn run_chunk(
    dev: &CudaDevice,
    kern: &KernelSet,
    dims: &Dims,
    shape: &ExpertShape,
    fp8: bool,
    h: BufView<'_, f32>,
    n: usize,
    bufs: &mut MoeBufs,
    lay: &MetaLayout,
    p0: usize,
    max_tok: usize,
    down_in_vram: bool,
) -> Result<(), GpuError> {
    let hidden = dims.hidden;
    let inter = shape.mats[0].rows;
    let p1 = p0 + lay.pairs;
    let meta = &bufs.d_meta;
    // The fused launch reads gate and up in one format: a file whose gate
    // and up differ (llama.cpp never writes one, but nothing forbids it)
    // takes the three launches.
    let (gate, up) = (&shape.mats[0], &shape.mats[1]);
    let glu = max_tok <= colibri_cuda::GLU_MAX_TOK
        && gate.format == up.format
        && gate.scales.map(|s| s.0) == up.scales.map(|s| s.0);
    if !glu {
        // SAFETY (of the gather): pair rows are rows < n of h (the caller's
        // contract).
        unsafe {
            kern.gather_rows(
                dev,
                h,
                hidden,
                n,
                meta.view(lay.pair_rows())?.cast::<u32>()?,
                bufs.xin.view_mut(p0 * hidden..p1 * hidden)?,
                hidden,
                hidden,
            )?;
        }
    }
    let table = |t: usize| -> Result<BufView<'_, u64>, GpuError> {
        Ok(meta.view(lay.ptrs(t))?.cast::<u64>()?)
    };
    // The table launch of matrix `mat` (0 gate, 1 up, 2 down) over the
    // chunk's experts, reading its tokens from h through the pair rows
    // (the caller may point x elsewhere, packed by pair row, instead).
    let launch = |mat: usize, x_stride: usize, y_stride: usize| {
        let ms = &shape.mats[mat];
        Ok::<_, GpuError>(MatvecTable {
            format: ms.format,
            rows: ms.rows,
            cols: ms.cols,
            matrices: lay.m,
            w_ptrs: table(mat)?,
            scale_ptrs: if fp8 {
                Some((table(3 + mat)?, ms.scales.map_or(0, |s| s.0)))
            } else {
                None
            },
            x: h,
            x_tok_stride: x_stride,
            x_rows: Some((meta.view(lay.pair_rows())?.cast::<u32>()?, p0)),
            tok_off: meta.view(lay.off())?.cast::<u32>()?,
            tok_cnt: meta.view(lay.cnt())?.cast::<u32>()?,
            max_tok,
            y_tok_stride: y_stride,
        })
    };
    let run = |mat: usize,
               x: BufView<'_, f32>,
               x_stride: usize,
               y: colibri_cuda::BufMut<'_, f32>,
               y_stride: usize|
     -> Result<(), GpuError> {
        let mut t = launch(mat, x_stride, y_stride)?;
        (t.x, t.x_rows) = (x, None);
        // SAFETY: the tables' pointers and pair rows are the caller's
        // contract; each expert's tokens are its own pair rows inside x
        // and y.
        unsafe { kern.matvec_table(dev, &t, y)? };
        Ok(())
    };
    let pairs = n * dims.top_k;
    if glu {
        // Gate, up and SwiGLU in one launch (the bits of the three),
        // reading each pair's token where it is in h.
        let t = launch(0, hidden, inter)?;
        let up = (table(1)?, if fp8 { Some(table(4)?) } else { None });
        // The down projections, asked of L2 while gate and up compute,
        // where they are in device memory (not read in place from RAM).
        let ahead = if down_in_vram {
            Some((table(2)?, shape.mats[2].bytes))
        } else {
            None
        };
        // SAFETY: as for `run` above: the gate, up and down tables of the
        // same experts, filled by the caller (each down address holding
        // this layer's down matrix, `shape.mats[2].bytes`); the chunk's
        // pair rows p0..p1 map to rows < n of h (the caller's contract, as
        // for the gather).
        unsafe {
            kern.matvec_table_glu(dev, &t, up, ahead, bufs.ea.view_mut(0..pairs * inter)?)?;
        }
    } else {
        run(
            0,
            bufs.xin.as_view(),
            hidden,
            bufs.eg.view_mut(0..pairs * inter)?,
            inter,
        )?;
        run(
            1,
            bufs.xin.as_view(),
            hidden,
            bufs.eu.view_mut(0..pairs * inter)?,
            inter,
        )?;
        kern.swiglu(
            dev,
            bufs.eg.view(p0 * inter..p1 * inter)?,
            bufs.eu.view(p0 * inter..p1 * inter)?,
            bufs.ea.view_mut(p0 * inter..p1 * inter)?,
            p1 - p0,
            inter,
        )?;
    }
    run(
        2,
        bufs.ea.as_view(),
        inter,
        bufs.eo.view_mut(0..pairs * hidden)?,
        hidden,
    )
}

/// A matrix's bytes as stored, which is what the device kernels read; the
/// RAM tier's CPU layouts never reach here (the GPU tier turns them off when
/// it attaches), and this refuses them rather than compute garbage.
fn stored_bytes(m: &colibri_model::tensor::QMatrix) -> Result<&[u8], GpuError> {
    if m.layout() != colibri_model::tensor::Layout::RowMajor {
        return Err(GpuError::Internal(format!(
            "an expert in a CPU layout ({:?}) reached the GPU tier",
            m.layout()
        )));
    }
    Ok(m.data().as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::FileFacts;

    fn q4_0(rows: usize, cols: usize) -> MatShape {
        MatShape {
            format: DevFormat::Q4_0,
            rows,
            cols,
            bytes: rows * cols / 32 * 18,
            scales: None,
        }
    }

    #[test]
    fn mirrored_slots_keep_the_ram_slots_gaps_within_bounds() {
        // 768 × 2048 gate and up, 2048 × 768 down: 884,736 bytes each.
        let mats = [q4_0(768, 2048), q4_0(768, 2048), q4_0(2048, 768)];
        let n = mats[0].bytes;
        // A GGUF's three reads, each 4 KiB-aligned, 160 bytes in.
        let at = [0, n + 4096 - 160 + 160, 2 * (n + 4096)];
        let s = ExpertShape::mirroring(mats, at).expect("mirrored");
        assert_eq!(s.off, at);
        assert!(s.slot_bytes >= at[2] + n + 16);
        assert_eq!(s.slot_bytes % TENSOR_ALIGN, 0);
        // Any order in the slot (down read first).
        let s = ExpertShape::mirroring(mats, [n + 4096, 2 * (n + 4096), 0]).expect("mirrored");
        assert!(s.slot_bytes >= 2 * (n + 4096) + n + 16);
        // Refused: not starting at 0, off 16 bytes, overlapping, far apart.
        assert!(ExpertShape::mirroring(mats, [16, n + 16, 2 * n + 16]).is_none());
        assert!(ExpertShape::mirroring(mats, [0, n + 8, 2 * n + 16]).is_none());
        assert!(ExpertShape::mirroring(mats, [0, n - 16, 2 * n]).is_none());
        assert!(ExpertShape::mirroring(mats, [0, n, 2 * n + n / 2]).is_none());
        // FP8 scales are copied apart: never mirrored.
        let mut fp8 = mats;
        fp8[0].scales = Some((128, 96));
        assert!(ExpertShape::mirroring(fp8, [0, n, 2 * n]).is_none());
    }

    /// `synth::small_qwen3_moe` as a Q4_0 GGUF: every expert of a layer
    /// lands alike in its RAM slot, with gaps between the matrices.
    fn small_gguf(dir: &std::path::Path) -> std::path::PathBuf {
        use colibri_model::convert::Silent;
        use colibri_model::convert::cast::Quant;
        use colibri_model::synth::{self, SynthFormat, SynthSource};
        let out = dir.join("small.gguf");
        let src = SynthSource::new(synth::small_qwen3_moe(), 7).expect("config");
        synth::write(&src, Quant::Q4_0, SynthFormat::Gguf, &out, &Silent).expect("synth");
        out
    }

    /// Over real GGUFs' layouts at two alignment units: a layer's slots
    /// mirror where its experts' matrices land in RAM whenever every
    /// expert of the layer places them alike, and equal layers share one
    /// slot size.
    #[test]
    fn gguf_layers_get_slots_that_mirror_the_ram_slots() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let small = small_gguf(tmp.path());
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/gguf/qwen3_moe.q4_0.gguf");
        let mut mirrored = 0;
        for path in [small, fixture] {
            let (model, src) = Model::load(&path).expect("model");
            let locator = src.locator(&model.spec).expect("locator");
            let len = std::fs::metadata(&path).expect("file").len();
            for unit in [512, 4096] {
                let facts = [FileFacts { unit, len }];
                let layout =
                    ExpertLayout::build(&model.spec, locator.as_ref(), &facts).expect("layout");
                let shapes = shapes_from_layout(&model, &layout).expect("shapes");
                let mut sizes = std::collections::BTreeSet::new();
                for l in layout.moe_layers() {
                    let s = shapes[l].expect("a MoE layer has a shape");
                    sizes.insert(s.slot_bytes);
                    let base = layout.base[l].expect("MoE layer");
                    let rel: Vec<[usize; 3]> = layout.records
                        [base..base + layout.experts_per_layer]
                        .iter()
                        .map(|r| {
                            let lo = *r.slot_offsets.iter().min().expect("three");
                            r.slot_offsets.map(|o| (o - lo) as usize)
                        })
                        .collect();
                    let alike = rel.iter().all(|r| *r == rel[0]);
                    let what = format!("{} unit {unit} layer {l}", path.display());
                    if alike {
                        assert_eq!(s.off, rel[0], "{what}");
                        // Separate reads: gaps between the matrices.
                        let bytes: usize = s.mats.iter().map(|m| m.bytes).sum();
                        assert!(s.slot_bytes > bytes + 256, "{what}");
                        mirrored += 1;
                    } else {
                        assert_eq!(s.off, ExpertShape::new(s.mats).off, "{what}: packed");
                    }
                    for i in 0..3 {
                        assert!(s.off[i] + s.mats[i].bytes + 16 <= s.slot_bytes, "{what}");
                    }
                }
                assert_eq!(sizes.len(), 1, "unit {unit}: one size class, {sizes:?}");
            }
        }
        // The small file's two layers at both units.
        assert!(mirrored >= 4, "{mirrored}");
    }
}
