//! The compute threads: a persistent pool that runs one data-parallel job
//! at a time, built for the thousands of small matrix products of a decode
//! token (several per MoE expert, each tens of microseconds).
//!
//! A job is `tasks` independent calls `f(i)`. The calling thread takes part
//! and workers claim task indices from a shared counter, so which thread
//! runs a task never changes what it computes: results are the same for any
//! thread count. Between jobs a worker spins (then yields) for
//! [`SPIN`] before it parks on a condition variable, so back-to-back
//! products within a token cost no system call, while an idle pool (a
//! server waiting for requests, a decode blocked on the disk) does not
//! burn a core. A general work-stealing pool (rayon) wakes its sleeping
//! workers through the kernel on every product; measured on 2 cores, that
//! was a fifth of a warm decode token's time (docs/benchmarks.md).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker keeps polling for the next job before parking.
///
/// Longer than a decode ever leaves a worker between two jobs. On many
/// cores a one-token job's slowest task can end hundreds of microseconds
/// after the others, and the calling thread's serial work before the next
/// job adds tens more. A worker that parks there wakes late, which makes
/// the next job's tail longer still. On a 16-core Xeon, a 16-thread warm
/// decode of Qwen3-30B-A3B's geometry at 200 µs parked its workers
/// 1,400–23,000 times in 47 tokens and ran 19.0 / 39.0 / 29.2 tok/s; at
/// 2 ms they did not park, and it ran 40.5 / 43.1 / 35.5 tok/s in the same
/// rounds. Two threads on two cores: no change, warm or under a memory cap
/// (docs/benchmarks.md). An idle pool still parks within 2 ms.
pub const SPIN: Duration = Duration::from_millis(2);

thread_local! {
    /// What [`defer_drop`] was given on this thread, not dropped yet.
    static DEFERRED: std::cell::RefCell<Vec<Box<dyn std::any::Any>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Drops `value` later on this thread: while [`Pool::run`] on this thread
/// waits for other threads to finish a job's last tasks, else at the next
/// [`drop_deferred`]. For values whose drop is slow serial work between
/// jobs and whose lifetime does not matter to a few microseconds: a MoE
/// layer's expert leases (each release takes the RAM tier's lock and
/// reorders its eviction list) and its expert outputs, which a decode
/// released while every worker waited for the next job
/// (docs/benchmarks.md). Whoever defers must also call [`drop_deferred`]
/// where the values must be gone (a forward pass's end, before fetching
/// experts that need their slots).
pub fn defer_drop<T: 'static>(value: T) {
    DEFERRED.with_borrow_mut(|d| d.push(Box::new(value)));
}

/// Drops everything [`defer_drop`] holds for this thread, now.
pub fn drop_deferred() {
    // Taken out first: a drop that defers again cannot find the list
    // borrowed.
    while let Some(values) =
        DEFERRED.with_borrow_mut(|d| (!d.is_empty()).then(|| std::mem::take(d)))
    {
        drop(values);
    }
}

/// Calls [`drop_deferred`] when dropped: what a scope put off is gone
/// when it is left, by any path.
pub struct DeferredScope;

impl Drop for DeferredScope {
    fn drop(&mut self) {
        drop_deferred();
    }
}

/// [`Pool::times`]'s sums, in nanoseconds.
#[derive(Default)]
struct TimeCounters {
    jobs: AtomicU64,
    between_ns: AtomicU64,
    end_wait_ns: AtomicU64,
}

/// [`Pool::times`]: where the threads that publish jobs spent their time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolTimes {
    /// Jobs run on more than one thread.
    pub jobs: u64,
    /// From the end of one job to the start of the same thread's next, on
    /// the same pool, where that is shorter than [`SPIN`] (longer, the
    /// workers park anyway: the pool was idle, not waiting): the calling
    /// thread's serial work between a decode's jobs, with any wait for an
    /// expert read there.
    pub between: Duration,
    /// From the end of the calling thread's own tasks to the job's end:
    /// waiting for other threads' last tasks.
    pub end_wait: Duration,
}

