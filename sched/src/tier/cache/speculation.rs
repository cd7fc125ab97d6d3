//! The speculative side of the tier: prefetch reads of predicted experts,
//! their slots, their tickets, promotion when a demand joins one, and
//! dropping them when the prediction turns out stale.
//!
//! - A prefetch read takes only free slots beyond the demand reserve, or
//!   replaces an unused prefetch of an earlier batch; it never evicts a
//!   cached, pinned or leased expert.
//! - Its ticket is recorded after submission; a demand that joins it (or
//!   joined before the ticket was known) has it promoted to demand
//!   priority in the reader.
//! - A stale prediction that landed is evicted at once; one still being
//!   read is cancelled and marked so nobody joins it: a fetch that wants
//!   the expert after all waits for the cancelled read to come back and
//!   then reads it on demand.

use colibri_io::{Priority, ReadRequest, Slot, Ticket};
use colibri_model::ModelError;

use super::super::layout::ExpertLayout;
use super::super::stats::{Counters, bump};
use super::{Entry, Loading, State, TierCache};

/// What asking to prefetch one expert did.
enum PrefetchIssue {
    Issued(ReadRequest, IssuedPrefetch),
    /// Already resident or being read: nothing to do.
    Present,
    /// No slot may be taken for prefetch now.
    NoSlot,
}

/// A prefetch read just issued: which entry, and which read of it.
#[derive(Clone, Copy, Debug)]
pub(super) struct IssuedPrefetch {
    entry: u32,
    read_id: u64,
}

impl State {
    /// A slot for a prefetch: only beyond the demand reserve; replaces the
    /// oldest unused prefetch of an earlier prefetch batch when there is
    /// none (never one of `batch` itself: a long prediction would otherwise
    /// evict its own first, nearest, experts to read its last ones).
    fn prefetch_slot(
        &mut self,
        layout: &ExpertLayout,
        counters: &Counters,
        class: usize,
        batch: u64,
    ) -> Option<Slot> {
        let c = &self.classes[class];
        if c.arena.free_slots() <= c.prefetch_reserve {
            let oldest = self.lists.back(c.unclaimed)?;
            if self.prefetch_batch[oldest as usize] >= batch {
                return None;
            }
            self.evict(layout, counters, oldest);
        }
        let c = &self.classes[class];
        if c.arena.free_slots() > c.prefetch_reserve {
            c.arena.try_acquire()
        } else {
            None
        }
    }

    /// Starts a prefetch read of entry `e`, part of prefetch batch `batch`,
    /// into a free slot (never evicting a cached or leased expert).
    fn issue_prefetch(
        &mut self,
        layout: &ExpertLayout,
        counters: &Counters,
        e: u32,
        batch: u64,
    ) -> PrefetchIssue {
        if !matches!(self.entries[e as usize], Entry::Absent) {
            return PrefetchIssue::Present;
        }
        let class = self.class_of(layout, e);
        let Some(slot) = self.prefetch_slot(layout, counters, class, batch) else {
            return PrefetchIssue::NoSlot;
        };
        self.prefetch_batch[e as usize] = batch;
        let read_id = self.new_read_id();
        self.entries[e as usize] =
            Entry::Loading(Loading::new(Priority::Prefetch, Vec::new(), read_id, false));
        let record = &layout.records[e as usize];
        bump(&counters.prefetch_reads, 1);
        bump(&counters.prefetch_read_bytes, record.read_bytes);
        PrefetchIssue::Issued(
            ReadRequest {
                slot,
                extents: record.reads.clone(),
                priority: Priority::Prefetch,
                tag: u64::from(e),
            },
            IssuedPrefetch { entry: e, read_id },
        )
    }

    /// Starts prefetch reads of `predictions` (nearest layer first) as one
    /// prefetch batch, until each size class runs out of prefetch slots.
    pub(super) fn issue_prefetches(
        &mut self,
        layout: &ExpertLayout,
        counters: &Counters,
        predictions: &[(usize, Vec<usize>)],
    ) -> Vec<(ReadRequest, IssuedPrefetch)> {
        let mut out = Vec::new();
        if predictions.iter().all(|(_, ids)| ids.is_empty()) {
            return out;
        }
        self.prefetch_batches += 1;
        let batch = self.prefetch_batches;
        let mut full = vec![false; self.classes.len()];
        for (layer, ids) in predictions {
            for &expert in ids {
                let Some(e) = layout.entry(*layer, expert) else {
                    continue;
                };
                let class = layout.records[e].class;
                if full[class] {
                    continue;
                }
                match self.issue_prefetch(layout, counters, e as u32, batch) {
                    PrefetchIssue::Issued(request, which) => out.push((request, which)),
                    PrefetchIssue::Present => {}
                    PrefetchIssue::NoSlot => full[class] = true,
                }
            }
        }
        out
    }

