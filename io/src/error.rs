//! Typed errors of the disk path.
//!
//! Every error that concerns a read names the file, the byte offset and the
//! length the caller asked for, so that a failing expert read surfaces as
//! "read of 18874368 bytes at offset 4096 of /models/x.safetensors failed:
//! I/O error from the device (EIO)" and never as a bare errno, garbage data,
//! a panic or a hang.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// What went wrong with one read, classified from the kernel's errno.
///
/// The classes exist so that callers can decide what to do without matching
/// raw errno values: a `Media` error is worth reporting as a failing drive, an
/// `InvalidArgument` under `O_DIRECT` is a bug in our alignment, and so on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ReadErrorKind {
    /// `EIO`: the device or file system reported an I/O error.
    Media,
    /// `ENOSPC` / `EDQUOT`: seen on reads from some network and FUSE file
    /// systems that allocate on read.
    NoSpace,
    /// `EBADF`: the descriptor is not open for reading (closed under us).
    BadFile,
    /// `EINVAL`: the kernel rejected the arguments, for `O_DIRECT` usually a
    /// misaligned offset, length or buffer.
    InvalidArgument,
    /// `EFAULT`: the destination buffer is not valid memory.
    BadBuffer,
    /// `ENOMEM` / `ENOBUFS`: the kernel could not allocate for the read.
    OutOfMemory,
    /// `ENXIO` / `ENODEV`: the device behind the file went away.
    DeviceGone,
    /// `ESTALE`: the file was replaced on a network file system.
    Stale,
    /// `EOPNOTSUPP`: the file system does not support this kind of read.
    Unsupported,
    /// `ECANCELED`: the kernel cancelled the read without us asking.
    KernelCancelled,
    /// `EINTR` / `EAGAIN` returned more times in a row than we retry.
    RetriesExhausted,
    /// Any other errno.
    Other,
}

impl ReadErrorKind {
    /// Classifies a positive errno value.
    pub fn from_errno(errno: i32) -> Self {
        match errno {
            libc::EIO => Self::Media,
            libc::ENOSPC | libc::EDQUOT => Self::NoSpace,
            libc::EBADF => Self::BadFile,
            libc::EINVAL => Self::InvalidArgument,
            libc::EFAULT => Self::BadBuffer,
            libc::ENOMEM | libc::ENOBUFS => Self::OutOfMemory,
            libc::ENXIO | libc::ENODEV => Self::DeviceGone,
            libc::ESTALE => Self::Stale,
            libc::EOPNOTSUPP => Self::Unsupported,
            libc::ECANCELED => Self::KernelCancelled,
            libc::EINTR | libc::EAGAIN => Self::RetriesExhausted,
            _ => Self::Other,
        }
    }
}

impl fmt::Display for ReadErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Self::Media => "I/O error from the device",
            Self::NoSpace => "no space left (reported on a read)",
            Self::BadFile => "the file descriptor is not open for reading",
            Self::InvalidArgument => "the kernel rejected the read (misaligned O_DIRECT read?)",
            Self::BadBuffer => "the destination buffer is not valid memory",
            Self::OutOfMemory => "the kernel ran out of memory for the read",
            Self::DeviceGone => "the device behind the file went away",
            Self::Stale => "stale file handle (file replaced on a network file system)",
            Self::Unsupported => "the file system does not support this read",
            Self::KernelCancelled => "the kernel cancelled the read",
            Self::RetriesExhausted => "interrupted too many times in a row",
            Self::Other => "read failed",
        };
        f.write_str(text)
    }
}

/// The C library's description of an errno ("Input/output error").
pub(crate) fn errno_text(errno: i32) -> String {
    let text = io::Error::from_raw_os_error(errno).to_string();
    // std appends " (os error N)", which the message already says.
    match text.rfind(" (os error ") {
        Some(cut) => text[..cut].to_string(),
        None => text,
    }
}

/// Errors of colibri-io.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// A file of a [`FileSet`](crate::FileSet) could not be opened.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },

    /// `fstat`/`statx` failed on an open file.
    #[error("cannot stat {path}: {source}")]
    Stat {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },

    /// A read failed with an errno that is not retried.
    #[error(
        "read of {len} bytes at offset {offset} of {path} failed: {kind} (errno {errno}: {})",
        errno_text(*errno)
    )]
    Read {
        /// The file.
        path: PathBuf,
        /// Offset of the extent the caller asked for.
        offset: u64,
        /// Length of the extent the caller asked for.
        len: u64,
        /// Classification of `errno`.
        kind: ReadErrorKind,
        /// The raw errno the kernel returned.
        errno: i32,
    },

    /// A read reached the end of the file before the wanted bytes: the file
    /// is shorter than the caller believes (truncated or replaced mid-run, or
    /// a wrong extent). Never papered over with zeros.
    #[error(
        "read of {len} bytes at offset {offset} of {path} ran past the end of the file \
         (the file is now {file_len} bytes): was it truncated or replaced while colibri ran?"
    )]
    UnexpectedEof {
        /// The file.
        path: PathBuf,
        /// Offset of the extent the caller asked for.
        offset: u64,
        /// Length of the extent the caller asked for.
        len: u64,
        /// The file's length when the short read was seen (`fstat`).
        file_len: u64,
    },

    /// The request was cancelled by the caller (or by the reader shutting
    /// down) before all of its bytes were read.
    #[error("read request was cancelled")]
    Cancelled,

    /// The extents of a request (widened to the alignment) do not fit in the
    /// destination slot.
    #[error(
        "the request needs {needed} bytes of slot (after alignment) but the slot holds {capacity}"
    )]
    SlotTooSmall {
        /// Bytes the aligned extents need.
        needed: u64,
        /// Bytes the slot holds.
        capacity: usize,
    },

    /// An extent names a file id that is not in the reader's file set.
    #[error("file id {0} is not in this reader's file set")]
    UnknownFile(u32),

    /// An argument is out of range (zero sizes, overflowing extents, …).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The pinned arena could not be mapped.
    #[error("cannot map a host memory arena of {bytes} bytes: {source}")]
    Arena {
        /// Bytes requested.
        bytes: usize,
        /// Why.
        #[source]
        source: io::Error,
    },

    /// The io_uring backend was required but the kernel does not provide it.
    #[error("io_uring is unavailable: {reason}")]
    UringUnavailable {
        /// What the probe found (errno, sysctl value).
        reason: String,
    },

    /// The backend failed in a way that is not tied to one read.
    #[error("I/O backend failure: {context}: {source}")]
    Backend {
        /// What the backend was doing.
        context: String,
        /// Why.
        #[source]
        source: io::Error,
    },

    /// The reader thread has stopped; no more requests can be served.
    #[error("the reader thread has stopped")]
    ReaderStopped,
}

impl IoError {
    /// The errno behind this error, where there is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Read { errno, .. } => Some(*errno),
            Self::Open { source, .. }
            | Self::Stat { source, .. }
            | Self::Arena { source, .. }
            | Self::Backend { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}
