//! `Reader`: the handle the engine uses to read extents into pinned slots.
//!
//! A `Reader` owns one reader thread (one per drive is the intended use),
//! which owns the backend: an io_uring ring, or a pread thread pool where
//! io_uring is unavailable or not wanted. The handle is `Send + Sync`; any
//! thread may submit, cancel or read the counters.
//!
//! The engine's pattern: submit every read a layer needs in one batch (demand
//! for the misses, prefetch for the predicted next layer), then take
//! completions from its channel as they arrive and compute on each expert
//! as soon as its bytes are in. Nothing ever waits on one particular read
//! unless the caller chooses to.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, bounded, unbounded};

use crate::arena::PinnedArena;
use crate::counters::{self, CounterSnapshot, Counters};
use crate::dispatch::{Command, DispatchConfig, Dispatcher};
use crate::error::IoError;
use crate::fault::FaultInjector;
use crate::files::FileSet;
use crate::pread::{MAX_PREAD_THREADS, PreadExecutor};
use crate::request::{Completion, MAX_KERNEL_READ, PlannedRequest, ReadRequest, Ticket, plan};
use crate::uring::UringExecutor;

/// Largest queue depth accepted.
pub const MAX_QUEUE_DEPTH: usize = 4096;

static WARNED_PREAD_FALLBACK: AtomicBool = AtomicBool::new(false);

/// Which backend to use (the CLI's `--io {auto,uring,pread}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum IoBackendChoice {
    /// io_uring where the kernel allows it, otherwise pread (with a warning).
    #[default]
    Auto,
    /// io_uring or an error.
    Uring,
    /// The pread thread pool.
    Pread,
}

impl std::str::FromStr for IoBackendChoice {
    type Err = IoError;

    fn from_str(text: &str) -> Result<Self, IoError> {
        match text {
            "auto" => Ok(Self::Auto),
            "uring" | "io_uring" | "io-uring" => Ok(Self::Uring),
            "pread" => Ok(Self::Pread),
            other => Err(IoError::InvalidArgument(format!(
                "unknown I/O backend {other:?} (expected auto, uring or pread)"
            ))),
        }
    }
}

impl std::fmt::Display for IoBackendChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Uring => "uring",
            Self::Pread => "pread",
        })
    }
}

/// The backend a reader actually runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Backend {
    /// One io_uring ring.
    Uring,
    /// A pread thread pool.
    Pread,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Uring => "io_uring",
            Self::Pread => "pread",
        })
    }
}

/// What the reader runs on, for logs and reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BackendInfo {
    /// The backend.
    pub backend: Backend,
    /// Reads in flight at most.
    pub queue_depth: usize,
    /// Of which prefetch reads at most.
    pub prefetch_limit: usize,
    /// Files registered with the ring.
    pub registered_files: bool,
    /// Arenas registered as fixed buffers (`READ_FIXED`).
    pub registered_buffers: bool,
    /// Reads in the kernel are cancelled with `IORING_OP_ASYNC_CANCEL`
    /// (otherwise their completions are only discarded).
    pub async_cancel: bool,
    /// Why `Auto` fell back to pread, when it did.
    pub fallback_reason: Option<String>,
}

/// Settings of a [`Reader`].
#[derive(Debug, Clone)]
pub struct ReaderConfig {
    /// Which backend.
    pub backend: IoBackendChoice,
    /// Reads in flight at most (the drive's queue depth from this reader).
    pub queue_depth: usize,
    /// Prefetch reads in flight at most; `None`: three quarters of the queue
    /// depth (at least one), keeping room for demand reads that arrive while
    /// prefetch is running.
    pub prefetch_limit: Option<usize>,
    /// Extents longer than this are cut into several kernel reads (rounded
    /// to the alignment); capped at 1 GiB.
    pub max_read_bytes: u64,
    /// Register arenas with io_uring as fixed buffers.
    pub register_buffers: bool,
    /// Fault injection (tests).
    pub faults: Option<FaultInjector>,
}

impl Default for ReaderConfig {
    fn default() -> Self {
        Self {
            backend: IoBackendChoice::Auto,
            queue_depth: 32,
            prefetch_limit: None,
            max_read_bytes: MAX_KERNEL_READ,
            register_buffers: true,
            faults: None,
        }
    }
}

/// A sender of completions (each submit says where its completions go).
pub type CompletionSender = Sender<Completion>;
/// The receiving end.
pub type CompletionReceiver = Receiver<Completion>;

/// A new unbounded channel for completions.
pub fn completion_channel() -> (CompletionSender, CompletionReceiver) {
    unbounded()
}

/// Handle to a reader thread.
pub struct Reader {
    commands: Sender<Command>,
    wake: Option<Arc<OwnedFd>>,
    files: Arc<FileSet>,
    counters: Arc<Counters>,
    info: BackendInfo,
    next_ticket: AtomicU64,
    max_read_bytes: u64,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("backend", &self.info)
            .finish()
    }
}

