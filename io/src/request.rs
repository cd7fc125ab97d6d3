//! What a caller asks the reader for, and what it gets back.
//!
//! A [`ReadRequest`] reads one or more byte extents (possibly of different
//! files) into one [`Slot`]: an expert's gate, up and down tensors land in
//! one slot and the kernels take views into it. Each request yields exactly
//! one [`Completion`], in whatever order the drive finishes them, carrying
//! the slot back together with where each extent's bytes are in it.
//!
//! Planning (this file) happens on the caller's thread at submit time:
//! every extent is widened to its file's alignment, placed at an aligned
//! position in the slot, and cut into kernel reads of at most
//! `max_read_bytes`, so a request that cannot fit fails before it is queued.

use std::ops::Range;

use crate::align::align_up;
use crate::arena::Slot;
use crate::error::IoError;
use crate::files::{FileId, FileSet};

/// Largest single kernel read we issue. Linux caps one read at
/// `MAX_RW_COUNT` (2 GiB − 4 KiB); we stay well below with a power of two.
pub const MAX_KERNEL_READ: u64 = 1 << 30;

/// Priority of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Priority {
    /// Needed now: compute is waiting. Always issued before any prefetch read
    /// that is still queued.
    Demand,
    /// Speculative: issued only when no demand read is waiting, and limited
    /// to part of the queue depth so it never fills the drive's queue ahead
    /// of a demand read that arrives later.
    Prefetch,
}

/// A byte range of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Which file of the reader's [`FileSet`].
    pub file: FileId,
    /// First byte.
    pub offset: u64,
    /// Number of bytes.
    pub len: u64,
}

/// Read some extents into one slot.
#[derive(Debug)]
pub struct ReadRequest {
    /// Destination; handed back in the [`Completion`].
    pub slot: Slot,
    /// The bytes wanted, placed in the slot in this order.
    pub extents: Vec<Extent>,
    /// Demand or prefetch.
    pub priority: Priority,
    /// Caller's own label, returned in the completion (e.g. a packed
    /// `(layer, expert)`).
    pub tag: u64,
}

/// Identifies a submitted request (unique for the reader's lifetime).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct Ticket(pub u64);

/// The outcome of one request.
#[derive(Debug)]
pub struct Completion {
    /// Which request.
    pub ticket: Ticket,
    /// The request's tag.
    pub tag: u64,
    /// The request's priority.
    pub priority: Priority,
    /// The destination slot, handed back whatever the outcome.
    pub slot: Slot,
    /// On success, where each extent's wanted bytes are in the slot (same
    /// order as the request's extents).
    pub result: Result<Vec<Range<usize>>, IoError>,
    /// Order in which the reader first handed one of this request's reads to
    /// the kernel (or the pread pool), counting from 0 over the reader's
    /// life; `None` if none ever was (cancelled or failed while queued).
    pub issue_seq: Option<u64>,
}

impl Completion {
    /// The wanted bytes of extent `index`, if the request succeeded.
    pub fn extent_bytes(&self, index: usize) -> Option<&[u8]> {
        let range = self.result.as_ref().ok()?.get(index)?.clone();
        self.slot.bytes().get(range)
    }

    /// Whether the request succeeded.
    pub fn is_ok(&self) -> bool {
        self.result.is_ok()
    }
}

/// One kernel read of a planned request.
#[derive(Debug, Clone)]
pub(crate) struct PlannedRead {
    /// Which extent of the request this read serves (for error messages).
    pub extent: u32,
    pub file: FileId,
    /// Aligned file offset.
    pub offset: u64,
    /// Position in the slot.
    pub slot_offset: usize,
    /// Bytes to read (aligned length).
    pub len: u32,
    /// Bytes from the start of this read that the caller wants; reading
    /// fewer is a short read, reading fewer than `len` but at least `need`
    /// is the aligned tail running into end of file, which is fine.
    pub need: u32,
    /// Alignment granule of the file (1 when buffered).
    pub unit: u32,
}

/// A request after planning, ready for the reader thread.
#[derive(Debug)]
pub(crate) struct PlannedRequest {
    pub ticket: Ticket,
    pub tag: u64,
    pub priority: Priority,
    pub slot: Slot,
    pub extents: Vec<Extent>,
    pub ranges: Vec<Range<usize>>,
    pub reads: Vec<PlannedRead>,
}

/// Lays out `extents` in a slot of `capacity` bytes and cuts them into
/// kernel reads of at most `max_read_bytes` (rounded down to each file's
/// alignment).
pub(crate) fn plan(
    files: &FileSet,
    extents: &[Extent],
    capacity: usize,
    max_read_bytes: u64,
) -> Result<(Vec<Range<usize>>, Vec<PlannedRead>), IoError> {
    let mut ranges = Vec::with_capacity(extents.len());
    let mut reads = Vec::with_capacity(extents.len());
    let mut cursor: u64 = 0;
    for (index, extent) in extents.iter().enumerate() {
        let info = files
            .info(extent.file)
            .ok_or(IoError::UnknownFile(extent.file.0))?;
        let alignment = info.alignment;
        let unit = alignment.unit();
        if extent.len == 0 {
            ranges.push(0..0);
            continue;
        }
        let widened = alignment.widen(extent.offset, extent.len)?;
        let start = align_up(cursor, unit)
            .ok_or_else(|| IoError::InvalidArgument("slot layout overflows".into()))?;
        let end = start
            .checked_add(widened.len)
            .ok_or_else(|| IoError::InvalidArgument("slot layout overflows".into()))?;
        if end > capacity as u64 {
            return Err(IoError::SlotTooSmall {
                needed: end,
                capacity,
            });
        }
        let want_start = (start + widened.skip) as usize;
        ranges.push(want_start..want_start + extent.len as usize);
        // Each kernel read is a multiple of the unit, so every read after
        // the first starts aligned in both the file and the slot.
        let chunk = (max_read_bytes.clamp(1, MAX_KERNEL_READ) / unit).max(1) * unit;
        let want_end = extent.offset + extent.len;
        let mut done = 0;
        while done < widened.len {
            let len = chunk.min(widened.len - done);
            let offset = widened.offset + done;
            let need = want_end.saturating_sub(offset).min(len);
            reads.push(PlannedRead {
                extent: index as u32,
                file: extent.file,
                offset,
                slot_offset: (start + done) as usize,
                len: len as u32,
                need: need as u32,
                unit: unit as u32,
            });
            done += len;
        }
        cursor = end;
    }
    Ok((ranges, reads))
}
