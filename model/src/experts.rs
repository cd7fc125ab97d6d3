//! Routed experts and where they come from.
//!
//! The forward pass asks an [`ExpertSource`] for the experts a layer's
//! router chose and computes each one as soon as it is available. Sources
//! decide placement: [`ResidentExperts`] maps every expert of a checkpoint;
//! the engine's tiered sources (RAM cache, NVMe reads) implement the same
//! trait, so placement never changes what is computed.

use std::sync::Arc;

use crate::config::ModelSpec;
use crate::error::{ModelError, Result};
use crate::source::Checkpoint;
use crate::weights::{MlpWeights, TensorNames};

/// The weights of one routed expert.
pub type ExpertWeights = MlpWeights;

/// What a source has done so far (for metrics and benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SourceStats {
    /// Experts found in RAM / not found there.
    pub ram_hits: u64,
    pub ram_misses: u64,
    /// Experts found in VRAM / not found there (GPU tier).
    pub vram_hits: u64,
    pub vram_misses: u64,
    /// Bytes of experts read from disk.
    pub disk_bytes_read: u64,
    /// Demand misses that a prefetch had already covered or started, and
    /// those it had not.
    pub prefetch_covered_misses: u64,
    pub uncovered_misses: u64,
}

/// Experts delivered together: `(expert, weights)` pairs.
pub type ExpertGroup = Vec<(usize, Arc<ExpertWeights>)>;

/// Hands out routed experts.
pub trait ExpertSource: Send + Sync {
    /// Calls `ready(expert, weights)` exactly once for every id in `ids`
    /// (distinct, ascending), in the order they become available. Returning
    /// an error from `ready` stops the fetch and is passed through.
    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<()>,
    ) -> Result<()>;

    /// [`fetch`](Self::fetch), delivering the experts in groups of those
    /// available at the same time (a tier hands over all its hits at once,
    /// then each completed read with any that completed meanwhile), so the
    /// caller can compute a group in one pass of its thread pool. Every id
    /// of `ids` is in exactly one group. The default delivers one expert
    /// per group.
    fn fetch_groups(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(ExpertGroup) -> Result<()>,
    ) -> Result<()> {
        self.fetch(layer, ids, &mut |e, w| ready(vec![(e, w)]))
    }

    /// A hint that `ids` of `layer` will probably be needed soon. Sources
    /// that read from disk start reading; others ignore it.
    fn prefetch(&self, _layer: usize, _ids: &[usize]) {}

    /// The input of MoE layer `layer` exists: `h` holds the normed hidden
    /// state of each of the step's `rows` rows (`rows × hidden`) and
    /// `logits` the layer's router logits for them (`rows × experts`, before
    /// any softmax, sigmoid or selection bias). Called by the forward pass
    /// just before it fetches that layer's experts, so a source that
    /// predicts later layers' experts from `h` (by applying their routers)
    /// can start reading them while this layer computes, and one that
    /// learns which experts the routers favour can read those ahead. A hint
    /// only: it must not change what any fetch delivers. The default
    /// ignores it.
    fn moe_input(&self, _layer: usize, _h: &[f32], _logits: &[f32], _rows: usize) {}

    /// Expert `expert` of `layer` if the source holds it in pinned memory
    /// right now, without reading, waiting or counting a request: for a
    /// consumer that copies experts ahead of their use (the GPU tier's
    /// next-layer staging). Holding the returned weights keeps them in
    /// memory. The default (sources that would have to read or that hand
    /// out pageable memory) says `None`.
    fn peek(&self, _layer: usize, _expert: usize) -> Option<Arc<ExpertWeights>> {
        None
    }

    /// Counters of what the source has done.
    fn stats(&self) -> SourceStats {
        SourceStats::default()
    }
}

/// [`ExpertSource::fetch_groups`] for a source that has every expert at
/// hand (memory-mapped): all of `ids` in one group.
pub fn one_group(
    source: &(impl ExpertSource + ?Sized),
    layer: usize,
    ids: &[usize],
    ready: &mut dyn FnMut(ExpertGroup) -> Result<()>,
) -> Result<()> {
    let mut group = Vec::with_capacity(ids.len());
    source.fetch(layer, ids, &mut |e, w| {
        group.push((e, w));
        Ok(())
    })?;
    ready(group)
}

/// Loads expert `e` of layer `layer` from a checkpoint, in either the Hub's
/// per-expert layout or transformers 5's fused per-layer layout.
pub fn load_expert(
    spec: &ModelSpec,
    ck: &Checkpoint,
    layer: usize,
    e: usize,
) -> Result<ExpertWeights> {
    let moe = spec
        .moe
        .as_ref()
        .ok_or_else(|| ModelError::Invalid("model has no experts".into()))?;
    let names = TensorNames::new(spec.family);
    let (h, i) = (spec.hidden_size, moe.intermediate_size);
    let [g, u, d] = names.expert(layer, e);
    if ck.contains(&g) {
        return crate::weights::mlp(ck, [&g, &u, &d], h, i, spec.fp8_block);
    }
    let [gu, dn] = names.fused_experts(layer);
    if ck.contains(&gu) {
        let n = moe.num_experts;
        let gate_up = ck.matrix_reshaped(&gu, &[n, 2 * i, h], n * 2 * i, h)?;
        let down = ck.matrix_reshaped(&dn, &[n, h, i], n * h, i)?;
        return Ok(ExpertWeights {
            gate: gate_up.rows_view(e * 2 * i, i)?,
            up: gate_up.rows_view(e * 2 * i + i, i)?,
            down: down.rows_view(e * h, h)?,
        });
    }
    Err(ModelError::MissingTensor(g))
}

