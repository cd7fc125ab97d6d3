//! Counters of the reader, readable at any time from any thread.
//!
//! The reader thread is the only writer; everyone else takes a
//! [`CounterSnapshot`]. Gauges (`reads_queued`, `reads_in_kernel`) say where
//! the I/O is right now; the rest only grow. A "read" is one kernel read
//! (an extent, or a piece of a large one); a "request" is what the caller
//! submitted and gets one completion for.
//!
//! `busy_ns` is the time at least one read was in the kernel: the engine
//! sets it against the time it spent blocked on reads to tell compute that
//! overlapped I/O from compute alone and from waiting alone.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Live counters (shared between the reader thread and its handles).
#[derive(Debug)]
pub(crate) struct Counters {
    /// Time with at least one read in the kernel before the current busy
    /// period, and when that period began. A mutex, not two atomics, so a
    /// snapshot never sees a period both ended and still running; it is
    /// taken twice per busy period, never per read in a busy queue.
    busy: Mutex<(Duration, Option<Instant>)>,
    pub requests_submitted: AtomicU64,
    pub reads_queued: AtomicU64,
    pub reads_in_kernel: AtomicU64,
    pub requests_completed: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_delivered: AtomicU64,
    pub short_reads_resubmitted: AtomicU64,
    pub reads_discarded: AtomicU64,
    pub bytes_discarded: AtomicU64,
    pub reads_retried: AtomicU64,
    pub faults_injected: AtomicU64,
    pub requests_promoted: AtomicU64,
    pub reads_promoted: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            busy: Mutex::new((Duration::ZERO, None)),
            requests_submitted: AtomicU64::new(0),
            reads_queued: AtomicU64::new(0),
            reads_in_kernel: AtomicU64::new(0),
            requests_completed: AtomicU64::new(0),
            requests_failed: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            bytes_delivered: AtomicU64::new(0),
            short_reads_resubmitted: AtomicU64::new(0),
            reads_discarded: AtomicU64::new(0),
            bytes_discarded: AtomicU64::new(0),
            reads_retried: AtomicU64::new(0),
            faults_injected: AtomicU64::new(0),
            requests_promoted: AtomicU64::new(0),
            reads_promoted: AtomicU64::new(0),
        }
    }
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CounterSnapshot {
    /// Requests accepted by `submit` (including ones that failed planning).
    pub requests_submitted: u64,
    /// Kernel reads waiting in our priority queues (gauge).
    pub reads_queued: u64,
    /// Kernel reads handed to the kernel / pread pool and not yet reaped
    /// (gauge).
    pub reads_in_kernel: u64,
    /// Requests completed with all their bytes.
    pub requests_completed: u64,
    /// Requests completed with an error.
    pub requests_failed: u64,
    /// Requests completed as cancelled.
    pub requests_cancelled: u64,
    /// Bytes the kernel transferred (aligned supersets included, and the
    /// reads whose results were discarded).
    pub bytes_read: u64,
    /// Bytes the callers asked for, of successful requests.
    pub bytes_delivered: u64,
    /// Short reads whose remainder was resubmitted.
    pub short_reads_resubmitted: u64,
    /// Reads that finished in the kernel after their request was cancelled
    /// or had failed: bandwidth spent for nothing (stale prefetch).
    pub reads_discarded: u64,
    /// Bytes those discarded reads transferred (part of `bytes_read`).
    pub bytes_discarded: u64,
    /// Reads retried after `EINTR`/`EAGAIN`.
    pub reads_retried: u64,
    /// Faults the injector applied.
    pub faults_injected: u64,
    /// Prefetch requests raised to demand priority ([`crate::Reader::promote`])
    /// while at least one of their reads was still queued.
    pub requests_promoted: u64,
    /// Queued reads moved from the prefetch queue to the demand queue by
    /// those promotions.
    pub reads_promoted: u64,
    /// Nanoseconds during which at least one read was in the kernel (or the
    /// pread pool), up to the snapshot.
    pub busy_ns: u64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> CounterSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            requests_submitted: get(&self.requests_submitted),
            reads_queued: get(&self.reads_queued),
            reads_in_kernel: get(&self.reads_in_kernel),
            requests_completed: get(&self.requests_completed),
            requests_failed: get(&self.requests_failed),
            requests_cancelled: get(&self.requests_cancelled),
            bytes_read: get(&self.bytes_read),
            bytes_delivered: get(&self.bytes_delivered),
            short_reads_resubmitted: get(&self.short_reads_resubmitted),
            reads_discarded: get(&self.reads_discarded),
            bytes_discarded: get(&self.bytes_discarded),
            reads_retried: get(&self.reads_retried),
            faults_injected: get(&self.faults_injected),
            requests_promoted: get(&self.requests_promoted),
            reads_promoted: get(&self.reads_promoted),
            busy_ns: self.busy_ns(),
        }
    }

    fn busy(&self) -> std::sync::MutexGuard<'_, (Duration, Option<Instant>)> {
        // Plain numbers: a panic elsewhere cannot leave them inconsistent.
        self.busy
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The reader thread: the first read entered the kernel.
    pub(crate) fn busy_begins(&self) {
        let mut busy = self.busy();
        if busy.1.is_none() {
            busy.1 = Some(Instant::now());
        }
    }

    /// The reader thread: the last read left the kernel.
    pub(crate) fn busy_ends(&self) {
        let mut busy = self.busy();
        if let Some(since) = busy.1.take() {
            busy.0 += since.elapsed();
        }
    }

    /// Busy time so far, the current period included.
    pub(crate) fn busy_ns(&self) -> u64 {
        let busy = self.busy();
        let total = busy.0 + busy.1.map_or(Duration::ZERO, |since| since.elapsed());
        u64::try_from(total.as_nanos()).unwrap_or(u64::MAX)
    }
}

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

pub(crate) fn sub(counter: &AtomicU64, n: u64) {
    counter.fetch_sub(n, Ordering::Relaxed);
}
