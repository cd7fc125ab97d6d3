//! Counters of the reader, readable at any time from any thread.
//!
//! The reader thread is the only writer; everyone else takes a
//! [`CounterSnapshot`]. Gauges (`reads_queued`, `reads_in_kernel`) say where
//! the I/O is right now; the rest only grow. A "read" is one kernel read
//! (an extent, or a piece of a large one); a "request" is what the caller
//! submitted and gets one completion for.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters (shared between the reader thread and its handles).
#[derive(Debug, Default)]
pub(crate) struct Counters {
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
    pub reads_retried: AtomicU64,
    pub faults_injected: AtomicU64,
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
    /// Bytes the kernel transferred (aligned supersets included).
    pub bytes_read: u64,
    /// Bytes the callers asked for, of successful requests.
    pub bytes_delivered: u64,
    /// Short reads whose remainder was resubmitted.
    pub short_reads_resubmitted: u64,
    /// Reads that finished in the kernel after their request was cancelled
    /// or had failed: bandwidth spent for nothing (stale prefetch).
    pub reads_discarded: u64,
    /// Reads retried after `EINTR`/`EAGAIN`.
    pub reads_retried: u64,
    /// Faults the injector applied.
    pub faults_injected: u64,
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
            reads_retried: get(&self.reads_retried),
            faults_injected: get(&self.faults_injected),
        }
    }
}

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

pub(crate) fn sub(counter: &AtomicU64, n: u64) {
    counter.fetch_sub(n, Ordering::Relaxed);
}
