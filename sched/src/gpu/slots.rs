//! The VRAM expert cache's bookkeeping: which expert sits in which device
//! slot, with the RAM tier's semantics and no CUDA in sight (so it is
//! tested everywhere).
//!
//! Every routed expert is an entry (a dense index) in one of three states:
//! `Absent`; `Loading` (a slot is reserved and its bytes are being copied
//! in: **single flight**, a second reservation of the same entry is
//! refused with [`Reserve::InFlight`]); `Resident` with a lease count and a
//! pinned flag. A **lease** is held by a layer that computes on the slot;
//! an entry with a lease, a pin or a copy in flight is in no eviction list,
//! so it can never be evicted. Idle resident entries are linked into their
//! size class's LRU list (O(1), [`IntrusiveLists`]); a reservation takes a
//! free slot of the class, else evicts the least recently used idle entry,
//! else fails (every slot is leased, pinned or loading: the caller then
//! computes from its staging slot without caching, which costs speed,
//! never correctness).
//!
//! Ordering of the device work itself (a slot is overwritten only after
//! the kernels that read its old expert) is the caller's: the GPU tier
//! writes cache slots only on the compute stream, after the launches that
//! read them.

use crate::tier::lists::{IntrusiveLists, ListId};

/// A slot of a size class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotRef {
    pub class: usize,
    pub slot: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Absent,
    Loading(SlotRef),
    Resident {
        slot: SlotRef,
        leases: u32,
        pinned: bool,
    },
}

/// The answer to a reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reserve {
    /// A slot to copy the expert into; call [`VramCache::complete`] (or
    /// [`VramCache::abort`]) when done. `evicted` names the entry that
    /// held it.
    Slot {
        slot: SlotRef,
        evicted: Option<u32>,
    },
    /// Already resident or being loaded: nothing to do.
    InFlight,
    Resident,
    /// No slot can be had now (all leased, pinned or loading, or the class
    /// has no cache slots).
    Full,
}

/// Where one entry is (tests and diagnostics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VramResidency {
    Absent,
    Loading,
    Resident {
        leases: u32,
        pinned: bool,
        evictable: bool,
    },
}

/// Counters of the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct VramCacheStats {
    pub hits: u64,
    pub misses: u64,
    pub loads: u64,
    pub evictions: u64,
    /// Reservations refused because every slot was in use.
    pub full: u64,
}

struct Class {
    free: Vec<usize>,
    slots: usize,
    /// Which entry holds each slot (`u32::MAX`: none).
    holder: Vec<u32>,
}

/// Slot bookkeeping of the VRAM expert cache over `entries` experts in
/// size classes of given slot counts.
pub struct VramCache {
    state: Vec<State>,
    class_of: Vec<u16>,
    classes: Vec<Class>,
    lists: IntrusiveLists,
    stats: VramCacheStats,
}

impl VramCache {
    /// `class_of[e]` is entry e's size class (`u16::MAX`: not a routed
    /// expert); `slots[c]` the cache slots of class c.
    pub fn new(class_of: Vec<u16>, slots: &[usize]) -> VramCache {
        let entries = class_of.len();
        VramCache {
            state: vec![State::Absent; entries],
            class_of,
            classes: slots
                .iter()
                .map(|&n| Class {
                    free: (0..n).rev().collect(),
                    slots: n,
                    holder: vec![u32::MAX; n],
                })
                .collect(),
            lists: IntrusiveLists::new(entries, slots.len().max(1)),
            stats: VramCacheStats::default(),
        }
    }

    pub fn entries(&self) -> usize {
        self.state.len()
    }

    /// Cache slots of class `c`.
    pub fn slots(&self, c: usize) -> usize {
        self.classes.get(c).map_or(0, |k| k.slots)
    }

    pub fn stats(&self) -> VramCacheStats {
        self.stats
    }

    fn class(&self, e: u32) -> Option<usize> {
        match self.class_of.get(e as usize) {
            Some(&c) if c != u16::MAX && (c as usize) < self.classes.len() => Some(c as usize),
            _ => None,
        }
    }

