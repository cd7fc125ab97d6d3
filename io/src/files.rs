//! `FileSet`: the files a reader reads from, opened for direct I/O when the
//! file system allows it.
//!
//! Each file is probed on its own (a model directory may span file systems):
//! open with `O_DIRECT`, ask `statx(STATX_DIOALIGN)` for the alignment, then
//! do one aligned test read, because some file systems accept the flag at
//! open and refuse the read. tmpfs refuses `O_DIRECT` at open with `EINVAL`.
//!
//! A file that cannot use `O_DIRECT` is read through the page cache with
//! readahead off (`POSIX_FADV_RANDOM`: read exactly the bytes asked for) and
//! every read range dropped afterwards (`POSIX_FADV_DONTNEED`), so the page
//! cache never becomes a hidden, unaccounted memory tier. The set says so
//! once with a `warn!`.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::align::{AlignedBuf, Alignment, DioSupport, statx_dio_alignment};
use crate::error::IoError;

/// Index of a file in a [`FileSet`] (its position in the list given to
/// [`FileSet::open`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct FileId(pub u32);

/// Whether to try `O_DIRECT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum DirectIo {
    /// Use `O_DIRECT` wherever the probe succeeds (the default).
    #[default]
    Auto,
    /// Never use `O_DIRECT` (buffered reads, each range dropped afterwards).
    Off,
}

/// What the open-time probe decided for one file.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FileInfo {
    /// Path as given.
    pub path: PathBuf,
    /// Whether reads bypass the page cache.
    pub direct: bool,
    /// Alignment reads must respect ([`Alignment::BUFFERED`] when not direct).
    pub alignment: Alignment,
    /// Length at open time (the file may change later; reads re-check).
    pub len_at_open: u64,
    /// Why the file is read buffered, when it is.
    pub buffered_reason: Option<String>,
}

struct OpenFile {
    file: File,
    info: FileInfo,
}

/// A set of files opened for reading, each with its direct-I/O decision.
pub struct FileSet {
    files: Vec<OpenFile>,
}

impl std::fmt::Debug for FileSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.files.iter().map(|file| &file.info))
            .finish()
    }
}

impl FileSet {
    /// Opens every path (in order: the i-th path gets `FileId(i)`).
    pub fn open<P: AsRef<Path>>(paths: &[P], direct: DirectIo) -> Result<FileSet, IoError> {
        let count = u32::try_from(paths.len())
            .map_err(|_| IoError::InvalidArgument("more than 2^32 files".into()))?;
        let mut files = Vec::with_capacity(paths.len());
        for path in paths {
            files.push(open_one(path.as_ref(), direct)?);
        }
        let buffered: Vec<&FileInfo> = files
            .iter()
            .map(|f| &f.info)
            .filter(|info| !info.direct)
            .collect();
        if let Some(first) = buffered.first()
            && direct == DirectIo::Auto
        {
            tracing::warn!(
                "O_DIRECT is unavailable for {} of {} files (first: {}: {}); reading them \
                 through the page cache with readahead off and each range dropped after the \
                 read (POSIX_FADV_DONTNEED)",
                buffered.len(),
                count,
                first.path.display(),
                first.buffered_reason.as_deref().unwrap_or("unknown"),
            );
        }
        Ok(FileSet { files })
    }

    /// Number of files.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// The probe's decision for a file.
    pub fn info(&self, id: FileId) -> Option<&FileInfo> {
        self.files.get(id.0 as usize).map(|f| &f.info)
    }

    /// All files' decisions, in id order.
    pub fn infos(&self) -> impl Iterator<Item = &FileInfo> {
        self.files.iter().map(|f| &f.info)
    }

    /// Path of a file, or `"<unknown file N>"` for an id not in the set.
    pub fn path(&self, id: FileId) -> PathBuf {
        match self.info(id) {
            Some(info) => info.path.clone(),
            None => PathBuf::from(format!("<unknown file {}>", id.0)),
        }
    }

    /// Whether every file reads with `O_DIRECT`.
    pub fn all_direct(&self) -> bool {
        self.files.iter().all(|f| f.info.direct)
    }

    /// The file's length now (`fstat`), to report truncation.
    pub fn current_len(&self, id: FileId) -> Result<u64, IoError> {
        let file = self
            .files
            .get(id.0 as usize)
            .ok_or(IoError::UnknownFile(id.0))?;
        file.file
            .metadata()
            .map(|m| m.len())
            .map_err(|source| IoError::Stat {
                path: file.info.path.clone(),
                source,
            })
    }

