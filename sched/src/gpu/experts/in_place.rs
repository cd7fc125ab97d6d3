//! The device's expert table, and reading experts in place from RAM.
//!
//! Layers route on the device (no host round trip, the whole decode step
//! replayed as one graph) when the device knows where every routed expert
//! is: a table of six addresses per expert (gate, up, down, their FP8
//! scales) that `moe_route_plan` copies into each launch's pointer table.
//!
//! - **All in VRAM** (`preload_all`): every entry points at its pinned
//!   cache slot and never changes.
//! - **In place** ([`ExpertTier::map_ram`]): VRAM holds only some experts,
//!   but the RAM tier holds every one in its pinned arenas, registered
//!   with CUDA and mapped into the device's address space. An entry points
//!   at the expert's VRAM slot when it has one, else at its bytes in RAM,
//!   which the kernels then read over the bus as they compute, instead of
//!   the host reading the router back and copying the expert first.
//!
//! Between two device-routed passes the host reads back every layer's
//! routed ids (one copy, part of the graph), counts hits and misses (so the
//! cache's LRU order sees every use), and chooses missed experts to
//! promote into VRAM slots. At the next pass it reserves their slots
//! (evicting the least recently used idle experts), points the evicted
//! entries back at RAM, and copies the promoted experts on the copy stream
//! while that pass computes; their entries switch to the slot at the pass
//! after (the copy has drained by then). A slot is written only while no
//! entry points at it and no kernel runs, and an expert's bytes are the
//! same in RAM and in a slot, read by the same kernels: where an expert is
//! read from never changes a bit.

use std::sync::Arc;

use colibri_cuda::{
    BufMut, BufView, CudaDevice, DeviceBuffer, Event, HostBuffer, HostRegistration,
};
use colibri_model::ModelError;
use colibri_model::experts::{ExpertSource, ExpertWeights};

use super::super::slots::{Reserve, VramResidency};
use super::super::{Dims, GpuError};
use super::{Copied, ExpertTier, MoeBufs, bytemuck_f32, copy_expert_event, stored_bytes};

/// Missed experts promoted into VRAM per device-routed pass at most, once
/// the cache has no free slot (while it has, every miss is promoted). Each
/// promotion crosses the bus once more while the next pass reads its own
/// misses over it. Measured on the H200 (synthetic 30B-A3B, 4 GiB of VRAM,
/// reading in place): 8 per pass left the cache at 60% hits, 85.8 tok/s;
/// 32 reached 91% and 173.5 tok/s; 128 or no cap 90% and 161.8 tok/s.
pub(crate) const PROMOTE_PER_PASS: usize = 32;

/// Bytes kernels may read past the end of a matrix (the device table's
/// contract is 4; slots are padded by 16).
const OVER_READ: usize = 16;

/// Where the device finds every routed expert of the tier's layers.
pub(super) struct DeviceTable {
    /// `[entry][6]` device addresses (0 where a matrix has no scales).
    pub(super) buf: DeviceBuffer<u64>,
    /// What `buf` holds now.
    now: Vec<u64>,
    /// Set when experts without a VRAM slot are read in place from RAM.
    ram: Option<InPlace>,
}

impl DeviceTable {
    /// Every expert pinned in VRAM at `addrs` (never changes).
    pub(super) fn resident(dev: &CudaDevice, addrs: Vec<u64>) -> Result<DeviceTable, GpuError> {
        Ok(DeviceTable {
            buf: dev.upload(&addrs)?,
            now: addrs,
            ram: None,
        })
    }
}

impl DeviceTable {
    /// Whether some addresses may be pinned host RAM (experts read in
    /// place), not device memory.
    pub(super) fn reads_ram(&self) -> bool {
        self.ram.is_some()
    }

    /// The addresses `r` of the table, and where `moe_route_plan` writes
    /// layer `layer`'s routed ids for `nk` pairs when reading in place
    /// (the log the host reads back; `None`: the combine's own array).
    pub(super) fn parts(
        &mut self,
        r: std::ops::Range<usize>,
        layer: usize,
        nk: usize,
    ) -> Result<(BufView<'_, u64>, Option<BufMut<'_, u32>>), GpuError> {
        let log = match self.ram.as_mut() {
            Some(ip) if nk <= ip.log_rows * ip.k => {
                let at = layer * ip.log_rows * ip.k;
                Some(ip.log.view_mut(at..at + nk)?)
            }
            _ => None,
        };
        Ok((self.buf.view(r)?, log))
    }
}

