//! The pread backend: a pool of threads doing blocking `pread(2)`, behind
//! the same scheduler as the io_uring ring.
//!
//! Used where io_uring is unavailable (kernel without it, `io_uring_setup`
//! refused by `kernel.io_uring_disabled` or a seccomp filter) or when the
//! user asks for it. Each worker does one read at a time, so the number of
//! workers is the queue depth the drive sees. A read cannot be interrupted
//! once a worker has started it, so cancelling a read in flight means
//! discarding its result when it comes back (the dispatcher's job).

use std::os::fd::RawFd;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, select, unbounded};

use crate::dispatch::{Command, Executor, KernelRead, ReadResult};
use crate::error::IoError;
use crate::files::FileSet;

/// Most worker threads we start, whatever the queue depth.
pub const MAX_PREAD_THREADS: usize = 256;

/// A destination pointer sent to a worker.
struct Destination(*mut u8);

// SAFETY: the pointer designates a range of a slot that the dispatcher's
// pending request owns until this read's result has been received back from
// the worker; no one else touches the range meanwhile, so moving the pointer
// to the worker thread cannot create a data race.
unsafe impl Send for Destination {}

struct Job {
    id: u64,
    fd: RawFd,
    offset: u64,
    buf: Destination,
    len: u32,
}

pub(crate) struct PreadExecutor {
    jobs: Option<Sender<Job>>,
    results: Receiver<ReadResult>,
    workers: Vec<JoinHandle<()>>,
    files: Arc<FileSet>,
}

impl PreadExecutor {
    /// Starts `threads` workers (at least one, at most
    /// [`MAX_PREAD_THREADS`]).
    pub(crate) fn new(files: Arc<FileSet>, threads: usize) -> Result<Self, IoError> {
        let (jobs_tx, jobs_rx) = unbounded::<Job>();
        let (results_tx, results_rx) = unbounded();
        let mut workers = Vec::new();
        for index in 0..threads.clamp(1, MAX_PREAD_THREADS) {
            let jobs = jobs_rx.clone();
            let results = results_tx.clone();
            // Each worker keeps the files open for as long as it may read.
            let files = Arc::clone(&files);
            let worker = std::thread::Builder::new()
                .name(format!("colibri-pread-{index}"))
                .spawn(move || worker_loop(&jobs, &results, &files))
                .map_err(|source| IoError::Backend {
                    context: "spawning a pread worker".into(),
                    source,
                })?;
            workers.push(worker);
        }
        Ok(Self {
            jobs: Some(jobs_tx),
            results: results_rx,
            workers,
            files,
        })
    }
}

fn worker_loop(jobs: &Receiver<Job>, results: &Sender<ReadResult>, _files: &Arc<FileSet>) {
    while let Ok(job) = jobs.recv() {
        // SAFETY: `fd` is open (the file set is kept alive by `_files`), and
        // `buf..buf+len` is writable memory reserved for this read alone
        // until we send its result (see `Destination`).
        let n = unsafe {
            libc::pread(
                job.fd,
                job.buf.0.cast(),
                job.len as usize,
                job.offset as libc::off_t,
            )
        };
        let res = if n < 0 {
            -std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
        } else {
            // len <= 1 GiB, so the count fits in i32.
            n as i32
        };
        if results.send(ReadResult { id: job.id, res }).is_err() {
            break;
        }
    }
}

impl Executor for PreadExecutor {
    fn push(&mut self, read: &KernelRead) -> Result<(), IoError> {
        let fd = self
            .files
            .raw_fd(read.file)
            .ok_or(IoError::UnknownFile(read.file.0))?;
        let offset = i64::try_from(read.offset).map_err(|_| {
            IoError::InvalidArgument(format!("offset {} is beyond off_t", read.offset))
        })?;
        let job = Job {
            id: read.id,
            fd,
            offset: offset as u64,
            buf: Destination(read.buf),
            len: read.len,
        };
        self.jobs
            .as_ref()
            .and_then(|jobs| jobs.send(job).ok())
            .ok_or_else(|| IoError::Backend {
                context: "pread workers have stopped".into(),
                source: std::io::Error::from_raw_os_error(libc::EPIPE),
            })
    }

    fn cancel(&mut self, _id: u64) {
        // A blocking pread cannot be interrupted; its result is discarded.
    }

    fn wait(
        &mut self,
        commands: Option<&Receiver<Command>>,
        block: bool,
        done: &mut Vec<ReadResult>,
        got: &mut Vec<Command>,
    ) -> Result<(), IoError> {
        if block {
            match commands {
                Some(commands) => select! {
                    recv(commands) -> command => {
                        // A disconnected channel is noticed by the dispatcher.
                        if let Ok(command) = command {
                            got.push(command);
                        }
                    }
                    recv(self.results) -> result => {
                        if let Ok(result) = result {
                            done.push(result);
                        }
                    }
                },
                None => {
                    if let Ok(result) = self.results.recv() {
                        done.push(result);
                    }
                }
            }
        }
        done.extend(self.results.try_iter());
        Ok(())
    }

    fn finish(&mut self) {
        // Closing the job channel ends each worker after its current read.
        self.jobs = None;
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
