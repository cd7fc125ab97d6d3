//! Fallbacks exercised for real, in child processes with restrictions this
//! machine does not otherwise have (the test binary re-runs one of its own
//! tests in the child):
//!
//! - a seccomp filter makes `io_uring_setup` fail with EPERM (what a
//!   container runtime's default profile does): `Auto` must fall back to
//!   pread and say why, `Uring` must be refused with a clear error, and reads
//!   must still be correct;
//! - without `CAP_IPC_LOCK` and with a 1 MiB `RLIMIT_MEMLOCK`, `mlock` and
//!   io_uring buffer registration are refused: the arena and the reader must
//!   still work, unlocked and with plain reads.

mod common;

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Arc;

use colibri_io::{
    Backend, Extent, FileId, IoBackendChoice, IoError, Priority, ReadRequest, Reader, ReaderConfig,
};
use common::*;

const CHILD_ENV: &str = "COLIBRI_IO_RESTRICTED_CHILD";
const CAP_IPC_LOCK: libc::c_ulong = 14;
const PR_CAPBSET_DROP: libc::c_int = 24;

/// Re-runs test `name` of this binary in a child whose restrictions are
/// applied by `restrict` between fork and exec; fails if the child fails.
fn run_in_child(name: &str, restrict: fn() -> std::io::Result<()>) {
    let exe = std::env::current_exe().expect("test binary");
    let mut command = Command::new(exe);
    command
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, name);
    // SAFETY: `restrict` runs in the forked child before exec and only makes
    // async-signal-safe system calls (prctl, setrlimit).
    unsafe { command.pre_exec(restrict) };
    let output = command.output().expect("run the restricted child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!("{text}");
    assert!(output.status.success(), "restricted child {name} failed");
    assert!(text.contains("1 passed"), "the child ran its checks");
}

/// Whether this process is the child that runs `name`'s checks.
fn in_child(name: &str) -> bool {
    let here = std::env::var(CHILD_ENV).ok();
    if here.as_deref() != Some(name) {
        eprintln!("({name} checks only run inside its restricted child)");
        return false;
    }
    true
}

/// Drops CAP_IPC_LOCK from the bounding set (so root loses it at exec) and
/// limits locked memory to 1 MiB.
fn no_memlock() -> std::io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: 1 << 20,
        rlim_max: 1 << 20,
    };
    // SAFETY: prctl reads only its integer arguments; setrlimit reads
    // `limit`, which outlives the call.
    unsafe {
        if libc::prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0
            || libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

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
    if std::env::var_os(CHILD_ENV).is_none() {
        run_in_child("in_seccomp_child_io_uring_is_blocked", block_io_uring);
    }
}

#[test]
fn in_seccomp_child_io_uring_is_blocked() {
    if !in_child("in_seccomp_child_io_uring_is_blocked") {
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

#[test]
fn arena_and_reader_work_when_memory_locking_is_refused() {
    if std::env::var_os(CHILD_ENV).is_none() {
        run_in_child("in_memlock_child_locking_is_refused", no_memlock);
    }
}

#[test]
fn in_memlock_child_locking_is_refused() {
    if !in_child("in_memlock_child_locking_is_refused") {
        return;
    }
    let arena = arena(8 << 20, 2);
    assert!(
        !arena.is_locked(),
        "a 16 MiB arena cannot be locked under a 1 MiB limit"
    );
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let content = random_bytes(171, 12 << 20);
    let path = write_file(place.dir.path(), "memlock.bin", &content);
    let files = place.open(&[&path]);
    for backend in backends() {
        let config = ReaderConfig {
            backend,
            queue_depth: 4,
            ..ReaderConfig::default()
        };
        let reader =
            Reader::new(Arc::clone(&files), std::slice::from_ref(&arena), config).expect("reader");
        let info = reader.backend();
        eprintln!("{backend} without memlock: {info:?}");
        if info.backend == Backend::Uring {
            assert!(
                !info.registered_buffers,
                "registration needs locked memory here"
            );
        }
        let done = reader
            .read_blocking(ReadRequest {
                slot: arena.try_acquire().expect("slot"),
                extents: vec![Extent {
                    file: FileId(0),
                    offset: 3,
                    len: (8 << 20) - 4096,
                }],
                priority: Priority::Demand,
                tag: 0,
            })
            .expect("reader alive");
        assert_eq!(
            done.extent_bytes(0),
            Some(&content[3..(8 << 20) - 4093]),
            "{backend}"
        );
    }
}
