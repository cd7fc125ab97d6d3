//! Raw disk benchmark: how fast does *our reader* read this file?
//!
//! `colibri bench-io --raw FILE` calls [`raw`]: it keeps `queue_depth` reads
//! of `block_size` bytes in flight through a [`Reader`] (same backend, same
//! `O_DIRECT` decision, same pinned slots as the engine) and reports
//! throughput, IOPS and the latency of each read from submission to
//! completion (p50/p90/p99/p99.9/max, from an HDR histogram). Offsets are
//! block-aligned, drawn from a seeded generator (random) or consecutive
//! (sequential), so runs are repeatable.
//!
//! [`sweep_queue_depths`] runs the same measurement at several queue depths;
//! [`QueueDepthSweep::pick`] chooses the smallest depth that reaches a given
//! fraction of the best throughput: the knee of the latency–throughput
//! curve, beyond which more depth buys latency and no bandwidth.
//!
//! Without `O_DIRECT` (e.g. tmpfs) the figures measure the page cache or
//! memory, not a drive; the report says which was in effect.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::arena::PinnedArena;
use crate::error::IoError;
use crate::files::{DirectIo, FileId, FileSet};
use crate::reader::{Backend, IoBackendChoice, Reader, ReaderConfig, completion_channel};
use crate::request::{Extent, Priority, ReadRequest};

/// Order of the blocks read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum AccessPattern {
    /// Uniformly random block-aligned offsets.
    #[default]
    Random,
    /// Consecutive blocks from offset 0, wrapping at the end of the file.
    Sequential,
}

/// When a run stops: at whichever limit comes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BenchLimit {
    /// Stop after reading this many bytes.
    pub max_bytes: Option<u64>,
    /// Stop issuing reads after this long.
    pub max_duration: Option<Duration>,
}

impl Default for BenchLimit {
    fn default() -> Self {
        Self {
            max_bytes: Some(4 << 30),
            max_duration: Some(Duration::from_secs(10)),
        }
    }
}

/// Everything a run can be told.
#[derive(Debug, Clone)]
pub struct RawBenchConfig {
    /// Bytes per read (a multiple of the file's direct-I/O alignment).
    pub block_size: usize,
    /// Reads in flight.
    pub queue_depth: usize,
    /// Backend choice.
    pub backend: IoBackendChoice,
    /// When to stop.
    pub limit: BenchLimit,
    /// Random or sequential.
    pub pattern: AccessPattern,
    /// Seed of the random offsets.
    pub seed: u64,
    /// Whether to try `O_DIRECT`.
    pub direct: DirectIo,
}

impl Default for RawBenchConfig {
    fn default() -> Self {
        Self {
            block_size: 1 << 20,
            queue_depth: 32,
            backend: IoBackendChoice::Auto,
            limit: BenchLimit::default(),
            pattern: AccessPattern::Random,
            seed: 0x00c0_11b1,
            direct: DirectIo::Auto,
        }
    }
}

/// Read-latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LatencyMicros {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Slowest read.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

/// Result of one run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RawReport {
    /// File read.
    pub path: String,
    /// Its size.
    pub file_bytes: u64,
    /// Backend that ran.
    pub backend: Backend,
    /// Whether reads bypassed the page cache.
    pub o_direct: bool,
    /// Direct-I/O alignment granule (1 when buffered).
    pub alignment: u64,
    /// Whether the slots were registered io_uring buffers.
    pub registered_buffers: bool,
    /// Random or sequential.
    pub pattern: AccessPattern,
    /// Bytes per read.
    pub block_size: usize,
    /// Reads in flight.
    pub queue_depth: usize,
    /// Reads completed.
    pub reads: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Wall time from the first submission to the last completion.
    pub seconds: f64,
    /// Throughput in 10^6 bytes per second.
    pub mb_per_s: f64,
    /// Reads per second.
    pub iops: f64,
    /// Latency of a read from submission to completion.
    pub latency_us: LatencyMicros,
}