impl PoolTimes {
    /// What was added since `earlier`.
    pub fn since(&self, earlier: &PoolTimes) -> PoolTimes {
        PoolTimes {
            jobs: self.jobs.saturating_sub(earlier.jobs),
            between: self.between.saturating_sub(earlier.between),
            end_wait: self.end_wait.saturating_sub(earlier.end_wait),
        }
    }
}

thread_local! {
    /// When this thread's last job ended, and on which pool (its shared
    /// state's address).
    static LAST_END: std::cell::Cell<Option<(usize, Instant)>> = const { std::cell::Cell::new(None) };
}

impl Pool {
    /// Adds a job's times to [`Pool::times`]: it began at `began`, and the
    /// calling thread's own tasks ended at `mine_done`.
    fn count_times(&self, began: Instant, mine_done: Instant) {
        let sh = &*self.shared;
        let c = &sh.times.0;
        let end = Instant::now();
        let me = sh as *const Shared as usize;
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        if let Some((pool, last)) = LAST_END.get()
            && pool == me
        {
            let gap = began.saturating_duration_since(last);
            if gap < SPIN {
                c.between_ns.fetch_add(nanos(gap), Ordering::Relaxed);
            }
        }
        LAST_END.set(Some((me, end)));
        c.end_wait_ns.fetch_add(
            nanos(end.saturating_duration_since(mine_done)),
            Ordering::Relaxed,
        );
        c.jobs.fetch_add(1, Ordering::Relaxed);
    }
}

/// Drops one deferred value; whether there was one.
fn drop_one_deferred() -> bool {
    match DEFERRED.with_borrow_mut(|d| d.pop()) {
        Some(v) => {
            drop(v);
            true
        }
        None => false,
    }
}

/// A job's function with its lifetime erased, so that [`Shared`] can hold
/// it between the publisher's call and its return.
type TaskFn = *const (dyn Fn(usize) + Sync + 'static);

/// Bits of the claim word's next-task index (the low bits); the job's task
/// count sits above them. A claim is one `fetch_add(1)` of the word, which
/// returns the job it claimed in (its task count) with the index, so a
/// thread that reaches the word late, even after the next job replaced
/// it, never takes an index for a job that is not the word's.
const INDEX_BITS: u32 = 24;

/// The most tasks a job's word holds: the index field keeps room above
/// it for the claims that find the job used up (at most one per thread
/// per job). [`Pool::run`] folds larger jobs into ranges.
const MAX_WORD_TASKS: usize = 1 << 22;

/// The claim word of a job of `tasks` tasks, none claimed.
fn claim_word(tasks: usize) -> u64 {
    debug_assert!(tasks <= MAX_WORD_TASKS);
    (tasks as u64) << INDEX_BITS
}

/// A claim word's task count and next index.
fn claim_parts(word: u64) -> (usize, usize) {
    let index = word & ((1 << INDEX_BITS) - 1);
    ((word >> INDEX_BITS) as usize, index as usize)
}

/// A value alone on its cache line (two lines: the adjacent-line
/// prefetcher pairs them).
#[repr(align(128))]
struct CacheLine<T>(T);

impl Shared {
    /// Claims and runs the current job's tasks until none is left, then
    /// counts them finished. Every claimed index is counted once, run or
    /// not: after a task panics (the first panic is kept for the
    /// publisher), the tasks still claimed are skipped.
    fn work(&self) {
        // A used-up job: leave without writing the line every claimer
        // writes (a late worker's claim would be its only write).
        let (tasks, next) = claim_parts(self.claim.0.load(Ordering::Relaxed));
        if next >= tasks {
            return;
        }
        let mut done = 0;
        let mut f: Option<TaskFn> = None;
        loop {
            let (tasks, i) = claim_parts(self.claim.0.fetch_add(1, Ordering::Acquire));
            if i >= tasks {
                break;
            }
            // SAFETY: a claim below the word's task count is a task of the
            // job now published. Its publisher wrote `f` before the word
            // (Release; this claim reads from it or a later claim, Acquire)
            // and writes it again only once every task is counted
            // finished, which this one is not yet. All this loop's claims
            // are of one job: the next cannot be published while this
            // thread holds tasks not yet counted.
            let f = *f.get_or_insert_with(|| unsafe { *self.f.0.get() });
            if !self.panicked.load(Ordering::Relaxed) {
                // SAFETY: as above, the job's function outlives its tasks
                // (its publisher returns only once all are counted).
                let run =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*f)(i) }));
                if let Err(payload) = run {
                    let mut first = self.panic.lock().unwrap_or_else(|p| p.into_inner());
                    first.get_or_insert(payload);
                    self.panicked.store(true, Ordering::Release);
                }
            }
            done += 1;
        }
        if done > 0 {
            self.finished.0.fetch_add(done, Ordering::Release);
        }
    }
}

