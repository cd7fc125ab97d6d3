//! `TierCache`: routed experts read from disk on demand into a budgeted RAM
//! cache of pinned slots, behind the [`ExpertSource`] trait.
//!
//! # Structure
//!
//! Every routed expert is an *entry* (dense index from [`ExpertLayout`]) in
//! one of three states, all under one mutex:
//!
//! - `Absent`;
//! - `Loading`: a read is in flight into a slot the entry owns; everyone
//!   who wants the expert meanwhile joins its waiter list (**single
//!   flight**: one read per (layer, expert) at a time, whoever started it —
//!   a `fetch` or a `prefetch`);
//! - `Resident`: the bytes are in a slot ([`SlotStorage`]) and the entry
//!   counts its **leases**.
//!
//! A lease is what a caller holds: the [`ExpertWeights`] handed out are
//! views into the slot whose owner is a `Lease`; when the last view of it
//! drops, the lease ends. An expert with a live lease is in no eviction
//! list, so it cannot be evicted, and no slot is ever reused while anyone
//! can still read it. Pinned experts are never in a list either. Only idle
//! entries (resident, unleased, unpinned) are linked into the per-class
//! eviction order ([`EvictionOrder`], O(1)); at most `cache_slots` of them
//! are kept per size class, the oldest beyond that are evicted as soon as
//! they become idle.
//!
//! # Slots
//!
//! Each size class has one [`PinnedArena`] of `pinned + cache + staging`
//! slots (see the planner). The staging slots are what make a budget of
//! zero cached experts work: a miss is read into a free slot, used, and the
//! slot is freed when its lease ends. A miss that finds no free slot evicts
//! the least valuable idle expert, else the oldest unused prefetch, else
//! waits for a slot to come back (a lease ending or a read failing).
//! Prefetch only takes free slots beyond a reserve kept for demand reads
//! (half the demand staging; the plan adds staging slots for prefetch when
//! the prefetcher runs), never evicts a cached or leased expert, and
//! replaces its own oldest unused prediction of an earlier batch when it
//! runs out. How prefetch reads are promoted when a demand joins them and
//! dropped when they go stale is in `cache/speculation.rs`.
//!
//! # Order of delivery
//!
//! `fetch` first issues the demand reads of its misses (with the prefetch
//! reads of [`TierCache::fetch_with_prefetch`] in the same submission,
//! after them), then delivers the hits (the caller computes on them while
//! the reads are in flight), then delivers the misses one by one as their
//! reads complete. Completions are
//! taken by one installer thread, which turns a finished read into a
//! resident entry and hands a lease to every waiter through the waiter's
//! channel.
//!
//! # Locks
//!
//! One mutex guards all entry state. A `Lease` takes it when it ends, so a
//! lease is never dropped while the mutex is held: leases that could not be
//! delivered are collected and dropped after unlocking.

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use colibri_io::crossbeam_channel::{self, Receiver, RecvTimeoutError, Sender};
use colibri_io::{
    BackendInfo, Completion, CompletionSender, CounterSnapshot, FileSet, IoError, PinnedArena,
    Priority, ReadRequest, Reader, ReaderConfig, Slot, Ticket, completion_channel,
};
use colibri_model::experts::{ExpertGroup, ExpertSource, ExpertWeights, SourceStats};
use colibri_model::source::{ExpertLocation, ExpertLocator};
use colibri_model::tensor::{ByteStorage, Bytes, QMatrix};
use colibri_model::{ModelError, ModelSpec};

use super::layout::{ExpertLayout, FileFacts};
use super::lists::{EvictionOrder, IntrusiveLists, ListId};
use super::memory::MemoryLimits;
use super::plan::{Plan, PlanRequest};
use super::stats::{Counters, LatencySummary, ReadLatency, TierStats, bump};
use super::usage::{UsageHistory, model_key};
use super::{TierError, TierSetup, UsageMode};

mod speculation;

/// How long a fetch waits for a slot with no read of its own in flight
/// before it reports that every slot is held (a caller keeping more
/// experts alive than the staging area holds). Never a silent hang.
const SLOT_WAIT_LIMIT: Duration = Duration::from_secs(120);

/// A long-running process (a server) writes its usage history this often,
/// on a short-lived thread of its own, so a crash or a kill loses at most
/// this much learning; the history is also written when the tier drops.
const USAGE_SAVE_INTERVAL: Duration = Duration::from_secs(600);

/// The bytes of one resident expert: the slot and where each matrix is.
struct SlotStorage {
    slot: Slot,
    matrices: [std::ops::Range<usize>; 3],
    /// Set once the bytes have passed the record's checksum: they are not
    /// written again while this storage lives (a refill makes a new one),
    /// so later leases skip the hash (2.5 MB of xxh3 per lease was the
    /// largest cost of a RAM hit on the GPU tier's copy path).
    verified: std::sync::atomic::AtomicBool,
    /// Its Q4_0 matrices are in the CPU's tile layout
    /// ([`colibri_model::kernels::q4_0_tiles`]), not as stored.
    tiled: bool,
}

/// One lease of a resident expert; the owner of the byte views handed out.
struct Lease {
    /// Taken out (and dropped) before the lease is reported ended, so an
    /// entry whose leases are all gone holds the only reference to its
    /// storage and evicting it frees the slot at once.
    storage: Option<Arc<SlotStorage>>,
    shared: Weak<Shared>,
    entry: u32,
}

impl ByteStorage for Lease {
    fn bytes(&self) -> &[u8] {
        match &self.storage {
            Some(storage) => storage.slot.bytes(),
            None => &[],
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        drop(self.storage.take());
        if let Some(shared) = self.shared.upgrade() {
            shared.end_lease(self.entry);
        }
    }
}

/// What a fetch hears about the experts it waits for.
enum Msg {
    Ready {
        lease: Lease,
    },
    Failed {
        entry: u32,
        reason: String,
    },
    /// A slot may have become available.
    Wake,
}

struct Loading {
    /// Current priority: a prefetch read a demand has joined is promoted.
    priority: Priority,
    /// Who started the read (a prefetch stays a prefetch in the counters).
    origin: Priority,
    waiters: Vec<Sender<Msg>>,
    since: Instant,
    /// Pin the expert once it lands (start-up loading of hot experts).
    pin: bool,
    /// Identifies this read among all reads of the entry, so a ticket
    /// recorded after `submit` returns lands on the read it belongs to.
    read_id: u64,
    /// The reader's ticket (prefetch reads only: recorded after submit).
    ticket: Option<Ticket>,
    /// A demand joined before the ticket was known: promote once it is.
    promote_pending: bool,
    /// A stale prediction: cancelled (or to be cancelled once the ticket is
    /// known); nobody may join it, whatever comes back is discarded.
    cancelled: bool,
    /// A demand has used this prefetch (counted once).
    used: bool,
    /// A fill read ([`TierCache::fill`]): lands in the class's filled list.
    fill: bool,
}

impl Loading {
    fn new(priority: Priority, waiters: Vec<Sender<Msg>>, read_id: u64, pin: bool) -> Loading {
        Loading {
            priority,
            origin: priority,
            waiters,
            since: Instant::now(),
            pin,
            read_id,
            ticket: None,
            promote_pending: false,
            cancelled: false,
            used: false,
            fill: false,
        }
    }
}

struct Resident {
    storage: Arc<SlotStorage>,
    leases: u32,
    pinned: bool,
    /// Used again after the use that brought it in (SLRU's promotion test).
    reused: bool,
}

enum Entry {
    Absent,
    Loading(Loading),
    Resident(Resident),
}

/// Where one expert is right now (tests and diagnostics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    Absent,
    Loading,
    /// In RAM; `leases` holders; `pinned`; `evictable` (idle and linked).
    Resident {
        leases: u32,
        pinned: bool,
        evictable: bool,
    },
}