impl Reader {
    /// Starts a reader thread for `files`. Slots of `arenas` are registered
    /// with io_uring as fixed buffers; slots of other arenas may still be
    /// read into (with plain reads).
    pub fn new(
        files: Arc<FileSet>,
        arenas: &[Arc<PinnedArena>],
        config: ReaderConfig,
    ) -> Result<Reader, IoError> {
        let queue_depth = config.queue_depth;
        if queue_depth == 0 || queue_depth > MAX_QUEUE_DEPTH {
            return Err(IoError::InvalidArgument(format!(
                "queue depth {queue_depth} (expected 1..={MAX_QUEUE_DEPTH})"
            )));
        }
        let prefetch_limit = config
            .prefetch_limit
            .unwrap_or(queue_depth - queue_depth / 4)
            .clamp(1, queue_depth);
        let counters = Arc::new(Counters::default());
        let (commands_tx, commands_rx) = unbounded();
        let (ready_tx, ready_rx) = bounded(1);
        let thread_files = Arc::clone(&files);
        let thread_counters = Arc::clone(&counters);
        let arenas = arenas.to_vec();
        let dispatch = DispatchConfig {
            queue_depth,
            prefetch_limit,
            faults: config.faults.clone(),
        };
        let choice = config.backend;
        let register_buffers = config.register_buffers;
        let thread = std::thread::Builder::new()
            .name("colibri-io-reader".into())
            .spawn(move || {
                let dispatcher =
                    Dispatcher::new(Arc::clone(&thread_files), thread_counters, dispatch);
                let base = BackendInfo {
                    backend: Backend::Pread,
                    queue_depth,
                    prefetch_limit,
                    registered_files: false,
                    registered_buffers: false,
                    async_cancel: false,
                    fallback_reason: None,
                };
                let mut fallback_reason = None;
                if choice != IoBackendChoice::Pread {
                    match UringExecutor::new(
                        Arc::clone(&thread_files),
                        &arenas,
                        queue_depth,
                        register_buffers,
                    ) {
                        Ok(executor) => {
                            let features = executor.features();
                            let info = BackendInfo {
                                backend: Backend::Uring,
                                registered_files: features.registered_files,
                                registered_buffers: features.registered_buffers,
                                async_cancel: features.async_cancel,
                                ..base
                            };
                            let _ = ready_tx.send(Ok((info, Some(executor.wake_fd()))));
                            dispatcher.run(executor, commands_rx);
                            return;
                        }
                        Err(error) if choice == IoBackendChoice::Auto => {
                            if !WARNED_PREAD_FALLBACK.swap(true, Ordering::Relaxed) {
                                tracing::warn!(
                                    "{error}; reading with the pread thread pool instead \
                                     ({queue_depth} threads)"
                                );
                            }
                            fallback_reason = Some(error.to_string());
                        }
                        Err(error) => {
                            let _ = ready_tx.send(Err(error));
                            return;
                        }
                    }
                } else {
                    tracing::info!("reading with the pread thread pool, as configured");
                }
                let threads = queue_depth.min(MAX_PREAD_THREADS);
                match PreadExecutor::new(thread_files, threads) {
                    Ok(executor) => {
                        let info = BackendInfo {
                            fallback_reason,
                            ..base
                        };
                        let _ = ready_tx.send(Ok((info, None)));
                        dispatcher.run(executor, commands_rx);
                    }
                    Err(error) => {
                        let _ = ready_tx.send(Err(error));
                    }
                }
            })
            .map_err(|source| IoError::Backend {
                context: "spawning the reader thread".into(),
                source,
            })?;
        let started = ready_rx.recv();
        let (info, wake) = match started {
            Ok(Ok(ready)) => ready,
            Ok(Err(error)) => {
                let _ = thread.join();
                return Err(error);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(IoError::ReaderStopped);
            }
        };
        Ok(Reader {
            commands: commands_tx,
            wake,
            files,
            counters,
            info,
            next_ticket: AtomicU64::new(0),
            max_read_bytes: config.max_read_bytes,
            thread: Some(thread),
        })
    }

    /// The backend in use and its features.
    pub fn backend(&self) -> &BackendInfo {
        &self.info
    }

    /// The files this reader reads.
    pub fn files(&self) -> &Arc<FileSet> {
        &self.files
    }

    /// Current counters.
    pub fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    /// Nanoseconds with at least one read in the kernel so far (the
    /// `busy_ns` of [`counters`](Self::counters), without the rest): a
    /// caller that samples it around a wait learns how much of the wait
    /// the drive was busy.
    pub fn busy_ns(&self) -> u64 {
        self.counters.busy_ns()
    }

