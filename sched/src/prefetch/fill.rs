//! Filling the RAM tier's free room while the engine is idle, with the
//! experts the routers have favoured so far ([`IdleFiller`],
//! [`FillScores`], [`TierCache::fill`]).
//!
//! A decode's misses on a cache that is not yet full are first uses: no
//! eviction order avoids them, and the next layer's router guesses them
//! poorly (docs/benchmarks.md, "The memory cgroups on llama.cpp's layout").
//! What does rank them is how much probability each router has given each
//! expert over every row routed so far, prompt included: an expert that
//! keeps coming close to the top-k is likely to be chosen soon.
//!
//! Reading them *during* a decode was measured and loses on a 2-vCPU host:
//! every read costs the compute pool CPU time, and fewer than half of the
//! filled experts were used (docs/benchmarks.md, "Filling the cache's free
//! room"). Between requests the CPU and the drive are idle, so the filler
//! waits until no forward pass has fetched an expert for [`IDLE_AFTER`],
//! then keeps a few reads of the most favoured absent experts in flight at
//! prefetch priority until the cache has no room left or a pass starts.
//!
//! Scores only decide what is read ahead; what a fetch delivers is the same
//! bytes whether an expert was filled, cached or read on demand.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use colibri_model::config::RouterKind;
use colibri_model::ops::{sigmoid, softmax_inplace};

use crate::tier::TierCache;

/// Fill reads kept outstanding unless `COLIBRI_FILL` says otherwise (`0`
/// turns filling off).
pub const DEFAULT_FILL_IN_FLIGHT: usize = 4;

/// How long no forward pass may have fetched an expert before the filler
/// reads (a decode fetches every millisecond or so; a request's prefill
/// layers take well under this on the CPUs colibri targets).
pub const IDLE_AFTER: Duration = Duration::from_millis(250);

/// How often the filler looks whether the engine is idle.
const POLL: Duration = Duration::from_millis(50);

/// Router probability summed per routed expert (one score per entry of the
/// tier's [`ExpertLayout`](crate::tier::ExpertLayout)).
#[derive(Clone, Debug)]
pub struct FillScores {
    scores: Vec<f32>,
    /// The `moe_input` rows learned from.
    rows: u64,
    /// Entries with a positive score, best first, as of the last ranking.
    ranked: Vec<u32>,
    /// How far the tier has walked `ranked`.
    cursor: usize,
    /// `learn` calls since the last ranking, and how many call for a new
    /// one (a forward pass's MoE layers: once per token in a decode).
    learned: usize,
    rank_every: usize,
}

impl FillScores {
    /// No scores yet for the `entries` routed experts of a layout; ranked
    /// anew after every `rank_every` layers learned (at least 1).
    pub fn new(entries: usize, rank_every: usize) -> FillScores {
        FillScores {
            scores: vec![0.0; entries],
            rows: 0,
            ranked: Vec::new(),
            cursor: 0,
            learned: 0,
            rank_every: rank_every.max(1),
        }
    }

    /// Adds the router probabilities of `rows` rows of one layer
    /// (`logits`: `rows × experts`, raw) to the scores of that layer's
    /// experts, entries `first..first + experts`: softmax for a softmax
    /// router, each expert's sigmoid for a sigmoid one (its selection bias
    /// left out: the bias steers balance, not preference). Entries out of
    /// range or logits of the wrong size teach nothing.
    pub fn learn(
        &mut self,
        router: &RouterKind,
        first: usize,
        experts: usize,
        logits: &[f32],
        rows: usize,
    ) {
        let Some(scores) = self.scores.get_mut(first..first.saturating_add(experts)) else {
            return;
        };
        if experts == 0 || logits.len() != rows * experts {
            return;
        }
        let mut p = vec![0.0f32; experts];
        for row in logits.chunks_exact(experts) {
            match router {
                RouterKind::Softmax { .. } => {
                    p.copy_from_slice(row);
                    softmax_inplace(&mut p);
                }
                RouterKind::SigmoidGrouped { .. } => {
                    for (pv, &l) in p.iter_mut().zip(row) {
                        *pv = sigmoid(l);
                    }
                }
            }
            for (s, &pv) in scores.iter_mut().zip(&p) {
                // A router's NaN teaches nothing.
                if pv.is_finite() {
                    *s += pv;
                }
            }
        }
        self.rows += rows as u64;
        self.learned += 1;
    }