    /// Gives issued prefetch reads their tickets. Returns the tickets to
    /// cancel (predictions found stale before their ticket was known) and
    /// to promote (joined by a demand before it was known).
    fn record_tickets(
        &mut self,
        issued: &[IssuedPrefetch],
        tickets: &[Ticket],
    ) -> (Vec<Ticket>, Vec<Ticket>) {
        let (mut cancel, mut promote) = (Vec::new(), Vec::new());
        for (p, &ticket) in issued.iter().zip(tickets) {
            if let Entry::Loading(l) = &mut self.entries[p.entry as usize]
                && l.read_id == p.read_id
            {
                l.ticket = Some(ticket);
                if l.cancelled {
                    cancel.push(ticket);
                } else if std::mem::take(&mut l.promote_pending) {
                    promote.push(ticket);
                }
            }
        }
        (cancel, promote)
    }

    /// Drops a stale prediction of entry `e`: a landed, unused prefetch is
    /// evicted (its slot is free at once); a prefetch read nobody has
    /// joined is marked cancelled, and its ticket returned when known.
    /// Anything else (cached, leased, demanded, absent) is left alone.
    fn cancel_prediction(
        &mut self,
        layout: &ExpertLayout,
        counters: &Counters,
        e: u32,
    ) -> (bool, Option<Ticket>) {
        let class = self.class_of(layout, e);
        match &mut self.entries[e as usize] {
            Entry::Loading(l)
                if l.origin == Priority::Prefetch
                    && !l.fill
                    && l.priority == Priority::Prefetch
                    && l.waiters.is_empty()
                    && !l.pin
                    && !l.cancelled =>
            {
                l.cancelled = true;
                bump(&counters.prefetch_cancelled, 1);
                (true, l.ticket)
            }
            Entry::Resident(_) if self.lists.list_of(e) == Some(self.classes[class].unclaimed) => {
                self.evict(layout, counters, e);
                bump(&counters.prefetch_stale_evicted, 1);
                self.wake();
                (true, None)
            }
            _ => (false, None),
        }
    }
}

impl State {
    /// How many fill reads `class` can take now: cache slots that no
    /// cached expert (idle, filled or in use) and no read in flight will
    /// occupy, and only free slots beyond the demand reserve. The arena
    /// holds pinned, cache and staging slots, so the slots free beyond the
    /// staging area's, counting unused prefetches (they live in staging)
    /// as free, are the cache's room.
    fn fill_room(&self, class: usize) -> usize {
        let c = &self.classes[class];
        let free = c.arena.free_slots();
        let cache_room = (free + self.lists.len(c.unclaimed)).saturating_sub(c.staging_slots);
        cache_room.min(free.saturating_sub(c.prefetch_reserve))
    }

    /// Starts up to `want` fill reads, of the absent entries of `ranked`
    /// (best first) from `*cursor` on, where their class has room; moves
    /// the cursor past every entry it looked at.
    fn issue_fills(
        &mut self,
        layout: &ExpertLayout,
        counters: &Counters,
        ranked: &[u32],
        cursor: &mut usize,
        want: usize,
    ) -> Vec<(ReadRequest, IssuedPrefetch)> {
        let mut room: Vec<usize> = (0..self.classes.len()).map(|c| self.fill_room(c)).collect();
        let mut out = Vec::new();
        if want == 0 || room.iter().all(|&r| r == 0) {
            return out;
        }
        while out.len() < want && room.iter().any(|&r| r > 0) {
            let Some(&e) = ranked.get(*cursor) else {
                break;
            };
            *cursor += 1;
            let Some(record) = layout.records.get(e as usize) else {
                continue;
            };
            let class = record.class;
            if !matches!(self.entries[e as usize], Entry::Absent) || room[class] == 0 {
                continue;
            }
            let Some(slot) = self.classes[class].arena.try_acquire() else {
                room[class] = 0;
                continue;
            };
            room[class] -= 1;
            self.classes[class].fill_loading += 1;
            let read_id = self.new_read_id();
            let mut loading = Loading::new(Priority::Prefetch, Vec::new(), read_id, false);
            loading.fill = true;
            self.entries[e as usize] = Entry::Loading(loading);
            bump(&counters.fill_reads, 1);
            bump(&counters.fill_read_bytes, record.read_bytes);
            out.push((
                ReadRequest {
                    slot,
                    extents: record.reads.clone(),
                    priority: Priority::Prefetch,
                    tag: u64::from(e),
                },
                IssuedPrefetch { entry: e, read_id },
            ));
        }
        out
    }
}

