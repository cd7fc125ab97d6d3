//! What the tier did: hits, misses, joined reads, prefetch outcomes,
//! evictions, bytes read, time spent waiting on reads, and the latency of
//! each expert read (from submission to the bytes being usable).
//!
//! Prefetch is judged by two figures. **Recall**: of the demand misses (a
//! requested expert not cached or pinned), the share a prefetch had
//! already covered (landed) or started (joined). **Waste**: bytes
//! prefetched that no fetch used (evicted unused, or cancelled after the
//! read had reached the drive), per prefetched byte a fetch did use.
//!
//! Counters are atomics bumped on the paths that already hold the cache
//! lock or run on one thread, so reading them never stops the engine.
//! Snapshots subtract ([`TierStats::since`]) so a benchmark can measure
//! just its decode phase.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub fetch_calls: AtomicU64,
    pub requests: AtomicU64,
    pub hits: AtomicU64,
    pub prefetch_hits: AtomicU64,
    pub joined_demand: AtomicU64,
    pub joined_prefetch: AtomicU64,
    pub demand_reads: AtomicU64,
    pub prefetch_reads: AtomicU64,
    pub demand_read_bytes: AtomicU64,
    pub prefetch_read_bytes: AtomicU64,
    pub prefetch_unused: AtomicU64,
    pub prefetch_used: AtomicU64,
    pub prefetch_used_bytes: AtomicU64,
    pub prefetch_wasted: AtomicU64,
    pub prefetch_wasted_bytes: AtomicU64,
    pub prefetch_promoted: AtomicU64,
    pub prefetch_cancelled: AtomicU64,
    pub prefetch_cancelled_unissued: AtomicU64,
    pub prefetch_stale_evicted: AtomicU64,
    pub fill_reads: AtomicU64,
    pub fill_read_bytes: AtomicU64,
    pub fill_hits: AtomicU64,
    pub fill_joined: AtomicU64,
    pub fill_used_bytes: AtomicU64,
    pub fill_unused: AtomicU64,
    pub fill_unused_bytes: AtomicU64,
    pub evictions: AtomicU64,
    pub read_errors: AtomicU64,
    pub slot_waits: AtomicU64,
    pub fetch_ns: AtomicU64,
    pub io_wait_ns: AtomicU64,
    pub io_wait_busy_ns: AtomicU64,
}