/// Slot use of one size class at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ClassOccupancy {
    pub slot_bytes: u64,
    pub arena_slots: usize,
    pub free_slots: usize,
    pub cache_slots: usize,
    pub staging_slots: usize,
    pub pinned: usize,
    /// Idle cached experts (evictable).
    pub idle: usize,
    /// Prefetched experts not yet used.
    pub unclaimed: usize,
    /// Experts a fill brought in, not yet used.
    pub filled: usize,
    pub leased: usize,
    pub loading: usize,
}

struct ClassState {
    arena: Arc<PinnedArena>,
    order: EvictionOrder,
    unclaimed: ListId,
    /// Experts read into free cache room by [`TierCache::fill`], not yet
    /// used; newest (least favoured) at the front. They count against
    /// `cache_slots` and are the first to go when a slot is needed.
    filled: ListId,
    /// Fill reads of this class in flight.
    fill_loading: usize,
    cache_slots: usize,
    staging_slots: usize,
    /// Free slots prefetch leaves to demand reads.
    prefetch_reserve: usize,
}

struct State {
    entries: Vec<Entry>,
    lists: IntrusiveLists,
    classes: Vec<ClassState>,
    usage: Option<UsageHistory>,
    /// When the usage history was last written (or the tier opened).
    usage_saved: Instant,
    /// Fetches waiting for a slot.
    slot_waiters: Vec<Sender<Msg>>,
    /// Source of [`Loading::read_id`].
    next_read_id: u64,
    /// Per entry: the prefetch batch that last read it.
    prefetch_batch: Vec<u64>,
    /// Prefetch batches started so far.
    prefetch_batches: u64,
    /// Entries in [`Entry::Resident`].
    resident: usize,
}

pub(crate) struct Shared {
    layout: ExpertLayout,
    files: Arc<FileSet>,
    state: Mutex<State>,
    counters: Counters,
    latency: ReadLatency,
    /// Tile the Q4_0 matrices of experts as they arrive (see
    /// [`TierCache::set_tile_q4_0`]).
    tile_q4_0: std::sync::atomic::AtomicBool,
}

/// Whether the RAM tier rearranges matrices of `format` into a CPU
/// layout when it tiles experts: Q4_0 into tiles (where the tiling is on
/// at all), Q2_K, Q3_K, Q4_K and Q5_K into panels where a panel kernel
/// for them runs ([`colibri_model::kernels::panels_run_here`]).
fn cpu_layout(format: colibri_model::format::WeightFormat) -> bool {
    match format {
        colibri_model::format::WeightFormat::Q4_0 => true,
        f => colibri_model::kernels::panels_run_here(f),
    }
}

/// Rearranges the matrices of one expert in `bytes` (its slot;
/// `ranges[i]` where matrix `i` is) that take a CPU layout
/// ([`cpu_layout`]: Q4_0 tiles, k-quant panels), or back to rows.
/// Whether it had any.
fn retile_q4_0(
    location: &ExpertLocation,
    bytes: &mut [u8],
    ranges: &[std::ops::Range<usize>; 3],
    to_tiles: bool,
) -> Result<bool, String> {
    use colibri_model::format::WeightFormat;
    use colibri_model::kernels::{k_panels, q4_0_tiles};
    let mut scratch = Vec::new();
    let mut any = false;
    for (m, range) in location.matrices().into_iter().zip(ranges) {
        if !cpu_layout(m.format) {
            continue;
        }
        let rb = m.format.row_bytes(m.cols).unwrap_or(0);
        let want = m.rows * rb;
        let Some(part) = bytes
            .get_mut(range.clone())
            .filter(|p| rb > 0 && p.len() == want)
        else {
            return Err(format!(
                "a {}×{} {} matrix in {range:?} of a {}-byte slot",
                m.rows,
                m.cols,
                m.format.name(),
                bytes.len()
            ));
        };
        let blocks = m.cols / colibri_model::quant::QK;
        match (m.format, to_tiles) {
            (WeightFormat::Q4_0, true) => {
                q4_0_tiles::tile_in_place(part, m.rows, blocks, &mut scratch)
            }
            (WeightFormat::Q4_0, false) => {
                q4_0_tiles::untile_in_place(part, m.rows, blocks, &mut scratch)
            }
            (f, true) => k_panels::panels_in_place(f, part, m.rows, rb, &mut scratch),
            (f, false) => k_panels::rows_in_place(f, part, m.rows, rb, &mut scratch),
        }
        any = true;
    }
    Ok(any)
}

/// What the installer did to a read's bytes before making them resident.
#[derive(Default)]
struct Prepared {
    /// Checked against the record's checksum (before tiling: the checksum
    /// covers the bytes as stored).
    verified: bool,
    tiled: bool,
}

/// The outcome of a fetch's first look at one expert.
enum Claim {
    Hit(Lease),
    Joined,
    /// Joined a prefetch read that must now be promoted to demand priority.
    JoinedPromote(Ticket),
    Absent,
    /// A cancelled prediction's read is still in flight: look again once it
    /// has come back.
    Busy,
}

impl State {
    fn class_of(&self, layout: &ExpertLayout, e: u32) -> usize {
        layout.records[e as usize].class
    }

    /// Tells every fetch waiting for a slot to look again.
    fn wake(&mut self) {
        for waiter in self.slot_waiters.drain(..) {
            let _ = waiter.send(Msg::Wake);
        }
    }

    fn new_lease(&mut self, weak: &Weak<Shared>, e: u32) -> Option<Lease> {
        let Entry::Resident(r) = &mut self.entries[e as usize] else {
            return None;
        };
        r.leases += 1;
        Some(Lease {
            storage: Some(Arc::clone(&r.storage)),
            shared: weak.clone(),
            entry: e,
        })
    }

