//! The reader thread's scheduler, shared by both backends.
//!
//! One thread owns all request state: two FIFO queues of kernel reads (demand
//! and prefetch), the table of requests in progress and the map of reads the
//! backend holds. It never blocks on a single read: it hands reads to an
//! [`Executor`] (the io_uring ring or the pread pool) up to the queue depth,
//! then waits for *any* completion or command, so results flow back to the
//! caller one request at a time as each finishes.
//!
//! Policy lives here, once, for both backends:
//! - **Priority**: a read is taken from the prefetch queue only when the
//!   demand queue is empty, and prefetch reads may hold at most
//!   `prefetch_limit` of the `queue_depth` places in the kernel, so a demand
//!   read that arrives later finds room at once.
//! - **Short reads**: the remainder is resubmitted at the head of its queue.
//!   Under `O_DIRECT` a transfer that is not a multiple of the alignment can
//!   only be the end of the file, so it is an error at once.
//! - **Errors**: `EINTR`/`EAGAIN` are retried (bounded); everything else
//!   fails the request with an [`IoError`] naming file, offset and length. A
//!   read that returns 0 before the wanted bytes is `UnexpectedEof`, never
//!   zeros.
//! - **Cancellation**: a queued read is dropped lazily (marked dead, skipped
//!   when popped); a read in the kernel is asked to stop (the backend may
//!   issue `IORING_OP_ASYNC_CANCEL`) and its completion, whatever it says, is
//!   discarded. Either way the request's slot is handed back only once the
//!   kernel can no longer write into it.
//! - **Promotion**: a prefetch request that compute now waits for is raised
//!   to demand priority: its queued reads move to the back of the demand
//!   queue (reads already in the kernel cannot be sped up and keep their
//!   place in the prefetch share), so it no longer waits behind speculation.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use crate::align::align_down;
use crate::arena::Slot;
use crate::counters::{self, Counters};
use crate::error::{IoError, ReadErrorKind};
use crate::fault::{FaultAction, FaultInjector};
use crate::files::{FileId, FileSet};
use crate::request::{Completion, Extent, PlannedRead, PlannedRequest, Priority, Ticket};

/// How many times in a row one read is retried after `EINTR`/`EAGAIN`.
const MAX_RETRIES: u32 = 64;

/// What the handles tell the reader thread.
pub(crate) enum Command {
    Submit(Vec<(PlannedRequest, Sender<Completion>)>),
    Cancel(Vec<Ticket>),
    Promote(Vec<Ticket>),
    Hold,
    Release,
    Shutdown,
}

/// One read handed to a backend.
#[derive(Debug)]
pub(crate) struct KernelRead {
    /// Identifies the read in its completion.
    pub id: u64,
    pub file: FileId,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: u32,
    /// `(arena id, slot index)` of the destination, for registered buffers.
    pub slot: (u64, usize),
}

/// A backend's report on one read: bytes transferred, or `-errno`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadResult {
    pub id: u64,
    pub res: i32,
}

/// What the dispatcher needs from a backend.
pub(crate) trait Executor {
    /// Queues one read. It reaches the kernel at the next [`wait`](Self::wait)
    /// at the latest.
    fn push(&mut self, read: &KernelRead) -> Result<(), IoError>;
    /// Best-effort request to stop a read already pushed. Its completion
    /// still arrives (with data or `-ECANCELED`).
    fn cancel(&mut self, id: u64);
    /// Submits what was pushed and collects finished reads into `done`. When
    /// `block`, waits until at least one read finishes or, when `commands`
    /// is given, a command may be waiting; commands the wait itself takes
    /// go into `got`.
    fn wait(
        &mut self,
        commands: Option<&Receiver<Command>>,
        block: bool,
        done: &mut Vec<ReadResult>,
        got: &mut Vec<Command>,
    ) -> Result<(), IoError>;
    /// Called once with nothing in flight, before the thread exits.
    fn finish(&mut self);
}