    /// Raw descriptor of a file, valid while `self` lives.
    pub(crate) fn raw_fd(&self, id: FileId) -> Option<RawFd> {
        self.files.get(id.0 as usize).map(|f| f.file.as_raw_fd())
    }

    /// Raw descriptors of all files in id order (for io_uring registration).
    pub(crate) fn raw_fds(&self) -> Vec<RawFd> {
        self.files.iter().map(|f| f.file.as_raw_fd()).collect()
    }

    /// Drops a just-read range of a buffered file from the page cache. Does
    /// nothing for direct files. Failures are ignored: the advice is an
    /// optimisation of memory use, never of correctness.
    pub(crate) fn drop_cached(&self, id: FileId, offset: u64, len: u64) {
        let Some(file) = self.files.get(id.0 as usize) else {
            return;
        };
        if file.info.direct {
            return;
        }
        fadvise(&file.file, offset, len, libc::POSIX_FADV_DONTNEED);
    }
}

fn fadvise(file: &File, offset: u64, len: u64, advice: libc::c_int) {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: the descriptor is open for the duration of the call (borrowed
    // from `file`); posix_fadvise only reads its integer arguments.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), offset, len, advice);
    }
}

fn open_plain(path: &Path) -> Result<File, IoError> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| IoError::Open {
            path: path.to_path_buf(),
            source,
        })
}

fn buffered(path: &Path, reason: String) -> Result<OpenFile, IoError> {
    let file = open_plain(path)?;
    // Readahead would read (and cache) bytes nobody asked for.
    fadvise(&file, 0, 0, libc::POSIX_FADV_RANDOM);
    let len_at_open = file
        .metadata()
        .map_err(|source| IoError::Stat {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    Ok(OpenFile {
        file,
        info: FileInfo {
            path: path.to_path_buf(),
            direct: false,
            alignment: Alignment::BUFFERED,
            len_at_open,
            buffered_reason: Some(reason),
        },
    })
}

fn open_one(path: &Path, direct: DirectIo) -> Result<OpenFile, IoError> {
    if direct == DirectIo::Off {
        return buffered(path, "O_DIRECT turned off by configuration".into());
    }
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            return buffered(
                path,
                "the file system refuses O_DIRECT at open (EINVAL)".into(),
            );
        }
        Err(source) => {
            return Err(IoError::Open {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let alignment = match statx_dio_alignment(file.as_fd()) {
        Ok(DioSupport::Reported(alignment)) => alignment,
        Ok(DioSupport::Unsupported) => {
            return buffered(
                path,
                "statx(STATX_DIOALIGN) reports no direct I/O for this file".into(),
            );
        }
        // statx itself failing (very old kernel) is the same as not reported.
        Ok(DioSupport::NotReported) | Err(_) => Alignment::FALLBACK,
    };
    let len_at_open = file
        .metadata()
        .map_err(|source| IoError::Stat {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    // Some file systems accept O_DIRECT at open and refuse the read: probe
    // one aligned unit at offset 0 (an empty file reads 0 bytes, also fine).
    let unit = alignment.unit() as usize;
    let mut probe = AlignedBuf::new(unit, unit)?;
    let len = probe.len();
    // SAFETY: `probe` owns `len` initialised (zeroed) bytes at `as_mut_ptr`,
    // and no other reference to them exists while this slice lives.
    let buf = unsafe { std::slice::from_raw_parts_mut(probe.as_mut_ptr(), len) };
    match file.read_at(buf, 0) {
        Ok(_) => Ok(OpenFile {
            file,
            info: FileInfo {
                path: path.to_path_buf(),
                direct: true,
                alignment,
                len_at_open,
                buffered_reason: None,
            },
        }),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => buffered(
            path,
            format!(
                "an aligned O_DIRECT test read ({unit} bytes, {:?} alignment) was refused (EINVAL)",
                alignment.source
            ),
        ),
        Err(e) => Err(IoError::Read {
            path: path.to_path_buf(),
            offset: 0,
            len: unit as u64,
            kind: crate::error::ReadErrorKind::from_errno(e.raw_os_error().unwrap_or(0)),
            errno: e.raw_os_error().unwrap_or(0),
        }),
    }
}
