//! The router-aware prefetcher: guesses which routed experts the coming MoE
//! layers will use and reads them from disk while the current layer
//! computes (DESIGN.md, "A decode step").
//!
//! - [`logic`]: the predictors ([`Predictor`]) and one step's bookkeeping
//!   ([`PrefetchLogic`]): what to read ahead, what turned out stale, how
//!   well each predictor guessed ([`PredictorScore`]). No I/O.
//! - [`router`]: every MoE layer's router, applied ahead of time
//!   ([`RouterSet`]).
//! - [`source`]: the [`Prefetcher`], an [`colibri_model::ExpertSource`] over
//!   the RAM tier driven by the forward pass's
//!   [`moe_input`](colibri_model::ExpertSource::moe_input) hint.
//! - [`fill`]: fills the cache's free room while the engine is idle, with
//!   the experts the routers favour ([`IdleFiller`], [`FillScores`]).
//! - [`throttle`]: pauses reading ahead while the reads go mostly unused.
//! - [`trace`]: routing traces recorded from real runs.
//! - [`replay`]: traces replayed through the real tier and prefetch logic
//!   over a synthetic expert file, for recall / waste / hit rate offline.
//!
//! The tier's counters say what prefetch achieved in a run
//! ([`crate::tier::TierStats::prefetch_recall`], `prefetch_waste`); the
//! scores here say how good the guesses were as sets, for every predictor
//! at once when evaluating (one extra router product per layer).

pub mod fill;
pub mod logic;
pub mod replay;
pub mod router;
pub mod source;
pub mod throttle;
pub mod trace;

use std::path::PathBuf;

use serde::Serialize;

pub use self::fill::{FillScores, IdleFiller};
pub use self::logic::{Predictor, PredictorScore, PrefetchLogic};
pub use self::router::RouterSet;
pub use self::source::Prefetcher;
pub use self::trace::{Trace, TraceHeader, TraceRecord, TraceWriter};

/// Settings of the prefetcher (`--no-prefetch`, `--routing-trace`).
#[derive(Clone, Debug)]
pub struct PrefetchOptions {
    /// Read predicted experts ahead (default on). Off, the tier serves
    /// fetches alone.
    pub enabled: bool,
    /// Whose guesses are read.
    pub predictor: Predictor,
    /// Also score the other predictors (costs their router products).
    pub evaluate: bool,
    /// Record every routing decision and router guess to this file (implies
    /// `evaluate`).
    pub trace: Option<PathBuf>,
    /// Names the model in a trace's header.
    pub model_name: String,
    /// Reads kept in flight by the [`IdleFiller`], which fills the RAM
    /// cache's free room while no forward pass runs; 0 turns it off. The
    /// default is `COLIBRI_FILL` when set, else
    /// [`fill::DEFAULT_FILL_IN_FLIGHT`].
    pub fill_in_flight: usize,
}

impl Default for PrefetchOptions {
    fn default() -> Self {
        PrefetchOptions {
            enabled: true,
            predictor: Predictor::default(),
            evaluate: false,
            trace: None,
            model_name: String::new(),
            fill_in_flight: fill::fill_in_flight_setting(),
        }
    }
}

/// What a prefetcher did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PrefetcherStats {
    /// The predictor whose guesses were read.
    pub predictor: Predictor,
    /// Forward passes seen.
    pub steps: u64,
    /// Router products applied to guess, and the time they took.
    pub guess_calls: u64,
    pub guess_ns: u64,
    /// Stale predictions dropped (landed ones evicted, reads cancelled).
    pub stale_dropped: u64,
    /// Forward passes that read nothing ahead because recent reads ahead
    /// went mostly unused ([`throttle`]).
    pub paused_steps: u64,
    /// Set scores of every tracked predictor.
    pub scores: Vec<PredictorScore>,
}