/// A kernel read waiting in a queue or in the kernel.
#[derive(Debug)]
struct QueuedRead {
    ticket: u64,
    priority: Priority,
    plan: PlannedRead,
    retries: u32,
    fault_short: bool,
}

enum Outcome {
    Running,
    Cancelled,
    Failed(IoError),
}

struct Pending {
    tag: u64,
    priority: Priority,
    slot: Slot,
    extents: Vec<Extent>,
    ranges: Vec<std::ops::Range<usize>>,
    reply: Sender<Completion>,
    /// Reads not yet finished (queued + in kernel).
    reads_left: usize,
    /// Reads in our queues (live ones only).
    reads_queued: usize,
    /// Ids of this request's reads the backend holds.
    in_kernel: Vec<u64>,
    outcome: Outcome,
    issue_seq: Option<u64>,
}

impl Pending {
    fn running(&self) -> bool {
        matches!(self.outcome, Outcome::Running)
    }
}

/// Settings of the scheduler.
pub(crate) struct DispatchConfig {
    pub queue_depth: usize,
    pub prefetch_limit: usize,
    pub faults: Option<FaultInjector>,
}

pub(crate) struct Dispatcher {
    files: Arc<FileSet>,
    counters: Arc<Counters>,
    config: DispatchConfig,
    demand: VecDeque<QueuedRead>,
    prefetch: VecDeque<QueuedRead>,
    requests: HashMap<u64, Pending>,
    in_kernel: HashMap<u64, QueuedRead>,
    prefetch_in_kernel: usize,
    /// Results made up by fault injection (or a failed push), delivered at
    /// the next turn of the loop without waiting.
    synthetic: Vec<ReadResult>,
    next_read_id: u64,
    next_issue_seq: u64,
    reads_issued: u64,
    holds: u32,
    shutting_down: bool,
}

impl Dispatcher {
    pub(crate) fn new(
        files: Arc<FileSet>,
        counters: Arc<Counters>,
        config: DispatchConfig,
    ) -> Self {
        Self {
            files,
            counters,
            config,
            demand: VecDeque::new(),
            prefetch: VecDeque::new(),
            requests: HashMap::new(),
            in_kernel: HashMap::new(),
            prefetch_in_kernel: 0,
            synthetic: Vec::new(),
            next_read_id: 0,
            next_issue_seq: 0,
            reads_issued: 0,
            holds: 0,
            shutting_down: false,
        }
    }

