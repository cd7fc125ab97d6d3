//! Continuous batching. One scheduler thread owns every running sequence;
//! between forward passes, requests join and leave the batch. Each step
//! feeds one token per decoding sequence plus prompt chunks of new ones
//! (within a token budget), runs **one** forward pass for all of them — so
//! every routed expert is fetched once per layer for the whole batch — and
//! hands each sequence its logits.
//!
//! Results go back through an [`EventSink`] per request; a sink that
//! reports its receiver gone (client disconnected) cancels the sequence and
//! frees its KV cache within that step.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use colibri_model::SeqInput;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::Serialize;

use crate::engine::Engine;
use crate::sequence::{FinishReason, Sequence, TokenEvent};

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences decoding together at most.
    pub max_batch: usize,
    /// Requests allowed to wait for a batch place; more are refused.
    pub max_queue: usize,
    /// Tokens one step may feed (prompt chunks are cut to fit).
    pub step_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_batch: 16,
            max_queue: 64,
            step_tokens: 512,
        }
    }
}

/// What a request hears back.
#[derive(Clone, Debug)]
pub enum Event {
    Token(TokenEvent),
    Done(Usage),
    Error(String),
}

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish_reason: Option<FinishReason>,
}

/// Receives a request's events; returns false when nobody listens any more.
pub trait EventSink: Send {
    fn send(&mut self, ev: Event) -> bool;
}

impl<F: FnMut(Event) -> bool + Send> EventSink for F {
    fn send(&mut self, ev: Event) -> bool {
        self(ev)
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    QueueFull,
    ShuttingDown,
}

struct Job {
    seq: Sequence,
    sink: Box<dyn EventSink>,
}

struct Active {
    seq: Sequence,
    sink: Box<dyn EventSink>,
    completion: usize,
}

/// Counters the server exports.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    pub requests_total: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub requests_failed: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub generated_tokens_total: AtomicU64,
    pub steps_total: AtomicU64,
    /// Rows (tokens) fed through the model, summed over steps.
    pub rows_total: AtomicU64,
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    /// Seconds spent in forward passes, in microseconds.
    pub busy_us: AtomicU64,
}

