//! `O_DIRECT` alignment: what the kernel requires and how to satisfy it.
//!
//! Direct I/O bypasses the page cache, so the device DMAs straight into our
//! buffer; in exchange the file offset, the length and the buffer address
//! must be multiples of the file system's direct-I/O alignment. Linux ≥ 6.1
//! reports it through `statx(STATX_DIOALIGN)` (`stx_dio_mem_align`,
//! `stx_dio_offset_align`; ≥ 6.14 also `STATX_DIO_READ_ALIGN`, a possibly
//! smaller offset alignment that holds for reads). Where the kernel does not
//! report it we assume 4096, which satisfies every common block device.
//!
//! A caller wants arbitrary byte extents; [`Alignment::widen`] turns one into
//! the smallest aligned superset and says where the wanted bytes start inside
//! it, so the reader can read the superset and hand out a view of the middle.

use std::alloc::{self, Layout};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

use crate::error::IoError;

/// Alignment assumed when the kernel does not report one.
pub const FALLBACK_ALIGN: u32 = 4096;

/// `STATX_DIO_READ_ALIGN` (Linux 6.14), not yet in the `libc` crate.
const STATX_DIO_READ_ALIGN: u32 = 0x0002_0000;

/// Where an [`Alignment`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum AlignmentSource {
    /// Reported by `statx(STATX_DIOALIGN)`.
    Statx,
    /// Not reported by this kernel or file system: [`FALLBACK_ALIGN`].
    Fallback,
    /// The file is read through the page cache: no constraint.
    Buffered,
}

/// Direct-I/O alignment constraints of one open file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Alignment {
    /// Required alignment of the buffer address, in bytes (a power of two).
    pub mem: u32,
    /// Required alignment of the file offset and length, in bytes (a power of
    /// two).
    pub offset: u32,
    /// Where these values came from.
    pub source: AlignmentSource,
}

/// An extent widened to the alignment: read `len` bytes at `offset`, and the
/// wanted bytes are at `skip..skip + wanted_len` of what was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AlignedExtent {
    /// Aligned file offset to read from (≤ the wanted offset).
    pub offset: u64,
    /// Aligned length to read (≥ the wanted length).
    pub len: u64,
    /// Where the wanted bytes start within the aligned read.
    pub skip: u64,
}

impl Alignment {
    /// No constraint: the file is read through the page cache.
    pub const BUFFERED: Alignment = Alignment {
        mem: 1,
        offset: 1,
        source: AlignmentSource::Buffered,
    };

    /// The 4096-byte assumption used when the kernel reports nothing.
    pub const FALLBACK: Alignment = Alignment {
        mem: FALLBACK_ALIGN,
        offset: FALLBACK_ALIGN,
        source: AlignmentSource::Fallback,
    };

    /// The single granule we align everything to: the larger of the memory
    /// and offset alignments. Using one granule for buffer positions, file
    /// offsets and lengths keeps every derived position (e.g. the remainder
    /// of a short read) aligned on both counts, at the cost of at most a few
    /// hundred extra bytes per read on devices whose two alignments differ.
    pub fn unit(&self) -> u64 {
        u64::from(self.mem.max(self.offset))
    }

    /// Widens the extent `(offset, len)` to the smallest superset that starts
    /// and ends on [`unit`](Self::unit) boundaries.
    ///
    /// Fails only when `offset + len` overflows `u64`.
    pub fn widen(&self, offset: u64, len: u64) -> Result<AlignedExtent, IoError> {
        let unit = self.unit();
        let end = offset.checked_add(len).ok_or_else(|| {
            IoError::InvalidArgument(format!("extent at {offset} of {len} bytes overflows"))
        })?;
        let start = align_down(offset, unit);
        let end = align_up(end, unit).ok_or_else(|| {
            IoError::InvalidArgument(format!("extent end {end} cannot be aligned to {unit}"))
        })?;
        Ok(AlignedExtent {
            offset: start,
            len: end - start,
            skip: offset - start,
        })
    }
}

/// Rounds `value` down to a multiple of the power of two `unit`.
pub fn align_down(value: u64, unit: u64) -> u64 {
    debug_assert!(unit.is_power_of_two());
    value & !(unit - 1)
}

/// Rounds `value` up to a multiple of the power of two `unit`; `None` on
/// overflow.
pub fn align_up(value: u64, unit: u64) -> Option<u64> {
    debug_assert!(unit.is_power_of_two());
    Some(value.checked_add(unit - 1)? & !(unit - 1))
}

