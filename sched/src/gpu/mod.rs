//! The GPU tier: the forward pass on a CUDA device, with VRAM as one more
//! placement tier above RAM and NVMe (DESIGN.md: one hierarchy, never a
//! threshold).
//!
//! - [`plan`]: the VRAM planner ([`VramPlan`]): dense blocks, KV reserve
//!   and expert cache slots inside `--vram-budget`; scratch, staging ring
//!   and stream buffers outside it; never over-committed.
//! - [`slots`]: the VRAM expert cache's bookkeeping ([`VramCache`]):
//!   eviction (O(1) LRU), leases, single flight, pinning.
//! - `weights`: dense blocks, resident or streamed per layer from pinned
//!   RAM through two stream buffers (copy stream, events).
//! - `kv`: each sequence's keys and values, in VRAM or mapped pinned RAM.
//! - `experts`: a layer's routed experts: hits computed from their VRAM
//!   slots while misses, taken from the RAM tier (whose pinned arenas are
//!   registered with CUDA, so the copy reads the very bytes the disk read
//!   landed in), are copied host-to-device into the staging ring on the
//!   copy stream, chunk by chunk, each chunk computed as soon as its copies
//!   land; events recycle ring slots. One pointer-table matvec launch per
//!   matrix covers every expert of a chunk, whatever slots they sit in.
//! - `forward`: the layer loop (attention, MoE, head) for a batch.
//!
//! What runs where: every matrix product, norm, rotary embedding,
//! attention, SwiGLU and the MoE combine run on the GPU; the host embeds
//! token rows (one row per token, exact), routes each row from the router
//! logits the GPU computed (the CPU tier's own routing function, so the
//! decisions follow the same rules), and drives the copies.
//!
//! Exactness: each GPU kernel computes an output element with one fixed
//! reduction order, whatever the batch, the slot, the placement or the
//! chunking, so a GPU run is bit-identical to itself under every VRAM
//! budget and batch composition. It is not bit-identical to the CPU tier
//! (different, equally exact-in-spirit reduction orders). Q4_0 and Q8_0
//! products follow the CPU's choice: by default they quantize their input
//! to 8-bit blocks and sum integers exactly as the CPU's `dot_q4_0_q8` and
//! `dot_q8_0_q8` do (the same bits per product); with `--exact-quant` the
//! weights are dequantized exactly, on both tiers.

pub mod plan;
pub mod slots;

mod experts;
mod forward;
mod kv;
pub mod route;
mod weights;

use std::sync::{Arc, Mutex};

use colibri_cuda::{
    CudaDevice, CudaError, DeviceBuffer, HostRegistration, KernelCache, KernelSet,
    WeightFormat as DevFormat,
};
use colibri_io::PinnedArena;
use colibri_model::config::{AttentionSpec, FfnKind, QkNorm};
use colibri_model::format::WeightFormat;
use colibri_model::rope::{Rope, mla_softmax_scale_factor};
use colibri_model::{ExpertSource, Model, ModelError, SeqInput};
use serde::Serialize;

use crate::Engine;
use crate::tier::plan::{DEFAULT_KV_RESERVE_POSITIONS, kv_bytes_per_position};

pub use self::experts::ExpertShape;
pub use self::plan::{LayerShare, VramBudgetSource, VramPlan, VramRequest};
pub use self::slots::{VramCache, VramCacheStats, VramResidency};

/// Rows one pass carries at most (a bigger batch runs as several passes:
/// each sequence's tokens stay in order, so the result is the same).
pub const DEFAULT_MAX_ROWS: usize = 512;

/// Rows of logits computed and copied back at a time.
pub const LM_ROWS: usize = 64;

/// `--device`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceChoice {
    /// CUDA when a usable GPU and NVRTC are there, else the CPU tier.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda),
            other => Err(format!("unknown device `{other}` (auto, cpu or cuda)")),
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceChoice::Auto => "auto",
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Cuda => "cuda",
        })
    }
}

/// Experts of the next MoE layer copied ahead per layer by default: about
/// what the bus carries in the time from a layer's last copy to the next
/// layer's routing (docs/benchmarks.md, "Copying the next layer's experts
/// ahead").
pub const DEFAULT_AHEAD: usize = 3;

/// Settings of the GPU tier (`--device`, `--vram-budget`, `--devices`).
#[derive(Clone, Debug)]
pub struct GpuOptions {
    pub device: DeviceChoice,
    /// Bytes for dense weights, KV cache and expert cache; `None`: what is
    /// free minus the working set and a reserve.
    pub vram_budget: Option<u64>,
    /// Device ordinals; empty: device 0. Several: the layers are split
    /// between them by bytes (each holds its layers' dense weights, experts
    /// and KV cache, the last one the head), each with `vram_budget`.
    pub devices: Vec<usize>,
    /// Rows per pass at most.
    pub max_rows: usize,
    /// Staging slots per expert size class.
    pub ring_slots: usize,
    /// While a layer computes, copy up to this many experts that the next
    /// MoE layer's router picks for this layer's input into VRAM (0: off;
    /// `--no-prefetch` turns it off). Speed only, never results.
    pub ahead: usize,
    /// When VRAM cannot hold every routed expert but RAM can: hold them
    /// all in the RAM tier's pinned arenas and let the kernels read the
    /// ones without a VRAM slot in place, so decode layers route on the
    /// device and steps replay as graphs. Speed only, never results.
    pub in_place: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            device: DeviceChoice::Auto,
            vram_budget: None,
            devices: Vec::new(),
            max_rows: DEFAULT_MAX_ROWS,
            ring_slots: plan::DEFAULT_RING_SLOTS,
            ahead: DEFAULT_AHEAD,
            in_place: true,
        }
    }
}