    /// The entries with a positive score, best first (ties to the lower
    /// entry), as [`fill`](Self::fill) walks them.
    pub fn ranking(&self) -> Vec<u32> {
        let mut ranked: Vec<u32> = (0..self.scores.len() as u32)
            .filter(|&e| self.scores[e as usize] > 0.0)
            .collect();
        ranked.sort_by(|&a, &b| {
            self.scores[b as usize]
                .total_cmp(&self.scores[a as usize])
                .then(a.cmp(&b))
        });
        ranked
    }

    /// The scores, one per layout entry.
    pub fn scores(&self) -> &[f32] {
        &self.scores
    }

    /// Rows learned from so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Tops up the tier's fill reads to `in_flight` with the most favoured
    /// absent experts; how many reads it started. The ranking is redone
    /// once `rank_every` layers were learned since the last, and walked
    /// once between rankings, so a call costs little whether or not the
    /// cache has room.
    pub fn fill(&mut self, tier: &TierCache, in_flight: usize) -> usize {
        if self.rows == 0 || in_flight == 0 {
            return 0;
        }
        if self.learned >= self.rank_every || self.ranked.is_empty() {
            self.ranked = self.ranking();
            self.cursor = 0;
            self.learned = 0;
        }
        if self.cursor >= self.ranked.len() {
            return 0;
        }
        tier.fill(&self.ranked, &mut self.cursor, in_flight)
    }
}

/// What the filler thread and the forward pass share.
struct Shared {
    tier: Arc<TierCache>,
    scores: Mutex<FillScores>,
    /// When the filler was started; `last_fetch` counts from it.
    epoch: Instant,
    /// Nanoseconds after `epoch` when a fetch last began or ended.
    last_fetch: AtomicU64,
    /// Fetches running now.
    fetching: AtomicU64,
    in_flight: usize,
    stop: Mutex<bool>,
    wake: Condvar,
}

impl Shared {
    fn scores(&self) -> MutexGuard<'_, FillScores> {
        // Plain numbers; a panic elsewhere cannot leave them inconsistent.
        self.scores
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Whether no fetch has run for [`IDLE_AFTER`].
    fn idle(&self) -> bool {
        let since = self
            .now_ns()
            .saturating_sub(self.last_fetch.load(Ordering::Acquire));
        self.fetching.load(Ordering::Acquire) == 0 && Duration::from_nanos(since) >= IDLE_AFTER
    }

    fn run(&self) {
        let mut stop = self.stop.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            stop = match self.wake.wait_timeout(stop, POLL) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
            if *stop {
                return;
            }
            if self.idle() && !self.tier.all_resident() {
                self.scores().fill(&self.tier, self.in_flight);
            }
        }
    }
}

/// A thread that fills the tier's free room while no forward pass runs
/// (see the module documentation). Dropping it stops the thread.
pub struct IdleFiller {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl IdleFiller {
    /// Starts filling `tier` with `in_flight` reads at a time, ranking by
    /// scores of `tier.layout()`'s entries, redone every `per_pass` layers
    /// learned.
    pub fn start(
        tier: Arc<TierCache>,
        per_pass: usize,
        in_flight: usize,
    ) -> std::io::Result<IdleFiller> {
        let entries = tier.layout().len();
        let shared = Arc::new(Shared {
            tier,
            scores: Mutex::new(FillScores::new(entries, per_pass)),
            epoch: Instant::now(),
            last_fetch: AtomicU64::new(0),
            fetching: AtomicU64::new(0),
            in_flight,
            stop: Mutex::new(false),
            wake: Condvar::new(),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("colibri-fill".into())
                .spawn(move || shared.run())?
        };
        Ok(IdleFiller {
            shared,
            thread: Some(thread),
        })
    }

    /// Learns one layer's router logits (see [`FillScores::learn`]).
    pub fn learn(
        &self,
        router: &RouterKind,
        first: usize,
        experts: usize,
        logits: &[f32],
        rows: usize,
    ) {
        self.shared
            .scores()
            .learn(router, first, experts, logits, rows);
    }

    /// A fetch begins: the engine is busy until the guard drops.
    pub fn fetching(&self) -> FetchGuard<'_> {
        self.shared.fetching.fetch_add(1, Ordering::AcqRel);
        self.touch();
        FetchGuard { filler: self }
    }