pub(crate) fn bump(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// A copy of the tier's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierStats {
    /// `fetch` calls (one per MoE layer per forward pass).
    pub fetch_calls: u64,
    /// Experts asked for.
    pub requests: u64,
    /// Of which already in RAM (cached, pinned or prefetched and landed).
    pub hits: u64,
    /// Of the hits, experts a prefetch had brought in and not yet used.
    pub prefetch_hits: u64,
    /// Of the misses, joined to a demand read already in flight.
    pub joined_demand: u64,
    /// Of the misses, joined to a prefetch read already in flight.
    pub joined_prefetch: u64,
    /// Demand reads issued (one per expert).
    pub demand_reads: u64,
    /// Prefetch reads issued.
    pub prefetch_reads: u64,
    /// Aligned bytes of demand reads.
    pub demand_read_bytes: u64,
    /// Aligned bytes of prefetch reads.
    pub prefetch_read_bytes: u64,
    /// Prefetched experts evicted before any use.
    pub prefetch_unused: u64,
    /// Prefetch reads a fetch used (landed, or joined in flight), and their
    /// aligned bytes.
    pub prefetch_used: u64,
    pub prefetch_used_bytes: u64,
    /// Prefetch reads no fetch used that cost disk bandwidth (evicted
    /// unused, or cancelled once issued), and their aligned bytes.
    pub prefetch_wasted: u64,
    pub prefetch_wasted_bytes: u64,
    /// Prefetch reads a demand joined while they still had prefetch
    /// priority (raised to demand priority).
    pub prefetch_promoted: u64,
    /// Stale predictions whose reads were cancelled (queued or in flight).
    pub prefetch_cancelled: u64,
    /// Of those, reads cancelled before they reached the drive (no bytes).
    pub prefetch_cancelled_unissued: u64,
    /// Stale predictions that had landed and were evicted unused.
    pub prefetch_stale_evicted: u64,
    /// Reads that filled free cache room with the experts the routers
    /// favoured most so far ([`TierCache::fill`](super::TierCache::fill)),
    /// and their aligned bytes.
    pub fill_reads: u64,
    pub fill_read_bytes: u64,
    /// Requested experts a fill had brought in, at their first use (hits).
    pub fill_hits: u64,
    /// Misses joined to a fill read still in flight.
    pub fill_joined: u64,
    /// Aligned bytes of the fill reads that were used.
    pub fill_used_bytes: u64,
    /// Filled experts evicted before any use, and their aligned bytes.
    pub fill_unused: u64,
    pub fill_unused_bytes: u64,
    /// Cached experts evicted.
    pub evictions: u64,
    /// Reads that failed.
    pub read_errors: u64,
    /// Times a fetch found no slot and waited for one.
    pub slot_waits: u64,
    /// Nanoseconds inside `fetch` (waiting + delivering, i.e. computing).
    pub fetch_ns: u64,
    /// Nanoseconds `fetch` was blocked waiting for reads or slots.
    pub io_wait_ns: u64,
    /// Of those, nanoseconds during which the reader had a read in the
    /// kernel (the rest is hand-over between threads, or slot waits).
    pub io_wait_busy_ns: u64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> TierStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TierStats {
            fetch_calls: g(&self.fetch_calls),
            requests: g(&self.requests),
            hits: g(&self.hits),
            prefetch_hits: g(&self.prefetch_hits),
            joined_demand: g(&self.joined_demand),
            joined_prefetch: g(&self.joined_prefetch),
            demand_reads: g(&self.demand_reads),
            prefetch_reads: g(&self.prefetch_reads),
            demand_read_bytes: g(&self.demand_read_bytes),
            prefetch_read_bytes: g(&self.prefetch_read_bytes),
            prefetch_unused: g(&self.prefetch_unused),
            prefetch_used: g(&self.prefetch_used),
            prefetch_used_bytes: g(&self.prefetch_used_bytes),
            prefetch_wasted: g(&self.prefetch_wasted),
            prefetch_wasted_bytes: g(&self.prefetch_wasted_bytes),
            prefetch_promoted: g(&self.prefetch_promoted),
            prefetch_cancelled: g(&self.prefetch_cancelled),
            prefetch_cancelled_unissued: g(&self.prefetch_cancelled_unissued),
            prefetch_stale_evicted: g(&self.prefetch_stale_evicted),
            fill_reads: g(&self.fill_reads),
            fill_read_bytes: g(&self.fill_read_bytes),
            fill_hits: g(&self.fill_hits),
            fill_joined: g(&self.fill_joined),
            fill_used_bytes: g(&self.fill_used_bytes),
            fill_unused: g(&self.fill_unused),
            fill_unused_bytes: g(&self.fill_unused_bytes),
            evictions: g(&self.evictions),
            read_errors: g(&self.read_errors),
            slot_waits: g(&self.slot_waits),
            fetch_ns: g(&self.fetch_ns),
            io_wait_ns: g(&self.io_wait_ns),
            io_wait_busy_ns: g(&self.io_wait_busy_ns),
        }
    }
}

impl TierStats {
    /// Counts accumulated since `earlier`.
    pub fn since(&self, earlier: &TierStats) -> TierStats {
        TierStats {
            fetch_calls: self.fetch_calls - earlier.fetch_calls,
            requests: self.requests - earlier.requests,
            hits: self.hits - earlier.hits,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            joined_demand: self.joined_demand - earlier.joined_demand,
            joined_prefetch: self.joined_prefetch - earlier.joined_prefetch,
            demand_reads: self.demand_reads - earlier.demand_reads,
            prefetch_reads: self.prefetch_reads - earlier.prefetch_reads,
            demand_read_bytes: self.demand_read_bytes - earlier.demand_read_bytes,
            prefetch_read_bytes: self.prefetch_read_bytes - earlier.prefetch_read_bytes,
            prefetch_unused: self.prefetch_unused - earlier.prefetch_unused,
            prefetch_used: self.prefetch_used - earlier.prefetch_used,
            prefetch_used_bytes: self.prefetch_used_bytes - earlier.prefetch_used_bytes,
            prefetch_wasted: self.prefetch_wasted - earlier.prefetch_wasted,
            prefetch_wasted_bytes: self.prefetch_wasted_bytes - earlier.prefetch_wasted_bytes,
            prefetch_promoted: self.prefetch_promoted - earlier.prefetch_promoted,
            prefetch_cancelled: self.prefetch_cancelled - earlier.prefetch_cancelled,
            prefetch_cancelled_unissued: self.prefetch_cancelled_unissued
                - earlier.prefetch_cancelled_unissued,
            prefetch_stale_evicted: self.prefetch_stale_evicted - earlier.prefetch_stale_evicted,
            fill_reads: self.fill_reads - earlier.fill_reads,
            fill_read_bytes: self.fill_read_bytes - earlier.fill_read_bytes,
            fill_hits: self.fill_hits - earlier.fill_hits,
            fill_joined: self.fill_joined - earlier.fill_joined,
            fill_used_bytes: self.fill_used_bytes - earlier.fill_used_bytes,
            fill_unused: self.fill_unused - earlier.fill_unused,
            fill_unused_bytes: self.fill_unused_bytes - earlier.fill_unused_bytes,
            evictions: self.evictions - earlier.evictions,
            read_errors: self.read_errors - earlier.read_errors,
            slot_waits: self.slot_waits - earlier.slot_waits,
            fetch_ns: self.fetch_ns - earlier.fetch_ns,
            io_wait_ns: self.io_wait_ns - earlier.io_wait_ns,
            io_wait_busy_ns: self.io_wait_busy_ns - earlier.io_wait_busy_ns,
        }
    }

