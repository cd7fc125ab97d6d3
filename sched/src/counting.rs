//! Counters around an expert source: how many fetches and how many distinct
//! experts the forward passes asked for. With continuous batching one fetch
//! per layer serves every sequence in the step, so `experts_fetched` grows
//! slower than the routed uses (`rows × top_k` per MoE layer).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use colibri_model::experts::{ExpertSource, ExpertWeights};
use colibri_model::{ModelError, Result};

#[derive(Debug, Default)]
pub struct ExpertCounters {
    pub fetch_calls: AtomicU64,
    pub experts_fetched: AtomicU64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExpertCounts {
    pub fetch_calls: u64,
    pub experts_fetched: u64,
}

impl ExpertCounters {
    pub fn snapshot(&self) -> ExpertCounts {
        ExpertCounts {
            fetch_calls: self.fetch_calls.load(Ordering::Relaxed),
            experts_fetched: self.experts_fetched.load(Ordering::Relaxed),
        }
    }
}

pub struct CountingExperts {
    inner: Arc<dyn ExpertSource>,
    counters: Arc<ExpertCounters>,
}

impl CountingExperts {
    pub fn new(inner: Arc<dyn ExpertSource>) -> (CountingExperts, Arc<ExpertCounters>) {
        let counters = Arc::new(ExpertCounters::default());
        (
            CountingExperts {
                inner,
                counters: counters.clone(),
            },
            counters,
        )
    }
}

impl ExpertSource for CountingExperts {
    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        self.counters.fetch_calls.fetch_add(1, Ordering::Relaxed);
        self.counters
            .experts_fetched
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        self.inner.fetch(layer, ids, ready)
    }

    fn fetch_groups(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(colibri_model::experts::ExpertGroup) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        self.counters.fetch_calls.fetch_add(1, Ordering::Relaxed);
        self.counters
            .experts_fetched
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        self.inner.fetch_groups(layer, ids, ready)
    }

    fn prefetch(&self, layer: usize, ids: &[usize]) {
        self.inner.prefetch(layer, ids)
    }

    fn peek(&self, layer: usize, expert: usize) -> Option<Arc<ExpertWeights>> {
        self.inner.peek(layer, expert)
    }

    fn moe_input(&self, layer: usize, h: &[f32], logits: &[f32], rows: usize) {
        self.inner.moe_input(layer, h, logits, rows)
    }

    fn stats(&self) -> colibri_model::experts::SourceStats {
        self.inner.stats()
    }
}