/// Every routed expert held in the RAM tier's pinned arenas.
struct InPlace {
    /// The RAM tier's weights of every entry, held while the tier lives:
    /// a held expert is never evicted or moved.
    held: Vec<Option<Arc<ExpertWeights>>>,
    /// `[entry][6]`: the device addresses of each entry's bytes in RAM.
    ram: Vec<u64>,
    /// Routed ids of the last device-routed pass, `[layer][row][k]` for up
    /// to `log_rows` rows (moe_route_plan writes them here; the combine
    /// reads them), and their copy in pinned host memory.
    log: DeviceBuffer<u32>,
    log_host: HostBuffer,
    log_rows: usize,
    k: usize,
    /// Missed experts to promote at the next device-routed pass.
    wanted: Vec<u32>,
    /// Promotions whose copies were issued, and their events.
    copying: Vec<(u32, Event)>,
    /// Bytes of one expert of each layer (0: no routed experts).
    expert_bytes: Vec<u64>,
    /// Whether small passes read in place or route on the host.
    picker: RoutePicker,
}

/// Counters of reading in place.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct InPlaceCounters {
    /// Device-routed passes that read experts in place.
    pub passes: u64,
    /// Expert uses read from RAM in place, and their bytes.
    pub reads: u64,
    pub bytes: u64,
    /// Missed experts promoted into VRAM slots.
    pub promotions: u64,
    /// Changes of route ([`RoutePicker`]).
    pub switches: u64,
}

impl ExpertTier {
    /// Whether MoE layers of passes of at most `DEVICE_ROUTE_MAX_ROWS`
    /// rows route on the device: every expert is in VRAM, or every expert
    /// is in pinned RAM the device reads in place and that route is the
    /// faster one now ([`RoutePicker`]).
    pub fn routes_on_device(&self) -> bool {
        self.table.as_ref().is_some_and(|t| {
            t.ram
                .as_ref()
                .is_none_or(|ip| ip.picker.route() == Route::InPlace)
        })
    }

    /// Whether experts without a VRAM slot can be read in place from RAM
    /// (small passes then route either way, by measurement).
    pub fn reads_in_place(&self) -> bool {
        self.table.as_ref().is_some_and(|t| t.ram.is_some())
    }

    /// A small pass (one that could read in place) took `seconds` on the
    /// route [`Self::routes_on_device`] said.
    pub fn record_pass(&mut self, seconds: f64) {
        if let Some(ip) = self.table.as_mut().and_then(|t| t.ram.as_mut()) {
            let before = ip.picker.route();
            ip.picker.record(seconds);
            if ip.picker.route() != before {
                self.in_place.switches += 1;
            }
        }
    }

