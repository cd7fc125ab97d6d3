//! The KV cache of a sequence on the GPU tier: per layer, part A (GQA: the
//! keys; MLA: the normed latent) and part B (GQA: the values; MLA: the
//! rotated shared key), `[position][width]` each, for `cap` positions.
//!
//! It lives in VRAM while the tier's KV grant has room, otherwise in
//! mapped pinned RAM that the attention kernel reads in place over the bus
//! (each step reads a sequence's whole cache once either way, so a copy
//! would only move the same bytes twice). It is attached to the model's
//! [`KvCache`] (its tier state), so it moves with the sequence and is freed
//! with it; capacity grows by doubling, the old positions copied over
//! (through pinned RAM when the grant holds the grown cache only without
//! the old one, so that a context past half the grant stays in VRAM).
//!
//! With several devices (`--devices`) each holds the cache of its own
//! layers: the sequence's tier state keeps one device cache per stage.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use colibri_cuda::{BufMut, BufView, CudaDevice, DeviceBuffer, HostBuffer, KernelSet};
use colibri_model::KvCache;

use super::GpuError;

/// The first allocation of a sequence's cache, in positions.
pub const KV_INITIAL_POSITIONS: usize = 256;

/// VRAM granted to KV caches, shared by every sequence of one tier.
#[derive(Debug)]
pub(crate) struct KvGrant {
    left: Mutex<u64>,
    pub in_vram: AtomicU64,
    pub in_host: AtomicU64,
}

impl KvGrant {
    fn left(&self) -> u64 {
        *self.left.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn new(bytes: u64) -> Arc<KvGrant> {
        Arc::new(KvGrant {
            left: Mutex::new(bytes),
            in_vram: AtomicU64::new(0),
            in_host: AtomicU64::new(0),
        })
    }

    fn take(&self, bytes: u64) -> bool {
        let mut left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        if *left >= bytes {
            *left -= bytes;
            true
        } else {
            false
        }
    }

    fn give(&self, bytes: u64) {
        *self.left.lock().unwrap_or_else(|p| p.into_inner()) += bytes;
    }
}

enum Mem {
    Vram(DeviceBuffer<f32>, Arc<KvGrant>, u64),
    Host(HostBuffer, Arc<KvGrant>, u64),
}

impl Drop for Mem {
    fn drop(&mut self) {
        match self {
            Mem::Vram(_, g, bytes) => {
                g.give(*bytes);
                g.in_vram.fetch_sub(*bytes, Ordering::Relaxed);
            }
            Mem::Host(_, g, bytes) => {
                g.in_host.fetch_sub(*bytes, Ordering::Relaxed);
            }
        }
    }
}

/// One sequence's keys and values on one device of the GPU tier: layers
/// `first..first + layers`.
pub(crate) struct DeviceKv {
    cap: usize,
    first: usize,
    a: usize,
    b: usize,
    mem: Mem,
}

/// What a sequence's [`KvCache`] carries for the GPU tier: the device
/// cache of each stage (device) of the tier `tier`.
struct StagedKv {
    tier: u64,
    stages: Vec<Option<Box<DeviceKv>>>,
}

impl DeviceKv {
    fn floats(shape: &KvShape, cap: usize) -> Result<usize, GpuError> {
        shape
            .layers
            .len()
            .checked_mul(cap)
            .and_then(|n| n.checked_mul(shape.a + shape.b))
            .filter(|&n| n.checked_mul(4).is_some())
            .ok_or_else(|| GpuError::Internal("KV cache size overflows".into()))
    }