impl RawReport {
    /// One line for humans.
    pub fn summary(&self) -> String {
        format!(
            "{} {:?} bs={} qd={} {}{}: {:.1} MB/s, {:.0} IOPS, latency p50 {:.0} us, \
             p90 {:.0} us, p99 {:.0} us, p99.9 {:.0} us, max {:.0} us ({} reads in {:.2} s)",
            self.backend,
            self.pattern,
            self.block_size,
            self.queue_depth,
            if self.o_direct {
                "O_DIRECT"
            } else {
                "buffered"
            },
            if self.registered_buffers {
                ", fixed buffers"
            } else {
                ""
            },
            self.mb_per_s,
            self.iops,
            self.latency_us.p50,
            self.latency_us.p90,
            self.latency_us.p99,
            self.latency_us.p999,
            self.latency_us.max,
            self.reads,
            self.seconds,
        )
    }
}

/// Random block reads of `path` with the given block size, queue depth and
/// backend, until `limit`.
pub fn raw(
    path: &Path,
    block_size: usize,
    queue_depth: usize,
    backend: IoBackendChoice,
    limit: BenchLimit,
) -> Result<RawReport, IoError> {
    raw_with(
        path,
        &RawBenchConfig {
            block_size,
            queue_depth,
            backend,
            limit,
            ..RawBenchConfig::default()
        },
    )
}

/// A run with every setting explicit.
pub fn raw_with(path: &Path, config: &RawBenchConfig) -> Result<RawReport, IoError> {
    let files = Arc::new(FileSet::open(&[path], config.direct)?);
    let info = files
        .info(FileId(0))
        .cloned()
        .ok_or(IoError::UnknownFile(0))?;
    let unit = info.alignment.unit();
    let block = config.block_size as u64;
    if block == 0 || !block.is_multiple_of(unit) {
        return Err(IoError::InvalidArgument(format!(
            "block size {block} is not a positive multiple of {}'s alignment ({unit} bytes)",
            path.display()
        )));
    }
    let blocks = info.len_at_open / block;
    if blocks == 0 {
        return Err(IoError::InvalidArgument(format!(
            "{} ({} bytes) is smaller than one block of {block} bytes",
            path.display(),
            info.len_at_open
        )));
    }
    let depth = config.queue_depth;
    let arena = PinnedArena::new(config.block_size, depth.max(1))?;
    let reader = Reader::new(
        files,
        &[Arc::clone(&arena)],
        ReaderConfig {
            backend: config.backend,
            queue_depth: depth,
            ..ReaderConfig::default()
        },
    )?;
    let registered_buffers = reader.backend().registered_buffers;
    let backend = reader.backend().backend;
    let (reply, completions) = completion_channel();
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
    let mut next_block = 0u64;
    let max_bytes = match (config.limit.max_bytes, config.limit.max_duration) {
        (None, None) => Some(info.len_at_open),
        (bytes, _) => bytes,
    };
    // Latency histogram in nanoseconds, 1 ns .. 1 h, 3 significant digits.
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)
        .map_err(|e| IoError::InvalidArgument(format!("histogram: {e}")))?;
    let mut started_at = vec![Instant::now(); depth];
    let start = Instant::now();
    let mut issued_bytes = 0u64;
    let mut outstanding = 0usize;
    let mut reads = 0u64;
    let mut bytes = 0u64;
    let mut last_done = start;
    let mut batch = Vec::with_capacity(depth);

    let more = |issued: u64| {
        let by_bytes = max_bytes.is_none_or(|max| issued + block <= max);
        let by_time = config
            .limit
            .max_duration
            .is_none_or(|max| start.elapsed() < max);
        by_bytes && by_time
    };
    let mut next_offset = |rng: &mut ChaCha8Rng| match config.pattern {
        AccessPattern::Random => rng.random_range(0..blocks) * block,
        AccessPattern::Sequential => {
            let offset = next_block * block;
            next_block = (next_block + 1) % blocks;
            offset
        }
    };
    let request = |slot: crate::arena::Slot, offset: u64| ReadRequest {
        tag: slot.index() as u64,
        slot,
        extents: vec![Extent {
            file: FileId(0),
            offset,
            len: block,
        }],
        priority: Priority::Demand,
    };

    while let Some(slot) = arena.try_acquire() {
        if !more(issued_bytes) {
            break;
        }
        issued_bytes += block;
        started_at[slot.index()] = Instant::now();
        batch.push(request(slot, next_offset(&mut rng)));
    }
    outstanding += batch.len();
    reader.submit(std::mem::take(&mut batch), &reply)?;
    while outstanding > 0 {
        let first = completions.recv().map_err(|_| IoError::ReaderStopped)?;
        for done in std::iter::once(first).chain(completions.try_iter()) {
            let now = Instant::now();
            outstanding -= 1;
            let slot_index = done.slot.index();
            done.result?;
            let nanos = now.duration_since(started_at[slot_index]).as_nanos();
            histogram.saturating_record(u64::try_from(nanos).unwrap_or(u64::MAX).max(1));
            reads += 1;
            bytes += block;
            last_done = now;
            if more(issued_bytes) {
                issued_bytes += block;
                started_at[slot_index] = Instant::now();
                batch.push(request(done.slot, next_offset(&mut rng)));
            }
        }
        if !batch.is_empty() {
            outstanding += batch.len();
            reader.submit(std::mem::take(&mut batch), &reply)?;
        }
    }
    let seconds = last_done.duration_since(start).as_secs_f64().max(1e-9);
    let micros = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
    Ok(RawReport {
        path: path.display().to_string(),
        file_bytes: info.len_at_open,
        backend,
        o_direct: info.direct,
        alignment: unit,
        registered_buffers,
        pattern: config.pattern,
        block_size: config.block_size,
        queue_depth: depth,
        reads,
        bytes,
        seconds,
        mb_per_s: bytes as f64 / seconds / 1e6,
        iops: reads as f64 / seconds,
        latency_us: LatencyMicros {
            p50: micros(0.50),
            p90: micros(0.90),
            p99: micros(0.99),
            p999: micros(0.999),
            max: histogram.max() as f64 / 1000.0,
            mean: histogram.mean() / 1000.0,
        },
    })
}