    /// When VRAM does not hold every routed expert: takes every one from
    /// `source` (which must be able to hold them all at once: the caller
    /// checks the RAM tier's plan) and, if each lies in one of `regs` where
    /// this device can read it, builds the device table (VRAM slots where
    /// experts have one, RAM elsewhere). Returns how many experts are read
    /// in place (0: the table was not built, and layers keep routing on
    /// the host).
    pub fn map_ram(
        &mut self,
        dev: &CudaDevice,
        dims: &Dims,
        source: &dyn ExpertSource,
        regs: &[HostRegistration],
    ) -> Result<usize, GpuError> {
        let per = self.per_layer;
        let layers = self.shapes.len();
        if self.table.is_some() || regs.is_empty() || per == 0 || dims.top_k == 0 {
            return Ok(0);
        }
        let entries = layers * per;
        let mut held: Vec<Option<Arc<ExpertWeights>>> = vec![None; entries];
        let mut ram = vec![0u64; entries * 6];
        let locate = |ptr: *const u8, len: usize, align: usize| -> Result<Option<u64>, GpuError> {
            let Some(reg) = regs.iter().find(|r| r.contains(ptr, len + OVER_READ)) else {
                return Ok(None);
            };
            let a = dev.mapped_address(reg, ptr)?;
            Ok(a.is_multiple_of(align as u64).then_some(a))
        };
        let ids: Vec<usize> = (0..per).collect();
        let mut why: Option<String> = None;
        for layer in 0..layers {
            let Some(shape) = self.shapes[layer] else {
                continue;
            };
            let mut failure: Option<GpuError> = None;
            let res = source.fetch(layer, &ids, &mut |e, w| {
                let entry = layer * per + e;
                let r = (|| -> Result<Option<String>, GpuError> {
                    if !shape.holds(&w) {
                        return Ok(Some(format!(
                            "layer {layer} expert {e} is stored unlike its layer's other experts"
                        )));
                    }
                    for (i, m) in [&w.gate, &w.up, &w.down].iter().enumerate() {
                        let bytes = stored_bytes(m)?;
                        let align = shape.mats[i].format.alignment();
                        let Some(a) = locate(bytes.as_ptr(), bytes.len(), align)? else {
                            return Ok(Some(format!(
                                "layer {layer} expert {e} is not in registered pinned RAM"
                            )));
                        };
                        ram[entry * 6 + i] = a;
                        if let Some(s) = m.scales() {
                            let sb = bytemuck_f32(&s.scales);
                            let Some(a) = locate(sb.as_ptr(), sb.len(), 4)? else {
                                return Ok(Some(format!(
                                    "the FP8 scales of layer {layer} expert {e} are not in \
                                     registered pinned RAM"
                                )));
                            };
                            ram[entry * 6 + 3 + i] = a;
                        }
                    }
                    Ok(None)
                })();
                match r {
                    Ok(None) => {
                        held[entry] = Some(w);
                        Ok(())
                    }
                    Ok(Some(reason)) => {
                        why = Some(reason.clone());
                        Err(ModelError::Invalid(reason))
                    }
                    Err(err) => {
                        let msg = err.to_string();
                        failure = Some(err);
                        Err(ModelError::Invalid(msg))
                    }
                }
            });
            if let Some(reason) = why.take() {
                tracing::info!("GPU tier: experts are not read in place from RAM: {reason}");
                return Ok(0);
            }
            if let Err(e) = res {
                return Err(failure.take().unwrap_or(GpuError::Model(e)));
            }
        }
        let log_rows = super::super::forward::DEVICE_ROUTE_MAX_ROWS.min(dims.max_rows.max(1));
        let log_len = layers * log_rows * dims.top_k;
        let expert_bytes = self
            .shapes
            .iter()
            .map(|s| {
                s.map_or(0, |s| {
                    s.mats
                        .iter()
                        .map(|m| (m.bytes + m.scales.map_or(0, |(_, n)| 4 * n)) as u64)
                        .sum()
                })
            })
            .collect();
        let mut table = DeviceTable {
            buf: dev.alloc::<u64>(entries * 6)?,
            now: vec![u64::MAX; entries * 6],
            ram: Some(InPlace {
                held,
                ram,
                log: dev.alloc::<u32>(log_len.max(1))?,
                log_host: dev.alloc_host(4 * log_len.max(1))?,
                log_rows,
                k: dims.top_k,
                wanted: Vec::new(),
                copying: Vec::new(),
                expert_bytes,
                picker: RoutePicker::from_env(),
            }),
        };
        self.sync_table(dev, &mut table)?;
        self.table = Some(table);
        Ok(self.entries_in_place())
    }

    /// Experts that have no VRAM slot now.
    fn entries_in_place(&self) -> usize {
        (0..self.shapes.len() * self.per_layer)
            .filter(|&e| {
                self.shapes[e / self.per_layer].is_some()
                    && !matches!(
                        self.cache.residency(e as u32),
                        VramResidency::Resident { .. }
                    )
            })
            .count()
    }