    /// In VRAM when the grant has room, else in mapped pinned RAM (also
    /// when `host` asks for it).
    fn alloc(
        dev: &CudaDevice,
        grant: &Arc<KvGrant>,
        shape: &KvShape,
        cap: usize,
        host: bool,
    ) -> Result<DeviceKv, GpuError> {
        let (a, b) = (shape.a, shape.b);
        let floats = Self::floats(shape, cap)?;
        let bytes = (floats * 4) as u64;
        let mem = if !host && grant.take(bytes) {
            match dev.alloc::<f32>(floats) {
                Ok(buf) => {
                    grant.in_vram.fetch_add(bytes, Ordering::Relaxed);
                    Mem::Vram(buf, Arc::clone(grant), bytes)
                }
                Err(e) => {
                    grant.give(bytes);
                    return Err(e.into());
                }
            }
        } else {
            let h = dev.alloc_host(floats * 4)?;
            grant.in_host.fetch_add(bytes, Ordering::Relaxed);
            Mem::Host(h, Arc::clone(grant), bytes)
        };
        Ok(DeviceKv {
            cap,
            first: shape.layers.start,
            a,
            b,
            mem,
        })
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// VRAM bytes this cache holds of its grant (0 in mapped RAM).
    fn vram_bytes(&self) -> u64 {
        match &self.mem {
            Mem::Vram(_, _, bytes) => *bytes,
            Mem::Host(..) => 0,
        }
    }

    /// The device address of the cache's memory (it moves when it grows).
    pub fn device_ptr(&self) -> u64 {
        self.all().device_ptr()
    }

    fn all(&self) -> BufView<'_, f32> {
        match &self.mem {
            Mem::Vram(b, ..) => b.as_view(),
            Mem::Host(h, ..) => h.device_view::<f32>(),
        }
    }

    fn all_mut(&mut self) -> BufMut<'_, f32> {
        match &mut self.mem {
            Mem::Vram(b, ..) => b.as_mut(),
            Mem::Host(h, ..) => h.device_view_mut::<f32>(),
        }
    }

    fn range(&self, layer: usize, part: usize) -> Result<std::ops::Range<usize>, GpuError> {
        let at = layer
            .checked_sub(self.first)
            .ok_or_else(|| GpuError::Internal(format!("layer {layer} is not this stage's")))?;
        let per_layer = self.cap * (self.a + self.b);
        let start = at * per_layer + if part == 0 { 0 } else { self.cap * self.a };
        let len = self.cap * if part == 0 { self.a } else { self.b };
        Ok(start..start + len)
    }

    /// Part A (0) or B (1) of `layer`: `cap × width` floats.
    pub fn part(&self, layer: usize, part: usize) -> Result<BufView<'_, f32>, GpuError> {
        let r = self.range(layer, part)?;
        Ok(self.all().slice(r)?)
    }

    /// Both parts of `layer` (keys, values), exclusive.
    pub fn parts_mut(
        &mut self,
        layer: usize,
    ) -> Result<(BufMut<'_, f32>, BufMut<'_, f32>), GpuError> {
        let (a, b) = (self.range(layer, 0)?, self.range(layer, 1)?);
        let both = self.all_mut().slice_mut(a.start..b.end)?;
        Ok(both.split_at(a.len())?)
    }

    pub fn part_mut(&mut self, layer: usize, part: usize) -> Result<BufMut<'_, f32>, GpuError> {
        let r = self.range(layer, part)?;
        Ok(self.all_mut().slice_mut(r)?)
    }
}

/// What a tier needs to give a sequence its device cache.
pub(crate) struct KvShape {
    /// The GPU tier (shared by its stages).
    pub tier: u64,
    /// This stage, of `stages`.
    pub stage: usize,
    pub stages: usize,
    /// The layers this stage holds.
    pub layers: std::ops::Range<usize>,
    /// Floats per position of part A and part B.
    pub a: usize,
    pub b: usize,
}

/// This stage's device cache of `cache`, with room for `need` positions
/// (created, or grown by doubling with the `len` positions it holds copied
/// over).
pub(crate) fn ensure<'c>(
    cache: &'c mut KvCache,
    need: usize,
    shape: &KvShape,
    dev: &CudaDevice,
    k: &KernelSet,
    grant: &Arc<KvGrant>,
) -> Result<&'c mut DeviceKv, GpuError> {
    let len = cache.len();
    let capacity = cache.capacity();
    if need > capacity {
        return Err(GpuError::Internal(format!(
            "{need} positions in a cache of {capacity}"
        )));
    }
    let slot = cache.tier_state();
    let mut staged = match slot.take() {
        None => {
            if len > 0 {
                return Err(GpuError::Unsupported(format!(
                    "this KV cache's {len} positions were computed by the CPU tier (or it was \
                     cloned): the GPU tier cannot continue it"
                )));
            }
            Box::new(StagedKv {
                tier: shape.tier,
                stages: (0..shape.stages).map(|_| None).collect(),
            })
        }
        Some(any) => match any.downcast::<StagedKv>() {
            Ok(s) if s.tier == shape.tier && s.stages.len() == shape.stages => s,
            Ok(s) => {
                *slot = Some(s);
                return Err(GpuError::Unsupported(
                    "this KV cache belongs to another GPU engine".into(),
                ));
            }
            Err(other) => {
                *slot = Some(other);
                return Err(GpuError::Unsupported(
                    "this KV cache belongs to another compute tier".into(),
                ));
            }
        },
    };
    let current = staged.stages[shape.stage].take();
    let r = grown(current, len, need, capacity, shape, dev, k, grant);
    // On an error the stage's cache is gone (its positions cannot be
    // continued); the other stages keep theirs.
    let r = r.map(|kv| staged.stages[shape.stage] = Some(kv));
    *slot = Some(staged);
    r?;
    attached(cache, shape.stage)
}

