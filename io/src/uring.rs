//! The io_uring backend: one ring, owned by the reader thread.
//!
//! The ring is created on the reader thread (so `SINGLE_ISSUER` holds) and
//! never leaves it. Files are registered (`IORING_REGISTER_FILES`, saving a
//! descriptor lookup per read) and so are the pinned arenas
//! (`IORING_REGISTER_BUFFERS`, so `READ_FIXED` skips pinning the pages on
//! every read). Either registration may be refused (memlock accounting on
//! older kernels, exotic memory); the ring then falls back to plain `READ`
//! with raw descriptors and says so once.
//!
//! The reader thread sleeps in `io_uring_enter`, never on a channel, while
//! reads are in flight; to wake it when a caller submits or cancels, the
//! ring always holds one read of an `eventfd` that the handles write to.
//!
//! Cancellation of a read in the kernel is sent as `IORING_OP_ASYNC_CANCEL`
//! and its completion is discarded whatever it says. Why both: an
//! `O_DIRECT` read already sent to the drive cannot be stopped (the cancel
//! finds nothing, `-ENOENT`/`-EALREADY`), but a read still waiting in
//! io_uring's worker queue (buffered fallback, or a device queue that was
//! full) is removed and frees its queue place at once. The slot is handed
//! back only after the read's own completion arrives, because until then the
//! kernel may still be writing into it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_channel::Receiver;
use io_uring::{IoUring, Probe, opcode, types};

use crate::arena::PinnedArena;
use crate::dispatch::{Command, Executor, KernelRead, ReadResult};
use crate::error::IoError;
use crate::files::FileSet;

/// `user_data` of the eventfd wake-up read.
const WAKE: u64 = u64::MAX;
/// Bit set in the `user_data` of cancel requests (read ids stay below it).
const CANCEL: u64 = 1 << 62;
/// io_uring refuses registered buffers larger than 1 GiB each.
const MAX_REGISTERED_BUFFER: usize = 1 << 30;
/// io_uring's limit on the number of registered buffers.
const MAX_REGISTERED_BUFFERS: usize = 1 << 14;

static WARNED_FIXED: AtomicBool = AtomicBool::new(false);

/// What this kernel's io_uring supports, as found by [`probe`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct UringProbe {
    /// `None` when a ring could be set up; otherwise why not.
    pub unavailable: Option<String>,
    /// `IORING_OP_READ` is supported.
    pub read: bool,
    /// `IORING_OP_READ_FIXED` is supported.
    pub read_fixed: bool,
    /// `IORING_OP_ASYNC_CANCEL` is supported.
    pub async_cancel: bool,
    /// Registering one page-locked page as a fixed buffer worked.
    pub register_buffers: bool,
    /// Registering a file worked.
    pub register_files: bool,
}

/// Probes io_uring on this machine: can a ring be set up, which opcodes are
/// supported, do buffer and file registration work.
pub fn probe() -> UringProbe {
    let mut report = UringProbe {
        unavailable: None,
        read: false,
        read_fixed: false,
        async_cancel: false,
        register_buffers: false,
        register_files: false,
    };
    // Declared before the ring so that it outlives any registration.
    let arena = PinnedArena::new(4096, 1).ok();
    let ring = match IoUring::new(4) {
        Ok(ring) => ring,
        Err(error) => {
            report.unavailable = Some(describe_setup_error(&error));
            return report;
        }
    };
    let ops = supported_ops(&ring);
    report.read = ops.read;
    report.read_fixed = ops.read_fixed;
    report.async_cancel = ops.async_cancel;
    if let Some(arena) = &arena {
        let iov = libc::iovec {
            iov_base: arena.as_ptr().cast(),
            iov_len: arena.len_bytes(),
        };
        // SAFETY: the iovec covers the arena's mapping, which is declared
        // before the ring and so outlives it and its registration.
        report.register_buffers = unsafe { ring.submitter().register_buffers(&[iov]) }.is_ok();
        if report.register_buffers {
            let _ = ring.submitter().unregister_buffers();
        }
    }
    if let Ok(file) = std::fs::File::open("/proc/self/stat") {
        report.register_files = ring.submitter().register_files(&[file.as_raw_fd()]).is_ok();
        if report.register_files {
            let _ = ring.submitter().unregister_files();
        }
    }
    report
}