/// Measurements of one file at several queue depths.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct QueueDepthSweep {
    /// One report per depth, in the order measured.
    pub points: Vec<RawReport>,
}

impl QueueDepthSweep {
    /// The best throughput measured.
    pub fn best_mb_per_s(&self) -> Option<f64> {
        self.points.iter().map(|p| p.mb_per_s).reduce(f64::max)
    }

    /// The smallest queue depth whose throughput is at least `fraction` of
    /// the best (e.g. 0.95): beyond it, deeper queues add latency for little
    /// bandwidth.
    pub fn pick(&self, fraction: f64) -> Option<usize> {
        let best = self.best_mb_per_s()?;
        self.points
            .iter()
            .filter(|p| p.mb_per_s >= fraction * best)
            .map(|p| p.queue_depth)
            .min()
    }
}

/// Runs [`raw_with`] at each queue depth of `depths` (other settings from
/// `config`).
pub fn sweep_queue_depths(
    path: &Path,
    depths: &[usize],
    config: &RawBenchConfig,
) -> Result<QueueDepthSweep, IoError> {
    let mut points = Vec::with_capacity(depths.len());
    for &queue_depth in depths {
        points.push(raw_with(
            path,
            &RawBenchConfig {
                queue_depth,
                ..config.clone()
            },
        )?);
    }
    Ok(QueueDepthSweep { points })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(queue_depth: usize, mb_per_s: f64) -> RawReport {
        RawReport {
            path: String::new(),
            file_bytes: 0,
            backend: Backend::Uring,
            o_direct: true,
            alignment: 4096,
            registered_buffers: true,
            pattern: AccessPattern::Random,
            block_size: 1 << 20,
            queue_depth,
            reads: 1,
            bytes: 1,
            seconds: 1.0,
            mb_per_s,
            iops: 1.0,
            latency_us: LatencyMicros {
                p50: 1.0,
                p90: 1.0,
                p99: 1.0,
                p999: 1.0,
                max: 1.0,
                mean: 1.0,
            },
        }
    }

    #[test]
    fn pick_finds_the_knee_of_the_curve() {
        let sweep = QueueDepthSweep {
            points: vec![
                point(1, 500.0),
                point(2, 900.0),
                point(4, 1500.0),
                point(8, 1950.0),
                point(16, 2000.0),
                point(32, 1990.0),
            ],
        };
        assert_eq!(sweep.best_mb_per_s(), Some(2000.0));
        assert_eq!(sweep.pick(0.95), Some(8));
        assert_eq!(sweep.pick(1.0), Some(16));
        assert_eq!(sweep.pick(0.5), Some(4));
        assert_eq!(QueueDepthSweep { points: vec![] }.pick(0.9), None);
    }
}