/// Errors of the GPU tier.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The model or the request needs something the GPU tier lacks.
    #[error("GPU tier: {0}")]
    Unsupported(String),
    /// The device cannot hold the tier's working set.
    #[error("GPU tier: {0}")]
    Plan(String),
    #[error("GPU tier internal error: {0}")]
    Internal(String),
}

impl From<GpuError> for ModelError {
    fn from(e: GpuError) -> ModelError {
        match e {
            GpuError::Model(m) => m,
            other => ModelError::Invalid(other.to_string()),
        }
    }
}

/// The device format of a matrix stored as `f`. Its products take the CPU
/// tier's arithmetic, bit for bit: 8-bit activations and integer sums
/// unless `--exact-quant` asked for the exact dequantized product.
pub(crate) fn cuda_format(f: WeightFormat) -> Result<DevFormat, GpuError> {
    let int = colibri_model::kernels::kernels().int_activations;
    Ok(match f {
        WeightFormat::Q4_0 if int => DevFormat::Q4_0Q8,
        WeightFormat::Q8_0 if int => DevFormat::Q8_0Q8,
        WeightFormat::Q6K if int => DevFormat::Q6KQ8,
        WeightFormat::Q4K if int => DevFormat::Q4KQ8,
        WeightFormat::Q5K if int => DevFormat::Q5KQ8,
        WeightFormat::Q4_1 if int => DevFormat::Q4_1Q8,
        WeightFormat::Q5_0 if int => DevFormat::Q5_0Q8,
        WeightFormat::Q5_1 if int => DevFormat::Q5_1Q8,
        WeightFormat::Q2K if int => DevFormat::Q2KQ8,
        WeightFormat::Q3K if int => DevFormat::Q3KQ8,
        WeightFormat::Iq4Nl if int => DevFormat::Iq4NlQ8,
        WeightFormat::Iq4Xs if int => DevFormat::Iq4XsQ8,
        WeightFormat::F32 => DevFormat::F32,
        WeightFormat::F16 => DevFormat::F16,
        WeightFormat::Bf16 => DevFormat::Bf16,
        WeightFormat::F8E4M3 => DevFormat::F8E4M3,
        WeightFormat::Q8_0 => DevFormat::Q8_0,
        WeightFormat::Q4_0 => DevFormat::Q4_0,
        WeightFormat::Q6K => DevFormat::Q6K,
        WeightFormat::Q4K => DevFormat::Q4K,
        WeightFormat::Q5K => DevFormat::Q5K,
        WeightFormat::Q4_1 => DevFormat::Q4_1,
        WeightFormat::Q5_0 => DevFormat::Q5_0,
        WeightFormat::Q5_1 => DevFormat::Q5_1,
        WeightFormat::Q2K => DevFormat::Q2K,
        WeightFormat::Q3K => DevFormat::Q3K,
        WeightFormat::Iq4Nl => DevFormat::Iq4Nl,
        WeightFormat::Iq4Xs => DevFormat::Iq4Xs,
    })
}

/// The attention geometry of a model.
#[derive(Clone, Copy, Debug)]
pub(crate) enum AttnDims {
    Gqa {
        nh: usize,
        nkv: usize,
        hd: usize,
        qk_norm: QkNorm,
        clip: Option<f32>,
        scale: f32,
    },
    Mla {
        nh: usize,
        r: usize,
        dn: usize,
        dr: usize,
        dv: usize,
        q_lora: Option<usize>,
        scale: f32,
    },
}

/// Everything about the model's shapes the GPU pass needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub hidden: usize,
    pub vocab: usize,
    pub eps: f32,
    pub experts: usize,
    pub top_k: usize,
    pub moe_inter: usize,
    /// Widest dense MLP or shared expert.
    pub mlp_inter: usize,
    pub max_rows: usize,
    pub attn: AttnDims,
}

/// The attention kernel's limits (cuda/kernels/attention.cu).
const AT_MAX_DQ: usize = 640;
const AT_MAX_DV: usize = 512;
const RP_MAX_DIM: usize = 1024;
const CB_MAX_K: usize = 64;