struct SupportedOps {
    read: bool,
    read_fixed: bool,
    async_cancel: bool,
}

fn supported_ops(ring: &IoUring) -> SupportedOps {
    let mut probe = Probe::new();
    if ring.submitter().register_probe(&mut probe).is_err() {
        // Kernels before 5.6 have no probe and no IORING_OP_READ either.
        return SupportedOps {
            read: false,
            read_fixed: true,
            async_cancel: false,
        };
    }
    SupportedOps {
        read: probe.is_supported(opcode::Read::CODE),
        read_fixed: probe.is_supported(opcode::ReadFixed::CODE),
        async_cancel: probe.is_supported(opcode::AsyncCancel::CODE),
    }
}

fn describe_setup_error(error: &std::io::Error) -> String {
    let sysctl = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "absent".into());
    let why = match error.raw_os_error() {
        Some(libc::ENOSYS) => "the kernel has no io_uring (ENOSYS)",
        Some(libc::EPERM) => "io_uring_setup is not permitted (EPERM: sysctl or seccomp)",
        Some(libc::EACCES) => "io_uring_setup is not permitted (EACCES)",
        Some(libc::ENOMEM) => "io_uring_setup ran out of memory (ENOMEM: RLIMIT_MEMLOCK?)",
        _ => "io_uring_setup failed",
    };
    format!("{why}: {error}; kernel.io_uring_disabled = {sysctl}")
}

/// A registered arena: slot `i < registered_slots` is in registered buffer
/// `first_index + i / slots_per_buffer`; later slots use plain reads.
struct RegisteredArena {
    arena_id: u64,
    first_index: u16,
    slots_per_buffer: usize,
    registered_slots: usize,
}

/// What the ring ended up with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UringFeatures {
    pub registered_files: bool,
    pub registered_buffers: bool,
    pub async_cancel: bool,
}

pub(crate) struct UringExecutor {
    // Field order matters: the ring is dropped (and its registrations
    // released) before the arenas and the files it refers to.
    ring: IoUring,
    wake_buf: Box<u64>,
    wake_fd: Arc<OwnedFd>,
    wake_armed: bool,
    registered: Vec<RegisteredArena>,
    _arenas: Vec<Arc<PinnedArena>>,
    files: Arc<FileSet>,
    features: UringFeatures,
}

impl UringExecutor {
    /// Sets up a ring for `queue_depth` reads and registers `files` and
    /// `arenas`. Fails with [`IoError::UringUnavailable`] when the kernel
    /// has no usable io_uring.
    pub(crate) fn new(
        files: Arc<FileSet>,
        arenas: &[Arc<PinnedArena>],
        queue_depth: usize,
        register_buffers: bool,
    ) -> Result<Self, IoError> {
        // Room for every read, one cancel per read, and the wake-up read.
        let entries = (2 * queue_depth + 1).next_power_of_two() as u32;
        let ring = IoUring::builder()
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_submit_all()
            .build(entries)
            .or_else(|error| match error.raw_os_error() {
                // Older kernels refuse flags they do not know.
                Some(libc::EINVAL) => IoUring::new(entries),
                _ => Err(error),
            })
            .map_err(|error| IoError::UringUnavailable {
                reason: describe_setup_error(&error),
            })?;
        let ops = supported_ops(&ring);
        if !ops.read {
            return Err(IoError::UringUnavailable {
                reason: "the kernel's io_uring lacks IORING_OP_READ (kernel < 5.6)".into(),
            });
        }
        let registered_files = ring.submitter().register_files(&files.raw_fds()).is_ok();
        let registered = if register_buffers && ops.read_fixed {
            register_arenas(&ring, arenas)
        } else {
            Vec::new()
        };
        // SAFETY: eventfd takes no pointers; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(IoError::Backend {
                context: "eventfd for the reader's wake-ups".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: `raw` is a descriptor we just created and own exclusively.
        let wake_fd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let features = UringFeatures {
            registered_files,
            registered_buffers: !registered.is_empty(),
            async_cancel: ops.async_cancel,
        };
        let mut executor = Self {
            ring,
            wake_buf: Box::new(0),
            wake_fd,
            wake_armed: false,
            registered,
            _arenas: arenas.to_vec(),
            files,
            features,
        };
        executor.arm_wake()?;
        Ok(executor)
    }

