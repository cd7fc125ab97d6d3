//! Intrusive doubly linked lists over entry indices, and the eviction
//! policies built from them. Every operation is O(1): no scan ever walks
//! the cache (LESSONS.md: O(capacity) scans made more cache slower).
//!
//! Each entry is in at most one list at a time; its links live in one flat
//! array indexed by entry, so a list costs nothing per element beyond the
//! two `u32` links it owns anyway. Only *evictable* entries are ever in an
//! eviction list: an entry that is leased, pinned or still loading is
//! simply not linked, so choosing a victim is one look at a list's tail.
//!
//! Policies (both O(1)):
//! - [`EvictionPolicy::Lru`]: one list, most recently released at the head.
//!   The default.
//! - [`EvictionPolicy::Slru`]: segmented LRU, the frequency-aware variant.
//!   An expert used again while cached is promoted to a *protected*
//!   segment (at most half of the cache); everything else waits in a
//!   *probation* segment, which is where victims come from. One-off experts
//!   (a burst of rarely routed ones in a prompt) then cannot flush the
//!   experts that keep coming back.
//!
//! Why LRU is the default: on the fixtures' routing (`cargo run -p
//! colibri-sched --example eviction_policies`: 6 sampled continuations of
//! 200 tokens per fixture, caches of 25/50/75% of the routed experts), LRU
//! averaged a 56.3% hit rate and SLRU 55.4% (Belady's optimum 75.7%). SLRU
//! won by 1-5 points at 50-75% but lost up to 12 points at 25%, where a
//! small probation segment evicts the previous token's experts before they
//! come back; small caches are the regime that matters most here. The
//! fixtures have 8-32 experts; LESSONS.md reports frequency weighting
//! helping fine-grained (128-512 expert) models, so SLRU stays selectable
//! and should be re-measured on such a model's routing.

/// No entry.
pub const NIL: u32 = u32::MAX;

/// Which list an entry is in.
pub type ListId = u16;

/// Not in any list.
pub const NO_LIST: ListId = ListId::MAX;

#[derive(Clone, Copy, Debug)]
struct Link {
    prev: u32,
    next: u32,
    list: ListId,
}

#[derive(Clone, Copy, Debug)]
struct Ends {
    head: u32,
    tail: u32,
    len: usize,
}

/// A fixed set of intrusive lists over entries `0..entries`.
#[derive(Debug)]
pub struct IntrusiveLists {
    links: Vec<Link>,
    lists: Vec<Ends>,
}

impl IntrusiveLists {
    /// `lists` empty lists over `entries` entries (none linked).
    pub fn new(entries: usize, lists: usize) -> Self {
        IntrusiveLists {
            links: vec![
                Link {
                    prev: NIL,
                    next: NIL,
                    list: NO_LIST,
                };
                entries
            ],
            lists: vec![
                Ends {
                    head: NIL,
                    tail: NIL,
                    len: 0
                };
                lists
            ],
        }
    }

    /// The list `entry` is in.
    pub fn list_of(&self, entry: u32) -> Option<ListId> {
        let list = self.links[entry as usize].list;
        (list != NO_LIST).then_some(list)
    }

    /// Elements of `list`.
    pub fn len(&self, list: ListId) -> usize {
        self.lists[list as usize].len
    }

    /// Links `entry` (in no list) at the head of `list`.
    pub fn push_front(&mut self, list: ListId, entry: u32) {
        debug_assert_eq!(self.links[entry as usize].list, NO_LIST);
        let ends = &mut self.lists[list as usize];
        let old_head = ends.head;
        self.links[entry as usize] = Link {
            prev: NIL,
            next: old_head,
            list,
        };
        if old_head == NIL {
            ends.tail = entry;
        } else {
            self.links[old_head as usize].prev = entry;
        }
        ends.head = entry;
        ends.len += 1;
    }

    /// Unlinks `entry` from whatever list holds it; returns that list.
    pub fn remove(&mut self, entry: u32) -> Option<ListId> {
        let link = self.links[entry as usize];
        if link.list == NO_LIST {
            return None;
        }
        let ends = &mut self.lists[link.list as usize];
        if link.prev == NIL {
            ends.head = link.next;
        } else {
            self.links[link.prev as usize].next = link.next;
        }
        if link.next == NIL {
            ends.tail = link.prev;
        } else {
            self.links[link.next as usize].prev = link.prev;
        }
        ends.len -= 1;
        self.links[entry as usize] = Link {
            prev: NIL,
            next: NIL,
            list: NO_LIST,
        };
        Some(link.list)
    }

    /// The most recently linked entry of `list`.
    pub fn front(&self, list: ListId) -> Option<u32> {
        let head = self.lists[list as usize].head;
        (head != NIL).then_some(head)
    }

    /// The least recently linked entry of `list`.
    pub fn back(&self, list: ListId) -> Option<u32> {
        let tail = self.lists[list as usize].tail;
        (tail != NIL).then_some(tail)
    }

    /// Entries of `list` from head to tail (tests and diagnostics only).
    pub fn iter(&self, list: ListId) -> impl Iterator<Item = u32> + '_ {
        let mut at = self.lists[list as usize].head;
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let here = at;
            at = self.links[here as usize].next;
            Some(here)
        })
    }
}