impl Dims {
    pub fn of(model: &Model, max_rows: usize) -> Result<Dims, GpuError> {
        let spec = &model.spec;
        let attn = match &spec.attention {
            AttentionSpec::Gqa {
                num_heads,
                num_kv_heads,
                head_dim,
                qk_norm,
                clip_qkv,
                ..
            } => {
                if *head_dim > AT_MAX_DQ.min(AT_MAX_DV) || *head_dim > RP_MAX_DIM {
                    return Err(GpuError::Unsupported(format!(
                        "head_dim {head_dim} exceeds the attention kernel's {AT_MAX_DV}"
                    )));
                }
                if *num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
                    return Err(GpuError::Unsupported(format!(
                        "{num_heads} heads over {num_kv_heads} KV heads"
                    )));
                }
                AttnDims::Gqa {
                    nh: *num_heads,
                    nkv: *num_kv_heads,
                    hd: *head_dim,
                    qk_norm: *qk_norm,
                    clip: *clip_qkv,
                    scale: (*head_dim as f32).powf(-0.5),
                }
            }
            AttentionSpec::Mla {
                num_heads,
                q_lora_rank,
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
                ..
            } => {
                if kv_lora_rank + qk_rope_head_dim > AT_MAX_DQ || *kv_lora_rank > AT_MAX_DV {
                    return Err(GpuError::Unsupported(format!(
                        "MLA rank {kv_lora_rank} + rope {qk_rope_head_dim} exceeds the attention \
                         kernel's limits ({AT_MAX_DQ}, {AT_MAX_DV})"
                    )));
                }
                AttnDims::Mla {
                    nh: *num_heads,
                    r: *kv_lora_rank,
                    dn: *qk_nope_head_dim,
                    dr: *qk_rope_head_dim,
                    dv: *v_head_dim,
                    q_lora: *q_lora_rank,
                    scale: (((qk_nope_head_dim + qk_rope_head_dim) as f64).powf(-0.5)
                        * mla_softmax_scale_factor(&spec.rope)) as f32,
                }
            }
        };
        let (experts, top_k, moe_inter, shared) = match &spec.moe {
            Some(m) => (
                m.num_experts,
                m.top_k,
                m.intermediate_size,
                m.shared.as_ref().map_or(0, |s| s.intermediate_size),
            ),
            None => (0, 0, 0, 0),
        };
        if top_k > CB_MAX_K {
            return Err(GpuError::Unsupported(format!(
                "top-{top_k} routing exceeds the combine kernel's {CB_MAX_K}"
            )));
        }
        let dense_inter = spec
            .layers
            .iter()
            .filter_map(|l| match l.ffn {
                FfnKind::Dense { intermediate_size } => Some(intermediate_size),
                FfnKind::Moe => None,
            })
            .max()
            .unwrap_or(0);
        Ok(Dims {
            hidden: spec.hidden_size,
            vocab: spec.vocab_size,
            eps: spec.rms_norm_eps,
            experts,
            top_k,
            moe_inter,
            mlp_inter: dense_inter.max(shared).max(1),
            max_rows: max_rows.max(1),
            attn,
        })
    }

    /// Floats per position of KV part A and part B.
    pub fn kv_parts(&self) -> (usize, usize) {
        match self.attn {
            AttnDims::Gqa { nkv, hd, .. } => (nkv * hd, nkv * hd),
            AttnDims::Mla { r, dr, .. } => (r, dr),
        }
    }
}

/// Counters of the GPU tier.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct GpuStats {
    pub passes: u64,
    pub rows: u64,
    pub cache: VramCacheStats,
    /// Routed experts taken from the RAM tier (VRAM misses).
    pub experts_copied: u64,
    /// Bytes copied host-to-device for experts / dense blocks.
    pub expert_h2d_bytes: u64,
    pub dense_h2d_bytes: u64,
    /// Host-to-device copies that moved the copied experts (staged and
    /// ahead): one per expert where the VRAM slot mirrors the RAM slot,
    /// else one per matrix.
    pub expert_h2d_copies: u64,
    /// Experts promoted from the staging ring into the VRAM cache.
    pub promotions: u64,
    pub kv_vram_bytes: u64,
    pub kv_host_bytes: u64,
    /// RAM-tier arenas registered with CUDA (copies from them are DMA).
    pub arenas_registered: usize,
    pub dense_resident_blocks: usize,
    /// MoE layers routed and planned on the device (the device table
    /// knows where every expert is;
    /// counted when issued: a replayed graph repeats them uncounted).
    pub device_routed_layers: u64,
    /// Decode steps captured as graphs.
    pub graphs_captured: u64,
    /// GPU time of the replayed steps, in microseconds (timed events
    /// around each replay): the part of a decode step the device is busy.
    pub graph_gpu_us: u64,
    /// What the host asked of the device: kernel launches, graph replays,
    /// host waits, host↔device copies.
    pub launches: u64,
    pub graph_launches: u64,
    pub host_waits: u64,
    pub copies: u64,
    /// Experts of the next layer copied into VRAM ahead of its routing,
    /// their bytes (part of `expert_h2d_bytes`), and how many a layer used.
    pub ahead_copied: u64,
    pub ahead_bytes: u64,
    pub ahead_used: u64,
    /// Device-routed passes that read experts without a VRAM slot in place
    /// from pinned RAM, those experts' uses and bytes (read over the bus
    /// by the kernels; not in `expert_h2d_bytes`).
    pub in_place_passes: u64,
    pub in_place_reads: u64,
    pub in_place_bytes: u64,
    /// Changes between reading in place and routing on the host (the
    /// faster route, by measurement).
    pub route_switches: u64,
}