struct Shared {
    /// Bumped once per published job; the words idle workers poll, apart
    /// from those a job's claims write.
    epoch: AtomicU64,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    /// Whether a task of the current job panicked: its later tasks are
    /// skipped.
    panicked: AtomicBool,
    /// The current job's task count and next index ([`claim_word`]).
    claim: CacheLine<AtomicU64>,
    /// The current job's tasks counted finished, added once per thread
    /// as it leaves the job: its publisher returns when all are.
    finished: CacheLine<AtomicUsize>,
    /// The current job's function ([`Shared::work`] says when it is
    /// read).
    f: CacheLine<UnsafeCell<TaskFn>>,
    /// The first panic of the current job's tasks, resumed on its
    /// publisher's thread.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Times a worker parked, ever.
    parks: AtomicU64,
    /// What [`Pool::times`] reports, summed over the pool's life, apart
    /// from the words the workers poll.
    times: CacheLine<TimeCounters>,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: every field but `f` is Send and Sync. `f` is written only by
// the thread publishing a job (holding `Pool::publish`) before it
// publishes the job's claim word, while no thread holds a claim (the
// previous job's tasks were all counted finished), and read only by
// threads holding a claim of that job ([`Shared::work`]); it points to a
// `Sync` function, which its publisher keeps alive until every task is
// counted finished.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// What [`Shared::f`] holds before the first job.
fn no_task(_: usize) {}

/// A pool of compute threads. Work is split by task (output rows, heads)
/// only, so the result never depends on how many threads there are.
pub struct Pool {
    shared: Arc<Shared>,
    /// One job at a time; a second caller (or a nested call) runs its job
    /// on its own thread, with the same results.
    publish: Mutex<()>,
    threads: usize,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    /// A pool of `threads` threads, the caller's included (0 = one per
    /// available core).
    pub fn new(threads: usize) -> Result<Self, crate::ModelError> {
        Pool::with_setup(threads, None)
    }