    /// Drops an idle or unclaimed entry; its slot returns to the arena now.
    fn evict(&mut self, layout: &ExpertLayout, counters: &Counters, e: u32) {
        let class = self.class_of(layout, e);
        let list = self.lists.remove(e);
        if list == Some(self.classes[class].filled) {
            bump(&counters.fill_unused, 1);
            bump(
                &counters.fill_unused_bytes,
                layout.records[e as usize].read_bytes,
            );
        } else if list == Some(self.classes[class].unclaimed) {
            bump(&counters.prefetch_unused, 1);
            bump(&counters.prefetch_wasted, 1);
            bump(
                &counters.prefetch_wasted_bytes,
                layout.records[e as usize].read_bytes,
            );
        } else {
            bump(&counters.evictions, 1);
        }
        if let Entry::Resident(r) = &self.entries[e as usize] {
            debug_assert_eq!(r.leases, 0, "evicting a leased expert");
            debug_assert_eq!(Arc::strong_count(&r.storage), 1, "slot still referenced");
            self.resident -= 1;
        }
        self.entries[e as usize] = Entry::Absent;
    }

    /// Links a resident entry whose last lease just ended (or that landed
    /// with no one waiting) into its eviction order, and keeps the class
    /// within its cache slots.
    fn become_idle(&mut self, layout: &ExpertLayout, counters: &Counters, e: u32) {
        let reused = match &self.entries[e as usize] {
            Entry::Resident(r) if r.leases == 0 && !r.pinned => r.reused,
            _ => return,
        };
        let class = self.class_of(layout, e);
        let order = self.classes[class].order;
        order.insert(&mut self.lists, e, reused);
        self.trim(layout, counters, class);
        self.wake();
    }

    /// Idle cached experts of `class`, filled ones included.
    fn cached(&self, class: usize) -> usize {
        let c = &self.classes[class];
        c.order.len(&self.lists) + self.lists.len(c.filled)
    }

    /// Keeps `class` within its cache slots: the least favoured filled
    /// expert goes first, then the eviction order's victim.
    fn trim(&mut self, layout: &ExpertLayout, counters: &Counters, class: usize) {
        while self.cached(class) > self.classes[class].cache_slots {
            let c = &self.classes[class];
            let Some(victim) = self
                .lists
                .front(c.filled)
                .or_else(|| c.order.victim(&self.lists))
            else {
                break;
            };
            self.evict(layout, counters, victim);
        }
    }

    /// A slot for a demand read: free, else by evicting the least favoured
    /// filled expert, else an idle expert, else the oldest unused prefetch.
    fn demand_slot(
        &mut self,
        layout: &ExpertLayout,
        counters: &Counters,
        class: usize,
    ) -> Option<Slot> {
        loop {
            let c = &self.classes[class];
            if let Some(slot) = c.arena.try_acquire() {
                return Some(slot);
            }
            let victim = self
                .lists
                .front(c.filled)
                .or_else(|| c.order.victim(&self.lists))
                .or_else(|| self.lists.back(c.unclaimed))?;
            self.evict(layout, counters, victim);
        }
    }

    /// The demand path's first look at an entry: a hit takes a lease, a
    /// read in flight is joined; an absent entry is left to
    /// [`issue_demand`](Self::issue_demand), which runs only after every
    /// hit of the fetch is leased, so a miss can never evict a hit of the
    /// same fetch.
    fn claim(
        &mut self,
        layout: &ExpertLayout,
        counters: &Counters,
        weak: &Weak<Shared>,
        e: u32,
        waiter: &Sender<Msg>,
    ) -> Claim {
        let class = self.class_of(layout, e);
        let unclaimed = self.classes[class].unclaimed;
        let filled = self.classes[class].filled;
        let read_bytes = layout.records[e as usize].read_bytes;
        match &mut self.entries[e as usize] {
            Entry::Resident(r) => {
                match self.lists.remove(e) {
                    Some(list) if list == unclaimed => {
                        bump(&counters.prefetch_hits, 1);
                        bump(&counters.prefetch_used, 1);
                        bump(&counters.prefetch_used_bytes, read_bytes);
                    }
                    // Its first use: what brought it in was the fill.
                    Some(list) if list == filled => {
                        bump(&counters.fill_hits, 1);
                        bump(&counters.fill_used_bytes, read_bytes);
                    }
                    _ => r.reused = true,
                }
                bump(&counters.hits, 1);
                match self.new_lease(weak, e) {
                    Some(lease) => Claim::Hit(lease),
                    None => Claim::Absent,
                }
            }
            Entry::Loading(l) if l.cancelled => Claim::Busy,
            Entry::Loading(l) => {
                l.waiters.push(waiter.clone());
                let first_use = !std::mem::replace(&mut l.used, true);
                match l.origin {
                    Priority::Demand => bump(&counters.joined_demand, 1),
                    Priority::Prefetch if l.fill => {
                        if first_use {
                            bump(&counters.fill_joined, 1);
                            bump(&counters.fill_used_bytes, read_bytes);
                        } else {
                            bump(&counters.joined_demand, 1);
                        }
                    }
                    Priority::Prefetch => {
                        bump(&counters.joined_prefetch, 1);
                        if first_use {
                            bump(&counters.prefetch_used, 1);
                            bump(&counters.prefetch_used_bytes, read_bytes);
                        }
                    }
                }
                if l.priority == Priority::Prefetch && !l.pin {
                    // Compute now waits for it: it must not wait behind
                    // speculation any more.
                    l.priority = Priority::Demand;
                    bump(&counters.prefetch_promoted, 1);
                    match l.ticket {
                        Some(ticket) => return Claim::JoinedPromote(ticket),
                        None => l.promote_pending = true,
                    }
                }
                Claim::Joined
            }
            Entry::Absent => Claim::Absent,
        }
    }

    /// Starts a demand read of an absent entry, if a slot can be had.
    fn issue_demand(
        &mut self,
        layout: &ExpertLayout,
        counters: &Counters,
        e: u32,
        waiter: &Sender<Msg>,
    ) -> Option<ReadRequest> {
        let class = self.class_of(layout, e);
        let slot = self.demand_slot(layout, counters, class)?;
        let read_id = self.new_read_id();
        self.entries[e as usize] = Entry::Loading(Loading::new(
            Priority::Demand,
            vec![waiter.clone()],
            read_id,
            false,
        ));
        let record = &layout.records[e as usize];
        bump(&counters.demand_reads, 1);
        bump(&counters.demand_read_bytes, record.read_bytes);
        Some(ReadRequest {
            slot,
            extents: record.reads.clone(),
            priority: Priority::Demand,
            tag: u64::from(e),
        })
    }

    fn new_read_id(&mut self) -> u64 {
        self.next_read_id += 1;
        self.next_read_id
    }