/// How idle cached experts are chosen for eviction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum EvictionPolicy {
    /// Least recently used.
    #[default]
    Lru,
    /// Segmented LRU: experts reused while cached are protected.
    Slru,
}

impl std::str::FromStr for EvictionPolicy {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "lru" => Ok(Self::Lru),
            "slru" => Ok(Self::Slru),
            other => Err(format!("unknown eviction policy {other:?} (lru or slru)")),
        }
    }
}

impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Lru => "lru",
            Self::Slru => "slru",
        })
    }
}

/// The eviction order of one size class: two lists of [`IntrusiveLists`]
/// (probation and protected; LRU uses only probation).
#[derive(Clone, Copy, Debug)]
pub struct EvictionOrder {
    pub policy: EvictionPolicy,
    pub probation: ListId,
    pub protected: ListId,
    /// Protected entries at most (SLRU).
    pub protected_cap: usize,
}

impl EvictionOrder {
    /// An order over the lists `probation` and `protected` for a cache of
    /// `capacity` idle entries.
    pub fn new(
        policy: EvictionPolicy,
        probation: ListId,
        protected: ListId,
        capacity: usize,
    ) -> Self {
        EvictionOrder {
            policy,
            probation,
            protected,
            protected_cap: capacity / 2,
        }
    }

    /// Idle entries in the order.
    pub fn len(&self, lists: &IntrusiveLists) -> usize {
        lists.len(self.probation) + lists.len(self.protected)
    }

    /// Whether no entry is evictable.
    pub fn is_empty(&self, lists: &IntrusiveLists) -> bool {
        self.len(lists) == 0
    }

    /// Links an entry that just became evictable. `reused`: it was used
    /// again after the use that brought it in.
    pub fn insert(&self, lists: &mut IntrusiveLists, entry: u32, reused: bool) {
        match self.policy {
            EvictionPolicy::Lru => lists.push_front(self.probation, entry),
            EvictionPolicy::Slru if reused && self.protected_cap > 0 => {
                lists.push_front(self.protected, entry);
                if lists.len(self.protected) > self.protected_cap
                    && let Some(demoted) = lists.back(self.protected)
                {
                    lists.remove(demoted);
                    lists.push_front(self.probation, demoted);
                }
            }
            EvictionPolicy::Slru => lists.push_front(self.probation, entry),
        }
    }

    /// The next victim (left linked; the caller removes it).
    pub fn victim(&self, lists: &IntrusiveLists) -> Option<u32> {
        lists
            .back(self.probation)
            .or_else(|| lists.back(self.protected))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_link_and_unlink_in_constant_time_order() {
        let mut l = IntrusiveLists::new(6, 2);
        for e in [0, 1, 2] {
            l.push_front(0, e);
        }
        l.push_front(1, 5);
        assert_eq!(l.iter(0).collect::<Vec<_>>(), vec![2, 1, 0]);
        assert_eq!(l.back(0), Some(0));
        assert_eq!(l.front(0), Some(2));
        assert_eq!(l.front(1), Some(5));
        assert_eq!(l.remove(1), Some(0));
        assert_eq!(l.iter(0).collect::<Vec<_>>(), vec![2, 0]);
        assert_eq!(l.remove(1), None);
        assert_eq!(l.remove(0), Some(0));
        assert_eq!(l.remove(2), Some(0));
        assert_eq!(l.len(0), 0);
        assert_eq!(l.back(0), None);
        assert_eq!(l.list_of(5), Some(1));
        assert_eq!(l.list_of(3), None);
        l.push_front(0, 2);
        assert_eq!(l.iter(0).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn lru_evicts_the_least_recently_released() {
        let mut l = IntrusiveLists::new(4, 2);
        let order = EvictionOrder::new(EvictionPolicy::Lru, 0, 1, 4);
        for e in 0..4 {
            order.insert(&mut l, e, true);
        }
        assert_eq!(order.victim(&l), Some(0));
        // Using 0 again unlinks it; releasing it makes it the newest.
        l.remove(0);
        order.insert(&mut l, 0, true);
        assert_eq!(order.victim(&l), Some(1));
        assert_eq!(order.len(&l), 4);
    }

    #[test]
    fn slru_protects_reused_entries_from_one_off_ones() {
        let mut l = IntrusiveLists::new(10, 2);
        let order = EvictionOrder::new(EvictionPolicy::Slru, 0, 1, 5);
        assert_eq!(order.protected_cap, 2);
        // 0 and 1 were reused; 2..6 are one-offs, released later.
        order.insert(&mut l, 0, true);
        order.insert(&mut l, 1, true);
        for e in 2..6 {
            order.insert(&mut l, e, false);
        }
        // The oldest one-off goes first, not the older reused entries.
        assert_eq!(order.victim(&l), Some(2));
        // Overflowing the protected segment demotes its oldest.
        for e in 6..9 {
            order.insert(&mut l, e, true);
        }
        assert_eq!(l.len(1), 2);
        assert_eq!(l.list_of(0), Some(0));
        assert_eq!(l.iter(0).take(3).collect::<Vec<_>>(), vec![6, 1, 0]);
        // With no probation entries left, victims come from protected.
        while let Some(v) = l.back(0) {
            l.remove(v);
        }
        assert_eq!(order.victim(&l), Some(7));
    }
}