    /// A pool whose worker `i` (1 ≤ i < threads; the calling thread is 0)
    /// first runs `setup(i)` (to pin itself to a core, say).
    pub fn with_setup(
        threads: usize,
        setup: Option<Arc<dyn Fn(usize) + Send + Sync>>,
    ) -> Result<Self, crate::ModelError> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            claim: CacheLine(AtomicU64::new(claim_word(0))),
            finished: CacheLine(AtomicUsize::new(0)),
            f: CacheLine(UnsafeCell::new(
                &no_task as &(dyn Fn(usize) + Sync) as TaskFn,
            )),
            panic: Mutex::new(None),
            parks: AtomicU64::new(0),
            times: CacheLine(TimeCounters::default()),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut pool = Pool {
            shared: shared.clone(),
            publish: Mutex::new(()),
            threads,
            workers: Vec::with_capacity(threads.saturating_sub(1)),
        };
        for i in 1..threads {
            let shared = shared.clone();
            let setup = setup.clone();
            let handle = std::thread::Builder::new()
                .name(format!("colibri-cpu-{i}"))
                .spawn(move || {
                    if let Some(f) = setup {
                        f(i);
                    }
                    worker(&shared);
                })
                .map_err(|e| crate::ModelError::Invalid(format!("thread pool: {e}")))?;
            // Pushed at once so that Drop stops the ones already started if
            // a later spawn fails.
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Workers parked (or about to park) for want of a job.
    #[cfg(test)]
    fn parked(&self) -> usize {
        self.shared.sleepers.load(Ordering::SeqCst)
    }

    /// How many times a worker has parked since the pool started. A decode
    /// whose workers park between its jobs pays a wake-up for each
    /// (`bench-io` reports them per token).
    pub fn parks(&self) -> u64 {
        self.shared.parks.load(Ordering::Relaxed)
    }

    /// Where the threads that publish jobs spent their time, since the
    /// pool started: alone between jobs, and waiting at a job's end for
    /// other threads' last tasks. On many cores these, not the kernels,
    /// set a decode's pace (docs/benchmarks.md); `bench-io` reports them.
    pub fn times(&self) -> PoolTimes {
        let c = &self.shared.times.0;
        let ns = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        PoolTimes {
            jobs: c.jobs.load(Ordering::Relaxed),
            between: ns(&c.between_ns),
            end_wait: ns(&c.end_wait_ns),
        }
    }

    /// Runs `f(0..tasks)`, each index exactly once, on the pool's threads
    /// and the caller's; returns when all have run.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if tasks > MAX_WORD_TASKS {
            // More tasks than a claim word counts: ranges of them.
            let per = tasks.div_ceil(MAX_WORD_TASKS);
            return self.run(tasks.div_ceil(per), &|r| {
                (r * per..tasks.min((r + 1) * per)).for_each(f);
            });
        }
        let guard = match self.publish.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        if guard.is_none() || tasks == 1 || self.workers.is_empty() {
            (0..tasks).for_each(f);
            return;
        }
        let began = Instant::now();
        let sh = &*self.shared;
        // SAFETY: only the thread holding `publish` writes `f`, and no
        // thread holds a claim: the previous job returned once all its
        // tasks were counted finished, and a thread claims only from the
        // word stored below. `f` outlives every task of this job: this
        // call returns only once all of them are counted finished.
        unsafe {
            *sh.f.0.get() = std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), TaskFn>(f);
        }
        sh.finished.0.store(0, Ordering::Relaxed);
        sh.panicked.store(false, Ordering::Relaxed);
        sh.claim.0.store(claim_word(tasks), Ordering::Release);
        sh.epoch.fetch_add(1, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = sh.lock.lock().unwrap_or_else(|p| p.into_inner());
            sh.wake.notify_all();
        }
        sh.work();
        let mine_done = Instant::now();
        let mut spins = 0u32;
        while sh.finished.0.load(Ordering::Acquire) < tasks {
            // Waiting on the others' last tasks: the time for what this
            // thread put off.
            if drop_one_deferred() {
                continue;
            }
            // A worker holding the last task may have been preempted.
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        self.count_times(began, mine_done);
        // Every task is counted: no thread runs this job's function any
        // more. A task's panic goes on here, on the caller's thread, as
        // if the caller had run the task.
        let panic = sh.panic.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(guard);
        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
    }