    /// Where entry `e`'s six addresses should point now: its VRAM slot
    /// when it is resident there, else its bytes in RAM.
    fn wanted_addrs(&self, ip: &InPlace, e: usize) -> Result<[u64; 6], GpuError> {
        let mut a = [0u64; 6];
        match (
            self.cache.residency(e as u32),
            self.cache.slot_of(e as u32),
            self.shapes[e / self.per_layer],
        ) {
            (VramResidency::Resident { .. }, Some(s), Some(shape)) => {
                let base = self.cache_slot_ptr(s)?;
                for m in 0..3 {
                    a[m] = base + shape.off[m] as u64;
                    if shape.mats[m].scales.is_some() {
                        a[3 + m] = base + shape.scale_off[m] as u64;
                    }
                }
            }
            _ => a.copy_from_slice(&ip.ram[e * 6..e * 6 + 6]),
        }
        Ok(a)
    }

    /// Writes the entries of `t` whose place changed since the last call
    /// (one synchronous copy of the changed range, on the compute stream:
    /// no kernel runs between passes).
    fn sync_table(&self, dev: &CudaDevice, t: &mut DeviceTable) -> Result<(), GpuError> {
        let Some(ip) = t.ram.as_ref() else {
            return Ok(());
        };
        let mut changed: Option<(usize, usize)> = None;
        for e in 0..self.shapes.len() * self.per_layer {
            if self.shapes[e / self.per_layer].is_none() {
                continue;
            }
            let a = self.wanted_addrs(ip, e)?;
            if t.now[e * 6..e * 6 + 6] != a {
                t.now[e * 6..e * 6 + 6].copy_from_slice(&a);
                changed = Some(changed.map_or((e, e), |(lo, _)| (lo, e)));
            }
        }
        if let Some((lo, hi)) = changed {
            let r = lo * 6..(hi + 1) * 6;
            dev.write(t.buf.view_mut(r.clone())?, &t.now[r])?;
        }
        Ok(())
    }

    /// Marks promotions whose copies have completed resident (every pass
    /// ends with both streams drained, so all have). Call before any pass.
    pub fn settle(&mut self) -> Result<(), GpuError> {
        let Some(ip) = self.table.as_mut().and_then(|t| t.ram.as_mut()) else {
            return Ok(());
        };
        for (e, ev) in std::mem::take(&mut ip.copying) {
            ev.synchronize()?;
            self.cache.complete(e, 0, false);
        }
        Ok(())
    }

    /// Before a device-routed pass that reads in place: reserves slots for
    /// the promotions chosen after the last one, points every entry where
    /// its expert is, then issues the promotions' copies on the copy
    /// stream (they overlap this pass; the entries switch to their slots
    /// at the next one).
    pub fn begin_device_pass(&mut self, dev: &CudaDevice) -> Result<(), GpuError> {
        self.settle()?;
        let Some(mut t) = self.table.take() else {
            return Ok(());
        };
        let r = self.begin_in_place(dev, &mut t);
        self.table = Some(t);
        r
    }