    /// Fails a loading entry (its read could not be submitted or failed):
    /// back to absent, every waiter told why.
    fn fail_loading(&mut self, layout: &ExpertLayout, e: u32, reason: &str) {
        let entry = std::mem::replace(&mut self.entries[e as usize], Entry::Absent);
        match entry {
            Entry::Loading(loading) => {
                self.loaded(layout, e, &loading);
                for waiter in loading.waiters {
                    let _ = waiter.send(Msg::Failed {
                        entry: e,
                        reason: reason.to_string(),
                    });
                }
            }
            other => self.entries[e as usize] = other,
        }
    }

    /// Bookkeeping of a read of entry `e` that is over (landed, failed or
    /// cancelled).
    fn loaded(&mut self, layout: &ExpertLayout, e: u32, loading: &Loading) {
        if loading.fill {
            let class = self.class_of(layout, e);
            let c = &mut self.classes[class];
            c.fill_loading = c.fill_loading.saturating_sub(1);
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is only changed by short, non-panicking sections; a
        // panic elsewhere (a caller's callback) never leaves it half-done.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn end_lease(&self, e: u32) {
        let mut st = self.lock();
        let idle = match &mut st.entries[e as usize] {
            Entry::Resident(r) => {
                r.leases = r.leases.saturating_sub(1);
                r.leases == 0 && !r.pinned
            }
            _ => false,
        };
        if idle {
            st.become_idle(&self.layout, &self.counters, e);
        }
    }

    /// Why a read of entry `e` failed, naming the file.
    fn read_error_reason(&self, e: u32, error: &IoError) -> String {
        match error {
            IoError::Read { .. } | IoError::UnexpectedEof { .. } => error.to_string(),
            other => {
                let files: Vec<String> = self.layout.records[e as usize]
                    .reads
                    .iter()
                    .map(|r| self.files.path(r.file).display().to_string())
                    .collect();
                format!("{other} (reading from {})", files.join(", "))
            }
        }
    }

    /// Verifies an expert that has Q4_0 matrices and tiles them in its
    /// slot; experts without any are left as read (and verified on first
    /// use, as always).
    fn tile_expert(
        location: &ExpertLocation,
        slot: &mut Slot,
        ranges: &[std::ops::Range<usize>; 3],
    ) -> Result<Prepared, String> {
        let has_q4_0 = location.matrices().iter().any(|m| cpu_layout(m.format));
        if !has_q4_0 {
            return Ok(Prepared::default());
        }
        let bytes = slot.bytes_mut();
        let part = |r: &std::ops::Range<usize>| bytes.get(r.clone()).unwrap_or(&[]);
        location
            .verify([part(&ranges[0]), part(&ranges[1]), part(&ranges[2])])
            .map_err(|e| e.to_string())?;
        let tiled = retile_q4_0(location, bytes, ranges, true)?;
        Ok(Prepared {
            verified: true,
            tiled,
        })
    }

    /// Turns a finished read into a resident entry (or a failure) and
    /// hands a lease to every waiter.
    fn install(self: &Arc<Self>, done: Completion) {
        let Completion {
            tag,
            mut slot,
            result,
            issue_seq,
            ..
        } = done;
        let Ok(e) = u32::try_from(tag) else {
            return;
        };
        if e as usize >= self.layout.records.len() {
            return;
        }
        // Tiling rewrites the bytes, so it happens here, before they are
        // resident and anyone can read them, and outside the lock.
        let prepared = match &result {
            Ok(ranges) if self.tile_q4_0.load(std::sync::atomic::Ordering::Relaxed) => {
                let record = &self.layout.records[e as usize];
                match record.matrix_ranges(ranges) {
                    Some(m) => Self::tile_expert(&record.location, &mut slot, &m),
                    None => Ok(Prepared::default()),
                }
            }
            _ => Ok(Prepared::default()),
        };
        let weak = Arc::downgrade(self);
        let mut undeliverable = Vec::new();
        {
            let mut st = self.lock();
            let entry = std::mem::replace(&mut st.entries[e as usize], Entry::Absent);
            let loading = match entry {
                Entry::Loading(loading) => loading,
                other => {
                    // Not ours to install (cannot happen: only a loading
                    // entry has a read in flight). Keep the state as it is.
                    st.entries[e as usize] = other;
                    tracing::error!("tier: completion for expert entry {e} that is not loading");
                    return;
                }
            };
            st.loaded(&self.layout, e, &loading);
            let record = &self.layout.records[e as usize];
            if loading.cancelled {
                // A stale prediction (nobody can have joined it): whatever
                // came back is dropped and the slot is free again. The bytes
                // count as wasted if the read reached the drive.
                drop(slot);
                if issue_seq.is_some() || result.is_ok() {
                    bump(&self.counters.prefetch_wasted, 1);
                    bump(&self.counters.prefetch_wasted_bytes, record.read_bytes);
                } else {
                    bump(&self.counters.prefetch_cancelled_unissued, 1);
                }
                st.wake();
                return;
            }
            self.latency.record(loading.since.elapsed());
            let ranges = result
                .map_err(|error| self.read_error_reason(e, &error))
                .and_then(|ranges| {
                    record.matrix_ranges(&ranges).ok_or_else(|| {
                        format!("the reader placed the reads outside the slot ({ranges:?})")
                    })
                })
                .and_then(|m| prepared.map(|p| (m, p)));
            match ranges {
                Ok((matrices, prepared)) => {
                    st.resident += 1;
                    st.entries[e as usize] = Entry::Resident(Resident {
                        storage: Arc::new(SlotStorage {
                            slot,
                            matrices,
                            verified: std::sync::atomic::AtomicBool::new(prepared.verified),
                            tiled: prepared.tiled,
                        }),
                        leases: 0,
                        pinned: loading.pin,
                        reused: false,
                    });
                    for waiter in loading.waiters {
                        if let Some(lease) = st.new_lease(&weak, e)
                            && let Err(failed) = waiter.send(Msg::Ready { lease })
                        {
                            undeliverable.push(failed.into_inner());
                        }
                    }
                    let idle = matches!(&st.entries[e as usize],
                        Entry::Resident(r) if r.leases == 0 && !r.pinned);
                    if idle {
                        if loading.fill {
                            let class = st.class_of(&self.layout, e);
                            let filled = st.classes[class].filled;
                            st.lists.push_front(filled, e);
                            st.trim(&self.layout, &self.counters, class);
                            st.wake();
                        } else if loading.origin == Priority::Prefetch {
                            let class = st.class_of(&self.layout, e);
                            let unclaimed = st.classes[class].unclaimed;
                            st.lists.push_front(unclaimed, e);
                            st.wake();
                        } else {
                            st.become_idle(&self.layout, &self.counters, e);
                        }
                    }
                }
                Err(reason) => {
                    bump(&self.counters.read_errors, 1);
                    // The slot goes back before anyone is woken to use it.
                    drop(slot);
                    for waiter in loading.waiters {
                        let _ = waiter.send(Msg::Failed {
                            entry: e,
                            reason: reason.clone(),
                        });
                    }
                    st.wake();
                }
            }
        }
        // Their leases end here, outside the lock.
        drop(undeliverable);
    }
}

/// Routed experts from disk through a budgeted RAM cache. See the module
/// documentation.
pub struct TierCache {
    shared: Arc<Shared>,
    reader: Option<Reader>,
    reply: Option<CompletionSender>,
    installer: Option<JoinHandle<()>>,
    plan: Plan,
    backend: BackendInfo,
    model_key: String,
    usage_dir: Option<std::path::PathBuf>,
    measured_depth: Option<super::MeasuredDepth>,
}

impl std::fmt::Debug for TierCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierCache")
            .field("backend", &self.backend)
            .field("classes", &self.plan.classes)
            .finish()
    }
}