    /// Splits `data` into chunks of `chunk` elements (the last may be
    /// shorter) and runs `f(chunk_index, chunk)` for each on the pool.
    pub fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let chunk = chunk.max(1);
        let len = data.len();
        let base = SendPtr(data.as_mut_ptr());
        self.run(len.div_ceil(chunk), &|i| {
            let start = i * chunk;
            let n = chunk.min(len - start);
            // SAFETY: `run` calls each index once, so the chunks
            // `[i·chunk, i·chunk + n)` handed out are disjoint and inside
            // `data`, which stays mutably borrowed until `run` returns.
            let part = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), n) };
            f(i, part);
        });
    }

    /// `len` zeros in chunks of `chunk`, each zeroed by the task that then
    /// runs `f(chunk_index, chunk)` on it: [`Pool::for_each_chunk_mut`]
    /// over a zeroed vector, the zeroing split over the threads (one
    /// thread zeroing a prompt's attention output left the others
    /// waiting).
    pub fn zeroed_chunks(
        &self,
        len: usize,
        chunk: usize,
        f: impl Fn(usize, &mut [f32]) + Sync,
    ) -> Vec<f32> {
        let mut v: Vec<f32> = Vec::with_capacity(len);
        self.for_each_chunk_mut(&mut v.spare_capacity_mut()[..len], chunk, |i, part| {
            for m in part.iter_mut() {
                m.write(0.0);
            }
            // SAFETY: every element of `part` was initialised just above;
            // `MaybeUninit<f32>` has `f32`'s layout.
            let part = unsafe {
                std::slice::from_raw_parts_mut(part.as_mut_ptr().cast::<f32>(), part.len())
            };
            f(i, part);
        });
        // SAFETY: `for_each_chunk_mut` ran every chunk of 0..len once (or
        // panicked, leaving this unreached), and each task initialised its
        // chunk; the capacity is `len`.
        unsafe { v.set_len(len) };
        v
    }

    /// `f(i)` for `i in 0..n` on the pool, collected in index order.
    pub fn map_collect<R: Send>(&self, n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
        let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
        self.for_each_chunk_mut(&mut out, 1, |i, slot| slot[0] = Some(f(i)));
        out.into_iter().flatten().collect()
    }
}

/// An output the pool's tasks write in disjoint parts, each task its own
/// (a product's rows for every token): written in parallel where the
/// tasks' results were copied in by the calling thread alone after the
/// job. It counts what was written, so that an output left uninitialised
/// until the tasks fill it ([`Parts::over_uninit`]) is taken as a whole
/// only when every element was.
pub(crate) struct Parts<'a> {
    ptr: *mut f32,
    len: usize,
    written: AtomicUsize,
    _out: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: tasks on several threads write through the pointer only with
// `put`, whose contract makes their ranges disjoint; `f32` is Send.
unsafe impl Sync for Parts<'_> {}

