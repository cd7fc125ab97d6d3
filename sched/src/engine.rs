//! The engine: a loaded model, its expert source and the compute pool.

use std::path::Path;
use std::sync::Arc;

use colibri_model::{ExpertSource, Model, ModelError, Pool, SeqInput};

use crate::counting::{CountingExperts, ExpertCounters};
use crate::sequence::{Sequence, TokenEvent};
use crate::tier::{TierCache, TierOptions};

/// Prompt tokens fed per forward pass during prefill.
pub const PREFILL_CHUNK: usize = 256;

#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// Compute threads; 0 = one per available core.
    pub threads: usize,
    /// Context length cap; 0 = the model's `max_position_embeddings`.
    pub ctx: usize,
    /// Where routed experts live: RAM and pin budgets, I/O backend.
    pub tier: TierOptions,
}

pub struct Engine {
    pub model: Arc<Model>,
    /// The routed-expert source, wrapped in counters.
    pub experts: Arc<dyn ExpertSource>,
    pub expert_counters: Arc<ExpertCounters>,
    pub pool: Arc<Pool>,
    /// The RAM tier behind `experts`, when the model's experts stream from
    /// disk (its plan, counters and read latencies).
    pub tier: Option<Arc<TierCache>>,
    ctx: usize,
}

impl Engine {
    /// Loads a Hugging Face checkpoint directory; routed experts stream
    /// from disk through the RAM tier within `opts.tier`'s budgets.
    pub fn load(dir: &Path, opts: &EngineOptions) -> Result<Engine, ModelError> {
        let (model, src) = Model::load(dir)?;
        let source = crate::tier::open_source(&model, &src, dir, opts.ctx, &opts.tier)?;
        let mut engine = Engine::new(model, source.experts, opts)?;
        engine.tier = source.tier;
        Ok(engine)
    }

    pub fn new(
        model: Model,
        experts: Arc<dyn ExpertSource>,
        opts: &EngineOptions,
    ) -> Result<Engine, ModelError> {
        let max = model.spec.max_position_embeddings;
        let ctx = if opts.ctx == 0 {
            max
        } else {
            opts.ctx.min(max)
        };
        let (counting, expert_counters) = CountingExperts::new(experts);
        Ok(Engine {
            model: Arc::new(model),
            experts: Arc::new(counting),
            expert_counters,
            pool: Arc::new(Pool::new(opts.threads)?),
            tier: None,
            ctx,
        })
    }

    /// Positions one sequence may hold.
    pub fn context_len(&self) -> usize {
        self.ctx
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }
}

impl Engine {
    /// Runs one sequence to the end, calling `on_token` for every new
    /// token; `on_token` returns false to stop early.
    pub fn generate(
        &self,
        seq: &mut Sequence,
        mut on_token: impl FnMut(&TokenEvent) -> bool,
    ) -> Result<(), ModelError> {
        loop {
            let (cache, tokens, logits) = seq.input(PREFILL_CHUNK);
            if tokens.is_empty() {
                return Ok(());
            }
            let n = tokens.len();
            let mut out = self.model.forward(
                &self.pool,
                self.experts.as_ref(),
                &mut [SeqInput {
                    cache,
                    tokens,
                    logits,
                }],
            )?;
            if let Some(ev) = seq.accept(n, &mut out[0])? {
                let go_on = on_token(&ev);
                if ev.finish.is_some() {
                    return Ok(());
                }
                if !go_on {
                    seq.cancel();
                    return Ok(());
                }
            }
        }
    }
}
