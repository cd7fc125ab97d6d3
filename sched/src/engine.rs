//! The engine: a loaded model, its expert source and the compute pool.
//!
//! When routed experts stream from disk, the source is the RAM tier with
//! the router-aware prefetcher in front (unless prefetch is off): the
//! prefetcher gets the model's routers and the compute pool here, at
//! construction.

use std::path::Path;
use std::sync::Arc;

use colibri_model::{ExpertSource, Model, ModelError, Pool, SeqInput};

use colibri_io::topology::{Placement, Topology, pin_current_thread};

use crate::counting::{CountingExperts, ExpertCounters};
use crate::prefetch::{PrefetchOptions, Prefetcher};
use crate::sequence::{Sequence, TokenEvent};
use crate::tier::{TierCache, TierOptions};

/// Prompt tokens fed per forward pass during prefill.
pub const PREFILL_CHUNK: usize = 256;

/// MoE layers' worth of experts (`top_k` each) the tier keeps staging
/// slots for when prefetching: the next layer's guesses and the one
/// after's (the `next-two` and `union` predictors guess up to twice
/// `top_k` for one step).
pub const PREFETCH_LAYERS: usize = 2;

#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// Compute threads; 0 = one per physical core (of the NUMA node that
    /// holds the weights, on multi-node hosts).
    pub threads: usize,
    /// Context length cap; 0 = the model's `max_position_embeddings`.
    pub ctx: usize,
    /// Where routed experts live: RAM and pin budgets, I/O backend.
    pub tier: TierOptions,
    /// Reading the coming layers' experts ahead.
    pub prefetch: PrefetchOptions,
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
    /// Where the compute threads run.
    pub placement: Placement,
    /// The prefetcher in front of the tier, when prefetch is on.
    pub prefetcher: Option<Arc<Prefetcher>>,
    /// The GPU tier, when one is attached ([`crate::gpu::attach`]): then
    /// [`Engine::forward`] runs there.
    pub gpu: Option<Arc<crate::gpu::GpuTier>>,
    ctx: usize,
}

/// A compute pool placed on the machine: one thread per physical core near
/// the weights' memory unless `threads` says otherwise, each pinned to its
/// core where that helps (several NUMA nodes, or SMT siblings to avoid).
fn placed_pool(threads: usize, drive: Option<&Path>) -> Result<(Pool, Placement), ModelError> {
    let topo = Topology::detect();
    let drive_node = drive.and_then(|p| topo.drive_node(p));
    let placement = topo.placement(drive_node, threads);
    let logical = topo.cpus.len();
    let cpus = placement.compute_cpus.clone();
    let pin = (placement.multi_node || cpus.len() < logical)
        && std::env::var_os("COLIBRI_NO_PIN").is_none_or(|v| v == "0");
    let n = if threads == 0 {
        cpus.len().max(1)
    } else {
        threads
    };
    let setup: Option<Arc<dyn Fn(usize) + Send + Sync>> = if pin && !cpus.is_empty() {
        Some(Arc::new(move |i: usize| {
            if let Err(e) = pin_current_thread(&[cpus[i % cpus.len()]]) {
                tracing::debug!("could not pin compute thread {i}: {e}");
            }
        }))
    } else {
        None
    };
    Ok((Pool::with_setup(n, setup)?, placement))
}

/// Lays the dense matrices out for the CPU's kernels where they run
/// ([`colibri_model::weights::DenseWeights::set_cpu_layouts`]: Q4_0 tiles,
/// quads of 16-bit rows). The copies are anonymous memory, which a memory
/// cap cannot reclaim the way it reclaims the page cache's pages of the
/// file: with less than 4× their size usable, they stay in the page cache
/// as stored.
fn dense_cpu_layouts(model: &mut Model) -> Result<(), ModelError> {
    let bytes = model.weights.cpu_layout_bytes();
    if bytes == 0 {
        return Ok(());
    }
    let usable = crate::tier::MemoryLimits::probe().usable();
    if usable.is_some_and(|u| u < 4 * bytes) {
        tracing::info!(
            "dense weights left as stored: {bytes} bytes against {} usable",
            usable.unwrap_or(0)
        );
        return Ok(());
    }
    let t = std::time::Instant::now();
    let done = model.weights.set_cpu_layouts(true)?;
    tracing::debug!(
        "laid out {done} bytes of dense weights for the CPU in {:.2}s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

impl Engine {
    /// Loads a Hugging Face checkpoint directory; routed experts stream
    /// from disk through the RAM tier within `opts.tier`'s budgets.
    pub fn load(dir: &Path, opts: &EngineOptions) -> Result<Engine, ModelError> {
        let (mut model, src) = Model::load(dir)?;
        if opts.tier.tile_q4_0 {
            dense_cpu_layouts(&mut model)?;
        }
        let mut tier_options = opts.tier.clone();
        if opts.prefetch.enabled {
            tier_options.prefetch_layers = PREFETCH_LAYERS;
        }
        let source = crate::tier::open_source(&model, &src, dir, opts.ctx, &tier_options)?;
        let (pool, placement) = placed_pool(opts.threads, Some(dir))?;
        let pool = Arc::new(pool);
        let prefetcher = match &source.tier {
            Some(tier) if opts.prefetch.enabled => {
                let mut options = opts.prefetch.clone();
                if options.model_name.is_empty() {
                    options.model_name = dir.display().to_string();
                }
                Some(Arc::new(Prefetcher::new(
                    Arc::clone(tier),
                    &model,
                    Arc::clone(&pool),
                    &options,
                )?))
            }
            _ => None,
        };
        let experts: Arc<dyn ExpertSource> = match &prefetcher {
            Some(p) => p.clone(),
            None => source.experts,
        };
        let mut engine = Engine::with_pool(model, experts, pool, placement, opts)?;
        engine.tier = source.tier;
        engine.prefetcher = prefetcher;
        Ok(engine)
    }

    pub fn new(
        model: Model,
        experts: Arc<dyn ExpertSource>,
        opts: &EngineOptions,
    ) -> Result<Engine, ModelError> {
        let (pool, placement) = placed_pool(opts.threads, None)?;
        Engine::with_pool(model, experts, Arc::new(pool), placement, opts)
    }

    /// An engine computing on `pool` (which a prefetcher in `experts` may
    /// share), placed as `placement` says.
    pub fn with_pool(
        model: Model,
        experts: Arc<dyn ExpertSource>,
        pool: Arc<Pool>,
        placement: Placement,
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
            pool,
            tier: None,
            placement,
            prefetcher: None,
            gpu: None,
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

    /// One forward pass over a batch, on the GPU tier when one is attached,
    /// else on the CPU tier.
    pub fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        match &self.gpu {
            Some(gpu) => gpu.forward(&self.model, self.experts.as_ref(), batch),
            None => self.model.forward(&self.pool, self.experts.as_ref(), batch),
        }
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
            let mut out = self.forward(&mut [SeqInput {
                cache,
                tokens,
                logits,
            }])?;
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