    /// Submits a batch of requests; each yields exactly one [`Completion`]
    /// on `reply`, in the order they finish. Returns their tickets in the
    /// batch's order.
    ///
    /// A request that cannot be planned (unknown file, extents that do not
    /// fit the slot) completes at once with its error on `reply`. The call
    /// itself fails only if the reader thread has stopped; the requests'
    /// slots then return to their arenas.
    ///
    /// All requests of one batch reach the reader thread together, so within
    /// a batch every demand request is issued before any prefetch request,
    /// whatever their order in the batch.
    pub fn submit(
        &self,
        requests: Vec<ReadRequest>,
        reply: &CompletionSender,
    ) -> Result<Vec<Ticket>, IoError> {
        let mut tickets = Vec::with_capacity(requests.len());
        let mut planned = Vec::with_capacity(requests.len());
        for request in requests {
            let ticket = Ticket(self.next_ticket.fetch_add(1, Ordering::Relaxed));
            tickets.push(ticket);
            counters::add(&self.counters.requests_submitted, 1);
            match plan(
                &self.files,
                &request.extents,
                request.slot.len(),
                self.max_read_bytes,
            ) {
                Ok((ranges, reads)) => planned.push((
                    PlannedRequest {
                        ticket,
                        tag: request.tag,
                        priority: request.priority,
                        slot: request.slot,
                        extents: request.extents,
                        ranges,
                        reads,
                    },
                    reply.clone(),
                )),
                Err(error) => {
                    counters::add(&self.counters.requests_failed, 1);
                    let _ = reply.send(Completion {
                        ticket,
                        tag: request.tag,
                        priority: request.priority,
                        slot: request.slot,
                        result: Err(error),
                        issue_seq: None,
                    });
                }
            }
        }
        if !planned.is_empty() {
            self.send(Command::Submit(planned))?;
        }
        Ok(tickets)
    }

    /// Cancels requests. Each still yields exactly one completion: with
    /// [`IoError::Cancelled`], or with its data if it finished before the
    /// cancel reached the reader. Unknown or finished tickets are ignored.
    pub fn cancel(&self, tickets: &[Ticket]) -> Result<(), IoError> {
        self.send(Command::Cancel(tickets.to_vec()))
    }

    /// Raises prefetch requests to demand priority: compute now waits for
    /// them. Their reads still queued are issued before any prefetch read
    /// (after the demand reads already queued); reads already in the kernel
    /// go on as they are. Unknown, finished or demand tickets are ignored.
    pub fn promote(&self, tickets: &[Ticket]) -> Result<(), IoError> {
        self.send(Command::Promote(tickets.to_vec()))
    }

    /// Stops issuing reads to the kernel until the returned guard is dropped
    /// (reads already in the kernel go on). Lets a caller assemble one
    /// logical batch from several `submit` calls and have it scheduled by
    /// priority as a whole.
    pub fn hold(&self) -> Result<IssueHold<'_>, IoError> {
        self.send(Command::Hold)?;
        Ok(IssueHold { reader: self })
    }

    /// Submits one request and waits for its completion (for loading dense
    /// weights and for tests; the engine's hot path uses [`submit`]).
    ///
    /// [`submit`]: Self::submit
    pub fn read_blocking(&self, request: ReadRequest) -> Result<Completion, IoError> {
        let (reply, completions) = bounded(1);
        self.submit(vec![request], &reply)?;
        drop(reply);
        completions.recv().map_err(|_| IoError::ReaderStopped)
    }

    fn send(&self, command: Command) -> Result<(), IoError> {
        self.commands
            .send(command)
            .map_err(|_| IoError::ReaderStopped)?;
        self.wake_thread();
        Ok(())
    }

    fn wake_thread(&self) {
        if let Some(wake) = &self.wake {
            let one: u64 = 1;
            // SAFETY: the descriptor is an open eventfd (kept alive by the
            // Arc) and `one` is 8 readable bytes, as eventfd writes require.
            // A failed write (counter saturated) still leaves it readable,
            // which is all the wake-up needs.
            unsafe {
                libc::write(
                    wake.as_raw_fd(),
                    std::ptr::from_ref(&one).cast(),
                    std::mem::size_of::<u64>(),
                );
            }
        }
    }
}

impl Drop for Reader {
    /// Cancels everything still queued or in flight, waits until the kernel
    /// has finished with every buffer, and joins the reader thread.
    fn drop(&mut self) {
        let _ = self.send(Command::Shutdown);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// While alive, the reader issues no new reads (see [`Reader::hold`]).
#[must_use = "the hold ends when this guard is dropped"]
pub struct IssueHold<'a> {
    reader: &'a Reader,
}

impl Drop for IssueHold<'_> {
    fn drop(&mut self) {
        let _ = self.reader.send(Command::Release);
    }
}
