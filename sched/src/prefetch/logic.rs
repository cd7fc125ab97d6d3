//! What to prefetch and what to cancel, with no I/O: the predictors, the
//! bookkeeping of one step's predictions, and their scores.
//!
//! [`PrefetchLogic`] is driven by two events per MoE layer, in this order:
//! [`observe`](PrefetchLogic::observe) when the layer's input exists (with
//! what the next MoE layers' routers make of it) and
//! [`routed`](PrefetchLogic::routed) when its real routing is known. The
//! live prefetcher ([`super::Prefetcher`]) and the trace replay
//! ([`super::replay`]) both drive this one type, so what is measured
//! offline is what runs.
//!
//! Every predictor is a set of experts per *target* layer, accumulated over
//! the step (the L+2 guess made at L and the L+1 guess made at L+1 add up).
//! When the target's routing is known the set is scored against it, and the
//! active predictor's wrong guesses are returned as stale.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

/// How the experts of the coming MoE layers are guessed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Predictor {
    /// The next MoE layer's router applied to this layer's input
    /// (DESIGN.md, "A decode step").
    #[default]
    Next,
    /// The same for the next two MoE layers: earlier reads, more guesses.
    NextTwo,
    /// The experts the next MoE layer used in the previous step (the
    /// previous token), at the same point.
    CrossToken,
    /// `Next` and `CrossToken` together.
    Union,
}

impl Predictor {
    /// Every predictor, in report order.
    pub const ALL: [Predictor; 4] = [
        Predictor::Next,
        Predictor::NextTwo,
        Predictor::CrossToken,
        Predictor::Union,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Predictor::Next => "next",
            Predictor::NextTwo => "next-two",
            Predictor::CrossToken => "cross-token",
            Predictor::Union => "union",
        }
    }

    /// Whether it needs the next MoE layer's router applied.
    pub fn uses_next_router(self) -> bool {
        !matches!(self, Predictor::CrossToken)
    }

    /// Whether it needs the MoE layer after next's router applied.
    pub fn uses_second_router(self) -> bool {
        matches!(self, Predictor::NextTwo)
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Predictor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Predictor {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Predictor::ALL
            .into_iter()
            .find(|p| p.name() == text)
            .ok_or_else(|| {
                format!(
                    "unknown predictor {text:?} (expected next, next-two, cross-token or union)"
                )
            })
    }
}

/// How well one predictor guessed, as sets (before any cache): of the
/// experts the predicted layers really used, how many were guessed, and
/// how many guesses there were.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PredictorScore {
    pub predictor: Predictor,
    /// Routed layers scored (every MoE layer but the first of each step,
    /// which no predictor in the step precedes).
    pub layers: u64,
    /// Experts those layers used (the union over the step's rows).
    pub actual: u64,
    /// Experts guessed for them.
    pub predicted: u64,
    /// Guesses that were used.
    pub correct: u64,
}

impl PredictorScore {
    /// Share of used experts that were guessed.
    pub fn recall(&self) -> Option<f64> {
        (self.actual > 0).then(|| self.correct as f64 / self.actual as f64)
    }

    /// Share of guesses that were used.
    pub fn precision(&self) -> Option<f64> {
        (self.predicted > 0).then(|| self.correct as f64 / self.predicted as f64)
    }

    /// Wrong guesses per right one: wasted reads per useful read if nothing
    /// were cached.
    pub fn wrong_per_right(&self) -> Option<f64> {
        (self.correct > 0).then(|| (self.predicted - self.correct) as f64 / self.correct as f64)
    }
}

/// Where in a step an event is: steps are told apart by the layer order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Observed,
    Routed,
}

/// One step's predictions, the previous step's routing, and the scores.
#[derive(Debug)]
pub struct PrefetchLogic {
    active: Predictor,
    /// Track the other predictors too (scores only).
    evaluate: bool,
    /// The next MoE layer after each layer.
    next_moe: Vec<Option<usize>>,
    first_moe: Option<usize>,
    last: Option<(usize, Phase)>,
    steps: u64,
    previous: Vec<Option<Vec<usize>>>,
    current: Vec<Option<Vec<usize>>>,
    /// Per predictor: target layer → experts guessed for it this step.
    made: [BTreeMap<usize, BTreeSet<usize>>; 4],
    scores: [PredictorScore; 4],
}

impl PrefetchLogic {
    /// For a model of `num_layers` layers whose MoE layers are `moe_layers`
    /// (ascending). `evaluate` scores every predictor, not only `active`.
    pub fn new(
        num_layers: usize,
        moe_layers: &[usize],
        active: Predictor,
        evaluate: bool,
    ) -> PrefetchLogic {
        let next_moe = (0..num_layers)
            .map(|l| moe_layers.iter().copied().find(|&m| m > l))
            .collect();
        PrefetchLogic {
            active,
            evaluate,
            next_moe,
            first_moe: moe_layers.first().copied(),
            last: None,
            steps: 0,
            previous: vec![None; num_layers],
            current: vec![None; num_layers],
            made: Default::default(),
            scores: Predictor::ALL.map(|predictor| PredictorScore {
                predictor,
                ..PredictorScore::default()
            }),
        }
    }