impl TierCache {
    /// Lays out the experts `locator` finds for `spec`, plans their
    /// placement within the budgets of `setup`, starts the reader and
    /// loads the pinned experts.
    pub fn open(
        spec: &ModelSpec,
        locator: Arc<dyn ExpertLocator>,
        setup: &TierSetup,
    ) -> Result<TierCache, TierError> {
        let options = &setup.options;
        let files = Arc::new(FileSet::open(locator.files(), options.direct)?);
        let layout = ExpertLayout::build(spec, locator.as_ref(), &FileFacts::of(&files))?;
        let model_key = model_key(&setup.config_json, &layout, locator.files());
        let usage_dir = match &options.usage {
            UsageMode::Off => None,
            UsageMode::Auto => super::usage::default_dir(),
            UsageMode::Dir(dir) => Some(dir.clone()),
        };
        let history = usage_dir
            .as_ref()
            .map(|dir| UsageHistory::load(dir, &model_key, &layout));
        let memory = options.memory.clone().unwrap_or_else(MemoryLimits::probe);
        let (queue_depth, measured_depth) = options.resolve_queue_depth(&files, &layout);
        let plan = Plan::compute(&PlanRequest {
            layout: &layout,
            footprint: setup.footprint,
            memory,
            ram_budget: options.ram_budget,
            pin_budget: options.pin_budget,
            usage: history.as_ref().filter(|h| h.total_steps() > 0),
            queue_depth,
            prefetch_slots: options.prefetch_slots(&layout),
        });
        for warning in &plan.warnings {
            tracing::warn!("{warning}");
        }

        let mut classes = Vec::with_capacity(plan.classes.len());
        let mut arenas = Vec::with_capacity(plan.classes.len());
        for (c, class) in plan.classes.iter().enumerate() {
            let slots = class.arena_slots().max(1);
            let slot_bytes = usize::try_from(class.slot_bytes)
                .map_err(|_| TierError::Budget(format!("slot of {} bytes", class.slot_bytes)))?;
            // Huge pages, faulted in by a background thread rather than by
            // the reads that fill the slots (docs/benchmarks.md, "Expert
            // arenas faulted in ahead").
            let arena = PinnedArena::with_pages(slot_bytes, slots, true)?;
            arena.populate_in_background();
            arenas.push(Arc::clone(&arena));
            let base = (c * 4) as ListId;
            classes.push(ClassState {
                arena,
                order: EvictionOrder::new(options.policy, base, base + 1, class.cache_slots),
                unclaimed: base + 2,
                filled: base + 3,
                fill_loading: 0,
                cache_slots: class.cache_slots,
                staging_slots: class.staging_slots,
                // Half of the demand staging stays free for demand reads
                // (the slots added for prefetch are prefetch's to take).
                prefetch_reserve: (class.staging_slots - class.prefetch_slots).div_ceil(2),
            });
        }
        let reader = Reader::new(
            Arc::clone(&files),
            &arenas,
            ReaderConfig {
                backend: options.io,
                queue_depth: queue_depth.max(1),
                prefetch_limit: options.prefetch_limit,
                faults: options.faults.clone(),
                ..ReaderConfig::default()
            },
        )?;
        let backend = reader.backend().clone();
        let entries = layout.len();
        let lists = IntrusiveLists::new(entries, classes.len() * 4);
        let record_usage = usage_dir.is_some();
        let usage = if record_usage {
            history.or_else(|| Some(UsageHistory::empty(&model_key, &layout)))
        } else {
            None
        };
        let shared = Arc::new(Shared {
            layout,
            files,
            state: Mutex::new(State {
                entries: (0..entries).map(|_| Entry::Absent).collect(),
                lists,
                classes,
                usage,
                usage_saved: Instant::now(),
                slot_waiters: Vec::new(),
                next_read_id: 0,
                prefetch_batch: vec![0; entries],
                prefetch_batches: 0,
                resident: 0,
            }),
            counters: Counters::default(),
            latency: ReadLatency::new(),
            tile_q4_0: std::sync::atomic::AtomicBool::new(
                options.tile_q4_0 && colibri_model::kernels::q4_0_tiles_run_here(),
            ),
        });
        let (reply, completions) = completion_channel();
        let installer = spawn_installer(Arc::clone(&shared), completions)?;
        let mut cache = TierCache {
            shared,
            reader: Some(reader),
            reply: Some(reply),
            installer: Some(installer),
            plan,
            backend,
            model_key,
            usage_dir,
            measured_depth,
        };
        cache.load_pinned()?;
        tracing::info!(
            "expert tier: {} routed experts, {} pinned ({}), {} cache slots ({}), {} staging \
             ({}), {} reads at queue depth {}",
            cache.plan.routed_experts,
            cache.plan.pinned.len(),
            super::ByteSize(cache.plan.pinned_bytes),
            cache.plan.cache_slots(),
            super::ByteSize(cache.plan.cache_bytes),
            cache
                .plan
                .classes
                .iter()
                .map(|c| c.staging_slots)
                .sum::<usize>(),
            super::ByteSize(cache.plan.staging_bytes),
            cache.backend.backend,
            cache.backend.queue_depth,
        );
        Ok(cache)
    }