    /// The reader thread's loop; returns after `Shutdown` once every request
    /// has completed and nothing is left in the kernel.
    pub(crate) fn run<E: Executor>(mut self, mut exec: E, commands: Receiver<Command>) {
        let mut commands_open = true;
        let mut done = Vec::new();
        let mut got = Vec::new();
        let mut consecutive_failures = 0u32;
        loop {
            self.issue(&mut exec);
            if self.shutting_down && self.requests.is_empty() && self.in_kernel.is_empty() {
                break;
            }
            if self.in_kernel.is_empty() {
                // Nothing can complete: only a command can change anything.
                if !commands_open {
                    // Unreachable in practice (shutdown cancels everything),
                    // but never spin.
                    break;
                }
                match commands.recv() {
                    Ok(command) => self.handle(command, &mut exec),
                    Err(_) => {
                        commands_open = false;
                        self.begin_shutdown(&mut exec);
                    }
                }
            } else {
                let block = self.synthetic.is_empty();
                let source = commands_open.then_some(&commands);
                match exec.wait(source, block, &mut done, &mut got) {
                    Ok(()) => consecutive_failures = 0,
                    Err(error) => {
                        // Entering the ring failed for a reason other than
                        // an interrupt. Nothing here can free a buffer the
                        // kernel may still write into, so keep reaping (the
                        // completion queue is shared memory) and retry.
                        consecutive_failures += 1;
                        if consecutive_failures.is_power_of_two() {
                            tracing::error!(
                                "I/O backend wait failed ({consecutive_failures}x): {error}"
                            );
                        }
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
                for command in got.drain(..) {
                    self.handle(command, &mut exec);
                }
            }
            while commands_open {
                match commands.try_recv() {
                    Ok(command) => self.handle(command, &mut exec),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        commands_open = false;
                        self.begin_shutdown(&mut exec);
                    }
                }
            }
            done.append(&mut self.synthetic);
            for result in done.drain(..) {
                self.on_result(result, &mut exec);
            }
        }
        exec.finish();
    }

    fn handle<E: Executor>(&mut self, command: Command, exec: &mut E) {
        match command {
            Command::Submit(batch) => {
                for (request, reply) in batch {
                    self.enqueue(request, reply);
                }
            }
            Command::Cancel(tickets) => {
                for ticket in tickets {
                    self.stop(ticket.0, Outcome::Cancelled, exec);
                }
            }
            Command::Promote(tickets) => {
                for ticket in tickets {
                    self.promote(ticket.0);
                }
            }
            Command::Hold => self.holds += 1,
            Command::Release => self.holds = self.holds.saturating_sub(1),
            Command::Shutdown => self.begin_shutdown(exec),
        }
    }

    fn begin_shutdown<E: Executor>(&mut self, exec: &mut E) {
        self.shutting_down = true;
        self.holds = 0;
        let tickets: Vec<u64> = self.requests.keys().copied().collect();
        for ticket in tickets {
            self.stop(ticket, Outcome::Cancelled, exec);
        }
    }

    fn enqueue(&mut self, request: PlannedRequest, reply: Sender<Completion>) {
        let ticket = request.ticket.0;
        let count = request.reads.len();
        let queue = match request.priority {
            Priority::Demand => &mut self.demand,
            Priority::Prefetch => &mut self.prefetch,
        };
        for plan in request.reads {
            queue.push_back(QueuedRead {
                ticket,
                priority: request.priority,
                plan,
                retries: 0,
                fault_short: false,
            });
        }
        counters::add(&self.counters.reads_queued, count as u64);
        self.requests.insert(
            ticket,
            Pending {
                tag: request.tag,
                priority: request.priority,
                slot: request.slot,
                extents: request.extents,
                ranges: request.ranges,
                reply,
                reads_left: count,
                reads_queued: count,
                in_kernel: Vec::new(),
                outcome: Outcome::Running,
                issue_seq: None,
            },
        );
        if self.shutting_down {
            self.stop_without_backend(ticket);
        }
        self.maybe_complete(ticket);
    }

    /// Marks a request cancelled or failed: its queued reads die, its reads
    /// in the kernel are asked to stop, and it completes once none is left.
    fn stop<E: Executor>(&mut self, ticket: u64, outcome: Outcome, exec: &mut E) {
        let Some(request) = self.requests.get_mut(&ticket) else {
            return; // Already completed: the caller gets that completion.
        };
        if !request.running() {
            return;
        }
        request.outcome = outcome;
        counters::sub(&self.counters.reads_queued, request.reads_queued as u64);
        request.reads_queued = 0;
        for &id in &request.in_kernel {
            // Injected results never reached the backend; nothing to stop.
            if !self.synthetic.iter().any(|r| r.id == id) {
                exec.cancel(id);
            }
        }
        self.maybe_complete(ticket);
    }

    /// Raises a running prefetch request to demand priority; its queued
    /// reads go to the back of the demand queue. Unknown, finished, stopped
    /// or demand requests are left alone.
    fn promote(&mut self, ticket: u64) {
        let Some(request) = self.requests.get_mut(&ticket) else {
            return;
        };
        if !request.running() || request.priority == Priority::Demand {
            return;
        }
        request.priority = Priority::Demand;
        if request.reads_queued == 0 {
            return; // Everything is in the kernel already.
        }
        let mut moved = 0u64;
        let mut kept = VecDeque::with_capacity(self.prefetch.len());
        for mut read in self.prefetch.drain(..) {
            if read.ticket == ticket {
                read.priority = Priority::Demand;
                self.demand.push_back(read);
                moved += 1;
            } else {
                kept.push_back(read);
            }
        }
        self.prefetch = kept;
        counters::add(&self.counters.requests_promoted, 1);
        counters::add(&self.counters.reads_promoted, moved);
    }

    fn stop_without_backend(&mut self, ticket: u64) {
        if let Some(request) = self.requests.get_mut(&ticket) {
            request.outcome = Outcome::Cancelled;
            counters::sub(&self.counters.reads_queued, request.reads_queued as u64);
            request.reads_queued = 0;
        }
    }

    /// Next live read to issue: demand first; prefetch only when no demand
    /// read waits and prefetch holds fewer than its share of the kernel.
    fn pop_next(&mut self) -> Option<QueuedRead> {
        loop {
            let read = if let Some(read) = self.demand.pop_front() {
                read
            } else if self.prefetch_in_kernel < self.config.prefetch_limit {
                self.prefetch.pop_front()?
            } else {
                return None;
            };
            match self.requests.get(&read.ticket) {
                Some(request) if request.running() => return Some(read),
                // Dead: its request was cancelled or failed (and the queued
                // gauge already adjusted) or has completed.
                _ => continue,
            }
        }
    }

    fn issue<E: Executor>(&mut self, exec: &mut E) {
        if self.holds > 0 {
            return;
        }
        while self.in_kernel.len() < self.config.queue_depth {
            let Some(mut read) = self.pop_next() else {
                break;
            };
            let Some(request) = self.requests.get_mut(&read.ticket) else {
                continue;
            };
            let id = self.next_read_id;
            self.next_read_id += 1;
            self.reads_issued += 1;
            request.reads_queued -= 1;
            request.in_kernel.push(id);
            if request.issue_seq.is_none() {
                request.issue_seq = Some(self.next_issue_seq);
                self.next_issue_seq += 1;
            }
            counters::sub(&self.counters.reads_queued, 1);
            counters::add(&self.counters.reads_in_kernel, 1);
            if self.in_kernel.is_empty() {
                self.counters.busy_begins();
            }
            if read.priority == Priority::Prefetch {
                self.prefetch_in_kernel += 1;
            }
            let fault = self.config.faults.as_ref().and_then(|faults| {
                let path = self.files.path(read.plan.file);
                faults.decide(self.reads_issued, &path)
            });
            if fault.is_some() {
                counters::add(&self.counters.faults_injected, 1);
            }
            match fault {
                Some(FaultAction::Errno(errno)) => {
                    self.synthetic.push(ReadResult { id, res: -errno });
                }
                other => {
                    read.fault_short = other == Some(FaultAction::Short);
                    let slot = (request.slot.arena().id(), request.slot.index());
                    // SAFETY: planning checked slot_offset + len <= slot
                    // capacity, and the remainder of a short read only moves
                    // forward inside that range, so the pointer stays inside
                    // the slot the request owns.
                    let buf = unsafe { request.slot.as_mut_ptr().add(read.plan.slot_offset) };
                    let kernel_read = KernelRead {
                        id,
                        file: read.plan.file,
                        offset: read.plan.offset,
                        buf,
                        len: read.plan.len,
                        slot,
                    };
                    if let Err(error) = exec.push(&kernel_read) {
                        let errno = error.errno().unwrap_or(libc::EIO);
                        self.synthetic.push(ReadResult { id, res: -errno });
                    }
                }
            }
            self.in_kernel.insert(id, read);
        }
    }

    fn requeue_front(&mut self, mut read: QueuedRead) {
        if let Some(request) = self.requests.get_mut(&read.ticket) {
            request.reads_queued += 1;
            // A request promoted while this read was in the kernel.
            read.priority = request.priority;
        }
        counters::add(&self.counters.reads_queued, 1);
        match read.priority {
            Priority::Demand => self.demand.push_front(read),
            Priority::Prefetch => self.prefetch.push_front(read),
        }
    }

    fn on_result<E: Executor>(&mut self, result: ReadResult, exec: &mut E) {
        let Some(mut read) = self.in_kernel.remove(&result.id) else {
            return;
        };
        counters::sub(&self.counters.reads_in_kernel, 1);
        if self.in_kernel.is_empty() {
            self.counters.busy_ends();
        }
        if read.priority == Priority::Prefetch {
            self.prefetch_in_kernel -= 1;
        }
        let ticket = read.ticket;
        let Some(request) = self.requests.get_mut(&ticket) else {
            return;
        };
        request.in_kernel.retain(|&id| id != result.id);
        if !request.running() {
            // Cancelled or failed meanwhile: whatever the kernel did is
            // discarded (but the drive did read it: counted, so the totals
            // match the kernel's disk counters); the slot goes back once
            // nothing else is in flight.
            counters::add(&self.counters.reads_discarded, 1);
            if result.res > 0 {
                let got = result.res as u64;
                counters::add(&self.counters.bytes_read, got);
                counters::add(&self.counters.bytes_discarded, got);
                self.files
                    .drop_cached(read.plan.file, read.plan.offset, got);
            }
            self.maybe_complete(ticket);
            return;
        }
        let plan = &read.plan;
        if result.res < 0 {
            let errno = -result.res;
            if (errno == libc::EINTR || errno == libc::EAGAIN) && read.retries < MAX_RETRIES {
                read.retries += 1;
                counters::add(&self.counters.reads_retried, 1);
                self.requeue_front(read);
                return;
            }
            let extent = request.extents[plan.extent as usize];
            let error = IoError::Read {
                path: self.files.path(plan.file),
                offset: extent.offset,
                len: extent.len,
                kind: ReadErrorKind::from_errno(errno),
                errno,
            };
            self.stop(ticket, Outcome::Failed(error), exec);
            return;
        }
        let mut got = result.res as u64;
        if got > 0 {
            counters::add(&self.counters.bytes_read, got);
            self.files.drop_cached(plan.file, plan.offset, got);
        }
        let unit = u64::from(plan.unit);
        if read.fault_short {
            read.fault_short = false;
            let half = align_down(got / 2, unit);
            if half > 0 {
                got = half;
            }
        }
        if got >= u64::from(plan.need) {
            request.reads_left -= 1;
            self.maybe_complete(ticket);
        } else if got == 0 || !got.is_multiple_of(unit) {
            let extent = request.extents[plan.extent as usize];
            let file_len = self.files.current_len(plan.file).unwrap_or(0);
            let error = IoError::UnexpectedEof {
                path: self.files.path(plan.file),
                offset: extent.offset,
                len: extent.len,
                file_len,
            };
            self.stop(ticket, Outcome::Failed(error), exec);
        } else {
            // A genuine short read: ask again for the rest, first in line.
            let got32 = got as u32;
            read.plan.offset += got;
            read.plan.slot_offset += got as usize;
            read.plan.len -= got32;
            read.plan.need -= got32;
            read.retries = 0;
            counters::add(&self.counters.short_reads_resubmitted, 1);
            self.requeue_front(read);
        }
    }

    fn maybe_complete(&mut self, ticket: u64) {
        let Some(request) = self.requests.get(&ticket) else {
            return;
        };
        if !request.in_kernel.is_empty() || (request.running() && request.reads_left > 0) {
            return;
        }
        let Some(request) = self.requests.remove(&ticket) else {
            return;
        };
        let result = match request.outcome {
            Outcome::Running => {
                let wanted: u64 = request.extents.iter().map(|e| e.len).sum();
                counters::add(&self.counters.requests_completed, 1);
                counters::add(&self.counters.bytes_delivered, wanted);
                Ok(request.ranges)
            }
            Outcome::Cancelled => {
                counters::add(&self.counters.requests_cancelled, 1);
                Err(IoError::Cancelled)
            }
            Outcome::Failed(error) => {
                counters::add(&self.counters.requests_failed, 1);
                Err(error)
            }
        };
        // A caller that dropped its receiver no longer wants the result; the
        // slot then returns to its arena when the completion is dropped.
        let _ = request.reply.send(Completion {
            ticket: Ticket(ticket),
            tag: request.tag,
            priority: request.priority,
            slot: request.slot,
            result,
            issue_seq: request.issue_seq,
        });
    }
}
