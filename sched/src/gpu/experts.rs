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
    BufView, CudaDevice, DeviceBuffer, Event, HostBuffer, KernelSet, MatvecTable,
    WeightFormat as DevFormat,
};
use colibri_model::experts::{ExpertSource, ExpertWeights};
use colibri_model::moe::Routing;
use colibri_model::source::{ExpertLocator, MatrixLocation};
use colibri_model::tensor::QMatrix;
use colibri_model::{Model, ModelError};

use super::plan::{ExpertClassRequest, VramPlan};
use super::slots::{Reserve, SlotRef, VramCache, VramResidency};
use super::weights::TENSOR_ALIGN;
use super::{Dims, GpuError, cuda_format};
use crate::tier::ExpertLayout;

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
    fn of_matrix(m: &QMatrix) -> MatShape {
        MatShape {
            format: cuda_format(m.format),
            rows: m.rows,
            cols: m.cols,
            bytes: m.stored_bytes(),
            scales: m.scales().map(|s| (s.block, s.scales.len())),
        }
    }

    fn of_location(m: &MatrixLocation) -> MatShape {
        MatShape {
            format: cuda_format(m.format),
            rows: m.rows,
            cols: m.cols,
            bytes: m.extent.len as usize,
            scales: m.scales.as_ref().map(|s| (s.block, s.scales.len())),
        }
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

    fn of_weights(w: &ExpertWeights) -> ExpertShape {
        ExpertShape::new([
            MatShape::of_matrix(&w.gate),
            MatShape::of_matrix(&w.up),
            MatShape::of_matrix(&w.down),
        ])
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
    shapes: impl Iterator<Item = ExpertShape>,
) -> Result<Option<ExpertShape>, GpuError> {
    let mut first: Option<ExpertShape> = None;
    for s in shapes {
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

/// Per-layer expert shapes from the RAM tier's layout.
pub(crate) fn shapes_from_layout(
    model: &Model,
    layout: &ExpertLayout,
) -> Result<Vec<Option<ExpertShape>>, GpuError> {
    (0..model.spec.num_layers())
        .map(|l| {
            let Some(base) = layout.base.get(l).copied().flatten() else {
                return Ok(None);
            };
            let recs = &layout.records[base..base + layout.experts_per_layer];
            uniform(
                l,
                recs.iter().map(|r| {
                    let m = r.location.matrices();
                    ExpertShape::new([
                        MatShape::of_location(m[0]),
                        MatShape::of_location(m[1]),
                        MatShape::of_location(m[2]),
                    ])
                }),
            )
        })
        .collect()
}

/// Per-layer expert shapes from a locator (expert 0 of each layer stands
/// for the layer; the GPU pass checks every expert as it arrives).
pub(crate) fn shapes_from_locator(
    model: &Model,
    locator: Option<&dyn ExpertLocator>,
) -> Result<Vec<Option<ExpertShape>>, GpuError> {
    let spec = &model.spec;
    (0..spec.num_layers())
        .map(|l| {
            if spec.layers[l].ffn != colibri_model::config::FfnKind::Moe || spec.moe.is_none() {
                return Ok(None);
            }
            let Some(loc) = locator else {
                return Ok(None);
            };
            let e = loc.locate(l, 0)?;
            let m = e.matrices();
            Ok(Some(ExpertShape::new([
                MatShape::of_location(m[0]),
                MatShape::of_location(m[1]),
                MatShape::of_location(m[2]),
            ])))
        })
        .collect()
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
            Ok(shape)
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

/// Device and pinned-host buffers of the MoE step, sized for the largest
/// pass.
pub(crate) struct MoeBufs {
    pub xin: DeviceBuffer<f32>,
    pub eg: DeviceBuffer<f32>,
    pub eu: DeviceBuffer<f32>,
    pub ea: DeviceBuffer<f32>,
    pub eo: DeviceBuffer<f32>,
    pub so: DeviceBuffer<f32>,
    /// Six tables of `experts` pointers: gate, up, down, then their scales.
    d_ptrs: DeviceBuffer<u64>,
    d_off: DeviceBuffer<u32>,
    d_cnt: DeviceBuffer<u32>,
    d_pairs: DeviceBuffer<u32>,
    pub d_comb_idx: DeviceBuffer<u32>,
    pub d_comb_ids: DeviceBuffer<u32>,
    pub d_comb_w: DeviceBuffer<f32>,
    h_ptrs: HostBuffer,
    h_off: HostBuffer,
    h_cnt: HostBuffer,
    h_pairs: HostBuffer,
    h_comb_idx: HostBuffer,
    h_comb_ids: HostBuffer,
    h_comb_w: HostBuffer,
}

impl MoeBufs {
    /// Device bytes (for the planner) and allocation share one list.
    fn sizes(d: &Dims) -> [(usize, usize); 7] {
        let e = d.experts.max(1);
        let pairs = d.max_rows * d.top_k.max(1);
        [
            (pairs * d.hidden, 4),               // xin
            (pairs * d.moe_inter.max(1), 4 * 3), // eg, eu, ea
            (pairs * d.hidden, 4 * 2),           // eo, so
            (6 * e, 8),                          // pointer tables
            (2 * e, 4),                          // offsets, counts
            (pairs, 4 * 3),                      // pairs, combine idx and ids
            (pairs, 4),                          // combine weights
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
        Ok(MoeBufs {
            xin: z(pairs * d.hidden)?,
            eg: z(pairs * inter)?,
            eu: z(pairs * inter)?,
            ea: z(pairs * inter)?,
            eo: z(pairs * d.hidden)?,
            so: z(pairs * d.hidden)?,
            d_ptrs: super::zeros::<u64>(dev, 6 * e)?,
            d_off: super::zeros::<u32>(dev, e)?,
            d_cnt: super::zeros::<u32>(dev, e)?,
            d_pairs: super::zeros::<u32>(dev, pairs)?,
            d_comb_idx: super::zeros::<u32>(dev, pairs)?,
            d_comb_ids: super::zeros::<u32>(dev, pairs)?,
            d_comb_w: super::zeros::<f32>(dev, pairs)?,
            h_ptrs: dev.alloc_host(6 * e * 8)?,
            h_off: dev.alloc_host(e * 4)?,
            h_cnt: dev.alloc_host(e * 4)?,
            h_pairs: dev.alloc_host(pairs * 4)?,
            h_comb_idx: dev.alloc_host(pairs * 4)?,
            h_comb_ids: dev.alloc_host(pairs * 4)?,
            h_comb_w: dev.alloc_host(pairs * 4)?,
        })
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
    pub promotions: u64,
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
}

impl ExpertTier {
    pub fn new(
        dev: &CudaDevice,
        classes: Classes,
        shapes: &[Option<ExpertShape>],
        per_layer: usize,
        plan: &VramPlan,
        max_held: usize,
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
        })
    }

    pub fn cache_stats(&self) -> super::VramCacheStats {
        self.cache.stats()
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
        let mats = [&w.gate, &w.up, &w.down];
        let mut last = None;
        let mut bytes = 0u64;
        for (i, m) in mats.iter().enumerate() {
            let src = m.data().as_slice();
            let at = r * sb + shape.off[i];
            let dst = ring.buf.view_mut(at..at + src.len())?;
            // SAFETY: `src` lies in the lease `w`, kept in the ring slot
            // until this copy's event has been waited for; the ring slot's
            // previous readers were waited for above (copy_wait).
            last = Some(unsafe { dev.copy_host_ptr_async(src.as_ptr(), dst)? });
            bytes += src.len() as u64;
            if let Some(s) = m.scales() {
                let sbytes = bytemuck_f32(&s.scales);
                let at = r * sb + shape.scale_off[i];
                let dst = ring.buf.view_mut(at..at + sbytes.len())?;
                // SAFETY: as above; the scales are owned by `w` too.
                last = Some(unsafe { dev.copy_host_ptr_async(sbytes.as_ptr(), dst)? });
                bytes += sbytes.len() as u64;
            }
        }
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
        Ok((r, base))
    }

    /// The routed experts of MoE layer `layer` for `n` rows of normed hidden
    /// states `h`: slot outputs `[n][k][hidden]` into `bufs.so` and the
    /// combine metadata (expert ids, weights) uploaded to `bufs`.
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
        let hidden = dims.hidden;
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
        {
            let ids_h = bufs.h_comb_ids.typed_mut::<u32>();
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
                    ids_h[row * k + slot] = e as u32;
                }
            }
            let w_h = bufs.h_comb_w.typed_mut::<f32>();
            for (row, r) in routing.iter().enumerate() {
                w_h[row * k..(row + 1) * k].copy_from_slice(&r.weights);
            }
        }
        let mut pair_of = vec![u32::MAX; n * k];
        let mut hits = Vec::new();
        let mut misses = Vec::new();
        for &e in users.keys() {
            let entry = (layer * ne + e) as u32;
            match self.cache.lease(entry) {
                Some(s) => hits.push((e, s)),
                None => misses.push(e),
            }
        }
        let mut launch = Launch::default();
        let fp8 = shape.mats.iter().any(|m| m.scales.is_some());

        // Hits: one chunk, computed while the misses are fetched.
        let result = (|| -> Result<(), GpuError> {
            for &(e, s) in &hits {
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
                let got = ExpertShape::of_weights(&w);
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

        // Back to (row, slot) order for the combine.
        let nk = n * k;
        bufs.h_comb_idx.typed_mut::<u32>()[..nk].copy_from_slice(&pair_of);
        // SAFETY: the host metadata is written only between the router
        // read-back of a layer (a full compute-stream sync) and these
        // uploads, which the next layer's read-back waits for.
        unsafe {
            dev.upload_async(
                &bufs.h_comb_idx.typed::<u32>()[..nk],
                bufs.d_comb_idx.view_mut(0..nk)?,
            )?;
            dev.upload_async(
                &bufs.h_comb_ids.typed::<u32>()[..nk],
                bufs.d_comb_ids.view_mut(0..nk)?,
            )?;
            dev.upload_async(
                &bufs.h_comb_w.typed::<f32>()[..nk],
                bufs.d_comb_w.view_mut(0..nk)?,
            )?;
            // SAFETY (of the gather): every index is a pair row < nk
            // (pair_of has no u32::MAX left, checked above).
            kern.gather_rows(
                dev,
                bufs.eo.view(0..nk * hidden)?,
                hidden,
                nk,
                bufs.d_comb_idx.view(0..nk)?,
                bufs.so.view_mut(0..nk * hidden)?,
                hidden,
                hidden,
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
        let hidden = dims.hidden;
        let inter = shape.mats[0].rows;
        for &(r, _) in &launch.ring {
            if let Some(f) = &self.rings[class].slots[r].filled {
                dev.compute_wait(f)?;
            }
        }
        // SAFETY (uploads): the host tables' entries i0..i1 and pairs
        // p0..p1 were written for this chunk and are not written again
        // until the next layer's read-back has synchronized the stream.
        unsafe {
            for t in 0..6 {
                dev.upload_async(
                    &bufs.h_ptrs.typed::<u64>()[t * e + i0..t * e + i1],
                    bufs.d_ptrs.view_mut(t * e + i0..t * e + i1)?,
                )?;
            }
            dev.upload_async(
                &bufs.h_off.typed::<u32>()[i0..i1],
                bufs.d_off.view_mut(i0..i1)?,
            )?;
            dev.upload_async(
                &bufs.h_cnt.typed::<u32>()[i0..i1],
                bufs.d_cnt.view_mut(i0..i1)?,
            )?;
            dev.upload_async(
                &bufs.h_pairs.typed::<u32>()[p0..p1],
                bufs.d_pairs.view_mut(p0..p1)?,
            )?;
            // SAFETY (of the gather): pair rows are rows < n of h.
            kern.gather_rows(
                dev,
                h,
                hidden,
                n,
                bufs.d_pairs.view(p0..p1)?,
                bufs.xin.view_mut(p0 * hidden..p1 * hidden)?,
                hidden,
                hidden,
            )?;
        }
        let max_tok = bufs.h_cnt.typed::<u32>()[i0..i1]
            .iter()
            .copied()
            .max()
            .unwrap_or(0) as usize;
        let m = i1 - i0;
        let table = |t: usize| bufs.d_ptrs.view(t * e + i0..t * e + i1);
        let run = |mat: usize,
                   x: BufView<'_, f32>,
                   x_stride: usize,
                   y: colibri_cuda::BufMut<'_, f32>,
                   y_stride: usize|
         -> Result<(), GpuError> {
            let ms = &shape.mats[mat];
            let t = MatvecTable {
                format: ms.format,
                rows: ms.rows,
                cols: ms.cols,
                matrices: m,
                w_ptrs: table(mat)?,
                scale_ptrs: if fp8 {
                    Some((table(3 + mat)?, ms.scales.map_or(0, |s| s.0)))
                } else {
                    None
                },
                x,
                x_tok_stride: x_stride,
                tok_off: bufs.d_off.view(i0..i1)?,
                tok_cnt: bufs.d_cnt.view(i0..i1)?,
                max_tok,
                y_tok_stride: y_stride,
            };
            // SAFETY: every pointer of the chunk's tables is a slot (cache
            // or ring) holding this layer's shape of expert, copied or
            // resident before the launch in stream order (the compute
            // stream waited for the ring copies above); each expert's
            // tokens are its own pair rows inside x and y.
            unsafe { kern.matvec_table(dev, &t, y)? };
            Ok(())
        };
        let pairs = n * dims.top_k;
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
        run(
            2,
            bufs.ea.as_view(),
            inter,
            bufs.eo.view_mut(0..pairs * hidden)?,
            hidden,
        )?;

        // Promote the chunk's staged experts into the cache where there is
        // room (device-to-device, compute stream: after the launches above
        // read the ring slot, before its "consumed" event).
        let sb = self.classes.slot_bytes[class];
        for &(r, ex) in &launch.ring {
            let entry = (layer * self.per_layer + ex) as u32;
            if let Reserve::Slot { slot, .. } = self.cache.reserve(entry) {
                let copied = (|| -> Result<(), GpuError> {
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
                if ExpertShape::of_weights(&w).mats != shape.mats {
                    return Ok(());
                }
                let Reserve::Slot { slot, .. } = self.cache.reserve(entry) else {
                    return Ok(());
                };
                let r = (|| -> Result<(), GpuError> {
                    let buf = self.cache_bufs[slot.class]
                        .as_mut()
                        .ok_or_else(|| GpuError::Internal("pin without cache".into()))?;
                    let mats = [&w.gate, &w.up, &w.down];
                    for (i, m) in mats.iter().enumerate() {
                        let at = slot.slot * sb + shape.off[i];
                        let src = m.data().as_slice();
                        // SAFETY: `w` is alive until the synchronize below;
                        // the slot is reserved and read by no kernel yet.
                        let ev = unsafe {
                            dev.copy_host_ptr_async(
                                src.as_ptr(),
                                buf.view_mut(at..at + src.len())?,
                            )?
                        };
                        if let Some(s) = m.scales() {
                            let sbytes = bytemuck_f32(&s.scales);
                            let at = slot.slot * sb + shape.scale_off[i];
                            // SAFETY: as above.
                            let ev2 = unsafe {
                                dev.copy_host_ptr_async(
                                    sbytes.as_ptr(),
                                    buf.view_mut(at..at + sbytes.len())?,
                                )?
                            };
                            ev2.synchronize()?;
                        }
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
    let ptrs = bufs.h_ptrs.typed_mut::<u64>();
    for m in 0..3 {
        ptrs[m * e + i] = base + shape.off[m] as u64;
        ptrs[(3 + m) * e + i] = if shape.mats[m].scales.is_some() {
            base + shape.scale_off[m] as u64
        } else {
            0
        };
    }
    bufs.h_off.typed_mut::<u32>()[i] = launch.p as u32;
    bufs.h_cnt.typed_mut::<u32>()[i] = users.len() as u32;
    let pairs = bufs.h_pairs.typed_mut::<u32>();
    for (j, &(row, slot)) in users.iter().enumerate() {
        pairs[launch.p + j] = row as u32;
        pair_of[row * k + slot] = (launch.p + j) as u32;
    }
    launch.i += 1;
    launch.p += users.len();
}