    /// A use of entry `e`: a hit takes a lease and returns the slot (the
    /// entry leaves the eviction list until its last lease ends); a miss
    /// returns `None`.
    pub fn lease(&mut self, e: u32) -> Option<SlotRef> {
        match &mut self.state[e as usize] {
            State::Resident { slot, leases, .. } => {
                *leases += 1;
                let slot = *slot;
                self.lists.remove(e);
                self.stats.hits += 1;
                Some(slot)
            }
            _ => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Ends one lease of `e`; the last one makes an unpinned entry
    /// evictable (most recently used).
    pub fn release(&mut self, e: u32) {
        let idle = match &mut self.state[e as usize] {
            State::Resident { leases, pinned, .. } => {
                *leases = leases.saturating_sub(1);
                *leases == 0 && !*pinned
            }
            _ => false,
        };
        if idle && let Some(c) = self.class(e) {
            self.lists.push_front(c as ListId, e);
        }
    }

    /// Reserves a slot to bring `e` in (single flight: an entry loading or
    /// resident is not reserved again).
    pub fn reserve(&mut self, e: u32) -> Reserve {
        match self.state[e as usize] {
            State::Loading(_) => return Reserve::InFlight,
            State::Resident { .. } => return Reserve::Resident,
            State::Absent => {}
        }
        let Some(c) = self.class(e) else {
            self.stats.full += 1;
            return Reserve::Full;
        };
        let (slot, evicted) = if let Some(s) = self.classes[c].free.pop() {
            (s, None)
        } else if let Some(victim) = self.lists.back(c as ListId) {
            self.lists.remove(victim);
            let State::Resident { slot, .. } = self.state[victim as usize] else {
                // Only idle resident entries are linked.
                self.stats.full += 1;
                return Reserve::Full;
            };
            self.state[victim as usize] = State::Absent;
            self.stats.evictions += 1;
            (slot.slot, Some(victim))
        } else {
            self.stats.full += 1;
            return Reserve::Full;
        };
        let slot = SlotRef { class: c, slot };
        self.classes[c].holder[slot.slot] = e;
        self.state[e as usize] = State::Loading(slot);
        Reserve::Slot { slot, evicted }
    }

    /// The copy into `e`'s reserved slot is issued (ordered before any
    /// later reader): the entry is resident, with `leases` leases and
    /// pinned or not.
    pub fn complete(&mut self, e: u32, leases: u32, pinned: bool) {
        if let State::Loading(slot) = self.state[e as usize] {
            self.state[e as usize] = State::Resident {
                slot,
                leases,
                pinned,
            };
            self.stats.loads += 1;
            if leases == 0 && !pinned {
                self.lists.push_front(slot.class as ListId, e);
            }
        }
    }

    /// Gives a reserved slot back (the copy could not be issued).
    pub fn abort(&mut self, e: u32) {
        if let State::Loading(slot) = self.state[e as usize] {
            self.state[e as usize] = State::Absent;
            let class = &mut self.classes[slot.class];
            class.holder[slot.slot] = u32::MAX;
            class.free.push(slot.slot);
        }
    }

    /// Where `e` is.
    pub fn residency(&self, e: u32) -> VramResidency {
        match self.state[e as usize] {
            State::Absent => VramResidency::Absent,
            State::Loading(_) => VramResidency::Loading,
            State::Resident { leases, pinned, .. } => VramResidency::Resident {
                leases,
                pinned,
                evictable: self.lists.list_of(e).is_some(),
            },
        }
    }

    /// The slot of a resident entry.
    pub fn slot_of(&self, e: u32) -> Option<SlotRef> {
        match self.state[e as usize] {
            State::Resident { slot, .. } | State::Loading(slot) => Some(slot),
            State::Absent => None,
        }
    }

    /// Resident entries of class `c` (pinned, idle and leased).
    pub fn resident(&self, c: usize) -> usize {
        self.classes.get(c).map_or(0, |k| k.slots - k.free.len())
    }

    /// Idle (evictable) entries of class `c`.
    pub fn idle(&self, c: usize) -> usize {
        if c < self.classes.len() {
            self.lists.len(c as ListId)
        } else {
            0
        }
    }

    /// Checks the invariants (tests): every slot is free or held by exactly
    /// the entry that says it holds it, and exactly the idle unpinned
    /// resident entries are linked.
    pub fn check(&self) -> Result<(), String> {
        for (c, class) in self.classes.iter().enumerate() {
            let mut seen = vec![false; class.slots];
            for &s in &class.free {
                if std::mem::replace(&mut seen[s], true) {
                    return Err(format!("class {c}: slot {s} free twice"));
                }
                if class.holder[s] != u32::MAX {
                    return Err(format!("class {c}: free slot {s} has a holder"));
                }
            }
            for (s, &h) in class.holder.iter().enumerate() {
                if h == u32::MAX {
                    if !seen[s] {
                        return Err(format!("class {c}: slot {s} neither free nor held"));
                    }
                    continue;
                }
                match self.state[h as usize] {
                    State::Loading(r) | State::Resident { slot: r, .. }
                        if r == (SlotRef { class: c, slot: s }) => {}
                    other => {
                        return Err(format!("class {c}: slot {s} held by {h} in {other:?}"));
                    }
                }
            }
        }
        for (e, st) in self.state.iter().enumerate() {
            let linked = self.lists.list_of(e as u32).is_some();
            let should = matches!(
                st,
                State::Resident {
                    leases: 0,
                    pinned: false,
                    ..
                }
            );
            if linked != should {
                return Err(format!("entry {e}: linked {linked}, state {st:?}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot_of(r: Reserve) -> SlotRef {
        match r {
            Reserve::Slot { slot, .. } => slot,
            other => panic!("expected a slot, got {other:?}"),
        }
    }

    #[test]
    fn lru_evicts_the_least_recently_released_idle_entry() {
        let mut c = VramCache::new(vec![0; 6], &[2]);
        for e in [0, 1] {
            assert_eq!(c.lease(e), None);
            slot_of(c.reserve(e));
            c.complete(e, 0, false);
        }
        c.check().unwrap();
        // Use 0 again: 1 is now the least recently used.
        assert!(c.lease(0).is_some());
        c.release(0);
        match c.reserve(2) {
            Reserve::Slot { evicted, .. } => assert_eq!(evicted, Some(1)),
            other => panic!("{other:?}"),
        }
        c.complete(2, 0, false);
        assert_eq!(c.residency(1), VramResidency::Absent);
        assert!(c.lease(0).is_some());
        c.check().unwrap();
        assert_eq!(c.stats().evictions, 1);
    }

    #[test]
    fn leased_pinned_and_loading_entries_are_never_evicted() {
        let mut c = VramCache::new(vec![0; 5], &[3]);
        slot_of(c.reserve(0));
        c.complete(0, 1, false); // leased
        slot_of(c.reserve(1));
        c.complete(1, 0, true); // pinned
        slot_of(c.reserve(2)); // loading
        c.check().unwrap();
        assert_eq!(c.reserve(3), Reserve::Full);
        // Single flight: the loading entry is not reserved twice.
        assert_eq!(c.reserve(2), Reserve::InFlight);
        assert_eq!(c.reserve(0), Reserve::Resident);
        c.complete(2, 0, false);
        // Now 2 is idle and can go; 0 and 1 stay.
        match c.reserve(3) {
            Reserve::Slot { evicted, .. } => assert_eq!(evicted, Some(2)),
            other => panic!("{other:?}"),
        }
        c.complete(3, 0, false);
        c.release(0);
        assert!(matches!(
            c.residency(1),
            VramResidency::Resident {
                pinned: true,
                evictable: false,
                ..
            }
        ));
        c.check().unwrap();
    }

    #[test]
    fn zero_slots_caches_nothing_and_abort_frees() {
        let mut c = VramCache::new(vec![0, 0, 1, 1], &[0, 1]);
        assert_eq!(c.reserve(0), Reserve::Full);
        let s = slot_of(c.reserve(2));
        assert_eq!(s.class, 1);
        c.abort(2);
        assert_eq!(c.residency(2), VramResidency::Absent);
        assert_eq!(slot_of(c.reserve(3)), s);
        c.complete(3, 0, false);
        c.check().unwrap();
        // Classes are separate: class 0's misses never touch class 1.
        assert_eq!(c.reserve(1), Reserve::Full);
        assert_eq!(c.resident(1), 1);
        assert_eq!(c.idle(1), 1);
    }

    #[test]
    fn random_operations_keep_the_invariants() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let n = 40u32;
        let class_of: Vec<u16> = (0..n).map(|e| (e % 3) as u16).collect();
        let mut c = VramCache::new(class_of, &[4, 2, 0]);
        let mut leases = vec![0u32; n as usize];
        for _ in 0..5000 {
            let e = rng.random_range(0..n);
            match rng.random_range(0..4) {
                0 if c.lease(e).is_some() => leases[e as usize] += 1,
                1 if leases[e as usize] > 0 => {
                    leases[e as usize] -= 1;
                    c.release(e);
                }
                2 => {
                    if let Reserve::Slot { evicted, .. } = c.reserve(e) {
                        if let Some(v) = evicted {
                            assert_eq!(leases[v as usize], 0, "evicted a leased entry");
                        }
                        if rng.random_bool(0.1) {
                            c.abort(e);
                        } else {
                            c.complete(e, 0, rng.random_bool(0.05));
                        }
                    }
                }
                _ => {}
            }
            c.check().unwrap();
        }
    }
}