/// `current` (this stage's cache, if any) with room for `need` positions.
#[allow(clippy::too_many_arguments)]
fn grown(
    current: Option<Box<DeviceKv>>,
    len: usize,
    need: usize,
    capacity: usize,
    shape: &KvShape,
    dev: &CudaDevice,
    k: &KernelSet,
    grant: &Arc<KvGrant>,
) -> Result<Box<DeviceKv>, GpuError> {
    if current.is_none() && len > 0 {
        return Err(GpuError::Internal(format!(
            "stage {} has no device cache for the {len} positions of this sequence",
            shape.stage
        )));
    }
    match current {
        Some(kv) if kv.cap >= need => Ok(kv),
        old => {
            let cur = old.as_ref().map_or(0, |o| o.cap);
            let cap = need
                .max(cur.saturating_mul(2))
                .max(KV_INITIAL_POSITIONS)
                .min(capacity);
            let fresh_bytes = (DeviceKv::floats(shape, cap)? * 4) as u64;
            match old {
                Some(old) if len > 0 => {
                    let held = old.vram_bytes();
                    let left = grant.left();
                    if held > 0 && left < fresh_bytes && left + held >= fresh_bytes {
                        // The grown cache fits the grant only once the old
                        // one is gone (a doubling needs 1.5 times the
                        // grown size at once): park the positions in
                        // mapped pinned RAM meanwhile, rather than leave
                        // the whole cache there for good.
                        let mut park = DeviceKv::alloc(dev, grant, shape, old.cap, true)?;
                        copy_positions(&old, &mut park, len, shape, dev, k)?;
                        drop(old);
                        let mut fresh = Box::new(DeviceKv::alloc(dev, grant, shape, cap, false)?);
                        copy_positions(&park, &mut fresh, len, shape, dev, k)?;
                        // `park` drops once both streams are idle.
                        return Ok(fresh);
                    }
                    let mut fresh = Box::new(DeviceKv::alloc(dev, grant, shape, cap, false)?);
                    copy_positions(&old, &mut fresh, len, shape, dev, k)?;
                    // The old memory is freed when `old` drops: stream-ordered
                    // for VRAM, after both streams are idle for mapped memory.
                    Ok(fresh)
                }
                _ => Ok(Box::new(DeviceKv::alloc(dev, grant, shape, cap, false)?)),
            }
        }
    }
}

/// The first `len` positions of every layer of `from`, copied into `to`.
fn copy_positions(
    from: &DeviceKv,
    to: &mut DeviceKv,
    len: usize,
    shape: &KvShape,
    dev: &CudaDevice,
    k: &KernelSet,
) -> Result<(), GpuError> {
    for l in shape.layers.clone() {
        for part in 0..2 {
            let w = if part == 0 { shape.a } else { shape.b };
            let src = from.part(l, part)?.slice(0..len * w)?;
            let dst = to.part_mut(l, part)?.slice_mut(0..len * w)?;
            k.copy_2d(dev, src, len * w, dst, len * w, 1, len * w)?;
        }
    }
    Ok(())
}

/// Stage `stage`'s device cache already attached to `cache`.
pub(crate) fn attached(cache: &mut KvCache, stage: usize) -> Result<&mut DeviceKv, GpuError> {
    cache
        .tier_state()
        .as_mut()
        .and_then(|b| b.downcast_mut::<StagedKv>())
        .and_then(|s| s.stages.get_mut(stage))
        .and_then(|s| s.as_deref_mut())
        .ok_or_else(|| GpuError::Internal("KV cache without device state".into()))
}