    fn begin_in_place(&mut self, dev: &CudaDevice, t: &mut DeviceTable) -> Result<(), GpuError> {
        let Some(ip) = t.ram.as_mut() else {
            return Ok(());
        };
        let mut issue = Vec::new();
        for e in std::mem::take(&mut ip.wanted) {
            match self.cache.reserve(e) {
                Reserve::Slot { slot, .. } => issue.push((e, slot)),
                Reserve::Full => break,
                Reserve::InFlight | Reserve::Resident => {}
            }
        }
        // Evicted entries point back at RAM before any copy can start.
        self.sync_table(dev, t)?;
        let Some(ip) = t.ram.as_mut() else {
            return Ok(());
        };
        for (i, &(e, slot)) in issue.iter().enumerate() {
            let layer = e as usize / self.per_layer;
            let copied = (|| -> Result<(Event, Copied), GpuError> {
                let (Some(shape), Some(w)) = (self.shapes[layer], ip.held[e as usize].as_ref())
                else {
                    return Err(GpuError::Internal(format!(
                        "entry {e} has no expert in RAM"
                    )));
                };
                let sb = self.classes.slot_bytes[slot.class];
                let buf = self.cache_bufs[slot.class]
                    .as_mut()
                    .ok_or_else(|| GpuError::Internal("a cache slot without cache".into()))?;
                // SAFETY: `w` is held while the tier lives; the slot was
                // just reserved, so no table entry points at it (the sync
                // above) and no kernel runs on it: the last pass drained,
                // and this one reads it only after `settle` has waited for
                // the event below.
                unsafe { copy_expert_event(dev, &shape, w, buf, slot.slot * sb) }
            })();
            match copied {
                Ok((done, copied)) => {
                    ip.copying.push((e, done));
                    self.in_place.promotions += 1;
                    self.counters.h2d_bytes += copied.bytes;
                }
                Err(err) => {
                    for &(e, _) in &issue[i..] {
                        self.cache.abort(e);
                    }
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    /// The combine's expert ids of MoE layer `layer` for `nk` pairs: where
    /// the layer's routing wrote them.
    pub fn routed_ids<'a>(
        &'a self,
        bufs: &'a MoeBufs,
        layer: usize,
        nk: usize,
        device_routed: bool,
    ) -> Result<BufView<'a, u32>, GpuError> {
        if device_routed
            && let Some(ip) = self.table.as_ref().and_then(|t| t.ram.as_ref())
            && nk <= ip.log_rows * ip.k
        {
            let at = layer * ip.log_rows * ip.k;
            return Ok(ip.log.view(at..at + nk)?);
        }
        bufs.comb_ids(nk)
    }

    /// Enqueues the read-back of the pass's routed ids (after its last
    /// MoE layer, on the compute stream).
    pub fn download_log(&mut self, dev: &CudaDevice) -> Result<(), GpuError> {
        let Some(ip) = self.table.as_mut().and_then(|t| t.ram.as_mut()) else {
            return Ok(());
        };
        let len = ip.log.len();
        // SAFETY: `log_host` is read by the host only in `end_device_pass`,
        // after the pass's stream has drained.
        unsafe {
            dev.download_async(
                ip.log.view(0..len)?,
                &mut ip.log_host.typed_mut::<u32>()[..len],
            )?
        };
        Ok(())
    }

    /// After a device-routed pass of `n` rows has drained: counts each
    /// layer's experts as VRAM hits (refreshing their LRU place) or reads
    /// in place, and chooses the misses to promote at the next pass.
    pub fn end_device_pass(&mut self, n: usize) {
        let Some(mut t) = self.table.take() else {
            return;
        };
        if let Some(ip) = t.ram.as_mut() {
            self.count_pass(ip, n);
        }
        self.table = Some(t);
    }

    fn count_pass(&mut self, ip: &mut InPlace, n: usize) {
        let per = self.per_layer;
        let nk = n.min(ip.log_rows) * ip.k;
        self.in_place.passes += 1;
        let log = ip.log_host.typed::<u32>();
        let mut ids: Vec<u32> = Vec::with_capacity(nk);
        for layer in 0..self.shapes.len() {
            let Some(class) = self.classes.layer_class[layer] else {
                continue;
            };
            let at = layer * ip.log_rows * ip.k;
            ids.clear();
            ids.extend(log[at..at + nk].iter().filter(|&&e| (e as usize) < per));
            ids.sort_unstable();
            ids.dedup();
            // With no free slot, a promotion evicts: only a few per pass.
            let free = self.cache.resident(class) < self.cache.slots(class);
            for &e in &ids {
                let entry = (layer * per) as u32 + e;
                if self.cache.lease(entry).is_some() {
                    self.cache.release(entry);
                    continue;
                }
                self.in_place.reads += 1;
                self.in_place.bytes += ip.expert_bytes[layer];
                if self.cache.slots(class) > 0 && (free || ip.wanted.len() < PROMOTE_PER_PASS) {
                    ip.wanted.push(entry);
                }
            }
        }
    }
}

/// How a pass that could read experts in place routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// On the device, reading missed experts in place (one graph).
    InPlace,
    /// On the host, copying missed experts into VRAM first (a round trip
    /// per MoE layer, copies at the DMA engines' rate).
    Host,
}

/// Passes per measurement epoch, and how many of its first passes are not
/// timed (a switch's graph capture, promotions, copies in flight). An
/// epoch's figure is the median of its timed passes, so a prompt's pass
/// among decode steps does not decide it.
const EPOCH: u32 = 16;
const SETTLE: u32 = 2;
/// Epochs between two probes of the slower route, first and at most: a
/// probe that loses doubles the interval, one that wins resets it. The
/// first is soon: the first epochs run while the VRAM cache fills.
const PROBE_FIRST: u64 = 2;
const PROBE_MAX: u64 = 256;

/// Chooses, by measurement, how passes that could read experts in place
/// route. Which is faster depends on the misses, the bus and the cache:
/// kernels reading host memory in place stall on the bus as they compute
/// (H200, every expert missing: 43 GB/s against 49 for the host route's
/// copies), and the few promotions per step leave the cache colder than
/// promoting every staged miss does. Reading in place wins when few
/// experts miss (no round trip per layer, one graph per step; on the
/// synthetic 30B-A3B, 8 GiB of VRAM: 260 against 185 tok/s) and loses
/// when most do (2 GiB: 44 against 47.5). Both give the same bits, so the
/// choice is free to change: each
/// epoch of passes is timed, the faster route is kept, and the other is
/// probed again now and then (less often while it keeps losing).
#[derive(Clone, Debug)]
pub(crate) struct RoutePicker {
    route: Route,
    in_epoch: u32,
    /// The epoch's timed passes, in seconds.
    times: Vec<f64>,
    epoch: u64,
    /// Median seconds per pass of each route's last measured epoch.
    mean: [Option<f64>; 2],
    probe_every: u64,
    next_probe: u64,
    probing: bool,
    /// Set: always this route (`COLIBRI_GPU_ROUTE`, for comparisons).
    fixed: bool,
}

impl Default for RoutePicker {
    fn default() -> Self {
        RoutePicker {
            route: Route::InPlace,
            in_epoch: 0,
            times: Vec::with_capacity(EPOCH as usize),
            epoch: 0,
            mean: [None, None],
            probe_every: PROBE_FIRST,
            next_probe: 0,
            probing: false,
            fixed: false,
        }
    }
}

impl RoutePicker {
    /// The picker, or one route always when `COLIBRI_GPU_ROUTE` is
    /// `in-place` or `host` (to measure one against the other).
    pub fn from_env() -> RoutePicker {
        let fixed = match std::env::var("COLIBRI_GPU_ROUTE").as_deref() {
            Ok("in-place") => Some(Route::InPlace),
            Ok("host") => Some(Route::Host),
            _ => None,
        };
        match fixed {
            Some(route) => RoutePicker {
                route,
                fixed: true,
                ..RoutePicker::default()
            },
            None => RoutePicker::default(),
        }
    }