    pub(crate) fn features(&self) -> UringFeatures {
        self.features
    }

    /// The eventfd the handles write to when they send a command.
    pub(crate) fn wake_fd(&self) -> Arc<OwnedFd> {
        Arc::clone(&self.wake_fd)
    }

    fn arm_wake(&mut self) -> Result<(), IoError> {
        let entry = opcode::Read::new(
            types::Fd(self.wake_fd.as_raw_fd()),
            std::ptr::from_mut::<u64>(&mut *self.wake_buf).cast::<u8>(),
            8,
        )
        .build()
        .user_data(WAKE);
        self.push_entry(&entry)?;
        self.wake_armed = true;
        Ok(())
    }

    fn push_entry(&mut self, entry: &io_uring::squeue::Entry) -> Result<(), IoError> {
        for _ in 0..2 {
            // SAFETY: every entry we build points at memory that stays valid
            // until its completion is reaped: slot memory is owned by the
            // pending request (held by the dispatcher until then), the wake
            // buffer is a field of `self` that outlives the ring's use of it
            // (see `finish`), and descriptors are kept open by `files` and
            // `wake_fd`.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return Ok(());
            }
            // Full: hand what is queued to the kernel and try once more. The
            // ring is sized so that this does not happen in normal use.
            self.ring.submit().map_err(|source| IoError::Backend {
                context: "io_uring_enter (flushing a full submission queue)".into(),
                source,
            })?;
        }
        Err(IoError::Backend {
            context: "io_uring submission queue stays full".into(),
            source: std::io::Error::from_raw_os_error(libc::EBUSY),
        })
    }

    fn fixed_index(&self, arena_id: u64, slot: usize) -> Option<u16> {
        let registered = self.registered.iter().find(|r| r.arena_id == arena_id)?;
        if slot >= registered.registered_slots {
            return None;
        }
        let index = usize::from(registered.first_index) + slot / registered.slots_per_buffer;
        u16::try_from(index).ok()
    }

    fn reap(&mut self, done: &mut Vec<ReadResult>) {
        for cqe in self.ring.completion() {
            match cqe.user_data() {
                WAKE => self.wake_armed = false,
                data if data & CANCEL != 0 => {}
                id => done.push(ReadResult {
                    id,
                    res: cqe.result(),
                }),
            }
        }
    }
}

/// At most this many arena bytes are registered as fixed buffers (the
/// first slots of each arena, in order): registration pins, and so faults
/// in, every registered page at once, which for a cache of tens of GiB
/// would cost seconds at start. Slots past it use plain reads, which pin
/// the buffer only for the read's duration.
pub const MAX_REGISTERED_ARENA_BYTES: usize = 4 << 30;