impl<'a> Parts<'a> {
    /// Over an initialised output.
    pub(crate) fn over(out: &'a mut [f32]) -> Parts<'a> {
        Parts {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            written: AtomicUsize::new(0),
            _out: std::marker::PhantomData,
        }
    }

    /// Over memory not yet initialised (a vector's spare capacity).
    pub(crate) fn over_uninit(out: &'a mut [std::mem::MaybeUninit<f32>]) -> Parts<'a> {
        Parts {
            ptr: out.as_mut_ptr().cast(),
            len: out.len(),
            written: AtomicUsize::new(0),
            _out: std::marker::PhantomData,
        }
    }

    /// `src`'s rows of `len` into the output, row `t` from `at + t ·
    /// stride` (a task's block of rows for every token), bounds checked
    /// and counted once: one atomic add per task on the line every thread
    /// writes, not one per token.
    ///
    /// # Safety
    /// No two calls on this output write overlapping ranges.
    pub(crate) unsafe fn put_rows(&self, at: usize, stride: usize, src: &[f32], len: usize) {
        if src.is_empty() {
            return;
        }
        assert!(
            len > 0 && len <= stride && src.len().is_multiple_of(len),
            "whole rows, each shorter than the stride"
        );
        let rows = src.len() / len;
        assert!(
            at <= self.len && (rows - 1) * stride + len <= self.len - at,
            "a part of the output"
        );
        for (t, row) in src.chunks_exact(len).enumerate() {
            // SAFETY: row t ends at `at + t · stride + len`, within the
            // output (checked above for the last, `len ≤ stride`); no other
            // call writes these ranges (caller), and the borrow of the
            // output keeps every reader out until `self` is dropped.
            unsafe {
                std::ptr::copy_nonoverlapping(row.as_ptr(), self.ptr.add(at + t * stride), len)
            };
        }
        self.written.fetch_add(src.len(), Ordering::Relaxed);
    }

    /// Whether every element was written (the parts being disjoint).
    pub(crate) fn complete(&self) -> bool {
        self.written.load(Ordering::Relaxed) == self.len
    }
}

/// A raw pointer the pool's tasks may share (each touches its own part).
struct SendPtr<T>(*mut T);

impl<T> SendPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}

// SAFETY: only used by `for_each_chunk_mut`, whose tasks write disjoint
// ranges of a slice of `T: Send`.
unsafe impl<T: Send> Sync for SendPtr<T> {}

fn worker(sh: &Shared) {
    let mut seen = 0u64;
    loop {
        // Wait for a new job: spin, then yield, then park.
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if sh.shutdown.load(Ordering::Acquire) {
                return;
            }
            if sh.epoch.load(Ordering::Acquire) != seen {
                break;
            }
            spins += 1;
            if !spins.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            if started.elapsed() < SPIN {
                std::thread::yield_now();
                continue;
            }
            let mut l = sh.lock.lock().unwrap_or_else(|p| p.into_inner());
            // Counted before the worker shows as parked: whoever sees it
            // in `sleepers` (a SeqCst read of this SeqCst add) sees this
            // park counted too.
            sh.parks.fetch_add(1, Ordering::Relaxed);
            sh.sleepers.fetch_add(1, Ordering::SeqCst);
            while sh.epoch.load(Ordering::SeqCst) == seen && !sh.shutdown.load(Ordering::SeqCst) {
                l = sh.wake.wait(l).unwrap_or_else(|p| p.into_inner());
            }
            sh.sleepers.fetch_sub(1, Ordering::SeqCst);
            break;
        }
        seen = sh.epoch.load(Ordering::Acquire);
        sh.work();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records, when dropped, the thread it was dropped on.
    struct Noted(Arc<Mutex<Vec<std::thread::ThreadId>>>);

    impl Drop for Noted {
        fn drop(&mut self) {
            let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
            d.push(std::thread::current().id());
        }
    }

    /// Runs a two-task job on `pool` (two threads) whose calling thread
    /// waits at the end: its task lasts until a worker has the other one,
    /// in which the worker sleeps for `sleep`. Whether a worker ran it.
    fn caller_waits_for_a_worker(pool: &Pool, sleep: Duration) -> bool {
        let me = std::thread::current().id();
        let worker_in = AtomicBool::new(false);
        pool.run(2, &|_| {
            if std::thread::current().id() == me {
                let give_up = Instant::now() + Duration::from_secs(10);
                while !worker_in.load(Ordering::SeqCst) && Instant::now() < give_up {
                    std::hint::spin_loop();
                }
            } else {
                worker_in.store(true, Ordering::SeqCst);
                std::thread::sleep(sleep);
            }
        });
        worker_in.load(Ordering::SeqCst)
    }

    /// The calling thread's gaps between jobs shorter than `SPIN` count as
    /// time between jobs, longer ones do not; a job whose worker holds
    /// the last task counts the caller's wait for it.
    #[test]
    fn times_count_gaps_between_jobs_and_waits_at_their_ends() {
        let pool = Pool::new(2).unwrap();
        let before = pool.times();
        assert!(caller_waits_for_a_worker(&pool, Duration::from_millis(30)));
        let t = pool.times().since(&before);
        assert_eq!(t.jobs, 1);
        assert!(t.end_wait >= Duration::from_millis(20), "{t:?}");
        // A gap of 0.5 ms, busy: counted unless the thread was preempted
        // past SPIN, so a few tries.
        let counted = (0..20).any(|_| {
            let before = pool.times();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_micros(500) {
                std::hint::spin_loop();
            }
            pool.run(2, &|_| {});
            let t = pool.times().since(&before);
            t.jobs == 1 && t.between >= Duration::from_micros(500) && t.between < SPIN
        });
        assert!(counted, "a short gap between jobs counts");
        // An idle pool's gap is not a decode's.
        let before = pool.times();
        std::thread::sleep(SPIN * 3);
        pool.run(2, &|_| {});
        assert_eq!(pool.times().since(&before).between, Duration::ZERO);
    }

    /// A deferred value is dropped on the thread that deferred it: while
    /// that thread waits for a worker's last task, or at `drop_deferred`,
    /// or when a `DeferredScope` ends; never by a job that finishes
    /// without waiting (one task runs on the caller).
    #[test]
    fn deferred_values_drop_on_their_thread_at_a_wait_or_a_flush() {
        let pool = Pool::new(2).unwrap();
        let dropped = Arc::new(Mutex::new(Vec::new()));
        let me = std::thread::current().id();
        defer_drop(Noted(dropped.clone()));
        // One task: no other thread, no wait.
        pool.run(1, &|_| {});
        assert!(dropped.lock().unwrap().is_empty());
        assert!(caller_waits_for_a_worker(&pool, Duration::from_millis(50)));
        assert_eq!(*dropped.lock().unwrap(), vec![me]);
        defer_drop(Noted(dropped.clone()));
        defer_drop(Noted(dropped.clone()));
        drop_deferred();
        assert_eq!(dropped.lock().unwrap().len(), 3);
        {
            let _scope = DeferredScope;
            defer_drop(Noted(dropped.clone()));
            assert_eq!(dropped.lock().unwrap().len(), 3);
        }
        assert_eq!(*dropped.lock().unwrap(), vec![me; 4]);
    }

    /// Tasks on several threads fill an uninitialised output in disjoint
    /// parts; it is complete exactly when every part was written, and a
    /// part past the end is refused.
    #[test]
    fn parts_fill_an_output_from_every_thread() {
        let pool = Pool::new(3).unwrap();
        let mut v: Vec<f32> = Vec::with_capacity(1000);
        {
            let parts = Parts::over_uninit(&mut v.spare_capacity_mut()[..1000]);
            // 10 tokens of 100 rows, token-major; task i computes rows
            // 10i..10i + 10 of every token.
            pool.run(10, &|i| {
                let src: Vec<f32> = (0..10)
                    .flat_map(|t| (0..10).map(move |j| (t * 100 + i * 10 + j) as f32))
                    .collect();
                // SAFETY: task i alone writes rows 10i..10i + 10.
                unsafe { parts.put_rows(i * 10, 100, &src, 10) };
            });
            assert!(parts.complete());
        }
        // SAFETY: all 1000 written (complete, disjoint).
        unsafe { v.set_len(1000) };
        assert!(v.iter().enumerate().all(|(i, x)| *x == i as f32));

        let mut w = vec![0.0f32; 8];
        {
            let parts = Parts::over(&mut w);
            // SAFETY: disjoint ranges.
            unsafe { parts.put_rows(0, 4, &[1.0; 4], 4) };
            assert!(!parts.complete(), "half written");
            let past = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: disjoint from the first part; refused as out of bounds.
                unsafe { parts.put_rows(6, 4, &[2.0; 4], 4) }
            }));
            assert!(past.is_err(), "a part past the end is refused");
            let last_past = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: refused: the second row would end at 9.
                unsafe { parts.put_rows(4, 3, &[3.0; 4], 2) }
            }));
            assert!(last_past.is_err(), "a last row past the end is refused");
        }
        assert_eq!(w, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    }

    /// Every chunk reaches its task zeroed, and the vector comes back
    /// whole, for any thread count and chunks that do not divide it.
    #[test]
    fn zeroed_chunks_are_zero_for_their_tasks() {
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            for (len, chunk) in [(0, 4), (1, 4), (10, 3), (1000, 7)] {
                let v = pool.zeroed_chunks(len, chunk, |i, part| {
                    assert!(part.iter().all(|x| x.to_bits() == 0), "zeroed");
                    for (j, x) in part.iter_mut().enumerate() {
                        *x += (i * chunk + j) as f32;
                    }
                });
                assert_eq!(v.len(), len);
                assert!(v.iter().enumerate().all(|(i, x)| *x == i as f32));
            }
        }
    }

    #[test]
    fn every_task_runs_once_for_any_thread_count() {
        for threads in [1, 2, 3, 5] {
            let pool = Pool::new(threads).unwrap();
            for tasks in [0usize, 1, 2, 7, 100, 1000] {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                pool.run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    /// Thousands of short jobs back to back on more threads than cores
    /// (so workers are preempted between reading a job's word and
    /// claiming from it): every task of every job runs exactly once, by
    /// its own job's function, and none runs after its job returned (each
    /// job's counts are checked again once all have run).
    #[test]
    fn back_to_back_jobs_run_each_task_once_with_its_own_function() {
        let pool = Pool::new(6).unwrap();
        let jobs = 3000;
        let counts: Vec<Vec<AtomicUsize>> = (0..jobs)
            .map(|j| (0..2 + j % 9).map(|_| AtomicUsize::new(0)).collect())
            .collect();
        for (j, hits) in counts.iter().enumerate() {
            pool.run(hits.len(), &|i| {
                // A little work of a size that varies by task.
                let mut x = (j * 31 + i) as u64;
                for _ in 0..(i % 4) * 200 {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                }
                std::hint::black_box(x);
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "job {j}"
            );
        }
        for (j, hits) in counts.iter().enumerate() {
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "job {j}, after all"
            );
        }
    }

    /// A job of more tasks than a claim word counts runs each once.
    #[test]
    fn a_job_past_the_claim_words_count_runs_every_task_once() {
        let pool = Pool::new(3).unwrap();
        let tasks = MAX_WORD_TASKS + 77;
        let hits: Vec<std::sync::atomic::AtomicU8> = (0..tasks)
            .map(|_| std::sync::atomic::AtomicU8::new(0))
            .collect();
        pool.run(tasks, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn chunks_and_collect_cover_the_data_in_order() {
        let pool = Pool::new(3).unwrap();
        let mut v: Vec<u64> = vec![0; 1001];
        pool.for_each_chunk_mut(&mut v, 10, |ci, part| {
            for (j, x) in part.iter_mut().enumerate() {
                *x = (ci * 10 + j) as u64 * 3 + 1;
            }
        });
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64 * 3 + 1));
        let squares = pool.map_collect(57, |i| i * i);
        assert_eq!(squares, (0..57).map(|i| i * i).collect::<Vec<_>>());
    }

    #[test]
    fn parked_workers_wake_and_concurrent_callers_both_finish() {
        let pool = Arc::new(Pool::new(3).unwrap());
        // An idle pool stops polling: both workers park after SPIN.
        let parked_by = Instant::now() + SPIN * 2 + Duration::from_secs(10);
        while pool.parked() < 2 {
            assert!(Instant::now() < parked_by, "idle workers never parked");
            std::thread::sleep(SPIN);
        }
        assert!(pool.parks() >= 2, "each park is counted");
        let sum = AtomicUsize::new(0);
        pool.run(64, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 64 * 63 / 2);
        // Two threads at once: one publishes, the other runs inline.
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    let mut total = 0usize;
                    for _ in 0..200 {
                        let s = AtomicUsize::new(0);
                        pool.run(33, &|i| {
                            s.fetch_add(i + 1, Ordering::Relaxed);
                        });
                        total += s.load(Ordering::Relaxed);
                    }
                    total
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 200 * 33 * 34 / 2);
        }
    }

    /// A task's panic reaches the caller with its own message, whichever
    /// thread ran the task, after every thread has left the job (whose
    /// state lives on the caller's stack), and the pool keeps working.
    #[test]
    fn a_panicking_task_panics_the_caller_and_leaves_the_pool_usable() {
        let pool = Pool::new(4).unwrap();
        for round in 0..40usize {
            let bad = round % 37;
            let ran = AtomicUsize::new(0);
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.run(37, &|i| {
                    if i == bad {
                        panic!("task {i} failed");
                    }
                    ran.fetch_add(1, Ordering::Relaxed);
                });
            }));
            let payload = caught.expect_err("the job panicked");
            let msg = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .unwrap_or_default();
            assert_eq!(msg, format!("task {bad} failed"));
            assert!(ran.load(Ordering::Relaxed) < 37);
            let sum = AtomicUsize::new(0);
            pool.run(50, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 50 * 49 / 2, "round {round}");
        }
    }

    #[test]
    fn a_task_may_use_the_pool_again() {
        let pool = Pool::new(2).unwrap();
        let total = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run(5, &|j| {
                total.fetch_add(j, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 10);
    }
}
