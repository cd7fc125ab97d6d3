//! Helpers shared by the integration tests: seeded random files on real
//! file systems, and probes that decide (and say) which parts can run here.

#![allow(dead_code)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use colibri_io::{Completion, CompletionReceiver, DirectIo, FileSet, IoBackendChoice, PinnedArena};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Seeded random bytes (never all zeros).
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    ChaCha8Rng::seed_from_u64(seed).fill_bytes(&mut bytes);
    bytes
}

/// Writes `bytes` to `dir/name`.
pub fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write test file");
    path
}

/// `statfs(2)` file system magic of `path`.
pub fn fs_magic(path: &Path) -> Option<i64> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero statfs is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is writable for the call.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_type as i64)
}

pub fn is_tmpfs(path: &Path) -> bool {
    fs_magic(path) == Some(libc::TMPFS_MAGIC)
}

/// A place where reads go to a real file system with O_DIRECT, with the
/// tempdir that keeps it alive. Candidates: $TMPDIR or /tmp, then /work,
/// then the cargo target tmp dir; tmpfs ones are skipped (they refuse
/// O_DIRECT). For each candidate the FileSet probe decides; a refusal is
/// printed, never silent.
pub struct Place {
    pub dir: tempfile::TempDir,
    pub direct: bool,
    pub policy: DirectIo,
    pub label: String,
}

impl Place {
    /// Opens files of this place with its direct-I/O policy.
    pub fn open(&self, paths: &[&Path]) -> Arc<FileSet> {
        let set = FileSet::open(paths, self.policy).expect("open file set");
        for info in set.infos() {
            assert_eq!(info.direct, self.direct, "{}: {info:?}", self.label);
        }
        Arc::new(set)
    }
}

pub fn direct_place() -> Option<Place> {
    let mut candidates = vec![std::env::temp_dir(), PathBuf::from("/work")];
    candidates.push(PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    for base in candidates {
        if !base.is_dir() {
            continue;
        }
        if is_tmpfs(&base) {
            eprintln!(
                "note: {} is tmpfs, which refuses O_DIRECT; trying elsewhere",
                base.display()
            );
            continue;
        }
        let Ok(dir) = tempfile::tempdir_in(&base) else {
            continue;
        };
        let probe = write_file(dir.path(), "probe", &random_bytes(1, 8192));
        let set = FileSet::open(&[&probe], DirectIo::Auto).expect("open probe file");
        let info = set.infos().next().expect("one file").clone();
        if info.direct {
            return Some(Place {
                dir,
                direct: true,
                policy: DirectIo::Auto,
                label: format!("O_DIRECT on {}", base.display()),
            });
        }
        eprintln!(
            "SKIP (O_DIRECT part): the probe on {} says: {}",
            base.display(),
            info.buffered_reason.unwrap_or_default()
        );
    }
    None
}

/// A tmpfs place (buffered fallback), if /dev/shm exists and is tmpfs.
pub fn tmpfs_place() -> Option<Place> {
    let base = Path::new("/dev/shm");
    if !base.is_dir() || !is_tmpfs(base) {
        eprintln!("SKIP (buffered-fallback part): /dev/shm is absent or not tmpfs here");
        return None;
    }
    let dir = tempfile::tempdir_in(base).ok()?;
    let probe = write_file(dir.path(), "probe", &random_bytes(1, 8192));
    let set = FileSet::open(&[&probe], DirectIo::Auto).expect("open probe file");
    let info = set.infos().next().expect("one file").clone();
    if info.direct {
        // Linux >= 6.6 lets tmpfs accept O_DIRECT; the fallback path is then
        // exercised by turning O_DIRECT off, which takes the same code path.
        eprintln!(
            "note: tmpfs accepts O_DIRECT on this kernel (alignment {:?}); testing the \
             buffered fallback on /dev/shm with DirectIo::Off",
            info.alignment
        );
        return Some(Place {
            dir,
            direct: false,
            policy: DirectIo::Off,
            label: "buffered (DirectIo::Off) on tmpfs /dev/shm".into(),
        });
    }
    eprintln!(
        "note: tmpfs refuses O_DIRECT here: {}",
        info.buffered_reason.unwrap_or_default()
    );
    Some(Place {
        dir,
        direct: false,
        policy: DirectIo::Auto,
        label: "buffered (O_DIRECT refused) on tmpfs /dev/shm".into(),
    })
}

/// Every place available here: O_DIRECT on a real file system and buffered
/// on tmpfs.
pub fn places() -> Vec<Place> {
    direct_place().into_iter().chain(tmpfs_place()).collect()
}

/// The backends to test: pread always; io_uring when the kernel's probe
/// says it is available (otherwise say why it is skipped).
pub fn backends() -> Vec<IoBackendChoice> {
    let probe = colibri_io::probe_uring();
    match probe.unavailable {
        None => vec![IoBackendChoice::Uring, IoBackendChoice::Pread],
        Some(reason) => {
            eprintln!("SKIP (io_uring part): the kernel probe says: {reason}");
            vec![IoBackendChoice::Pread]
        }
    }
}

pub fn open(paths: &[&Path]) -> Arc<FileSet> {
    Arc::new(FileSet::open(paths, DirectIo::Auto).expect("open file set"))
}

pub fn arena(slot_size: usize, slots: usize) -> Arc<PinnedArena> {
    PinnedArena::new(slot_size, slots).expect("arena")
}

/// Receives `n` completions (bounded wait so a bug fails instead of hanging).
pub fn collect(completions: &CompletionReceiver, n: usize) -> Vec<Completion> {
    (0..n)
        .map(|i| {
            completions
                .recv_timeout(std::time::Duration::from_secs(120))
                .unwrap_or_else(|e| panic!("completion {i} of {n} never came: {e}"))
        })
        .collect()
}
