//! The pread fallback when io_uring is blocked, exercised for real: the test
//! re-runs itself in a child process whose seccomp filter makes
//! `io_uring_setup` fail with EPERM (what a container runtime's default
//! profile does), and checks there that `Auto` falls back to pread and says
//! why, `Uring` is refused with a clear error, and reads are still correct.

mod common;

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Arc;

use colibri_io::{
    Backend, Extent, FileId, IoBackendChoice, IoError, Priority, ReadRequest, Reader, ReaderConfig,
};
use common::*;

const CHILD_ENV: &str = "COLIBRI_IO_SECCOMP_CHILD";

/// Installs a seccomp filter that fails `io_uring_setup` with EPERM.
fn block_io_uring() -> std::io::Result<()> {
    let errno = libc::SECCOMP_RET_ERRNO | (libc::EPERM as u32);
    let mut filter = [
        // Load the syscall number (offset 0 of struct seccomp_data).
        libc::sock_filter {
            code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
            jt: 0,
            jf: 0,
            k: 0,
        },
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: libc::SYS_io_uring_setup as u32,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: errno,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        },
    ];
    let program = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_mut_ptr(),
    };
    // SAFETY: prctl with these options reads only its integer arguments and
    // `program`, which points at `filter`; both outlive the calls. Both
    // calls are async-signal-safe, as required between fork and exec.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            || libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER as libc::c_ulong,
                &program as *const libc::sock_fprog,
            ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[test]
fn auto_falls_back_to_pread_when_seccomp_blocks_io_uring() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return; // In the child, only the checks below run.
    }
    let exe = std::env::current_exe().expect("test binary");
    let mut command = Command::new(exe);
    command
        .args([
            "--exact",
            "in_seccomp_child_io_uring_is_blocked",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, "1");
    // SAFETY: the closure runs in the forked child before exec and only
    // calls async-signal-safe prctl(2).
    unsafe { command.pre_exec(block_io_uring) };
    let output = command.output().expect("run the seccomp child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!("{text}");
    assert!(output.status.success(), "seccomp child failed");
    assert!(text.contains("1 passed"), "the child ran its checks");
}

#[test]
fn in_seccomp_child_io_uring_is_blocked() {
    if std::env::var_os(CHILD_ENV).is_none() {
        eprintln!("(this half runs inside the seccomp child of the test above)");
        return;
    }
    let probe = colibri_io::probe_uring();
    let reason = probe
        .unavailable
        .expect("io_uring must look unavailable under the filter");
    assert!(reason.contains("EPERM"), "{reason}");
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let content = random_bytes(161, 300_000);
    let path = write_file(place.dir.path(), "seccomp.bin", &content);
    let files = place.open(&[&path]);
    let config = |backend| ReaderConfig {
        backend,
        queue_depth: 4,
        ..ReaderConfig::default()
    };
    match Reader::new(Arc::clone(&files), &[], config(IoBackendChoice::Uring)) {
        Err(error @ IoError::UringUnavailable { .. }) => eprintln!("Uring refused: {error}"),
        other => panic!("expected UringUnavailable, got {other:?}"),
    }
    let arena = arena(256 * 1024, 1);
    let reader = Reader::new(
        files,
        std::slice::from_ref(&arena),
        config(IoBackendChoice::Auto),
    )
    .expect("auto");
    let info = reader.backend();
    assert_eq!(info.backend, Backend::Pread);
    let why = info.fallback_reason.as_deref().unwrap_or("");
    assert!(why.contains("EPERM"), "{why}");
    eprintln!("Auto fell back: {why}");
    let done = reader
        .read_blocking(ReadRequest {
            slot: arena.try_acquire().expect("slot"),
            extents: vec![Extent {
                file: FileId(0),
                offset: 4097,
                len: 200_000,
            }],
            priority: Priority::Demand,
            tag: 0,
        })
        .expect("reader alive");
    assert_eq!(done.extent_bytes(0), Some(&content[4097..204_097]));
}
