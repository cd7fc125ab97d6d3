//! [`Prefetcher`]: the RAM tier behind an [`ExpertSource`] that guesses the
//! coming layers' experts and reads them ahead.
//!
//! Per MoE layer L of a step:
//!
//! 1. `moe_input(L, h)`: the routers of the next MoE layer(s) are applied
//!    to L's input `h` (on the compute pool: a router is one small matrix);
//!    [`PrefetchLogic::observe`] turns that and the previous step's routing
//!    into the active predictor's guesses, which wait for step 2.
//! 2. `fetch(L, ids)`: L's real routing is known. Guesses made for L that
//!    were wrong are dropped ([`TierCache::cancel_prefetch`]: landed ones
//!    evicted, reads cancelled), which frees their slots before L's misses
//!    need them; then L's fetch runs with the guesses for later layers
//!    riding along ([`TierCache::fetch_with_prefetch`]): one submission,
//!    demand reads first, prefetch slots taken only after L's own experts
//!    are leased or have theirs. The reads of L+1's experts thus overlap L's
//!    expert compute.
//!
//! Each layer's router logits also teach an [`IdleFiller`], which fills the
//! cache's free room with the experts the routers favour most while no
//! forward pass runs ([`PrefetchOptions::fill_in_flight`] reads at a time).
//!
//! Nothing here changes what is computed: the tier delivers the same bytes
//! whether an expert was prefetched, cached or read on demand.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use colibri_model::config::RouterKind;
use colibri_model::experts::{ExpertGroup, ExpertSource, ExpertWeights, SourceStats};
use colibri_model::{Model, ModelError, Pool};

use super::fill::IdleFiller;
use super::logic::{PredictorScore, PrefetchLogic};
use super::router::RouterSet;
use super::throttle::PrefetchThrottle;
use super::trace::{TraceHeader, TraceRecord, TraceWriter};
use super::{PrefetchOptions, PrefetcherStats};
use crate::tier::TierCache;

/// What the last `moe_input` produced, for the fetch that follows it.
struct Observation {
    layer: usize,
    rows: usize,
    guesses: Vec<(usize, Vec<usize>)>,
    router_next: Option<Vec<usize>>,
    router_second: Option<Vec<usize>>,
}

struct Inner {
    logic: PrefetchLogic,
    observed: Option<Observation>,
    trace: Option<TraceWriter>,
    /// Pauses reading ahead while the reads go mostly unused (`None`:
    /// `COLIBRI_PREFETCH_THROTTLE=0`).
    throttle: Option<PrefetchThrottle>,
}

/// The tier with a router-aware prefetcher in front. See the module
/// documentation.
pub struct Prefetcher {
    tier: Arc<TierCache>,
    routers: RouterSet,
    pool: Arc<Pool>,
    inner: Mutex<Inner>,
    /// Time spent applying routers to guess.
    guess_ns: AtomicU64,
    guesses: AtomicU64,
    stale_dropped: AtomicU64,
    /// Fills the cache's free room while idle (`None`: filling off).
    filler: Option<IdleFiller>,
    router: RouterKind,
}

