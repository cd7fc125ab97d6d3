//! colibri-io: the disk path. It knows nothing of models: it reads byte
//! extents of files into page-locked buffers as fast as the drive allows.
//!
//! The pieces, in the order data flows through them:
//!
//! - [`FileSet`] (`files.rs`) opens the files, with `O_DIRECT` where the file
//!   system allows it; [`Alignment`] (`align.rs`) says what direct I/O
//!   requires of offsets, lengths and buffers, and widens extents to match.
//! - [`PinnedArena`] (`arena.rs`) is page-locked memory cut into [`Slot`]s,
//!   the destinations of reads.
//! - [`Reader`] (`reader.rs`) is the handle: submit [`ReadRequest`]s (one or
//!   more extents into one slot, demand or prefetch), cancel them, get one
//!   [`Completion`] per request on a channel as each finishes. Behind it, one
//!   thread (`dispatch.rs`) schedules reads by priority, resubmits short
//!   reads and maps errors, over one of two backends: an io_uring ring with
//!   registered files and buffers (`uring.rs`) or a pread thread pool
//!   (`pread.rs`).
//! - [`FaultInjector`] (`fault.rs`) makes chosen reads fail or come back
//!   short, for tests of every layer above.
//! - [`bench`] measures a drive with this reader: throughput, IOPS and
//!   latency percentiles, and sweeps queue depths.
//!
//! ```no_run
//! use std::sync::Arc;
//! use colibri_io::*;
//!
//! # fn main() -> Result<(), IoError> {
//! let files = Arc::new(FileSet::open(&["/models/experts.bin"], DirectIo::Auto)?);
//! let arena = PinnedArena::new(4 << 20, 16)?;
//! let reader = Reader::new(files, &[arena.clone()], ReaderConfig::default())?;
//! let (reply, completions) = completion_channel();
//!
//! // Misses of this layer (demand) and predicted experts of the next layer
//! // (prefetch), in one batch: demand reads are issued first.
//! let mut batch = Vec::new();
//! for (tag, offset) in [(0u64, 0u64), (1, 3 << 20), (2, 9 << 20)] {
//!     let slot = arena.try_acquire().expect("a free slot");
//!     let priority = if tag < 2 { Priority::Demand } else { Priority::Prefetch };
//!     let extents = vec![Extent { file: FileId(0), offset, len: 3 << 20 }];
//!     batch.push(ReadRequest { slot, extents, priority, tag });
//! }
//! let tickets = reader.submit(batch, &reply)?;
//!
//! // Compute on each expert as soon as its bytes are in.
//! for _ in 0..tickets.len() {
//!     let done = completions.recv().expect("reader alive");
//!     match &done.result {
//!         Ok(_) => {
//!             let bytes = done.extent_bytes(0).expect("extent 0");
//!             println!("expert {} ready: {} bytes", done.tag, bytes.len());
//!         }
//!         Err(error) => eprintln!("expert {} failed: {error}", done.tag),
//!     }
//!     // Dropping `done` returns its slot to the arena.
//! }
//! # Ok(())
//! # }
//! ```

mod align;
mod arena;
pub mod bench;
mod counters;
mod dispatch;
mod error;
mod fault;
mod files;
mod pread;
mod reader;
mod request;
pub mod topology;
mod uring;

pub use align::{
    AlignedExtent, Alignment, AlignmentSource, DioSupport, FALLBACK_ALIGN, align_down, align_up,
    statx_dio_alignment,
};
pub use arena::{PinnedArena, SLOT_GRANULE, Slot};
pub use counters::CounterSnapshot;
pub use error::{IoError, ReadErrorKind};
pub use fault::{FaultAction, FaultInjector, FaultRule, FaultTrigger};
pub use files::{DirectIo, FileId, FileInfo, FileSet};
pub use pread::MAX_PREAD_THREADS;
pub use reader::{
    Backend, BackendInfo, CompletionReceiver, CompletionSender, IoBackendChoice, IssueHold,
    MAX_QUEUE_DEPTH, Reader, ReaderConfig, completion_channel,
};
pub use request::{Completion, Extent, MAX_KERNEL_READ, Priority, ReadRequest, Ticket};
pub use uring::{UringProbe, probe as probe_uring};

/// The channel crate completions travel on, re-exported so that callers use
/// the same version.
pub use crossbeam_channel;