impl GpuStats {
    /// The counts since `earlier` (a snapshot of the same tier); the
    /// sizes (KV bytes, arenas, resident blocks) are the current ones.
    pub fn since(&self, earlier: &GpuStats) -> GpuStats {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        GpuStats {
            passes: d(self.passes, earlier.passes),
            rows: d(self.rows, earlier.rows),
            cache: VramCacheStats {
                hits: d(self.cache.hits, earlier.cache.hits),
                misses: d(self.cache.misses, earlier.cache.misses),
                loads: d(self.cache.loads, earlier.cache.loads),
                evictions: d(self.cache.evictions, earlier.cache.evictions),
                full: d(self.cache.full, earlier.cache.full),
            },
            experts_copied: d(self.experts_copied, earlier.experts_copied),
            expert_h2d_bytes: d(self.expert_h2d_bytes, earlier.expert_h2d_bytes),
            expert_h2d_copies: d(self.expert_h2d_copies, earlier.expert_h2d_copies),
            dense_h2d_bytes: d(self.dense_h2d_bytes, earlier.dense_h2d_bytes),
            promotions: d(self.promotions, earlier.promotions),
            device_routed_layers: d(self.device_routed_layers, earlier.device_routed_layers),
            graphs_captured: d(self.graphs_captured, earlier.graphs_captured),
            graph_gpu_us: d(self.graph_gpu_us, earlier.graph_gpu_us),
            launches: d(self.launches, earlier.launches),
            graph_launches: d(self.graph_launches, earlier.graph_launches),
            host_waits: d(self.host_waits, earlier.host_waits),
            copies: d(self.copies, earlier.copies),
            ahead_copied: d(self.ahead_copied, earlier.ahead_copied),
            ahead_bytes: d(self.ahead_bytes, earlier.ahead_bytes),
            ahead_used: d(self.ahead_used, earlier.ahead_used),
            in_place_passes: d(self.in_place_passes, earlier.in_place_passes),
            in_place_reads: d(self.in_place_reads, earlier.in_place_reads),
            in_place_bytes: d(self.in_place_bytes, earlier.in_place_bytes),
            route_switches: d(self.route_switches, earlier.route_switches),
            ..*self
        }
    }

    /// Adds another device's counters.
    pub fn add(&mut self, o: &GpuStats) {
        // Every device takes part in every pass.
        self.passes = self.passes.max(o.passes);
        self.rows = self.rows.max(o.rows);
        self.cache.hits += o.cache.hits;
        self.cache.misses += o.cache.misses;
        self.cache.loads += o.cache.loads;
        self.cache.evictions += o.cache.evictions;
        self.cache.full += o.cache.full;
        self.experts_copied += o.experts_copied;
        self.expert_h2d_bytes += o.expert_h2d_bytes;
        self.expert_h2d_copies += o.expert_h2d_copies;
        self.dense_h2d_bytes += o.dense_h2d_bytes;
        self.promotions += o.promotions;
        self.kv_vram_bytes += o.kv_vram_bytes;
        self.kv_host_bytes += o.kv_host_bytes;
        self.arenas_registered += o.arenas_registered;
        self.dense_resident_blocks += o.dense_resident_blocks;
        self.device_routed_layers += o.device_routed_layers;
        self.graphs_captured += o.graphs_captured;
        self.graph_gpu_us += o.graph_gpu_us;
        self.launches += o.launches;
        self.graph_launches += o.graph_launches;
        self.host_waits += o.host_waits;
        self.copies += o.copies;
        self.ahead_copied += o.ahead_copied;
        self.ahead_bytes += o.ahead_bytes;
        self.ahead_used += o.ahead_used;
        self.in_place_passes = self.in_place_passes.max(o.in_place_passes);
        self.in_place_reads += o.in_place_reads;
        self.in_place_bytes += o.in_place_bytes;
        self.route_switches += o.route_switches;
    }
}

/// Per-phase time of the passes run with `COLIBRI_GPU_PROFILE=1` (no
/// graphs then): GPU time between timed events, and host time spent
/// issuing each phase (its waits included).
#[derive(Clone, Debug, Default, Serialize)]
pub struct GpuProfile {
    pub passes: u64,
    pub layers: u64,
    /// (phase, GPU ms, host ms), summed over the passes.
    pub phases: Vec<(String, f64, f64)>,
}

/// The GPU tier of an engine: one stage per device, in layer order.
pub struct GpuTier {
    stages: Mutex<Vec<forward::State>>,
    plans: Vec<VramPlan>,
    summary: String,
}

impl std::fmt::Debug for GpuTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTier")
            .field("summary", &self.summary)
            .finish()
    }
}

