//! `PinnedArena`: page-locked host memory cut into fixed-size slots that
//! reads land in.
//!
//! The arena is one anonymous `mmap`, locked with `mlock` so the pages stay
//! resident (a read into a swapped-out page would fault, and a later CUDA
//! tier wants to `cuMemHostRegister` the same range for DMA). Locking is best
//! effort: when `RLIMIT_MEMLOCK` refuses, the arena still works, says so once
//! with a `warn!`, and [`PinnedArena::is_locked`] reports it.
//!
//! Slots are handed out as owned [`Slot`] handles from an O(1) free list;
//! dropping a `Slot` returns it. A `Slot` is the only way to touch its bytes
//! from safe code, and a read request takes the `Slot` by value for as long
//! as the kernel may write into it, so no one can look at bytes in flight.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::IoError;

/// Slots are multiples of this, so every slot starts page-aligned (which
/// satisfies any direct-I/O memory alignment up to a page).
pub const SLOT_GRANULE: usize = 4096;

static NEXT_ARENA_ID: AtomicU64 = AtomicU64::new(1);
static WARNED_MLOCK: AtomicBool = AtomicBool::new(false);

/// Page-locked host memory split into equal slots.
pub struct PinnedArena {
    id: u64,
    base: NonNull<u8>,
    bytes: usize,
    slot_size: usize,
    slot_count: u32,
    locked: bool,
    free: Mutex<Vec<u32>>,
    slot_returned: Condvar,
}

// SAFETY: the arena's memory is reached only through `Slot` handles (each
// index is owned by at most one `Slot`, enforced by the free list under a
// mutex) or through raw pointers that a read holds while it owns the `Slot`.
// The struct itself only holds the mapping's address, which is valid from
// any thread.
unsafe impl Send for PinnedArena {}
// SAFETY: shared access only reads immutable fields or goes through the
// mutex-protected free list; see the `Send` justification for the bytes.
unsafe impl Sync for PinnedArena {}

impl std::fmt::Debug for PinnedArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedArena")
            .field("id", &self.id)
            .field("bytes", &self.bytes)
            .field("slot_size", &self.slot_size)
            .field("slot_count", &self.slot_count)
            .field("locked", &self.locked)
            .finish()
    }
}

impl PinnedArena {
    /// Maps `slot_count` slots of at least `slot_size` bytes each (rounded up
    /// to [`SLOT_GRANULE`]) and tries to lock them in memory.
    pub fn new(slot_size: usize, slot_count: usize) -> Result<Arc<PinnedArena>, IoError> {
        Self::with_pages(slot_size, slot_count, false)
    }