    pub fn route(&self) -> Route {
        self.route
    }

    fn slot(r: Route) -> usize {
        match r {
            Route::InPlace => 0,
            Route::Host => 1,
        }
    }

    fn other(r: Route) -> Route {
        match r {
            Route::InPlace => Route::Host,
            Route::Host => Route::InPlace,
        }
    }

    /// A pass on the current route took `seconds`.
    pub fn record(&mut self, seconds: f64) {
        if self.fixed {
            return;
        }
        if self.in_epoch >= SETTLE {
            self.times.push(seconds);
        }
        self.in_epoch += 1;
        if self.in_epoch < EPOCH {
            return;
        }
        self.times.sort_unstable_by(f64::total_cmp);
        let mean = self.times.get(self.times.len() / 2).copied().unwrap_or(0.0);
        let (cur, other) = (self.route, Self::other(self.route));
        self.mean[Self::slot(cur)] = Some(mean);
        self.epoch += 1;
        self.in_epoch = 0;
        self.times.clear();
        let next = match self.mean[Self::slot(other)] {
            // Never measured: measure it now.
            None => {
                self.probing = true;
                other
            }
            Some(o) => {
                let best = if o < mean { other } else { cur };
                if self.probing {
                    // The probe is over: back off while it keeps losing.
                    self.probing = false;
                    self.probe_every = if best == cur {
                        PROBE_FIRST
                    } else {
                        (self.probe_every * 2).min(PROBE_MAX)
                    };
                    self.next_probe = self.epoch + self.probe_every;
                    best
                } else if best == cur && self.epoch >= self.next_probe {
                    self.probing = true;
                    other
                } else {
                    if best != cur {
                        self.next_probe = self.epoch + self.probe_every;
                    }
                    best
                }
            }
        };
        self.route = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `passes` passes whose cost by route is `cost(route, pass)`;
    /// returns how many ran on each route.
    fn run(p: &mut RoutePicker, passes: usize, cost: impl Fn(Route, usize) -> f64) -> [usize; 2] {
        let mut n = [0; 2];
        for i in 0..passes {
            let r = p.route();
            n[RoutePicker::slot(r)] += 1;
            p.record(cost(r, i));
        }
        n
    }

    #[test]
    fn keeps_the_faster_route_and_probes_the_other_ever_less_often() {
        // Reading in place twice as slow (many misses): after one epoch of
        // each, the host route; probes of in place back off.
        let mut p = RoutePicker::default();
        let slow_in_place = |r: Route, i: usize| match r {
            Route::InPlace => 0.02 + 1e-6 * (i % 3) as f64,
            Route::Host => 0.01 + 1e-6 * (i % 5) as f64,
        };
        let first = run(&mut p, 2 * EPOCH as usize, slow_in_place);
        assert_eq!(first, [EPOCH as usize, EPOCH as usize]);
        assert_eq!(p.route(), Route::Host);
        let early = run(&mut p, 64 * EPOCH as usize, slow_in_place);
        let late = run(&mut p, 512 * EPOCH as usize, slow_in_place);
        assert!(early[0] > 0, "in place is probed again: {early:?}");
        let share = |n: [usize; 2]| n[0] as f64 / (n[0] + n[1]) as f64;
        assert!(share(early) < 0.15, "{early:?}");
        assert!(
            share(late) < share(early) && share(late) < 0.01,
            "probes back off: {early:?} then {late:?}"
        );
        // The other way round (few misses): in place, after the one probe.
        let mut p = RoutePicker::default();
        let fast_in_place = |r: Route, _| match r {
            Route::InPlace => 0.004,
            Route::Host => 0.006,
        };
        let n = run(&mut p, 100 * EPOCH as usize, fast_in_place);
        assert_eq!(p.route(), Route::InPlace);
        assert!(n[1] < 12 * EPOCH as usize, "{n:?}");
    }

    #[test]
    fn follows_a_change_in_which_route_is_faster() {
        let mut p = RoutePicker::default();
        let before = |r: Route, _| if r == Route::InPlace { 0.004 } else { 0.006 };
        run(&mut p, 40 * EPOCH as usize, before);
        assert_eq!(p.route(), Route::InPlace);
        // Misses rise (a new working set): the host route becomes faster
        // and is taken once it has been measured again.
        let after = |r: Route, _| if r == Route::InPlace { 0.012 } else { 0.006 };
        run(&mut p, (PROBE_FIRST as usize + 2) * EPOCH as usize, after);
        assert_eq!(p.route(), Route::Host);
        // The first epochs' passes are not timed: a slow switch costs
        // nothing.
        let mut p = RoutePicker::default();
        run(&mut p, 2 * EPOCH as usize, |r, i| {
            match (r, i % EPOCH as usize) {
                (_, k) if (k as u32) < SETTLE => 1.0,
                (Route::InPlace, _) => 0.004,
                (Route::Host, _) => 0.006,
            }
        });
        assert_eq!(p.route(), Route::InPlace);
    }

    #[test]
    fn one_long_pass_in_an_epoch_does_not_decide_it() {
        // A prompt's pass (ten times a decode step) in the middle of the
        // first, in place, epoch: in place stays the faster route.
        let mut p = RoutePicker::default();
        run(&mut p, 4 * EPOCH as usize, |r, i| {
            let base = if r == Route::InPlace { 0.004 } else { 0.006 };
            if i == EPOCH as usize / 2 {
                10.0 * base
            } else {
                base
            }
        });
        assert_eq!(p.route(), Route::InPlace);
    }
}