    /// Reads the pinned experts of the plan and pins them.
    fn load_pinned(&mut self) -> Result<(), TierError> {
        if self.plan.pinned.is_empty() {
            return Ok(());
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut batch = Vec::new();
        {
            let sh = &self.shared;
            let mut st = sh.lock();
            for &(layer, expert) in &self.plan.pinned {
                let Some(e) = sh.layout.entry(layer, expert) else {
                    continue;
                };
                let class = sh.layout.records[e].class;
                let Some(slot) = st.demand_slot(&sh.layout, &sh.counters, class) else {
                    return Err(TierError::Budget(format!(
                        "no slot for pinned expert {expert} of layer {layer}"
                    )));
                };
                let read_id = st.new_read_id();
                st.entries[e] = Entry::Loading(Loading::new(
                    Priority::Demand,
                    vec![tx.clone()],
                    read_id,
                    true,
                ));
                batch.push(ReadRequest {
                    slot,
                    extents: sh.layout.records[e].reads.clone(),
                    priority: Priority::Demand,
                    tag: e as u64,
                });
            }
        }
        drop(tx);
        let count = batch.len();
        self.submit(batch).map_err(TierError::Model)?;
        for _ in 0..count {
            match rx.recv() {
                Ok(Msg::Ready { lease, .. }) => drop(lease),
                Ok(Msg::Failed { entry, reason }) => {
                    let r = &self.shared.layout.records[entry as usize];
                    return Err(TierError::Model(ModelError::Expert {
                        layer: r.layer,
                        expert: r.expert,
                        reason: format!("loading a pinned expert: {reason}"),
                    }));
                }
                Ok(Msg::Wake) => {}
                Err(_) => return Err(TierError::Io(IoError::ReaderStopped)),
            }
        }
        Ok(())
    }

    /// Submits reads; if the reader has stopped, fails their entries so no
    /// waiter hangs.
    fn submit(&self, batch: Vec<ReadRequest>) -> Result<Vec<Ticket>, ModelError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let tags: Vec<u32> = batch.iter().map(|r| r.tag as u32).collect();
        let (Some(reader), Some(reply)) = (&self.reader, &self.reply) else {
            return Err(ModelError::Invalid("the expert tier is shut down".into()));
        };
        match reader.submit(batch, reply) {
            Ok(tickets) => Ok(tickets),
            Err(error) => {
                let reason = error.to_string();
                let mut st = self.shared.lock();
                for &e in &tags {
                    st.fail_loading(&self.shared.layout, e, &reason);
                }
                st.wake();
                let r = &self.shared.layout.records[tags[0] as usize];
                Err(ModelError::Expert {
                    layer: r.layer,
                    expert: r.expert,
                    reason,
                })
            }
        }
    }

    fn assemble(&self, lease: Lease) -> Result<ExpertWeights, ModelError> {
        let e = lease.entry as usize;
        let record = &self.shared.layout.records[e];
        let (matrices, storage) = match &lease.storage {
            Some(storage) => (storage.matrices.clone(), Arc::clone(storage)),
            None => return Err(ModelError::Invalid("empty lease".into())),
        };
        let owner: Arc<dyn ByteStorage> = Arc::new(lease);
        let part = |r: &std::ops::Range<usize>| Bytes::new(Arc::clone(&owner), r.start, r.len());
        let parts = [
            part(&matrices[0])?,
            part(&matrices[1])?,
            part(&matrices[2])?,
        ];
        use std::sync::atomic::Ordering;
        let w = if storage.verified.load(Ordering::Acquire) {
            record.location.assemble_unverified(parts)?
        } else {
            let w = record.location.assemble(parts)?;
            storage.verified.store(true, Ordering::Release);
            w
        };
        if !storage.tiled {
            return Ok(w);
        }
        let tiles = |m: QMatrix| match m.format {
            colibri_model::format::WeightFormat::Q4_0 => m.tiled_q4_0(),
            f if cpu_layout(f) => m.k_panels(),
            _ => Ok(m),
        };
        Ok(ExpertWeights {
            gate: tiles(w.gate)?,
            up: tiles(w.up)?,
            down: tiles(w.down)?,
        })
    }

    /// Whether experts read from now on are tiled ([`Self::set_tile_q4_0`]).
    pub fn tiles_q4_0(&self) -> bool {
        self.shared
            .tile_q4_0
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether experts read from now on have their Q4_0 matrices tiled for
    /// the CPU's tile kernel (only where one runs:
    /// [`colibri_model::kernels::q4_0_tiles_run_here`]) and their Q4_K and
    /// Q5_K matrices in panels (where a panel kernel runs too). Products give the
    /// same bits either way; tiles are the CPU's faster layout and wrong
    /// for anything that copies the bytes as stored (the GPU tier). Turning
    /// it off also returns every resident tiled expert to its stored
    /// layout; that fails if one is in use (leased), which the GPU tier
    /// avoids by attaching before the first forward pass.
    pub fn set_tile_q4_0(&self, on: bool) -> Result<(), TierError> {
        use std::sync::atomic::Ordering;
        let on = on && colibri_model::kernels::q4_0_tiles_run_here();
        self.shared.tile_q4_0.store(on, Ordering::SeqCst);
        if on {
            return Ok(());
        }
        let mut st = self.shared.lock();
        for (e, entry) in st.entries.iter_mut().enumerate() {
            let Entry::Resident(r) = entry else {
                continue;
            };
            if !r.storage.tiled {
                continue;
            }
            let location = &self.shared.layout.records[e].location;
            let Some(storage) = Arc::get_mut(&mut r.storage) else {
                return Err(TierError::Model(ModelError::Expert {
                    layer: location.layer,
                    expert: location.expert,
                    reason: "in use while its layout was to change back from CPU tiles".into(),
                }));
            };
            let ranges = storage.matrices.clone();
            retile_q4_0(location, storage.slot.bytes_mut(), &ranges, false).map_err(|reason| {
                TierError::Model(ModelError::Expert {
                    layer: location.layer,
                    expert: location.expert,
                    reason,
                })
            })?;
            storage.tiled = false;
        }
        Ok(())
    }

    /// Whether every routed expert is resident now: no fetch can miss,
    /// so guessing what to read ahead is wasted work.
    pub fn all_resident(&self) -> bool {
        self.shared.lock().resident == self.shared.layout.len()
    }

    /// The placement in effect.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The pinned arenas reads land in (the GPU tier registers them with
    /// CUDA so copies to the device read them in place).
    pub fn arenas(&self) -> Vec<Arc<PinnedArena>> {
        self.shared
            .lock()
            .classes
            .iter()
            .map(|c| Arc::clone(&c.arena))
            .collect()
    }

    /// The I/O backend in use.
    pub fn backend(&self) -> &BackendInfo {
        &self.backend
    }

    /// The queue-depth measurement in effect, when the depth was measured.
    pub fn measured_depth(&self) -> Option<&super::MeasuredDepth> {
        self.measured_depth.as_ref()
    }

    /// The model key of the usage history.
    pub fn model_key(&self) -> &str {
        &self.model_key
    }

    /// The experts' layout.
    pub fn layout(&self) -> &ExpertLayout {
        &self.shared.layout
    }

    /// The files read.
    pub fn files(&self) -> &Arc<FileSet> {
        &self.shared.files
    }

    /// The tier's counters.
    pub fn stats(&self) -> TierStats {
        self.shared.counters.snapshot()
    }

    /// The reader's counters (bytes the kernel transferred, requests).
    pub fn reader_counters(&self) -> CounterSnapshot {
        self.reader
            .as_ref()
            .map(Reader::counters)
            .unwrap_or_default()
    }

    /// Read latency percentiles since the last reset.
    pub fn read_latency(&self, reset: bool) -> LatencySummary {
        self.shared.latency.summary(reset)
    }

    /// Stops the reader from issuing new reads until the guard drops (reads
    /// already in the kernel go on). Groups several fetches and prefetches
    /// into one scheduling decision; tests use it to hold a read in flight.
    pub fn hold_io(&self) -> Option<colibri_io::IssueHold<'_>> {
        self.reader.as_ref()?.hold().ok()
    }