    /// [`Self::new`], asking the kernel for transparent huge pages when
    /// `huge_pages` (and `COLIBRI_NO_HUGEPAGES` is unset). Worth it for an
    /// arena the kernels stream (fewer TLB misses); an arena that fills
    /// while reads wait on it should also be faulted in ahead
    /// ([`Self::populate_in_background`]), or each first touch of a huge
    /// page may compact memory while a read waits (blocked on reads went
    /// from 11–15% to 22% of an 8 GiB-cgroup decode).
    pub fn with_pages(
        slot_size: usize,
        slot_count: usize,
        huge_pages: bool,
    ) -> Result<Arc<PinnedArena>, IoError> {
        if slot_size == 0 || slot_count == 0 {
            return Err(IoError::InvalidArgument(format!(
                "arena of {slot_count} slots of {slot_size} bytes"
            )));
        }
        let slot_count = u32::try_from(slot_count)
            .map_err(|_| IoError::InvalidArgument(format!("{slot_count} slots is too many")))?;
        let slot_size = slot_size
            .checked_next_multiple_of(SLOT_GRANULE)
            .ok_or_else(|| IoError::InvalidArgument(format!("slot size {slot_size}")))?;
        // One granule past the last slot: a device that reads a slot's
        // bytes in place may read a few bytes past a matrix's end (the GPU
        // tier's kernels do), which must stay inside the mapping.
        let bytes = slot_size
            .checked_mul(slot_count as usize)
            .and_then(|b| b.checked_add(SLOT_GRANULE))
            .ok_or_else(|| {
                IoError::InvalidArgument(format!(
                    "{slot_count} slots of {slot_size} bytes overflow"
                ))
            })?;
        // SAFETY: an anonymous private mapping at a kernel-chosen address
        // touches no existing memory; the result is checked below.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(IoError::Arena {
                bytes,
                source: std::io::Error::last_os_error(),
            });
        }
        let base = NonNull::new(raw.cast::<u8>()).ok_or_else(|| IoError::Arena {
            bytes,
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        })?;
        // A child process must not share these pages copy-on-write while the
        // kernel DMAs into them for us.
        // SAFETY: `raw..raw+bytes` is the mapping we just created.
        unsafe { libc::madvise(raw, bytes, libc::MADV_DONTFORK) };
        if huge_pages && std::env::var_os("COLIBRI_NO_HUGEPAGES").is_none_or(|v| v == "0") {
            // SAFETY: same range; MADV_HUGEPAGE is only a hint about how to
            // back it, and a failure leaves ordinary pages.
            unsafe { libc::madvise(raw, bytes, libc::MADV_HUGEPAGE) };
        }
        // Lock pages as they are first touched (MLOCK_ONFAULT) rather than
        // faulting the whole arena in now: a large cache would otherwise
        // cost seconds at start for pages a run may never use. Kernels
        // without mlock2 lock everything at once.
        // SAFETY: same range; mlock/mlock2 only change residency.
        let locked = unsafe {
            libc::mlock2(raw, bytes, libc::MLOCK_ONFAULT) == 0 || libc::mlock(raw, bytes) == 0
        };
        if !locked {
            let err = std::io::Error::last_os_error();
            if !WARNED_MLOCK.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "could not lock {bytes} bytes of host memory ({err}; RLIMIT_MEMLOCK is {}): \
                     reads still work but these pages may be swapped out and are not \
                     page-locked for DMA; raise `ulimit -l` or run with CAP_IPC_LOCK",
                    memlock_limit_text()
                );
            }
            // Fault the pages in now rather than on the first read.
            // SAFETY: same range, MADV_POPULATE_WRITE only prefaults it.
            unsafe { libc::madvise(raw, bytes, libc::MADV_POPULATE_WRITE) };
        }
        let free = (0..slot_count).rev().collect();
        Ok(Arc::new(PinnedArena {
            id: NEXT_ARENA_ID.fetch_add(1, Ordering::Relaxed),
            base,
            bytes,
            slot_size,
            slot_count,
            locked,
            free: Mutex::new(free),
            slot_returned: Condvar::new(),
        }))
    }

    /// Faults the whole arena in on a background thread, from its end
    /// backwards (slots are handed out from the start), 32 MiB at a time
    /// (`MADV_POPULATE_WRITE`): reads and kernels then meet resident pages,
    /// huge where [`Self::with_pages`] asked for them, instead of faulting
    /// them in (and compacting memory for them) on the decode's critical
    /// path. Contents never change: a page a read has filled is present
    /// and left alone. The thread holds the arena only for one step at a
    /// time, so dropping the arena stops it. Best effort: a kernel without
    /// `MADV_POPULATE_WRITE` (before 5.14) ends it at once.
    pub fn populate_in_background(self: &Arc<Self>) {
        const STEP: usize = 32 << 20;
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("colibri-arena-fault".into())
            .spawn(move || {
                let mut end = match weak.upgrade() {
                    Some(a) => a.bytes,
                    None => return,
                };
                while end > 0 {
                    let Some(arena) = weak.upgrade() else {
                        return;
                    };
                    let start = end.saturating_sub(STEP);
                    // SAFETY: `start..end` lies in the mapping, which the
                    // upgraded `arena` keeps alive during the call;
                    // MADV_POPULATE_WRITE only faults pages in (a present
                    // page, maybe being written by a read, is untouched).
                    let rc = unsafe {
                        libc::madvise(
                            arena.base.as_ptr().add(start).cast(),
                            end - start,
                            libc::MADV_POPULATE_WRITE,
                        )
                    };
                    if rc != 0 {
                        return;
                    }
                    end = start;
                }
            });
        if let Err(error) = spawned {
            tracing::debug!("arena pages fault in on first use: {error}");
        }
    }

    /// Process-unique id of this arena.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Start of the whole arena (for `cuMemHostRegister` or io_uring buffer
    /// registration). Writing through it is only sound for a range whose
    /// [`Slot`] the writer owns.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Length of the whole arena in bytes (the slots and one granule
    /// after them).
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes per slot (a multiple of [`SLOT_GRANULE`]).
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// Number of slots.
    pub fn slot_count(&self) -> usize {
        self.slot_count as usize
    }

    /// Whether `mlock` succeeded.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Slots not currently handed out.
    pub fn free_slots(&self) -> usize {
        self.free_list().len()
    }

    /// Takes a free slot, or `None` when all are in use.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Slot> {
        let index = self.free_list().pop()?;
        Some(Slot {
            arena: Arc::clone(self),
            index,
        })
    }

    /// Takes a free slot, waiting up to `timeout` for one to be returned.
    pub fn acquire_timeout(self: &Arc<Self>, timeout: Duration) -> Option<Slot> {
        let deadline = std::time::Instant::now() + timeout;
        let mut free = self.free_list();
        loop {
            if let Some(index) = free.pop() {
                return Some(Slot {
                    arena: Arc::clone(self),
                    index,
                });
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return None;
            }
            free = match self.slot_returned.wait_timeout(free, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }

    fn free_list(&self) -> MutexGuard<'_, Vec<u32>> {
        // The free list is a plain Vec that a panic cannot leave half-updated
        // (push/pop are single operations), so a poisoned lock is still valid.
        self.free
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn release(&self, index: u32) {
        self.free_list().push(index);
        self.slot_returned.notify_one();
    }
}

impl Drop for PinnedArena {
    fn drop(&mut self) {
        // SAFETY: `base..base+bytes` is the mapping created in `new`; no Slot
        // outlives the arena (each holds an `Arc` to it), so nothing refers
        // to the memory any more. munmap also drops the lock.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.bytes);
        }
    }
}