impl GpuTier {
    /// The placement in effect on the first device (the only one unless
    /// `--devices` names several).
    pub fn plan(&self) -> &VramPlan {
        &self.plans[0]
    }

    /// The placement on each device, in layer order.
    pub fn plans(&self) -> &[VramPlan] {
        &self.plans
    }

    /// One line: device and placement.
    pub fn summary(&self) -> &str {
        &self.summary
    }

    /// Counters, summed over the devices.
    pub fn stats(&self) -> GpuStats {
        let stages = self.lock();
        let mut all = GpuStats::default();
        for s in stages.iter() {
            all.add(&s.stats());
        }
        all
    }

    /// Counters of each device, in layer order.
    pub fn stage_stats(&self) -> Vec<GpuStats> {
        self.lock().iter().map(|s| s.stats()).collect()
    }

    /// Starts the per-phase profile afresh (e.g. after a warm-up).
    pub fn reset_profile(&self) {
        for s in self.lock().iter_mut() {
            s.reset_profile();
        }
    }

    /// The per-phase profile, when `COLIBRI_GPU_PROFILE=1` was set at
    /// attach (summed over the devices; passes counted on the first).
    pub fn profile(&self) -> Option<GpuProfile> {
        let stages = self.lock();
        let mut out: Option<GpuProfile> = None;
        for st in stages.iter() {
            let p = st.profile()?;
            let o = out.get_or_insert_with(|| GpuProfile {
                passes: p.passes,
                layers: 0,
                phases: forward::PHASES
                    .iter()
                    .map(|name| (name.to_string(), 0.0, 0.0))
                    .collect(),
            });
            o.layers += p.layers;
            for (i, ph) in o.phases.iter_mut().enumerate() {
                ph.1 += p.gpu_ms[i];
                ph.2 += p.host_ms[i];
            }
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<forward::State>> {
        // A panic inside a pass leaves device state that the next pass
        // rebuilds from scratch (every pass starts from the host's inputs).
        self.stages.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs a batch on the GPU (the counterpart of `Model::forward`).
    pub fn forward(
        &self,
        model: &Model,
        experts: &dyn ExpertSource,
        batch: &mut [SeqInput<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        forward::run(&mut self.lock(), model, experts, batch).map_err(ModelError::from)
    }

    /// Where one routed expert is in VRAM (tests and diagnostics).
    pub fn residency(&self, layer: usize, expert: usize) -> Option<VramResidency> {
        let stages = self.lock();
        let st = stages.iter().find(|s| s.holds_layer(layer))?;
        st.experts.residency(layer, expert)
    }
}

/// Why the engine runs on the CPU tier, or the GPU tier it attached.
pub enum Attached {
    Gpu(String),
    Cpu { reason: Option<String> },
}

/// Gives `engine` a GPU tier as `opts` says: `Cpu` attaches none; `Auto`
/// attaches one when a usable GPU and NVRTC are there and otherwise
/// returns the reason it runs on the CPU tier; `Cuda` fails when it cannot.
pub fn attach(engine: &mut Engine, opts: &GpuOptions) -> Result<Attached, GpuError> {
    if opts.device == DeviceChoice::Cpu {
        return Ok(Attached::Cpu { reason: None });
    }
    // The GPU copies weights as stored: no CPU layouts, dense or expert.
    let tiling = engine.tier.as_ref().map(|t| t.tiles_q4_0());
    if let Some(tier) = &engine.tier {
        tier.set_tile_q4_0(false).map_err(ModelError::from)?;
    }
    let dense_laid_out = set_dense_layouts(engine, false)?;
    let result = open(engine, opts);
    if result.is_err() {
        if let (Some(tier), Some(on)) = (&engine.tier, tiling) {
            tier.set_tile_q4_0(on).map_err(ModelError::from)?;
        }
        if dense_laid_out {
            set_dense_layouts(engine, true)?;
        }
    }
    match result {
        Ok(tier) => {
            let summary = tier.summary.clone();
            engine.gpu = Some(Arc::new(tier));
            Ok(Attached::Gpu(summary))
        }
        Err(e) if opts.device == DeviceChoice::Auto && fallback_ok(&e) => Ok(Attached::Cpu {
            reason: Some(e.to_string()),
        }),
        Err(e) => Err(e),
    }
}

/// Rewrites the engine's dense matrices into the CPU's layouts or back
/// (before any sequence shares the model); whether anything changed.
fn set_dense_layouts(engine: &mut Engine, on: bool) -> Result<bool, GpuError> {
    if engine.model.weights.cpu_layouts() == on {
        return Ok(false);
    }
    let Some(model) = Arc::get_mut(&mut engine.model) else {
        return Err(GpuError::Internal(
            "the model is shared: its weights cannot change layout now".into(),
        ));
    };
    Ok(model.weights.set_cpu_layouts(on)? > 0)
}

/// Whether `opts` will probably give a GPU tier: `cuda`, or `auto` with a
/// CUDA device present. Callers use it to leave the RAM tier's experts as
/// stored (no CPU tiles) when the GPU will compute them.
pub fn likely(opts: &GpuOptions) -> bool {
    match opts.device {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Auto => CudaDevice::count().is_ok_and(|n| n > 0),
    }
}

/// Whether `--device auto` runs on the CPU tier after `e` (the GPU tier is
/// impossible here) rather than failing.
fn fallback_ok(e: &GpuError) -> bool {
    matches!(
        e,
        GpuError::Cuda(CudaError::Unavailable { .. })
            | GpuError::Unsupported(_)
            | GpuError::Plan(_)
    )
}

/// Fails early (before a model is loaded) when `opts` insists on CUDA and
/// no usable device is there.
pub fn preflight(opts: &GpuOptions) -> Result<(), GpuError> {
    if opts.device != DeviceChoice::Cuda {
        return Ok(());
    }
    for &o in &ordinals(opts) {
        CudaDevice::open(o)?;
    }
    colibri_cuda::nvrtc::load()?;
    Ok(())
}

/// The device and kernels (no model): what `colibri plan` asks about.
pub fn open_device(ordinal: usize) -> Result<(CudaDevice, KernelSet), GpuError> {
    let dev = CudaDevice::open(ordinal)?;
    let k = KernelSet::load(&dev, &KernelCache::user_default())?;
    Ok((dev, k))
}

/// KV reserve positions for a context of `ctx` (0: the default reserve).
fn kv_positions(model: &Model, ctx: usize) -> usize {
    if ctx > 0 {
        ctx.min(model.spec.max_position_embeddings)
    } else {
        model
            .spec
            .max_position_embeddings
            .min(DEFAULT_KV_RESERVE_POSITIONS)
    }
}

/// The VRAM request for `model` on a device with `free`/`total` bytes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn vram_request(
    model: &Model,
    device: &str,
    free: u64,
    total: u64,
    ctx: usize,
    opts: &GpuOptions,
    layer_shapes: &[Option<ExpertShape>],
    pin_candidates: Vec<usize>,
    share: Option<LayerShare>,
    in_place: bool,
) -> Result<(VramRequest, Dims, experts::Classes), GpuError> {
    let dims = Dims::of(model, opts.max_rows)?;
    let classes = experts::Classes::of(layer_shapes, dims.experts);
    // Every layer's KV row has the same width: a share holds its layers'.
    let kv_per_position = match &share {
        Some(sh) => {
            kv_bytes_per_position(&model.spec) / sh.layers.max(1) as u64
                * (sh.end - sh.start) as u64
        }
        None => kv_bytes_per_position(&model.spec),
    };
    let positions = kv_positions(model, ctx);
    let rope_positions = rope_positions(model, ctx);
    let req = VramRequest {
        device: device.to_string(),
        total_bytes: total,
        free_bytes: free,
        budget: opts.vram_budget,
        dense_blocks: weights::block_sizes(&model.weights)?,
        kv_bytes_per_position: kv_per_position,
        kv_reserve_positions: positions,
        expert_classes: classes.requests(),
        ring_slots: opts.ring_slots,
        ahead: opts.ahead,
        in_place,
        scratch_bytes: forward::scratch_bytes(&dims, rope_positions, model),
        pin_candidates,
        share,
    };
    Ok((req, dims, classes))
}

/// Positions the rotary tables cover.
fn rope_positions(model: &Model, ctx: usize) -> usize {
    if ctx > 0 {
        ctx.min(model.spec.max_position_embeddings)
    } else {
        model.spec.max_position_embeddings
    }
    .max(1)
}

/// The rotary embedding the CPU tier uses for `model`.
pub(crate) fn rope_of(model: &Model) -> Rope {
    let (dim, interleave) = match &model.spec.attention {
        AttentionSpec::Gqa { head_dim, .. } => (*head_dim, false),
        AttentionSpec::Mla {
            qk_rope_head_dim,
            rope_interleave,
            ..
        } => (*qk_rope_head_dim, *rope_interleave),
    };
    Rope::new(&model.spec.rope, dim, interleave)
}

/// The device ordinals `opts` names (device 0 when none).
pub fn ordinals(opts: &GpuOptions) -> Vec<usize> {
    if opts.devices.is_empty() {
        vec![0]
    } else {
        opts.devices.clone()
    }
}

/// Each device's share of the layers (`None` for a single device): split
/// by bytes, dense block plus routed experts per layer, the head on the
/// last device ([`plan::split_layers`]).
fn shares(
    model: &Model,
    shapes: &[Option<ExpertShape>],
    devices: usize,
) -> Result<Vec<Option<LayerShare>>, GpuError> {
    if devices <= 1 {
        return Ok(vec![None]);
    }
    let blocks = weights::block_sizes(&model.weights)?;
    let layers = model.spec.num_layers();
    if devices > layers {
        return Err(GpuError::Unsupported(format!(
            "{devices} devices for {layers} layers: each device needs at least one layer"
        )));
    }
    let per_layer = Dims::of(model, 1)?.experts as u64;
    let layer_bytes: Vec<u64> = (0..layers)
        .map(|l| {
            let experts = shapes
                .get(l)
                .copied()
                .flatten()
                .map_or(0, |s| s.slot_bytes as u64 * per_layer);
            blocks.get(l).copied().unwrap_or(0) + experts
        })
        .collect();
    let head = blocks.get(layers).copied().unwrap_or(0);
    let ranges = plan::split_layers(&layer_bytes, head, devices);
    let n = ranges.len();
    Ok(ranges
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            Some(LayerShare {
                device_index: i,
                devices: n,
                start: r.start,
                end: r.end,
                layers,
                head: i + 1 == n,
            })
        })
        .collect())
}

/// `shapes` with the layers outside `share` left out (no slots for them).
fn shapes_of_share(
    shapes: &[Option<ExpertShape>],
    share: Option<&LayerShare>,
) -> Vec<Option<ExpertShape>> {
    shapes
        .iter()
        .enumerate()
        .map(|(l, s)| match share {
            Some(sh) if !(sh.start..sh.end).contains(&l) => None,
            _ => *s,
        })
        .collect()
}

/// A device's name (as `colibri plan` shows it) and its free and total
/// memory.
pub struct DeviceMemory {
    pub name: String,
    pub free: u64,
    pub total: u64,
}

/// What `colibri plan` shows for the GPU tier of a model on `devices` (in
/// layer order; several split the layers), its expert slots laid out as
/// the RAM tier's `layout` has them; `ram_holds_all`: the RAM tier's plan
/// holds every routed expert.
pub fn plans_for(
    model: &Model,
    layout: &crate::tier::ExpertLayout,
    ctx: usize,
    opts: &GpuOptions,
    devices: &[DeviceMemory],
    ram_holds_all: bool,
) -> Result<Vec<VramPlan>, GpuError> {
    let shapes = experts::shapes_from_layout(model, layout)?;
    let shares = shares(model, &shapes, devices.len())?;
    devices
        .iter()
        .zip(shares)
        .enumerate()
        .map(|(i, (d, share))| {
            let st_shapes = shapes_of_share(&shapes, share.as_ref());
            let (req, _, _) = vram_request(
                model,
                &d.name,
                d.free,
                d.total,
                ctx,
                opts,
                &st_shapes,
                Vec::new(),
                share,
                // Experts are read in place by the first device only.
                opts.in_place && ram_holds_all && i == 0,
            )?;
            VramPlan::compute(&req).map_err(GpuError::Plan)
        })
        .collect()
}

fn open(engine: &Engine, opts: &GpuOptions) -> Result<GpuTier, GpuError> {
    let ords = ordinals(opts);
    let mut seen = std::collections::BTreeSet::new();
    if ords.iter().any(|o| !seen.insert(*o)) {
        tracing::warn!(
            "--devices {ords:?} names a GPU more than once: it runs each of its layer ranges in \
             turn (no faster than naming it once)"
        );
    }
    let mut devs = Vec::new();
    for o in ords {
        devs.push(open_device(o)?);
    }
    let model = &engine.model;
    let shapes = match &engine.tier {
        Some(t) => experts::shapes_from_layout(model, t.layout())?,
        None => experts::shapes_from_source(model, engine.experts.as_ref())?,
    };
    let pinned: Vec<(usize, usize)> = engine
        .tier
        .as_ref()
        .map(|t| t.plan().pinned.clone())
        .unwrap_or_default();
    let shares = shares(model, &shapes, devs.len())?;
    let count = shares.len();
    let tier_id = forward::next_tier_id();
    // RAM leases held for copies in flight at most: half the RAM tier's
    // staging slots, so its reads always find a slot (each stage releases
    // its leases before the next runs).
    let max_held = engine
        .tier
        .as_ref()
        .and_then(|t| {
            t.plan()
                .classes
                .iter()
                .map(|c| c.staging_slots + c.cache_slots)
                .filter(|&n| n > 0)
                .min()
        })
        .map_or(usize::MAX, |n| (n / 2).max(1));
    let mut stages = Vec::with_capacity(count);
    let mut plans = Vec::with_capacity(count);
    let mut lines = Vec::with_capacity(count);
    for (index, ((dev, k), share)) in devs.into_iter().zip(shares).enumerate() {
        let layers = share
            .as_ref()
            .map_or(0..model.spec.num_layers(), |s| s.start..s.end);
        let st_shapes = shapes_of_share(&shapes, share.as_ref());
        let (free, total) = dev.mem_info()?;
        let info = dev.info().clone();
        let device = format!(
            "{} (GPU {}, {}, driver CUDA {}.{})",
            info.name, info.ordinal, info.arch, info.driver_version.0, info.driver_version.1
        );
        let classes_probe =
            experts::Classes::of(&st_shapes, Dims::of(model, opts.max_rows)?.experts);
        let pin_candidates = classes_probe.count_pins(&pinned, &st_shapes);
        let (req, dims, classes) = vram_request(
            model,
            &device,
            free as u64,
            total as u64,
            engine.context_len(),
            opts,
            &st_shapes,
            pin_candidates,
            share,
            opts.in_place && index == 0 && ram_holds_every_expert(engine),
        )?;
        let plan = VramPlan::compute(&req).map_err(GpuError::Plan)?;
        for w in &plan.warnings {
            tracing::warn!("{w}");
        }
        // The RAM tier's arenas: registered (portable: every device's
        // copies use the registration), so expert copies are DMA from the
        // bytes the disk reads landed in (no bounce copy).
        let (registrations, arenas) = if index == 0 {
            register_arenas(engine, &dev)
        } else {
            (Vec::new(), Vec::new())
        };
        let rope = rope_of(model);
        let mut state = forward::State::new(
            dev,
            k,
            model,
            &plan,
            dims,
            classes,
            &st_shapes,
            rope,
            rope_positions(model, engine.context_len()),
            registrations,
            arenas,
            max_held,
            opts.ahead,
            forward::StageOf {
                tier: tier_id,
                index,
                count,
                layers: layers.clone(),
            },
        )?;
        if !pinned.is_empty() {
            state.preload_pinned(&pinned, engine.experts.as_ref(), &plan)?;
        }
        // When the cache holds every routed expert, they are all loaded now
        // (the first tokens would load them anyway) and pinned, and layers
        // route on the device with no host round trip.
        let t0 = std::time::Instant::now();
        let all = state.preload_all(engine.experts.as_ref())?;
        if all > 0 {
            tracing::info!(
                "GPU tier: {all} routed experts loaded into VRAM of {device} in {:.1} s",
                t0.elapsed().as_secs_f64()
            );
        } else if plan.in_place {
            // Otherwise, when RAM holds every routed expert, they are all
            // loaded into it now and the device reads those without a
            // VRAM slot in place: layers still route on the device.
            let t0 = std::time::Instant::now();
            tracing::info!(
                "GPU tier: loading all {} routed experts into pinned RAM, so that {device} can \
                 read those without a VRAM slot in place (a read of every expert not yet in RAM)",
                plan.classes.iter().map(|c| c.experts).sum::<usize>()
            );
            let n = state.map_ram(engine.experts.as_ref())?;
            if n > 0 {
                tracing::info!(
                    "GPU tier: every routed expert in pinned RAM ({:.1} s); {n} without a VRAM \
                     slot are read in place by {device}",
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        let (blocks, resident) = plan.held_blocks();
        let what = if count > 1 {
            format!(
                "layers {}..{}{}: ",
                layers.start,
                layers.end,
                if index + 1 == count {
                    " and the head"
                } else {
                    ""
                }
            )
        } else {
            String::new()
        };
        lines.push(format!(
            "{device}: {what}VRAM budget {}, {resident} of {blocks} dense blocks resident, {} \
             expert cache slots, {} staging slots",
            crate::tier::ByteSize(plan.budget_bytes),
            plan.cache_slots(),
            plan.classes.iter().map(|c| c.ring_slots).sum::<usize>()
        ));
        stages.push(state);
        plans.push(plan);
    }
    let summary = if lines.len() == 1 {
        format!("GPU tier on {}", lines[0])
    } else {
        format!(
            "GPU tier on {} devices, layers split by bytes: {}",
            lines.len(),
            lines.join("; ")
        )
    };
    Ok(GpuTier {
        stages: Mutex::new(stages),
        plans,
        summary,
    })
}

/// Whether the RAM tier's plan has a slot for every routed expert (so
/// holding them all at once leaves it working).
fn ram_holds_every_expert(engine: &Engine) -> bool {
    engine
        .tier
        .as_ref()
        .is_some_and(|t| t.plan().holds_every_expert())
}

/// Registers the RAM tier's arenas with CUDA (portable, so every device
/// copies from them by DMA).
fn register_arenas(
    engine: &Engine,
    dev: &CudaDevice,
) -> (Vec<HostRegistration>, Vec<Arc<PinnedArena>>) {
    let mut arenas: Vec<Arc<PinnedArena>> = Vec::new();
    let mut registrations: Vec<HostRegistration> = Vec::new();
    if let Some(t) = &engine.tier {
        for arena in t.arenas() {
            // SAFETY: the arena's mapping stays allocated while `arenas`
            // holds it, and `registrations` (dropped first, see State) ends
            // the registration before that.
            match unsafe { dev.register_host(arena.as_ptr(), arena.len_bytes()) } {
                Ok(r) => {
                    registrations.push(r);
                    arenas.push(arena);
                }
                Err(e) => tracing::warn!(
                    "could not register a RAM-tier arena of {} bytes with CUDA ({e}); expert \
                     copies from it are staged by the driver (slower)",
                    arena.len_bytes()
                ),
            }
        }
    }
    (registrations, arenas)
}

/// A zero-filled device buffer (at least one element).
pub(crate) fn zeros<T: colibri_cuda::DeviceElem>(
    dev: &CudaDevice,
    n: usize,
) -> Result<DeviceBuffer<T>, GpuError> {
    Ok(dev.alloc::<T>(n.max(1))?)
}