impl TierCache {
    /// Fills free cache room ahead of need: reads the absent entries of
    /// `ranked` (entries of [`layout`](Self::layout), most wanted first),
    /// from `*cursor` on, keeping at most `in_flight` such reads
    /// outstanding; the cursor moves past every entry looked at, so a
    /// caller walks its ranking once however often it calls. Fill reads
    /// have prefetch priority (every demand read overtakes them; a fetch
    /// that wants one in flight joins and promotes it). Fill never evicts:
    /// it takes only cache slots that no cached expert or read in flight
    /// will occupy and free slots beyond the demand reserve, and a filled
    /// expert not yet used is the first to go when a slot is needed, the
    /// one filled last first. Returns how many reads it started.
    pub fn fill(&self, ranked: &[u32], cursor: &mut usize, in_flight: usize) -> usize {
        let sh = &self.shared;
        let issued = {
            let mut st = sh.lock();
            let flying: usize = st.classes.iter().map(|c| c.fill_loading).sum();
            let want = in_flight.saturating_sub(flying);
            st.issue_fills(&sh.layout, &sh.counters, ranked, cursor, want)
        };
        let started = issued.len();
        if started == 0 {
            return 0;
        }
        match self.submit_with_prefetch(Vec::new(), issued) {
            Ok(()) => started,
            Err(error) => {
                tracing::warn!("cache fill not submitted: {error}");
                0
            }
        }
    }

    /// Starts prefetch reads of `predictions` (nearest layer first) on
    /// their own.
    pub(super) fn prefetch_batch(&self, predictions: &[(usize, Vec<usize>)]) {
        if predictions.iter().all(|(_, ids)| ids.is_empty()) {
            return;
        }
        let sh = &self.shared;
        let speculative = sh
            .lock()
            .issue_prefetches(&sh.layout, &sh.counters, predictions);
        if let Err(error) = self.submit_with_prefetch(Vec::new(), speculative) {
            tracing::warn!("expert prefetch not submitted: {error}");
        }
    }

    /// Drops stale predictions of `layer`: the experts of `ids` that a
    /// prefetch brought in and nobody used are evicted (their slots free at
    /// once), and prefetch reads of them that nobody joined are cancelled
    /// (queued ones never reach the drive; the slot of one in the kernel
    /// comes back when the kernel is done with it). Experts a fetch uses,
    /// cached, pinned or demanded are left alone. Returns how many
    /// predictions were dropped.
    pub fn cancel_prefetch(&self, layer: usize, ids: &[usize]) -> usize {
        let sh = &self.shared;
        let mut tickets = Vec::new();
        let mut dropped = 0;
        {
            let mut st = sh.lock();
            for &expert in ids {
                let Some(e) = sh.layout.entry(layer, expert) else {
                    continue;
                };
                let (was, ticket) = st.cancel_prediction(&sh.layout, &sh.counters, e as u32);
                dropped += usize::from(was);
                tickets.extend(ticket);
            }
        }
        if !tickets.is_empty()
            && let Some(reader) = &self.reader
            && let Err(error) = reader.cancel(&tickets)
        {
            tracing::warn!("stale expert prefetch not cancelled: {error}");
        }
        dropped
    }

    pub(super) fn promote(&self, tickets: &[Ticket]) {
        if !tickets.is_empty()
            && let Some(reader) = &self.reader
            && let Err(error) = reader.promote(tickets)
        {
            tracing::warn!("expert prefetch not promoted: {error}");
        }
    }

    /// Submits demand reads and prefetch reads in one batch (the reader
    /// issues the demand reads first), then gives the prefetch reads their
    /// tickets, cancelling or promoting those whose fate was decided before
    /// the ticket was known.
    pub(super) fn submit_with_prefetch(
        &self,
        mut batch: Vec<ReadRequest>,
        speculative: Vec<(ReadRequest, IssuedPrefetch)>,
    ) -> Result<(), ModelError> {
        let demand = batch.len();
        let mut issued = Vec::with_capacity(speculative.len());
        for (request, which) in speculative {
            batch.push(request);
            issued.push(which);
        }
        let tickets = self.submit(batch)?;
        if issued.is_empty() {
            return Ok(());
        }
        let (cancel, promote) = self
            .shared
            .lock()
            .record_tickets(&issued, tickets.get(demand..).unwrap_or(&[]));
        if !cancel.is_empty()
            && let Some(reader) = &self.reader
            && let Err(error) = reader.cancel(&cancel)
        {
            tracing::warn!("stale expert prefetch not cancelled: {error}");
        }
        self.promote(&promote);
        Ok(())
    }
}
