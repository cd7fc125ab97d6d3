//! The reader's queue depth, measured on the drive that holds the model.
//!
//! Too few reads in flight leave an NVMe drive mostly idle (LESSONS.md: one
//! at a time leaves it 70–75% idle); too many only add latency once it is
//! saturated. The right number depends on the drive, the file system and
//! the read size, so it is measured, not assumed: random reads of the
//! model's largest expert file at the experts' read size are swept over
//! queue depths ([`colibri_io::bench::sweep_queue_depths`]) and the knee of
//! the latency–throughput curve is taken ([`QueueDepthSweep::pick`]: the
//! smallest depth within [`KNEE_FRACTION`] of the best throughput).
//!
//! The result is cached per device (the file system's device number), I/O
//! backend, `O_DIRECT` decision and read size (rounded up to a power of
//! two) under `$XDG_CACHE_HOME/colibri/io/`, so the sweep (about two
//! seconds) runs once per device, not per start. Delete the file to
//! measure again. A failed measurement falls back to the configured depth
//! with a warning: the depth changes speed, never results.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use colibri_io::bench::{BenchLimit, QueueDepthSweep, RawBenchConfig, sweep_queue_depths};
use colibri_io::{Backend, DirectIo, FileSet, IoBackendChoice};
use serde::{Deserialize, Serialize};

use super::layout::ExpertLayout;

/// Depths tried.
pub const SWEEP_DEPTHS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

/// The knee: the smallest depth reaching this share of the best throughput
/// (measurement noise makes the last few percent meaningless).
pub const KNEE_FRACTION: f64 = 0.9;

/// Each point of the sweep runs this long at most ...
const POINT_DURATION: Duration = Duration::from_millis(250);
/// ... or reads this much at most.
const POINT_BYTES: u64 = 256 << 20;

/// One device's measured depth, as cached.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeasuredDepth {
    /// The depth chosen.
    pub queue_depth: usize,
    /// Read size measured at (bytes).
    pub block_size: u64,
    pub backend: String,
    pub o_direct: bool,
    /// The file measured (the first time).
    pub file: String,
    /// Throughput (10^6 bytes/s) and p99 latency (µs) per depth tried.
    pub points: Vec<(usize, f64, f64)>,
}

/// Where measured depths are cached: `$XDG_CACHE_HOME/colibri/io` (or
/// `~/.cache/colibri/io`).
pub fn default_dir() -> Option<PathBuf> {
    super::usage::default_dir().and_then(|usage| usage.parent().map(|c| c.join("io")))
}

/// The measured queue depth for reading `layout`'s experts from `files`
/// with `backend`: from the cache in `dir` when there, else measured now
/// (and cached when `dir` is given).
pub fn measured_queue_depth(
    files: &FileSet,
    layout: &ExpertLayout,
    backend: IoBackendChoice,
    dir: Option<&Path>,
) -> Result<MeasuredDepth, String> {
    let info = files
        .infos()
        .max_by_key(|i| i.len_at_open)
        .ok_or("no expert files")?;
    let unit = info.alignment.unit().max(1);
    let block = layout.typical_read_bytes().max(1).div_ceil(unit) * unit;
    if block > info.len_at_open {
        return Err(format!(
            "{} is smaller than one read of {block} bytes",
            info.path.display()
        ));
    }
    let runs = match backend {
        IoBackendChoice::Pread => Backend::Pread,
        IoBackendChoice::Uring => Backend::Uring,
        IoBackendChoice::Auto if colibri_io::probe_uring().unavailable.is_none() => Backend::Uring,
        IoBackendChoice::Auto => Backend::Pread,
    };
    let device = std::fs::metadata(&info.path)
        .map_err(|e| format!("{}: {e}", info.path.display()))?
        .dev();
    let key = format!(
        "qd-dev{device:x}-{runs}-{}-{}.json",
        if info.direct { "direct" } else { "buffered" },
        block.next_power_of_two()
    );
    let cached = dir.map(|d| d.join(&key));
    if let Some(path) = &cached
        && let Ok(text) = std::fs::read(path)
    {
        match serde_json::from_slice::<MeasuredDepth>(&text) {
            Ok(m) if m.queue_depth > 0 => return Ok(m),
            _ => tracing::warn!("ignoring unreadable {}", path.display()),
        }
    }
    tracing::info!(
        "measuring the queue depth of {} (reads of {block} bytes, {runs}); cached for this device",
        info.path.display()
    );
    let sweep: QueueDepthSweep = sweep_queue_depths(
        &info.path,
        &SWEEP_DEPTHS,
        &RawBenchConfig {
            block_size: usize::try_from(block).map_err(|_| "read size")?,
            backend: match runs {
                Backend::Uring => IoBackendChoice::Uring,
                Backend::Pread => IoBackendChoice::Pread,
            },
            limit: BenchLimit {
                max_bytes: Some(POINT_BYTES),
                max_duration: Some(POINT_DURATION),
            },
            // As the engine reads it.
            direct: if info.direct {
                DirectIo::Auto
            } else {
                DirectIo::Off
            },
            ..RawBenchConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let queue_depth = sweep
        .pick(KNEE_FRACTION)
        .ok_or("the sweep measured nothing")?;
    let measured = MeasuredDepth {
        queue_depth,
        block_size: block,
        backend: runs.to_string(),
        o_direct: info.direct,
        file: info.path.display().to_string(),
        points: sweep
            .points
            .iter()
            .map(|p| (p.queue_depth, p.mb_per_s, p.latency_us.p99))
            .collect(),
    };
    if let (Some(path), Some(dir)) = (&cached, dir) {
        let written = std::fs::create_dir_all(dir).and_then(|()| {
            let tmp = dir.join(format!(".{key}.tmp.{}", std::process::id()));
            std::fs::write(&tmp, serde_json::to_vec_pretty(&measured)?)?;
            std::fs::rename(&tmp, path)
        });
        if let Err(error) = written {
            tracing::warn!(
                "not caching the measured queue depth in {}: {error}",
                dir.display()
            );
        }
    }
    Ok(measured)
}