/// An expert as a loader hands it out.
pub struct LoadedExpert {
    pub weights: ExpertWeights,
    /// For sources with record checksums (the packed store): the location
    /// whose checksum `weights`' bytes must match. Loaders leave it to the
    /// caller so that a resident source can verify on first use instead of
    /// reading every expert at load; [`LoadedExpert::verified`] checks now.
    pub check: Option<crate::source::ExpertLocation>,
}

impl LoadedExpert {
    pub fn unchecked(weights: ExpertWeights) -> LoadedExpert {
        LoadedExpert {
            weights,
            check: None,
        }
    }

    /// The weights, after verifying their checksum (if the source has one).
    pub fn verified(self) -> Result<ExpertWeights> {
        if let Some(loc) = &self.check {
            loc.verify_weights(&self.weights)?;
        }
        Ok(self.weights)
    }
}

/// Loads expert `e` of layer `l`.
pub type ExpertLoader<'a> = Box<dyn Fn(usize, usize) -> Result<LoadedExpert> + 'a>;

/// Something routed experts can be loaded from, resident.
pub trait ExpertStore {
    /// A loader for the experts of `spec` (sources index them once here).
    fn expert_loader<'a>(&'a self, spec: &'a ModelSpec) -> Result<ExpertLoader<'a>>;
}

impl ExpertStore for Checkpoint {
    fn expert_loader<'a>(&'a self, spec: &'a ModelSpec) -> Result<ExpertLoader<'a>> {
        Ok(Box::new(move |l, e| {
            load_expert(spec, self, l, e).map(LoadedExpert::unchecked)
        }))
    }
}

impl ExpertStore for crate::source::GgufFile {
    fn expert_loader<'a>(&'a self, spec: &'a ModelSpec) -> Result<ExpertLoader<'a>> {
        let locator = crate::source::GgufExpertLocator::new(spec, self)?;
        Ok(Box::new(move |l, e| {
            crate::source::gguf::experts::load_expert(&locator, self, l, e)
                .map(LoadedExpert::unchecked)
        }))
    }
}

impl ExpertStore for crate::source::WeightSource {
    fn expert_loader<'a>(&'a self, spec: &'a ModelSpec) -> Result<ExpertLoader<'a>> {
        match self {
            crate::source::WeightSource::Hf(ck) => ck.expert_loader(spec),
            crate::source::WeightSource::Gguf(f) => f.expert_loader(spec),
            crate::source::WeightSource::Packed(p) => p.expert_loader(spec),
        }
    }
}

/// One resident expert and, for checksummed sources, whether its bytes
/// have been verified yet.
struct Resident {
    weights: Arc<ExpertWeights>,
    check: Option<crate::source::ExpertLocation>,
    verified: std::sync::OnceLock<()>,
}

/// Every expert of a checkpoint, memory-mapped (the page cache holds them).
///
/// Experts of a packed store are verified against their record checksum
/// the first time they are fetched, which is when the page cache first
/// reads them from disk: loading stays O(index) rather than reading every
/// expert, and no expert is ever used unverified.
pub struct ResidentExperts {
    layers: Vec<Vec<Resident>>,
    /// Every fetch is a RAM hit (the page cache holds the mapping).
    hits: std::sync::atomic::AtomicU64,
}

impl ResidentExperts {
    /// Every routed expert of `src` (a [`Checkpoint`], a GGUF file, a
    /// packed store or a [`crate::source::WeightSource`]).
    pub fn load(spec: &ModelSpec, src: &(impl ExpertStore + ?Sized)) -> Result<ResidentExperts> {
        let load = src.expert_loader(spec)?;
        let mut layers = Vec::with_capacity(spec.num_layers());
        for (l, ls) in spec.layers.iter().enumerate() {
            let mut experts = Vec::new();
            if ls.ffn == crate::config::FfnKind::Moe
                && let Some(moe) = &spec.moe
            {
                for e in 0..moe.num_experts {
                    let x = load(l, e)?;
                    experts.push(Resident {
                        weights: Arc::new(x.weights),
                        check: x.check,
                        verified: std::sync::OnceLock::new(),
                    });
                }
            }
            layers.push(experts);
        }
        Ok(ResidentExperts {
            layers,
            hits: Default::default(),
        })
    }
}

impl ExpertSource for ResidentExperts {
    fn fetch_groups(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(ExpertGroup) -> Result<()>,
    ) -> Result<()> {
        one_group(self, layer, ids, ready)
    }

    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<()>,
    ) -> Result<()> {
        let experts = self.layers.get(layer).ok_or_else(|| ModelError::Expert {
            layer,
            expert: ids.first().copied().unwrap_or(0),
            reason: "no such layer".into(),
        })?;
        for &e in ids {
            let w = experts.get(e).ok_or_else(|| ModelError::Expert {
                layer,
                expert: e,
                reason: "no such expert".into(),
            })?;
            if let Some(loc) = &w.check
                && w.verified.get().is_none()
            {
                loc.verify_weights(&w.weights)?;
                let _ = w.verified.set(());
            }
            self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            ready(e, w.weights.clone())?;
        }
        Ok(())
    }

    fn stats(&self) -> SourceStats {
        SourceStats {
            ram_hits: self.hits.load(std::sync::atomic::Ordering::Relaxed),
            ..Default::default()
        }
    }
}
