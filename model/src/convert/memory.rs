//! Peak memory of a conversion, from `/proc/self/status` (Linux).
//!
//! `RssAnon` is what the process allocated itself: the figure that must
//! stay bounded however large the model is. Pages of the memory-mapped
//! source also count in `VmRSS`/`VmHWM` while mapped, but they are clean
//! page cache the kernel reclaims under pressure, so they are reported
//! apart.

use std::sync::atomic::{AtomicU64, Ordering};

/// A `kB` field of `/proc/self/status`, in bytes.
fn status_field(name: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?.strip_prefix(':')?;
        let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kb * 1024)
    })
}

/// Tracks the largest `RssAnon` seen at the sample points.
#[derive(Debug, Default)]
pub struct PeakMemory {
    anon: AtomicU64,
}

impl PeakMemory {
    pub fn new() -> PeakMemory {
        let p = PeakMemory::default();
        p.sample();
        p
    }

    /// Reads the current anonymous RSS and keeps the maximum.
    pub fn sample(&self) {
        if let Some(v) = status_field("RssAnon") {
            self.anon.fetch_max(v, Ordering::Relaxed);
        }
    }

    /// The largest anonymous RSS sampled (0 where /proc is unavailable).
    pub fn peak_anon(&self) -> u64 {
        self.anon.load(Ordering::Relaxed)
    }

    /// The kernel's high-water mark of the whole resident set (mapped
    /// source pages included).
    pub fn peak_rss() -> u64 {
        status_field("VmHWM").unwrap_or(0)
    }
}