    /// Share of requested experts that were in RAM.
    pub fn hit_rate(&self) -> f64 {
        if self.requests == 0 {
            return 0.0;
        }
        self.hits as f64 / self.requests as f64
    }

    /// Demand misses a prefetch had covered (landed) or started (joined).
    pub fn covered_misses(&self) -> u64 {
        self.prefetch_hits + self.joined_prefetch
    }

    /// Demand misses no prefetch had covered: read on demand, or joined to
    /// another fetch's demand read.
    pub fn uncovered_misses(&self) -> u64 {
        self.demand_reads + self.joined_demand
    }

    /// Share of demand misses a prefetch had covered or started; `None`
    /// without misses.
    pub fn prefetch_recall(&self) -> Option<f64> {
        let misses = self.covered_misses() + self.uncovered_misses();
        (misses > 0).then(|| self.covered_misses() as f64 / misses as f64)
    }

    /// Bytes prefetched and never used, per prefetched byte used; `None`
    /// when no prefetched byte was used (then `prefetch_wasted_bytes` says
    /// it all).
    pub fn prefetch_waste(&self) -> Option<f64> {
        (self.prefetch_used_bytes > 0)
            .then(|| self.prefetch_wasted_bytes as f64 / self.prefetch_used_bytes as f64)
    }

    /// Aligned bytes read from disk (demand + prefetch + fill).
    pub fn read_bytes(&self) -> u64 {
        self.demand_read_bytes + self.prefetch_read_bytes + self.fill_read_bytes
    }

    /// Fill reads a fetch used (at first use, landed or joined in flight).
    pub fn fill_used(&self) -> u64 {
        self.fill_hits + self.fill_joined
    }

    /// Time `fetch` was blocked on I/O.
    pub fn io_wait(&self) -> Duration {
        Duration::from_nanos(self.io_wait_ns)
    }
}

/// Expert read latency percentiles in microseconds: from an expert's
/// request to its bytes being usable, so all of its matrices' reads, the
/// time queued behind other reads and its tiling (`reads` counts experts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub reads: u64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
}

/// Latencies of expert reads, in nanoseconds (1 ns .. 1 h, 3 digits).
#[derive(Debug)]
pub(crate) struct ReadLatency {
    histogram: Mutex<Option<Histogram<u64>>>,
}

impl ReadLatency {
    pub(crate) fn new() -> Self {
        ReadLatency {
            histogram: Mutex::new(Histogram::new_with_bounds(1, 3_600_000_000_000, 3).ok()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Histogram<u64>>> {
        // A histogram is plain counters; a panic elsewhere cannot break it.
        self.histogram
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn record(&self, elapsed: Duration) {
        if let Some(h) = self.lock().as_mut() {
            let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
            h.saturating_record(nanos.max(1));
        }
    }

    /// Percentiles so far; `reset` starts a new measurement.
    pub(crate) fn summary(&self, reset: bool) -> LatencySummary {
        let mut guard = self.lock();
        let Some(h) = guard.as_mut() else {
            return LatencySummary::default();
        };
        let us = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        let summary = if h.is_empty() {
            LatencySummary::default()
        } else {
            LatencySummary {
                reads: h.len(),
                p50_us: us(0.5),
                p90_us: us(0.9),
                p99_us: us(0.99),
                p999_us: us(0.999),
                max_us: h.max() as f64 / 1000.0,
                mean_us: h.mean() / 1000.0,
            }
        };
        if reset {
            h.reset();
        }
        summary
    }
}