    /// Where one expert is now.
    pub fn residency(&self, layer: usize, expert: usize) -> Option<Residency> {
        let e = self.shared.layout.entry(layer, expert)?;
        let st = self.shared.lock();
        Some(match &st.entries[e] {
            Entry::Absent => Residency::Absent,
            Entry::Loading(_) => Residency::Loading,
            Entry::Resident(r) => Residency::Resident {
                leases: r.leases,
                pinned: r.pinned,
                evictable: st.lists.list_of(e as u32).is_some(),
            },
        })
    }

    /// Expert `expert` of `layer` if it is resident now (the arenas are
    /// pinned, and registered with CUDA when a GPU tier runs), leased like
    /// a hit but without reading, waiting or counting a request: the GPU
    /// tier copies the next layer's likely experts ahead with it. A
    /// read-ahead the CPU prefetcher has not seen used yet is left alone,
    /// so its accounting stays the prefetcher's. The lease refreshes the
    /// entry's recency when it ends, as a use does.
    pub fn peek_resident(&self, layer: usize, expert: usize) -> Option<Arc<ExpertWeights>> {
        let sh = &self.shared;
        let e = sh.layout.entry(layer, expert)? as u32;
        let lease = {
            let mut st = sh.lock();
            if !matches!(st.entries[e as usize], Entry::Resident(_)) {
                return None;
            }
            let class = &st.classes[st.class_of(&sh.layout, e)];
            let (unclaimed, filled) = (class.unclaimed, class.filled);
            match st.lists.list_of(e) {
                Some(list) if list == unclaimed => return None,
                Some(list) => {
                    if list == filled {
                        bump(&sh.counters.fill_hits, 1);
                        bump(
                            &sh.counters.fill_used_bytes,
                            sh.layout.records[e as usize].read_bytes,
                        );
                    }
                    st.lists.remove(e);
                }
                None => {}
            }
            st.new_lease(&Arc::downgrade(sh), e)?
        };
        self.assemble(lease).ok().map(Arc::new)
    }

    /// Slot use per size class.
    pub fn occupancy(&self) -> Vec<ClassOccupancy> {
        let sh = &self.shared;
        let st = sh.lock();
        let mut out: Vec<ClassOccupancy> = st
            .classes
            .iter()
            .map(|c| ClassOccupancy {
                slot_bytes: c.arena.slot_size() as u64,
                arena_slots: c.arena.slot_count(),
                free_slots: c.arena.free_slots(),
                cache_slots: c.cache_slots,
                staging_slots: c.staging_slots,
                idle: c.order.len(&st.lists),
                unclaimed: st.lists.len(c.unclaimed),
                filled: st.lists.len(c.filled),
                ..ClassOccupancy::default()
            })
            .collect();
        for (e, entry) in st.entries.iter().enumerate() {
            let o = &mut out[sh.layout.records[e].class];
            match entry {
                Entry::Absent => {}
                Entry::Loading(_) => o.loading += 1,
                Entry::Resident(r) if r.pinned => o.pinned += 1,
                Entry::Resident(r) if r.leases > 0 => o.leased += 1,
                Entry::Resident(_) => {}
            }
        }
        out
    }

    /// Writes the usage history now (it is also written when the cache is
    /// dropped). Returns the file, or `None` when recording is off.
    pub fn save_usage(&self) -> Result<Option<std::path::PathBuf>, super::usage::UsageError> {
        let Some(dir) = &self.usage_dir else {
            return Ok(None);
        };
        let history = self.shared.lock().usage.clone();
        match history {
            Some(h) if h.total_steps() > 0 => h.save(dir).map(Some),
            _ => Ok(None),
        }
    }
}

fn spawn_installer(
    shared: Arc<Shared>,
    completions: Receiver<Completion>,
) -> Result<JoinHandle<()>, TierError> {
    std::thread::Builder::new()
        .name("colibri-tier-install".into())
        .spawn(move || {
            for done in completions.iter() {
                shared.install(done);
            }
        })
        .map_err(|source| {
            TierError::Io(IoError::Backend {
                context: "spawning the tier installer thread".into(),
                source,
            })
        })
}

impl Drop for TierCache {
    fn drop(&mut self) {
        if let Err(error) = self.save_usage() {
            tracing::warn!("{error}");
        }
        // The reader cancels what is in flight and sends every completion
        // before it returns; then our sender goes, the channel closes and
        // the installer finishes.
        drop(self.reader.take());
        drop(self.reply.take());
        if let Some(installer) = self.installer.take() {
            let _ = installer.join();
        }
    }
}

impl TierCache {
    /// [`ExpertSource::fetch`] of `ids` of `layer`, which also starts
    /// prefetch reads of `prefetch` (`(layer, experts)`, nearest layer
    /// first) in the same submission as this fetch's demand reads: the
    /// reader issues every demand read of a submission before any prefetch
    /// read, and the prefetch slots are taken only after this fetch's hits
    /// are leased and its misses have their slots, so a prediction never
    /// delays or evicts what this layer needs.
    pub fn fetch_with_prefetch(
        &self,
        layer: usize,
        ids: &[usize],
        prefetch: &[(usize, Vec<usize>)],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        self.fetch_groups_with_prefetch(layer, ids, prefetch, &mut |group| {
            group.into_iter().try_for_each(|(e, w)| ready(e, w))
        })
    }