impl Prefetcher {
    /// A prefetcher over `tier` for `model`, applying routers on `pool`.
    /// Fails when `options.trace` cannot be created, or the model has no
    /// routed experts.
    pub fn new(
        tier: Arc<TierCache>,
        model: &Model,
        pool: Arc<Pool>,
        options: &PrefetchOptions,
    ) -> Result<Prefetcher, ModelError> {
        let routers = RouterSet::of(model).ok_or_else(|| {
            ModelError::Invalid("prefetch: the model has no routed experts".into())
        })?;
        let router = match &model.spec.moe {
            Some(moe) => moe.router.clone(),
            None => {
                return Err(ModelError::Invalid(
                    "prefetch: the model has no routed experts".into(),
                ));
            }
        };
        let filler = match options.fill_in_flight {
            0 => None,
            in_flight => {
                let per_pass = tier.layout().base.iter().flatten().count();
                let started = IdleFiller::start(Arc::clone(&tier), per_pass, in_flight);
                match started {
                    Ok(filler) => Some(filler),
                    Err(error) => {
                        tracing::warn!("not filling the expert cache while idle: {error}");
                        None
                    }
                }
            }
        };
        let moe_layers = routers.moe_layers();
        let evaluate = options.evaluate || options.trace.is_some();
        let logic = PrefetchLogic::new(
            routers.num_layers(),
            &moe_layers,
            options.predictor,
            evaluate,
        );
        let trace = match &options.trace {
            Some(path) => {
                let header = TraceHeader {
                    colibri_routing_trace: 1,
                    model: options.model_name.clone(),
                    num_layers: routers.num_layers(),
                    moe_layers,
                    experts_per_layer: tier.layout().experts_per_layer,
                    top_k: tier.layout().top_k,
                };
                let writer = TraceWriter::create(path, &header)
                    .map_err(|e| ModelError::Invalid(e.to_string()))?;
                tracing::info!("recording routing decisions to {}", path.display());
                Some(writer)
            }
            None => None,
        };
        Ok(Prefetcher {
            routers,
            pool,
            inner: Mutex::new(Inner {
                logic,
                observed: None,
                trace,
                throttle: std::env::var("COLIBRI_PREFETCH_THROTTLE")
                    .map_or(true, |v| v != "0")
                    .then(PrefetchThrottle::default),
            }),
            guess_ns: AtomicU64::new(0),
            guesses: AtomicU64::new(0),
            stale_dropped: AtomicU64::new(0),
            filler,
            router,
            tier,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Bookkeeping only; a panic in a caller's callback never happens
        // while it is held.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Learns layer `layer`'s router probabilities for filling.
    fn learn(&self, layer: usize, logits: &[f32], rows: usize) {
        let layout = self.tier.layout();
        if let (Some(filler), Some(first)) = (&self.filler, layout.entry(layer, 0)) {
            filler.learn(&self.router, first, layout.experts_per_layer, logits, rows);
        }
    }

    /// The tier behind.
    pub fn tier(&self) -> &Arc<TierCache> {
        &self.tier
    }

    /// What the prefetcher did and how well each tracked predictor guessed.
    pub fn stats(&self) -> PrefetcherStats {
        let inner = self.lock();
        PrefetcherStats {
            predictor: inner.logic.active(),
            steps: inner.logic.steps(),
            guess_calls: self.guesses.load(Ordering::Relaxed),
            guess_ns: self.guess_ns.load(Ordering::Relaxed),
            stale_dropped: self.stale_dropped.load(Ordering::Relaxed),
            paused_steps: inner
                .throttle
                .as_ref()
                .map_or(0, PrefetchThrottle::paused_steps),
            scores: inner.logic.scores(),
        }
    }

    /// Scores of the tracked predictors (all of them when evaluating).
    pub fn scores(&self) -> Vec<PredictorScore> {
        self.lock().logic.scores()
    }

    /// Writes the trace's buffered records.
    pub fn flush_trace(&self) {
        if let Some(trace) = self.lock().trace.as_mut()
            && let Err(error) = trace.flush()
        {
            tracing::warn!("{error}");
        }
    }

    fn guess(
        &self,
        target: Option<usize>,
        wanted: bool,
        h: &[f32],
        rows: usize,
    ) -> Option<Vec<usize>> {
        let target = target.filter(|_| wanted)?;
        let started = Instant::now();
        let guess = self.routers.guess(&self.pool, target, h, rows);
        self.guess_ns.fetch_add(
            u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.guesses.fetch_add(1, Ordering::Relaxed);
        match guess {
            Ok(g) => Some(g),
            Err(error) => {
                tracing::debug!("no guess for layer {target}: {error}");
                None
            }
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.flush_trace();
    }
}

impl ExpertSource for Prefetcher {
    fn moe_input(&self, layer: usize, h: &[f32], logits: &[f32], rows: usize) {
        // With every expert resident no guess can be read, so the router
        // products are skipped unless something records them (or scores
        // every predictor).
        let all_resident = self.tier.all_resident();
        if !all_resident {
            self.learn(layer, logits, rows);
        }
        let (t1, t2, want1, want2) = {
            let inner = self.lock();
            let logic = &inner.logic;
            // While the throttle pauses, the guesses would be dropped
            // unread: skip their router products too (a few % of a
            // decode's compute on two cores). `steps() + 1`: this layer may
            // open the next pass, whose number `observe` has yet to count.
            let paused = inner
                .throttle
                .as_ref()
                .is_some_and(|t| t.pauses(logic.steps() + 1));
            let skip = (all_resident || paused) && !logic.evaluates() && inner.trace.is_none();
            let t1 = logic.next_moe(layer);
            let t2 = t1.and_then(|t| logic.next_moe(t));
            let any = |f: fn(super::Predictor) -> bool| {
                super::Predictor::ALL
                    .into_iter()
                    .any(|p| logic.tracks(p) && f(p))
            };
            (
                t1,
                t2,
                !skip && any(super::Predictor::uses_next_router),
                !skip && any(super::Predictor::uses_second_router),
            )
        };
        // Outside the lock: the router products are the only real work.
        let router_next = self.guess(t1, want1, h, rows);
        let router_second = self.guess(t2, want2, h, rows);
        let mut inner = self.lock();
        let guesses = inner
            .logic
            .observe(layer, router_next.as_deref(), router_second.as_deref());
        inner.observed = Some(Observation {
            layer,
            rows,
            guesses,
            router_next,
            router_second,
        });
    }

    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let _busy = self.filler.as_ref().map(IdleFiller::fetching);
        let guesses = self.before_fetch(layer, ids);
        self.tier.fetch_with_prefetch(layer, ids, &guesses, ready)
    }

    fn fetch_groups(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(ExpertGroup) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let _busy = self.filler.as_ref().map(IdleFiller::fetching);
        let guesses = self.before_fetch(layer, ids);
        self.tier
            .fetch_groups_with_prefetch(layer, ids, &guesses, ready)
    }

    fn prefetch(&self, layer: usize, ids: &[usize]) {
        self.tier.prefetch(layer, ids);
    }

    fn peek(&self, layer: usize, expert: usize) -> Option<Arc<ExpertWeights>> {
        ExpertSource::peek(self.tier.as_ref(), layer, expert)
    }

    fn stats(&self) -> SourceStats {
        ExpertSource::stats(self.tier.as_ref())
    }
}

impl Prefetcher {
    /// What a fetch of `ids` of `layer` does first: learns the routing,
    /// records the trace, drops the predictions it made stale, and returns
    /// the predictions to read along with it.
    fn before_fetch(&self, layer: usize, ids: &[usize]) -> Vec<(usize, Vec<usize>)> {
        let (stale, guesses) = {
            let mut inner = self.lock();
            let stale = inner.logic.routed(layer, ids);
            let observed = inner.observed.take().filter(|o| o.layer == layer);
            let step = inner.logic.steps();
            if let Some(trace) = inner.trace.as_mut() {
                let (rows, router_next, router_second) = match &observed {
                    Some(o) => (o.rows, o.router_next.clone(), o.router_second.clone()),
                    None => (0, None, None),
                };
                let record = TraceRecord {
                    step,
                    layer,
                    rows,
                    experts: ids.to_vec(),
                    router_next,
                    router_second,
                };
                if let Err(error) = trace.record(&record) {
                    tracing::warn!("{error}; no longer recording");
                    inner.trace = None;
                }
            }
            let mut guesses = observed.map(|o| o.guesses).unwrap_or_default();
            if let Some(throttle) = inner.throttle.as_mut() {
                let t = self.tier.stats();
                if !throttle.admit(step, t.prefetch_reads, t.prefetch_used) {
                    guesses.clear();
                }
            }
            (stale, guesses)
        };
        if !stale.is_empty() {
            let dropped = self.tier.cancel_prefetch(layer, &stale);
            self.stale_dropped
                .fetch_add(dropped as u64, Ordering::Relaxed);
        }
        guesses
    }
}