pub struct Scheduler {
    tx: Mutex<Option<Sender<Job>>>,
    stats: Arc<SchedulerStats>,
    draining: Arc<AtomicBool>,
    /// Running + waiting, counted at submission so admission is exact.
    in_system: Arc<AtomicUsize>,
    config: SchedulerConfig,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Scheduler {
    pub fn start(engine: Arc<Engine>, config: SchedulerConfig) -> Scheduler {
        let (tx, rx) = crossbeam_channel::unbounded();
        let stats = Arc::new(SchedulerStats::default());
        let draining = Arc::new(AtomicBool::new(false));
        let in_system = Arc::new(AtomicUsize::new(0));
        let worker = Worker {
            engine,
            rx,
            config: config.clone(),
            stats: stats.clone(),
            draining: draining.clone(),
            in_system: in_system.clone(),
            waiting: VecDeque::new(),
            active: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("colibri-scheduler".into())
            .spawn(move || worker.run())
            .expect("spawning the scheduler thread");
        Scheduler {
            tx: Mutex::new(Some(tx)),
            stats,
            draining,
            in_system,
            config,
            thread: Mutex::new(Some(thread)),
        }
    }

    /// Queues a sequence. Refused when `max_batch + max_queue` requests are
    /// already in the system, or while shutting down.
    pub fn submit(&self, seq: Sequence, sink: Box<dyn EventSink>) -> Result<(), SubmitError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        let cap = self.config.max_batch + self.config.max_queue;
        let mut cur = self.in_system.load(Ordering::SeqCst);
        loop {
            if cur >= cap {
                return Err(SubmitError::QueueFull);
            }
            match self
                .in_system
                .compare_exchange(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        let sent = match self.tx.lock() {
            Ok(tx) => tx
                .as_ref()
                .map(|tx| tx.send(Job { seq, sink }).is_ok())
                .unwrap_or(false),
            Err(_) => false,
        };
        if !sent {
            self.in_system.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::ShuttingDown);
        }
        self.stats.requests_total.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    /// Requests running or waiting.
    pub fn in_system(&self) -> usize {
        self.in_system.load(Ordering::SeqCst)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Stops taking requests; running ones may finish until `grace` has
    /// passed, then they are cancelled. Returns when the thread has ended.
    pub fn shutdown(&self, grace: Duration) {
        self.draining.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + grace;
        while self.in_system.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        // Dropping the sender makes the worker cancel what is left and exit.
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        if let Some(t) = self.thread.lock().ok().and_then(|mut g| g.take()) {
            let _ = t.join();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shutdown(Duration::ZERO);
    }
}

struct Worker {
    engine: Arc<Engine>,
    rx: Receiver<Job>,
    config: SchedulerConfig,
    stats: Arc<SchedulerStats>,
    draining: Arc<AtomicBool>,
    in_system: Arc<AtomicUsize>,
    waiting: VecDeque<Job>,
    active: Vec<Active>,
}

impl Worker {
    fn run(mut self) {
        loop {
            // Take new jobs; block only when there is nothing to compute.
            let idle = self.active.is_empty() && self.waiting.is_empty();
            let first = if idle {
                match self.rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(j) => Some(j),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return self.cancel_all(),
                }
            } else {
                None
            };
            self.waiting.extend(first);
            loop {
                match self.rx.try_recv() {
                    Ok(j) => self.waiting.push_back(j),
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => return self.cancel_all(),
                }
            }
            while self.active.len() < self.config.max_batch {
                let Some(job) = self.waiting.pop_front() else {
                    break;
                };
                self.active.push(Active {
                    seq: job.seq,
                    sink: job.sink,
                    completion: 0,
                });
            }
            self.publish_gauges();
            self.step();
        }
    }

    fn publish_gauges(&self) {
        self.stats
            .waiting
            .store(self.waiting.len(), Ordering::Relaxed);
        self.stats
            .running
            .store(self.active.len(), Ordering::Relaxed);
    }

    /// One forward pass over every active sequence.
    fn step(&mut self) {
        if self.active.is_empty() {
            return;
        }
        // Token budget: decoding sequences (1 token) first, then prompt
        // chunks in arrival order; every step makes progress on at least
        // the oldest prefill.
        let mut budget = self.config.step_tokens.max(1);
        let decoding = self.active.iter().filter(|a| a.seq.pending() == 1).count();
        budget = budget.saturating_sub(decoding);
        let mut chunks = Vec::with_capacity(self.active.len());
        let mut any_prefill = false;
        for a in &self.active {
            let p = a.seq.pending();
            let c = if p <= 1 {
                p
            } else if budget > 0 || !any_prefill {
                let c = p.min(budget.max(1));
                budget = budget.saturating_sub(c);
                any_prefill = true;
                c
            } else {
                0
            };
            chunks.push(c);
        }
        let t0 = Instant::now();
        let engine = self.engine.clone();
        let mut fed = Vec::with_capacity(self.active.len());
        let mut batch: Vec<SeqInput<'_>> = Vec::with_capacity(self.active.len());
        let mut owners = Vec::new();
        for (i, (a, &c)) in self.active.iter_mut().zip(&chunks).enumerate() {
            if c == 0 {
                continue;
            }
            let (cache, tokens, logits) = a.seq.input(c);
            fed.push(tokens.len());
            owners.push(i);
            batch.push(SeqInput {
                cache,
                tokens,
                logits,
            });
        }
        let rows: usize = fed.iter().sum();
        let result = engine.forward(&mut batch);
        drop(batch);
        self.stats
            .busy_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.stats.steps_total.fetch_add(1, Ordering::Relaxed);
        self.stats
            .rows_total
            .fetch_add(rows as u64, Ordering::Relaxed);
        match result {
            Err(e) => {
                // A failed forward pass (an unreadable expert, say) fails
                // every sequence in it: their caches are now inconsistent.
                let msg = e.to_string();
                tracing::error!("forward pass failed: {msg}");
                for &i in &owners {
                    let a = &mut self.active[i];
                    a.sink.send(Event::Error(msg.clone()));
                    a.seq.cancel();
                    self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(mut outs) => {
                for ((&i, n), logits) in owners.iter().zip(&fed).zip(outs.iter_mut()) {
                    let a = &mut self.active[i];
                    match a.seq.accept(*n, logits) {
                        Ok(None) => {}
                        Ok(Some(ev)) => {
                            a.completion += 1;
                            self.stats
                                .generated_tokens_total
                                .fetch_add(1, Ordering::Relaxed);
                            if !a.sink.send(Event::Token(ev)) {
                                a.seq.cancel();
                                self.stats
                                    .requests_cancelled
                                    .fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(e) => {
                            a.sink.send(Event::Error(e.to_string()));
                            a.seq.cancel();
                            self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        }
        // Finished sequences leave (and their caches are freed) now; the
        // rest keep their arrival order, which prefill fairness relies on.
        let (done, running): (Vec<Active>, Vec<Active>) = std::mem::take(&mut self.active)
            .into_iter()
            .partition(|a| a.seq.finished().is_some());
        self.active = running;
        for mut a in done {
            self.stats
                .prompt_tokens_total
                .fetch_add(a.seq.prompt_len() as u64, Ordering::Relaxed);
            a.sink.send(Event::Done(Usage {
                prompt_tokens: a.seq.prompt_len(),
                completion_tokens: a.completion,
                finish_reason: a.seq.finished(),
            }));
            self.in_system.fetch_sub(1, Ordering::SeqCst);
        }
        self.publish_gauges();
        if self.draining.load(Ordering::SeqCst) {
            for mut j in self.waiting.drain(..) {
                j.sink
                    .send(Event::Error("the server is shutting down".into()));
                self.in_system.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    fn cancel_all(mut self) {
        for mut a in self.active.drain(..) {
            a.seq.cancel();
            a.sink.send(Event::Done(Usage {
                prompt_tokens: a.seq.prompt_len(),
                completion_tokens: a.completion,
                finish_reason: Some(FinishReason::Stop),
            }));
            self.in_system.fetch_sub(1, Ordering::SeqCst);
        }
        for mut j in self.waiting.drain(..) {
            j.sink
                .send(Event::Error("the server is shutting down".into()));
            self.in_system.fetch_sub(1, Ordering::SeqCst);
        }
        self.publish_gauges();
    }
}