/// What `statx` says about direct I/O on one open file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DioSupport {
    /// The kernel reported alignments (offset alignment possibly the
    /// read-specific one).
    Reported(Alignment),
    /// The kernel reported that this file does not support direct I/O
    /// (`STATX_DIOALIGN` set with zero alignments).
    Unsupported,
    /// The kernel or file system did not report (kernel < 6.1, or a file
    /// system without the hook): the caller must probe.
    NotReported,
}

/// Asks the kernel for the direct-I/O alignment of an open file.
pub fn statx_dio_alignment(fd: BorrowedFd<'_>) -> std::io::Result<DioSupport> {
    // SAFETY: `statx` is a plain C struct of integers for which all-zero is a
    // valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    // SAFETY: `fd` is a valid open descriptor for the duration of the call
    // (it is borrowed), `empty` is a NUL-terminated string, and `stx` is a
    // writable statx buffer that outlives the call.
    let rc = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN | STATX_DIO_READ_ALIGN,
            &mut stx,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Ok(DioSupport::NotReported);
    }
    if stx.stx_dio_mem_align == 0 || stx.stx_dio_offset_align == 0 {
        return Ok(DioSupport::Unsupported);
    }
    let mut offset = stx.stx_dio_offset_align;
    if stx.stx_mask & STATX_DIO_READ_ALIGN != 0 && stx.stx_dio_read_offset_align != 0 {
        offset = offset.min(stx.stx_dio_read_offset_align);
    }
    let mem = stx.stx_dio_mem_align;
    if !mem.is_power_of_two() || !offset.is_power_of_two() {
        // Never seen in practice; refuse to guess rather than misalign.
        return Ok(DioSupport::NotReported);
    }
    Ok(DioSupport::Reported(Alignment {
        mem,
        offset,
        source: AlignmentSource::Statx,
    }))
}

/// A small heap buffer with a chosen alignment, for probe reads.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two).
    pub(crate) fn new(len: usize, align: usize) -> Result<Self, IoError> {
        let layout = Layout::from_size_align(len.max(1), align)
            .map_err(|e| IoError::InvalidArgument(format!("buffer layout: {e}")))?;
        // SAFETY: `layout` has a non-zero size (max(1)).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| IoError::Arena {
            bytes: len,
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        })?;
        Ok(Self { ptr, layout })
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc_zeroed` with this exact
        // `layout` and is freed only here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widen_keeps_aligned_extents_unchanged() {
        let a = Alignment::FALLBACK;
        let w = a.widen(8192, 4096).expect("widen");
        assert_eq!(
            w,
            AlignedExtent {
                offset: 8192,
                len: 4096,
                skip: 0
            }
        );
    }

    #[test]
    fn widen_covers_unaligned_extents() {
        let a = Alignment {
            mem: 512,
            offset: 512,
            source: AlignmentSource::Statx,
        };
        for (offset, len) in [(1u64, 1u64), (511, 2), (513, 1000), (0, 513), (1023, 1)] {
            let w = a.widen(offset, len).expect("widen");
            assert_eq!(w.offset % 512, 0);
            assert_eq!(w.len % 512, 0);
            assert_eq!(w.offset + w.skip, offset);
            assert!(w.skip + len <= w.len, "{offset} {len} {w:?}");
            // Smallest superset: shrinking either side by a unit loses bytes.
            assert!(w.skip < 512);
            assert!(w.len - w.skip - len < 512);
        }
    }

    #[test]
    fn widen_uses_the_larger_alignment() {
        let a = Alignment {
            mem: 4096,
            offset: 512,
            source: AlignmentSource::Statx,
        };
        let w = a.widen(5000, 10).expect("widen");
        assert_eq!((w.offset, w.len, w.skip), (4096, 4096, 904));
    }

    #[test]
    fn buffered_alignment_is_identity() {
        let w = Alignment::BUFFERED.widen(12345, 678).expect("widen");
        assert_eq!((w.offset, w.len, w.skip), (12345, 678, 0));
    }

    #[test]
    fn widen_reports_overflow() {
        assert!(Alignment::FALLBACK.widen(u64::MAX - 10, 100).is_err());
        assert!(Alignment::FALLBACK.widen(u64::MAX - 10, 5).is_err());
    }
}