    fn touch(&self) {
        self.shared
            .last_fetch
            .store(self.shared.now_ns(), Ordering::Release);
    }
}

/// A fetch in progress ([`IdleFiller::fetching`]).
pub struct FetchGuard<'a> {
    filler: &'a IdleFiller,
}

impl Drop for FetchGuard<'_> {
    fn drop(&mut self) {
        self.filler.touch();
        self.filler.shared.fetching.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for IdleFiller {
    fn drop(&mut self) {
        *self.shared.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Fill reads kept outstanding: `COLIBRI_FILL` (a count; `0` turns filling
/// off), else [`DEFAULT_FILL_IN_FLIGHT`].
pub(crate) fn fill_in_flight_setting() -> usize {
    match std::env::var("COLIBRI_FILL") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!("COLIBRI_FILL={v:?} is not a count; filling {DEFAULT_FILL_IN_FLIGHT}");
            DEFAULT_FILL_IN_FLIGHT
        }),
        Err(_) => DEFAULT_FILL_IN_FLIGHT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOFTMAX: RouterKind = RouterKind::Softmax {
        norm_topk_prob: true,
    };

    #[test]
    fn softmax_scores_add_up_per_row_and_land_on_their_layer() {
        // Two MoE layers of four experts: entries 0..4 and 4..8.
        let mut f = FillScores::new(8, 2);
        // Two rows of the second layer: expert 3 favoured in both.
        let logits = [0.0, 1.0, -1.0, 3.0, 0.5, 0.0, -2.0, 2.5];
        f.learn(&SOFTMAX, 4, 4, &logits, 2);
        let s = f.scores();
        assert!(
            s[..4].iter().all(|&v| v == 0.0),
            "first layer untouched: {s:?}"
        );
        let layer = &s[4..8];
        assert!((layer.iter().sum::<f32>() - 2.0).abs() < 1e-5, "{layer:?}");
        assert!(layer[2] < layer[1] && layer[1] < layer[3], "{layer:?}");
        assert!(layer[3] > 1.0, "{layer:?}");
        assert_eq!(f.rows(), 2);
        // Entries past the end or logits of the wrong size: nothing.
        let before = s.to_vec();
        f.learn(&SOFTMAX, 6, 4, &logits[..4], 1);
        f.learn(&SOFTMAX, usize::MAX, 4, &logits[..4], 1);
        f.learn(&SOFTMAX, 0, 4, &logits[..3], 1);
        f.learn(&SOFTMAX, 0, 4, &logits, 1);
        assert_eq!(f.scores(), &before[..]);
        assert_eq!(f.rows(), 2);
    }

    #[test]
    fn sigmoid_scores_are_each_experts_sigmoid() {
        let router = RouterKind::SigmoidGrouped {
            n_group: 2,
            topk_group: 1,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
        };
        let mut f = FillScores::new(4, 1);
        f.learn(&router, 0, 4, &[0.0, 2.0, -2.0, f32::NAN], 1);
        let s = f.scores();
        assert!((s[0] - 0.5).abs() < 1e-6);
        assert!((s[1] - sigmoid(2.0)).abs() < 1e-6);
        assert!((s[2] - sigmoid(-2.0)).abs() < 1e-6);
        assert_eq!(s[3], 0.0, "NaN teaches nothing");
        // Only positive scores are ranked, best first.
        assert_eq!(f.ranking(), vec![1, 0, 2]);
    }

    #[test]
    fn the_ranking_is_best_first_and_ties_go_to_the_lower_entry() {
        let mut f = FillScores::new(6, 1);
        // Entries 0..3 and 3..6: equal logits in the first layer.
        f.learn(&SOFTMAX, 0, 3, &[1.0, 1.0, 1.0], 1);
        f.learn(&SOFTMAX, 3, 3, &[0.0, 5.0, -30.0], 1);
        assert_eq!(f.ranking(), vec![4, 0, 1, 2, 3, 5]);
        f.learn(&SOFTMAX, 0, 3, &[0.0, 0.0, 9.0], 1);
        assert_eq!(f.ranking(), vec![2, 4, 0, 1, 3, 5]);
    }
}