    /// [`fetch_with_prefetch`](Self::fetch_with_prefetch), delivering
    /// groups ([`ExpertSource::fetch_groups`]): the hits together, then
    /// each completed read with any others that completed meanwhile.
    pub fn fetch_groups_with_prefetch(
        &self,
        layer: usize,
        ids: &[usize],
        prefetch: &[(usize, Vec<usize>)],
        ready: &mut dyn FnMut(ExpertGroup) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let started = Instant::now();
        let sh = &self.shared;
        let mut pending = Vec::with_capacity(ids.len());
        for &expert in ids {
            let e = sh
                .layout
                .entry(layer, expert)
                .ok_or_else(|| ModelError::Expert {
                    layer,
                    expert,
                    reason: "not a routed expert of this model".into(),
                })?;
            pending.push(e as u32);
        }
        bump(&sh.counters.fetch_calls, 1);
        bump(&sh.counters.requests, ids.len() as u64);
        if ids.is_empty() {
            self.prefetch_batch(prefetch);
            return Ok(());
        }
        let due = {
            let mut st = sh.lock();
            match st.usage.as_mut() {
                Some(usage) => {
                    usage.record(layer, ids);
                    let due = st.usage_saved.elapsed() >= USAGE_SAVE_INTERVAL;
                    if due {
                        st.usage_saved = Instant::now();
                    }
                    due.then(|| st.usage.clone()).flatten()
                }
                None => None,
            }
        };
        if let (Some(history), Some(dir)) = (due, self.usage_dir.clone()) {
            // Off the decode path: the write and its fsync take milliseconds.
            let spawned = std::thread::Builder::new()
                .name("colibri-usage-save".into())
                .spawn(move || {
                    if let Err(error) = history.save(&dir) {
                        tracing::warn!("{error}");
                    }
                });
            if let Err(error) = spawned {
                tracing::warn!("not saving the usage history now: {error}");
            }
        }
        let weak = Arc::downgrade(sh);
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut io_wait = Duration::ZERO;
        let mut io_wait_busy = 0u64;
        let result = (|| -> Result<(), ModelError> {
            let expert_of = |e: u32| sh.layout.records[e as usize].expert;
            let mut deliver = |leases: Vec<Lease>| -> Result<(), ModelError> {
                let group = leases
                    .into_iter()
                    .map(|lease| {
                        let expert = expert_of(lease.entry);
                        Ok((expert, Arc::new(self.assemble(lease)?)))
                    })
                    .collect::<Result<ExpertGroup, ModelError>>()?;
                ready(group)
            };
            let mut delivered = 0usize;
            let mut in_flight = 0usize;
            let mut waited_since: Option<Instant> = None;
            let mut predictions = Some(prefetch);
            loop {
                let mut hits = Vec::new();
                let mut batch = Vec::new();
                let mut promote = Vec::new();
                let mut speculative = Vec::new();
                if !pending.is_empty() {
                    let mut st = sh.lock();
                    let mut absent = Vec::new();
                    let mut blocked = Vec::new();
                    for &e in &pending {
                        match st.claim(&sh.layout, &sh.counters, &weak, e, &tx) {
                            Claim::Hit(lease) => hits.push(lease),
                            Claim::Joined => in_flight += 1,
                            Claim::JoinedPromote(ticket) => {
                                in_flight += 1;
                                promote.push(ticket);
                            }
                            Claim::Absent => absent.push(e),
                            Claim::Busy => blocked.push(e),
                        }
                    }
                    for e in absent {
                        match st.issue_demand(&sh.layout, &sh.counters, e, &tx) {
                            Some(request) => {
                                in_flight += 1;
                                batch.push(request);
                            }
                            None => blocked.push(e),
                        }
                    }
                    if !blocked.is_empty() {
                        st.slot_waiters.push(tx.clone());
                        bump(&sh.counters.slot_waits, 1);
                    } else if let Some(predictions) = predictions.take() {
                        // Only once every miss of this layer has its slot.
                        speculative = st.issue_prefetches(&sh.layout, &sh.counters, predictions);
                    }
                    pending = blocked;
                }
                self.promote(&promote);
                // Reads first, so they run while the hits are computed.
                self.submit_with_prefetch(batch, speculative)?;
                if !hits.is_empty() {
                    delivered += hits.len();
                    deliver(hits)?;
                }
                if delivered == ids.len() {
                    return Ok(());
                }
                let t = Instant::now();
                let busy_before = self.reader.as_ref().map_or(0, Reader::busy_ns);
                let msg = rx.recv_timeout(SLOT_WAIT_LIMIT);
                io_wait += t.elapsed();
                let busy_after = self.reader.as_ref().map_or(0, Reader::busy_ns);
                io_wait_busy += busy_after.saturating_sub(busy_before);
                match msg {
                    Ok(Msg::Ready { lease, .. }) => {
                        in_flight -= 1;
                        waited_since = None;
                        // Reads that completed meanwhile join the group.
                        let mut group = vec![lease];
                        let mut failed = None;
                        while let Ok(more) = rx.try_recv() {
                            match more {
                                Msg::Ready { lease, .. } => {
                                    in_flight -= 1;
                                    group.push(lease);
                                }
                                Msg::Failed { entry, reason } => {
                                    failed = Some((entry, reason));
                                    break;
                                }
                                // The loop looks at blocked claims again anyway.
                                Msg::Wake => {}
                            }
                        }
                        delivered += group.len();
                        deliver(group)?;
                        if let Some((entry, reason)) = failed {
                            return Err(ModelError::Expert {
                                layer,
                                expert: expert_of(entry),
                                reason,
                            });
                        }
                    }
                    Ok(Msg::Failed { entry, reason }) => {
                        return Err(ModelError::Expert {
                            layer,
                            expert: expert_of(entry),
                            reason,
                        });
                    }
                    Ok(Msg::Wake) => {}
                    Err(RecvTimeoutError::Timeout) if in_flight == 0 => {
                        let since = *waited_since.get_or_insert(t);
                        if since.elapsed() >= SLOT_WAIT_LIMIT {
                            let first = pending.first().copied().unwrap_or(0);
                            let record = &sh.layout.records[first as usize];
                            return Err(ModelError::Expert {
                                layer,
                                expert: record.expert,
                                reason: format!(
                                    "no slot of {} bytes became free in {}s: every slot of \
                                     this size holds an expert still in use",
                                    sh.layout.classes[record.class].slot_bytes,
                                    SLOT_WAIT_LIMIT.as_secs()
                                ),
                            });
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {
                        tracing::warn!(
                            "layer {layer}: {in_flight} expert reads still in flight after \
                             {}s",
                            SLOT_WAIT_LIMIT.as_secs()
                        );
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(ModelError::Invalid("expert tier channel closed".into()));
                    }
                }
            }
        })();
        drop(rx);
        bump(
            &sh.counters.io_wait_ns,
            u64::try_from(io_wait.as_nanos()).unwrap_or(u64::MAX),
        );
        bump(&sh.counters.io_wait_busy_ns, io_wait_busy);
        bump(
            &sh.counters.fetch_ns,
            u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
        );
        result
    }
}

impl ExpertSource for TierCache {
    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        self.fetch_with_prefetch(layer, ids, &[], ready)
    }

    fn fetch_groups(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(ExpertGroup) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        self.fetch_groups_with_prefetch(layer, ids, &[], ready)
    }

    fn prefetch(&self, layer: usize, ids: &[usize]) {
        self.prefetch_batch(&[(layer, ids.to_vec())]);
    }

    fn peek(&self, layer: usize, expert: usize) -> Option<Arc<ExpertWeights>> {
        self.peek_resident(layer, expert)
    }

    fn stats(&self) -> SourceStats {
        let t = self.shared.counters.snapshot();
        SourceStats {
            ram_hits: t.hits,
            ram_misses: t.requests - t.hits,
            disk_bytes_read: t.read_bytes(),
            prefetch_covered_misses: t.covered_misses(),
            uncovered_misses: t.uncovered_misses(),
            ..SourceStats::default()
        }
    }
}