    /// The predictor whose guesses are read.
    pub fn active(&self) -> Predictor {
        self.active
    }

    /// Whether every predictor is scored.
    pub fn evaluates(&self) -> bool {
        self.evaluate
    }

    /// The first MoE layer after `layer`.
    pub fn next_moe(&self, layer: usize) -> Option<usize> {
        self.next_moe.get(layer).copied().flatten()
    }

    /// Steps seen so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Whether `predictor`'s guesses are needed (read or scored).
    pub fn tracks(&self, predictor: Predictor) -> bool {
        self.evaluate || predictor == self.active
    }

    fn enter(&mut self, layer: usize, phase: Phase) {
        if self.last.is_none_or(|last| (layer, phase) <= last) {
            self.steps += 1;
            self.previous = std::mem::replace(&mut self.current, vec![None; self.next_moe.len()]);
            // Guesses for layers a step never reached (an error mid-step).
            for made in &mut self.made {
                made.clear();
            }
        }
        self.last = Some((layer, phase));
    }

    /// MoE layer `layer`'s input exists. `next` is the next MoE layer's
    /// router applied to it, `second` the one after's (`None` when not
    /// computed). Returns the active predictor's guesses to prefetch,
    /// `(layer, experts)`, nearest layer first.
    pub fn observe(
        &mut self,
        layer: usize,
        next: Option<&[usize]>,
        second: Option<&[usize]>,
    ) -> Vec<(usize, Vec<usize>)> {
        self.enter(layer, Phase::Observed);
        let Some(t1) = self.next_moe(layer) else {
            return Vec::new();
        };
        let t2 = self.next_moe(t1);
        let history = self.previous.get(t1).cloned().flatten().unwrap_or_default();
        let mut out = Vec::new();
        for predictor in Predictor::ALL {
            if !self.tracks(predictor) {
                continue;
            }
            let mut guesses: Vec<(usize, Vec<usize>)> = Vec::new();
            match predictor {
                Predictor::Next => guesses.extend(next.map(|n| (t1, n.to_vec()))),
                Predictor::NextTwo => {
                    guesses.extend(next.map(|n| (t1, n.to_vec())));
                    if let (Some(t2), Some(s)) = (t2, second) {
                        guesses.push((t2, s.to_vec()));
                    }
                }
                Predictor::CrossToken => guesses.push((t1, history.clone())),
                Predictor::Union => {
                    let mut both: BTreeSet<usize> = history.iter().copied().collect();
                    both.extend(next.unwrap_or_default().iter().copied());
                    guesses.push((t1, both.into_iter().collect()));
                }
            }
            let made = &mut self.made[predictor.index()];
            for (target, experts) in &guesses {
                made.entry(*target)
                    .or_default()
                    .extend(experts.iter().copied());
            }
            if predictor == self.active {
                out = guesses;
            }
        }
        out.retain(|(_, experts)| !experts.is_empty());
        out
    }

    /// MoE layer `layer` was routed to `actual` (the union over the step's
    /// rows). Scores the guesses made for it and returns the active
    /// predictor's wrong ones: stale predictions to cancel.
    pub fn routed(&mut self, layer: usize, actual: &[usize]) -> Vec<usize> {
        self.enter(layer, Phase::Routed);
        let used: BTreeSet<usize> = actual.iter().copied().collect();
        let scored = self.first_moe != Some(layer);
        let mut stale = Vec::new();
        for predictor in Predictor::ALL {
            // A layer nothing was guessed for (its router product skipped
            // while the throttle paused, or every expert resident) is not
            // scored: the scores say how good the guesses that were made are.
            let made = self.made[predictor.index()].remove(&layer);
            let guessed = made.clone().unwrap_or_default();
            if scored && self.tracks(predictor) && made.is_some() {
                let score = &mut self.scores[predictor.index()];
                score.layers += 1;
                score.actual += used.len() as u64;
                score.predicted += guessed.len() as u64;
                score.correct += guessed.intersection(&used).count() as u64;
            }
            if predictor == self.active {
                stale = guessed.difference(&used).copied().collect();
            }
        }
        if let Some(slot) = self.current.get_mut(layer) {
            *slot = Some(used.into_iter().collect());
        }
        stale
    }

