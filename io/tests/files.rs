//! FileSet: the O_DIRECT probe, alignment from statx, and errors that name
//! the file.

mod common;

use colibri_io::{AlignmentSource, DirectIo, FileId, FileSet, IoError};
use common::*;

#[test]
fn real_file_systems_get_o_direct_with_the_kernels_alignment() {
    let Some(place) = direct_place() else {
        eprintln!("SKIP: no file system here accepts O_DIRECT (see the notes above)");
        return;
    };
    let path = write_file(place.dir.path(), "a.bin", &random_bytes(3, 10_000));
    let set = FileSet::open(&[&path], DirectIo::Auto).expect("open");
    let info = set.info(FileId(0)).expect("info");
    assert!(info.direct);
    assert_eq!(info.len_at_open, 10_000);
    assert!(info.alignment.mem.is_power_of_two() && info.alignment.offset.is_power_of_two());
    match info.alignment.source {
        AlignmentSource::Statx => eprintln!(
            "{}: statx(STATX_DIOALIGN) reports mem {} offset {}",
            place.label, info.alignment.mem, info.alignment.offset
        ),
        AlignmentSource::Fallback => eprintln!(
            "{}: STATX_DIOALIGN not reported; using the 4096 fallback",
            place.label
        ),
        AlignmentSource::Buffered => panic!("direct file with buffered alignment"),
    }
    assert_eq!(set.current_len(FileId(0)).expect("len"), 10_000);
}

#[test]
fn direct_io_off_opens_buffered() {
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let path = write_file(place.dir.path(), "b.bin", &random_bytes(4, 100));
    let set = FileSet::open(&[&path], DirectIo::Off).expect("open");
    let info = set.info(FileId(0)).expect("info");
    assert!(!info.direct);
    assert_eq!(info.alignment.unit(), 1);
    assert!(
        info.buffered_reason
            .as_deref()
            .unwrap_or("")
            .contains("configuration")
    );
}

#[test]
fn missing_file_is_an_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("no-such-file.safetensors");
    match FileSet::open(&[&path], DirectIo::Auto) {
        Err(error @ IoError::Open { .. }) => {
            assert!(
                error.to_string().contains("no-such-file.safetensors"),
                "{error}"
            );
            assert_eq!(error.errno(), Some(libc::ENOENT));
        }
        other => panic!("expected an open error, got {other:?}"),
    }
}

#[test]
fn empty_files_open() {
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let path = write_file(place.dir.path(), "empty.bin", &[]);
    let set = FileSet::open(&[&path], DirectIo::Auto).expect("open");
    assert_eq!(set.info(FileId(0)).expect("info").len_at_open, 0);
}

/// Collects everything a tracing subscriber writes.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .expect("capture lock")
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn the_buffered_fallback_is_announced_once_per_file_set() {
    // procfs refuses O_DIRECT at open: two such files, one warning.
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let set = tracing::subscriber::with_default(subscriber, || {
        FileSet::open(&["/proc/version", "/proc/cpuinfo"], DirectIo::Auto).expect("open")
    });
    assert!(set.infos().all(|info| !info.direct));
    let text = String::from_utf8(captured.0.lock().expect("lock").clone()).expect("utf8");
    assert_eq!(text.matches("O_DIRECT is unavailable").count(), 1, "{text}");
    assert!(
        text.contains("2 of 2 files") && text.contains("/proc/version"),
        "{text}"
    );
    assert!(text.contains("POSIX_FADV_DONTNEED"), "{text}");
}