fn register_arenas(ring: &IoUring, arenas: &[Arc<PinnedArena>]) -> Vec<RegisteredArena> {
    let mut iovecs = Vec::new();
    let mut registered = Vec::new();
    let mut budget = MAX_REGISTERED_ARENA_BYTES;
    for arena in arenas {
        let slot_size = arena.slot_size();
        if slot_size > MAX_REGISTERED_BUFFER || slot_size > budget {
            continue;
        }
        let registered_slots = arena.slot_count().min(budget / slot_size);
        budget -= registered_slots * slot_size;
        let slots_per_buffer = (MAX_REGISTERED_BUFFER / slot_size).min(registered_slots);
        let Ok(first_index) = u16::try_from(iovecs.len()) else {
            break;
        };
        let mut slot = 0;
        while slot < registered_slots {
            let slots = slots_per_buffer.min(registered_slots - slot);
            iovecs.push(libc::iovec {
                // SAFETY: slot < slot_count, so the offset is inside the
                // arena's mapping.
                iov_base: unsafe { arena.as_ptr().add(slot * slot_size) }.cast(),
                iov_len: slots * slot_size,
            });
            slot += slots;
        }
        registered.push(RegisteredArena {
            arena_id: arena.id(),
            first_index,
            slots_per_buffer,
            registered_slots,
        });
    }
    if iovecs.is_empty() || iovecs.len() > MAX_REGISTERED_BUFFERS {
        return Vec::new();
    }
    // SAFETY: each iovec lies inside an arena mapping; the executor keeps an
    // `Arc` to every arena and drops the ring (which releases the
    // registration) before them.
    match unsafe { ring.submitter().register_buffers(&iovecs) } {
        Ok(()) => registered,
        Err(error) => {
            if !WARNED_FIXED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "io_uring refused to register the pinned arenas as fixed buffers ({error}); \
                     using plain reads, which pin pages on every read"
                );
            }
            Vec::new()
        }
    }
}

macro_rules! read_entry {
    ($fd:expr, $read:expr, $fixed:expr) => {
        match $fixed {
            Some(index) => opcode::ReadFixed::new($fd, $read.buf, $read.len, index)
                .offset($read.offset)
                .build(),
            None => opcode::Read::new($fd, $read.buf, $read.len)
                .offset($read.offset)
                .build(),
        }
    };
}

impl Executor for UringExecutor {
    fn push(&mut self, read: &KernelRead) -> Result<(), IoError> {
        let fixed = self.fixed_index(read.slot.0, read.slot.1);
        let entry = if self.features.registered_files {
            read_entry!(types::Fixed(read.file.0), read, fixed)
        } else {
            let fd = self
                .files
                .raw_fd(read.file)
                .ok_or(IoError::UnknownFile(read.file.0))?;
            read_entry!(types::Fd(fd), read, fixed)
        };
        self.push_entry(&entry.user_data(read.id))
    }

    fn cancel(&mut self, id: u64) {
        if !self.features.async_cancel {
            return; // Discarding the completion is enough for correctness.
        }
        let entry = opcode::AsyncCancel::new(id).build().user_data(CANCEL | id);
        // Best effort: a cancel that cannot be queued changes nothing.
        let _ = self.push_entry(&entry);
    }

    fn wait(
        &mut self,
        _commands: Option<&Receiver<Command>>,
        block: bool,
        done: &mut Vec<ReadResult>,
        _got: &mut Vec<Command>,
    ) -> Result<(), IoError> {
        // The armed eventfd read completes when a handle sends a command,
        // so blocking here also wakes up for commands.
        let outcome = self.ring.submit_and_wait(usize::from(block));
        self.reap(done);
        if !self.wake_armed {
            self.arm_wake()?;
        }
        match outcome {
            Ok(_) => Ok(()),
            Err(error)
                if matches!(
                    error.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) =>
            {
                Ok(())
            }
            Err(source) => Err(IoError::Backend {
                context: "io_uring_enter".into(),
                source,
            }),
        }
    }

    fn finish(&mut self) {
        // The wake-up read points into `self.wake_buf`; make sure the kernel
        // is done with it before the ring and the buffer go away.
        if self.wake_armed && self.features.async_cancel {
            let entry = opcode::AsyncCancel::new(WAKE).build().user_data(CANCEL);
            if self.push_entry(&entry).is_ok() {
                let mut ignored = Vec::new();
                for _ in 0..1000 {
                    if !self.wake_armed {
                        break;
                    }
                    let _ = self.ring.submit_and_wait(1);
                    self.reap(&mut ignored);
                }
            }
        }
        if self.wake_armed {
            // Could not confirm the kernel let go of the buffer: leak it
            // rather than risk a write into freed memory.
            std::mem::forget(std::mem::replace(&mut self.wake_buf, Box::new(0)));
        }
    }
}