fn memlock_limit_text() -> String {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return "unknown".into();
    }
    if limit.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        format!("{} bytes", limit.rlim_cur)
    }
}

/// Exclusive ownership of one slot of a [`PinnedArena`]; returned to the
/// arena's free list on drop.
pub struct Slot {
    arena: Arc<PinnedArena>,
    index: u32,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("arena", &self.arena.id)
            .field("index", &self.index)
            .finish()
    }
}

impl Slot {
    /// Index of the slot within its arena.
    pub fn index(&self) -> usize {
        self.index as usize
    }

    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        self.arena.slot_size
    }

    /// Always false (slots are never empty); for API symmetry.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The arena this slot belongs to.
    pub fn arena(&self) -> &Arc<PinnedArena> {
        &self.arena
    }

    /// Start of the slot's bytes.
    pub fn as_ptr(&self) -> *const u8 {
        self.start()
    }

    /// Start of the slot's bytes, for writing (by a read the caller owns).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.start()
    }

    /// The slot's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the range is inside the arena mapping (index < slot_count),
        // initialised (anonymous pages are zero-filled) and, since this Slot
        // is the unique owner of the index, nothing writes to it while the
        // shared borrow of `self` lives.
        unsafe { std::slice::from_raw_parts(self.start(), self.arena.slot_size) }
    }

    /// The slot's bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and the exclusive borrow of the unique owner
        // rules out any other access.
        unsafe { std::slice::from_raw_parts_mut(self.start(), self.arena.slot_size) }
    }

    fn start(&self) -> *mut u8 {
        // SAFETY: index < slot_count, so the offset stays inside the mapping
        // of slot_size * slot_count bytes.
        unsafe {
            self.arena
                .base
                .as_ptr()
                .add(self.index as usize * self.arena.slot_size)
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.arena.release(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_distinct_aligned_and_recycled() {
        let arena = PinnedArena::new(5000, 3).expect("arena");
        assert_eq!(arena.slot_size(), 8192);
        let mut a = arena.try_acquire().expect("slot");
        let mut b = arena.try_acquire().expect("slot");
        let c = arena.try_acquire().expect("slot");
        assert!(arena.try_acquire().is_none());
        assert_eq!(arena.free_slots(), 0);
        for slot in [&a, &b, &c] {
            assert_eq!(slot.as_ptr() as usize % SLOT_GRANULE, 0);
        }
        a.bytes_mut().fill(0xA5);
        b.bytes_mut().fill(0x5A);
        assert!(a.bytes().iter().all(|&x| x == 0xA5));
        assert!(b.bytes().iter().all(|&x| x == 0x5A));
        let index = b.index();
        drop(b);
        let again = arena.try_acquire().expect("slot");
        assert_eq!(again.index(), index);
        drop((a, c, again));
        assert_eq!(arena.free_slots(), 3);
    }

    #[test]
    fn acquire_timeout_waits_for_a_returned_slot() {
        let arena = PinnedArena::new(4096, 1).expect("arena");
        let slot = arena.try_acquire().expect("slot");
        assert!(arena.acquire_timeout(Duration::from_millis(1)).is_none());
        let giver = std::thread::spawn(move || drop(slot));
        let got = arena.acquire_timeout(Duration::from_secs(60));
        giver.join().expect("join");
        assert!(got.is_some());
    }

    /// Pages of `arena` the kernel reports resident (mincore).
    fn resident_pages(arena: &PinnedArena) -> usize {
        let pages = arena.len_bytes().div_ceil(4096);
        let mut vec = vec![0u8; pages];
        // SAFETY: the range is the arena's mapping; `vec` has a byte per page.
        let rc =
            unsafe { libc::mincore(arena.as_ptr().cast(), arena.len_bytes(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn populating_in_the_background_faults_every_page_and_keeps_the_bytes() {
        // 40 MiB: more than one 32 MiB step.
        let arena = PinnedArena::with_pages(1 << 20, 40, true).expect("arena");
        let mut first = arena.try_acquire().expect("slot");
        let pattern: Vec<u8> = (0..first.bytes().len())
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        first.bytes_mut().copy_from_slice(&pattern);
        arena.populate_in_background();
        let pages = arena.len_bytes() / 4096;
        let start = std::time::Instant::now();
        while resident_pages(&arena) < pages {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{} of {pages} pages resident after a minute",
                resident_pages(&arena)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            first.bytes(),
            &pattern[..],
            "populating changed a slot's bytes"
        );
        // Dropping the arena while a populate could run is fine: the
        // thread holds it one step at a time.
        drop(first);
        let other = PinnedArena::with_pages(1 << 20, 40, true).expect("arena");
        other.populate_in_background();
        drop(other);
    }

    #[test]
    fn zero_sizes_are_rejected() {
        assert!(PinnedArena::new(0, 1).is_err());
        assert!(PinnedArena::new(1, 0).is_err());
    }
}