    /// Scores of the tracked predictors.
    pub fn scores(&self) -> Vec<PredictorScore> {
        Predictor::ALL
            .into_iter()
            .filter(|&p| self.tracks(p))
            .map(|p| self.scores[p.index()])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Layers 0..5, MoE at 1, 2, 4 (3 is dense).
    fn logic(active: Predictor) -> PrefetchLogic {
        PrefetchLogic::new(5, &[1, 2, 4], active, true)
    }

    #[test]
    fn next_moe_skips_dense_layers() {
        let l = logic(Predictor::Next);
        assert_eq!(l.next_moe(0), Some(1));
        assert_eq!(l.next_moe(2), Some(4));
        assert_eq!(l.next_moe(3), Some(4));
        assert_eq!(l.next_moe(4), None);
    }

    #[test]
    fn a_scripted_step_scores_every_predictor() {
        let mut l = logic(Predictor::Next);
        // Step 1. Layer 1: next = layer 2 guessed {3, 5}, second = layer 4
        // guessed {0}.
        assert_eq!(
            l.observe(1, Some(&[3, 5]), Some(&[0])),
            vec![(2, vec![3, 5])]
        );
        assert_eq!(l.routed(1, &[1, 2]), Vec::<usize>::new());
        l.observe(2, Some(&[0, 6]), None);
        // Layer 2 really used {3, 4}: 5 was wrong.
        assert_eq!(l.routed(2, &[3, 4]), vec![5]);
        assert!(l.observe(4, None, None).is_empty());
        // Layer 4 used {0, 7}: Next guessed {0, 6}.
        assert_eq!(l.routed(4, &[0, 7]), vec![6]);
        assert_eq!(l.steps(), 1);

        // Step 2: cross-token now has history.
        let got = l.observe(1, Some(&[4]), Some(&[7]));
        assert_eq!(got, vec![(2, vec![4])]);
        l.routed(1, &[1]);
        l.observe(2, Some(&[0]), None);
        l.routed(2, &[3, 4]);
        l.observe(4, None, None);
        l.routed(4, &[7]);
        assert_eq!(l.steps(), 2);

        let s: std::collections::HashMap<Predictor, PredictorScore> =
            l.scores().into_iter().map(|s| (s.predictor, s)).collect();
        // Scored layers: 2 and 4 in each step; actual = 2 + 2 + 2 + 1.
        let next = s[&Predictor::Next];
        assert_eq!((next.layers, next.actual), (4, 7));
        // Guesses: {3,5} {0,6} {4} {0} → right: 3, 0, 4 → 3 of 6.
        assert_eq!((next.predicted, next.correct), (6, 3));
        // Next-two adds layer 4's guesses from layer 1: {0} then {7}.
        let two = s[&Predictor::NextTwo];
        assert_eq!((two.predicted, two.correct), (7, 4));
        // Cross-token: nothing in step 1; step 2 guesses {3,4} for layer 2
        // (right) and {0,7} for layer 4 (7 right).
        let cross = s[&Predictor::CrossToken];
        assert_eq!((cross.predicted, cross.correct), (4, 3));
        // Union = next ∪ cross: step 1 as next (2 of 4 right); step 2
        // layer 2 {3,4} (2 right), layer 4 {0,7} (1 right).
        let union = s[&Predictor::Union];
        assert_eq!((union.predicted, union.correct), (8, 5));
        assert_eq!(union.recall(), Some(5.0 / 7.0));
        assert_eq!(union.wrong_per_right(), Some(3.0 / 5.0));
    }

    #[test]
    fn a_layer_nothing_was_guessed_for_is_not_scored() {
        let mut l = PrefetchLogic::new(5, &[1, 2, 4], Predictor::Next, false);
        // Step 1: the router products were skipped (a paused throttle).
        assert!(l.observe(1, None, None).is_empty());
        l.routed(1, &[1]);
        assert!(l.observe(2, None, None).is_empty());
        assert_eq!(l.routed(2, &[3, 4]), Vec::<usize>::new());
        l.observe(4, None, None);
        l.routed(4, &[0]);
        let next = l.scores()[0];
        assert_eq!((next.layers, next.actual, next.predicted), (0, 0, 0));
        // Step 2 guesses layer 2 only: only layer 2 is scored.
        l.observe(1, Some(&[3]), None);
        l.routed(1, &[1]);
        l.observe(2, None, None);
        l.routed(2, &[3, 4]);
        l.observe(4, None, None);
        l.routed(4, &[0]);
        let next = l.scores()[0];
        assert_eq!(next.predictor, Predictor::Next);
        assert_eq!(
            (next.layers, next.actual, next.predicted, next.correct),
            (1, 2, 1, 1)
        );
    }

    #[test]
    fn a_model_with_one_moe_layer_still_counts_steps() {
        let mut l = PrefetchLogic::new(2, &[1], Predictor::CrossToken, false);
        for step in 1..=3 {
            assert!(l.observe(1, None, None).is_empty());
            l.routed(1, &[0]);
            assert_eq!(l.steps(), step);
        }
        assert_eq!(l.scores().len(), 1, "only the active predictor");
    }

    #[test]
    fn predictor_names_round_trip() {
        for p in Predictor::ALL {
            assert_eq!(p.name().parse::<Predictor>(), Ok(p));
        }
        assert!("nope".parse::<Predictor>().is_err());
    }
}
