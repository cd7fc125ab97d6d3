//! The forward pass on the GPU: the CPU tier's `Model::forward`, layer for
//! layer, with every product, norm, rotation, attention and combine on the
//! device.
//!
//! A batch is cut into passes of at most `max_rows` rows (each sequence's
//! tokens stay in order, so the result is the one of a single pass). A
//! pass: the host embeds the token rows into pinned memory and the compute
//! stream takes them; each layer runs RMSNorm, attention (projections,
//! q/k norms, clamps, rotary embedding, appending to each sequence's KV
//! cache, attention per sequence, output projection) and the FFN (dense
//! SwiGLU, or the MoE block: router logits read back, rows routed on the
//! host with the GPU tier's portable routing, or on the device when
//! the device knows where every expert is (VRAM, or pinned RAM read in
//! place); experts through [`ExpertTier`],
//! shared expert, combine) with residual adds; the head normalizes and
//! projects the rows that want logits, a few at a time, and reads them
//! back. Every pass ends with the compute stream drained, so pinned host
//! buffers and RAM leases are free again.
//!
//! Several devices (`--devices`) are **stages**: each [`State`] holds a
//! range of layers (their dense blocks, experts and KV caches), the last
//! one the head too. A pass runs stage after stage; between two, the
//! hidden rows (n × hidden f32) go device → pinned host → device. Every
//! stage runs the same kernels on the same inputs as one device would, so
//! the result is bit-identical to a single GPU's.

use std::sync::Arc;

use colibri_cuda::{
    ATTENTION_CHUNK, Attention, AttentionSplit, BufMut, BufView, CudaDevice, DeviceBuffer,
    DeviceRouter, Event, Graph, HostBuffer, HostRegistration, KernelSet, KvView,
    MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_K, MatvecGroup, RopeTable, WeightView,
    attention_split_records, q8_row_bytes,
};
use colibri_io::PinnedArena;
use colibri_model::config::{QkNorm, RouterKind};
use colibri_model::experts::ExpertSource;
use colibri_model::moe::Routing;
use colibri_model::rope::Rope;
use colibri_model::weights::FfnWeights;
use colibri_model::{KvCache, Logits, Model, ModelError, SeqInput};

use super::experts::{Classes, ExpertShape, ExpertTier, MoeBufs};
use super::kv::{self, KvGrant, KvShape};
use super::plan::VramPlan;
use super::route::route_portable;
use super::weights::{AttnRef, DenseBlocks, FfnRef, LinRef, MatRef, MlaQRef, MlpRef, VecRef};
use super::{AttnDims, Dims, GpuError, GpuStats, LM_ROWS, zeros};

mod attention;

/// The eps of DeepSeek's q_a/kv_a layernorms (as the CPU tier).
const MLA_LORA_NORM_EPS: f32 = 1e-6;

/// Passes of at most this many rows route on the device when every expert
/// is resident (larger ones, prefill, route on the host: the same bits
/// either way, and the host's plan launches only the experts in use).
pub(crate) const DEVICE_ROUTE_MAX_ROWS: usize = 32;

/// Element counts of the scratch buffers for a pass of `max_rows` rows.
struct ScratchSizes {
    hidden_rows: usize,
    q: usize,
    kv: usize,
    ql: usize,
    ckv: usize,
    qa: usize,
    ctx: usize,
    mo: usize,
    mtmp: usize,
    mlp: usize,
    rl: usize,
    rows: usize,
    hn: usize,
    lg: usize,
    /// Bytes of one token's attention output as a Q8 row.
    ctxq: usize,
    /// attention_split's chunk records and counters, and the chunks a row
    /// may have.
    at_rec: usize,
    at_cnt: usize,
    at_chunks: usize,
}

/// Passes of up to this many rows spread each (row, head)'s attention
/// chunks over several blocks (`attention_split`): a decode step's few
/// (row, head) pairs leave most of the device idle otherwise.
pub(super) const SPLIT_ROWS: usize = 2;
/// Blocks per (row, head) of a split attention launch.
pub(super) const SPLIT_BLOCKS: usize = 16;

fn sizes(d: &Dims, mla_fallback: bool, rope_positions: usize) -> ScratchSizes {
    let r = d.max_rows;
    let (heads, dim_v) = match d.attn {
        AttnDims::Gqa { nh, hd, .. } => (nh, hd),
        AttnDims::Mla { nh, r: rank, .. } => (nh, rank),
    };
    let at_chunks = rope_positions.div_ceil(ATTENTION_CHUNK).max(1);
    let (q, kv, ql, ckv, qa, ctx, mo, mtmp) = match d.attn {
        AttnDims::Gqa { nh, nkv, hd, .. } => (nh * hd, nkv * hd, 0, 0, 0, nh * hd, 0, 0),
        AttnDims::Mla {
            nh,
            r: rank,
            dn,
            dr,
            dv,
            q_lora,
            ..
        } => (
            nh * (dn + dr),
            0,
            q_lora.unwrap_or(0),
            rank + dr,
            nh * (rank + dr),
            nh * rank,
            nh * dv,
            if mla_fallback { nh * (dn + dv) } else { 0 },
        ),
    };
    ScratchSizes {
        hidden_rows: r * d.hidden,
        q: r * q,
        kv: r * kv,
        ql: r * ql,
        ckv: r * ckv,
        qa: r * qa,
        ctx: r * ctx,
        mo: r * mo,
        mtmp: r * mtmp,
        mlp: r * d.mlp_inter,
        // This layer's router logits, then the next MoE layer's router on
        // the same input (its guess, for copying experts ahead).
        rl: 2 * r * d.experts.max(1),
        rows: r,
        hn: LM_ROWS * d.hidden,
        lg: LM_ROWS * d.vocab,
        ctxq: if ctx.is_multiple_of(32) {
            q8_row_bytes(ctx)
        } else {
            0
        },
        at_rec: attention_split_records(SPLIT_ROWS.min(r), heads, dim_v, at_chunks)
            .unwrap_or(usize::MAX),
        at_cnt: SPLIT_ROWS.min(r) * heads,
        at_chunks,
    }
}

/// Whether MLA's W_uv must take the slow per-head path (an FP8 kv_b whose
/// head blocks do not start on a scale block).
fn mla_needs_fallback(model: &Model) -> bool {
    let AttnDims::Mla { dn, dv, .. } = (match Dims::of(model, 1) {
        Ok(d) => d.attn,
        Err(_) => return false,
    }) else {
        return false;
    };
    model.weights.layers.iter().any(|l| match &l.attn {
        colibri_model::weights::AttnWeights::Mla(a) => a
            .kv_b
            .scales()
            .is_some_and(|s| !dn.is_multiple_of(s.block) || !(dn + dv).is_multiple_of(s.block)),
        _ => false,
    })
}

/// Device bytes of scratch, MoE buffers and rotary tables (planner).
pub(crate) fn scratch_bytes(d: &Dims, rope_positions: usize, model: &Model) -> u64 {
    let s = sizes(d, mla_needs_fallback(model), rope_positions);
    let floats = 3 * s.hidden_rows
        + s.q
        + 2 * s.kv
        + s.ql
        + s.ckv
        + s.qa
        + s.ctx
        + s.mo
        + s.mtmp
        + 2 * s.mlp
        + s.hidden_rows
        + s.rows
        + s.rl
        + s.hn
        + s.lg
        + s.at_rec;
    let u32s = 2 * s.rows + LM_ROWS + s.at_cnt;
    let rope = super::rope_of(model).dim() * rope_positions;
    (4 * (floats + u32s + rope) + s.ctxq) as u64 + MoeBufs::device_bytes(d)
}

struct Scratch {
    x: DeviceBuffer<f32>,
    h: DeviceBuffer<f32>,
    a: DeviceBuffer<f32>,
    q: DeviceBuffer<f32>,
    k: DeviceBuffer<f32>,
    v: DeviceBuffer<f32>,
    ql: DeviceBuffer<f32>,
    ckv: DeviceBuffer<f32>,
    qa: DeviceBuffer<f32>,
    ctx: DeviceBuffer<f32>,
    /// One token's attention output as a Q8 row (GQA, for the output
    /// projection when it takes 8-bit activations).
    ctxq: DeviceBuffer<u8>,
    mo: DeviceBuffer<f32>,
    mtmp: DeviceBuffer<f32>,
    fg: DeviceBuffer<f32>,
    fu: DeviceBuffer<f32>,
    sh: DeviceBuffer<f32>,
    gl: DeviceBuffer<f32>,
    rl: DeviceBuffer<f32>,
    pos: DeviceBuffer<u32>,
    slot0: DeviceBuffer<u32>,
    want: DeviceBuffer<u32>,
    hn: DeviceBuffer<f32>,
    lg: DeviceBuffer<f32>,
    split: SplitScratch,
}

/// What `attention_split` keeps between its blocks.
struct SplitScratch {
    records: DeviceBuffer<f32>,
    /// Zero between launches (attention_split leaves them so).
    counters: DeviceBuffer<u32>,
    /// Chunks a row may have.
    chunks: usize,
}

/// Pinned host buffers of a pass.
struct HostIo {
    x: HostBuffer,
    pos: HostBuffer,
    rl: HostBuffer,
    want: HostBuffer,
    lg: HostBuffer,
}

/// One sequence's share of a pass.
struct Part<'a> {
    cache: &'a mut KvCache,
    tokens: &'a [u32],
    /// Token indices (within `tokens`) whose logits are wanted.
    want: Vec<usize>,
}

/// The device state of a GPU tier; one pass at a time.
pub(crate) struct State {
    // Dropped first: registrations end before the arenas they cover can go.
    registrations: Vec<HostRegistration>,
    arenas: Vec<Arc<PinnedArena>>,
    pub experts: ExpertTier,
    dense: DenseBlocks,
    s: Scratch,
    moe: MoeBufs,
    io: HostIo,
    rope: RopeDev,
    mla_fallback: bool,
    kv_grant: Arc<KvGrant>,
    kv_shape: KvShape,
    dims: Dims,
    passes: u64,
    rows: u64,
    /// The model's router as the device runs it (None: the host routes).
    device_router: Option<DeviceRouter>,
    /// Per layer: the sigmoid router's selection bias on the device.
    bias: Vec<Option<DeviceBuffer<f32>>>,
    /// The last captured step and what it was captured for.
    graph: Option<(GraphKey, Graph)>,
    graphs_captured: u64,
    /// GPU time of the replayed steps (GpuStats::graph_gpu_us).
    graph_gpu_us: f64,
    /// Set by COLIBRI_GPU_NO_GRAPH=1 or after a step that failed as a
    /// graph: every pass then runs eagerly.
    graphs_off: bool,
    /// Per-phase timing (COLIBRI_GPU_PROFILE=1): passes then run without
    /// graphs, with timed events between phases.
    profile: Option<Profile>,
    // Dropped before the device (graph first: it holds buffer addresses).
    k: KernelSet,
    dev: CudaDevice,
}

/// What a captured step depends on besides the tier's own buffers: the
/// rows of each sequence, its KV cache's place and size, the rows whose
/// logits are read.
#[derive(Clone, Debug, PartialEq, Eq)]
struct GraphKey {
    parts: Vec<(usize, u64, usize)>,
    wanted: Vec<usize>,
}

/// Phases of a decode step for the profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Embedding upload, KV growth.
    Input = 0,
    /// Norms, projections, rotary, KV append, attention, residual.
    Attention = 1,
    /// Router matvec, and on the host path the read-back, wait and routing.
    Router = 2,
    /// Routed experts (device routing and plan included), fetches, copies.
    Experts = 3,
    /// Shared expert, combine, residual.
    Combine = 4,
    /// Final norm, LM head, logits read-back.
    Head = 5,
}

pub(crate) const PHASES: [&str; 6] = ["input", "attention", "router", "experts", "combine", "head"];

/// Accumulated per-phase times: GPU (between timed events) and host (time
/// the host spent issuing the phase, waits included).
#[derive(Default)]
pub(crate) struct Profile {
    marks: Vec<(Phase, Event)>,
    last_host: Option<std::time::Instant>,
    pub gpu_ms: [f64; 6],
    pub host_ms: [f64; 6],
    pub passes: u64,
    pub layers: u64,
}

/// `y = W x (+ b)` for `n` rows.
fn linear(
    dev: &CudaDevice,
    k: &KernelSet,
    base: BufView<'_, u8>,
    l: &LinRef,
    x: BufView<'_, f32>,
    n: usize,
    mut y: BufMut<'_, f32>,
) -> Result<(), GpuError> {
    let w = l.w.view(base)?;
    k.matvec(dev, &w, x, n, y.reborrow())?;
    if let Some(b) = &l.bias {
        k.add_bias(dev, y, b.view(base)?, n)?;
    }
    Ok(())
}

/// `down(silu(gate x) · up x)` for `n` rows of `x` into `y`.
#[allow(clippy::too_many_arguments)]
fn mlp(
    dev: &CudaDevice,
    k: &KernelSet,
    base: BufView<'_, u8>,
    m: &MlpRef,
    x: BufView<'_, f32>,
    n: usize,
    y: BufMut<'_, f32>,
    fg: &mut DeviceBuffer<f32>,
    fu: &mut DeviceBuffer<f32>,
) -> Result<(), GpuError> {
    let inter = m.gate.rows;
    let (g, u, dn) = (m.gate.view(base)?, m.up.view(base)?, m.down.view(base)?);
    k.matvec(dev, &g, x, n, fg.view_mut(0..n * inter)?)?;
    k.matvec(dev, &u, x, n, fu.view_mut(0..n * inter)?)?;
    k.swiglu_inplace(
        dev,
        fg.view_mut(0..n * inter)?,
        fu.view(0..n * inter)?,
        n,
        inter,
    )?;
    k.matvec(dev, &dn, fg.view(0..n * inter)?, n, y)?;
    Ok(())
}

/// The model's router as the device can run it (kernels/moe.cu), or None
/// when the host must route (too many experts or choices, group shapes
/// the kernel does not take).
fn device_router(model: &Model) -> Option<DeviceRouter> {
    let m = model.spec.moe.as_ref()?;
    if m.num_experts > MOE_ROUTE_MAX_EXPERTS
        || m.top_k == 0
        || m.top_k > MOE_ROUTE_MAX_K
        || m.top_k > m.num_experts
    {
        return None;
    }
    match m.router {
        RouterKind::Softmax { norm_topk_prob } => Some(DeviceRouter::Softmax {
            norm: norm_topk_prob,
        }),
        RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        } => ((1..=32).contains(&n_group)
            && m.num_experts.is_multiple_of(n_group)
            && m.num_experts / n_group >= 2
            && (1..=n_group).contains(&topk_group))
        .then_some(DeviceRouter::SigmoidGrouped {
            n_group,
            topk_group,
            norm: norm_topk_prob,
            scaling: routed_scaling_factor,
        }),
    }
}

/// The rotary tables on the device.
struct RopeDev {
    cos: DeviceBuffer<f32>,
    sin: DeviceBuffer<f32>,
    dim: usize,
    positions: usize,
    interleaved: bool,
}

impl RopeDev {
    fn table(&self) -> RopeTable<'_> {
        RopeTable {
            cos: self.cos.as_view(),
            sin: self.sin.as_view(),
            rot_dim: self.dim,
            positions: self.positions,
            interleaved: self.interleaved,
        }
    }
}

static NEXT_TIER_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A fresh id for a GPU tier (its stages share it; a KV cache made by one
/// tier is refused by another).
pub(crate) fn next_tier_id() -> u64 {
    NEXT_TIER_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Which share of the model a [`State`] runs: stage `index` of `count`,
/// layers `layers` (the last stage also runs the head).
#[derive(Clone, Debug)]
pub(crate) struct StageOf {
    pub tier: u64,
    pub index: usize,
    pub count: usize,
    pub layers: std::ops::Range<usize>,
}

/// `Model::forward` on the GPU tier's stages (one per device, in layer
/// order).
pub(crate) fn run(
    stages: &mut [State],
    model: &Model,
    experts: &dyn ExpertSource,
    batch: &mut [SeqInput<'_>],
) -> Result<Vec<Vec<f32>>, GpuError> {
    let spec = &model.spec;
    let (first, hd) = match stages.first() {
        Some(s) => (s, s.dims.hidden),
        None => return Err(GpuError::Internal("a GPU tier without a device".into())),
    };
    let (max_rows, positions) = (first.dims.max_rows, first.rope.positions);
    for seq in batch.iter() {
        seq.cache.check_room(seq.tokens.len())?;
        if let Some(&t) = seq.tokens.iter().find(|&&t| t as usize >= spec.vocab_size) {
            return Err(ModelError::TokenOutOfRange {
                id: t,
                vocab: spec.vocab_size,
            }
            .into());
        }
        if seq.cache.len() + seq.tokens.len() > positions {
            return Err(ModelError::ContextExceeded {
                needed: seq.cache.len() + seq.tokens.len(),
                context: positions,
            }
            .into());
        }
    }
    let mut out: Vec<Vec<f32>> = vec![Vec::new(); batch.len()];
    let mut done = vec![0usize; batch.len()];
    let mut hidden: Vec<f32> = Vec::new();
    loop {
        // The next pass: a chunk of each unfinished sequence, in order, up
        // to max_rows rows.
        let mut room = max_rows;
        let mut parts = Vec::new();
        let mut owners = Vec::new();
        for (s, seq) in batch.iter_mut().enumerate() {
            let left = seq.tokens.len() - done[s];
            if left == 0 || room == 0 {
                continue;
            }
            let take = left.min(room);
            room -= take;
            let (a, b) = (done[s], done[s] + take);
            let last = b == seq.tokens.len();
            let want = match seq.logits {
                Logits::None => Vec::new(),
                Logits::Last if last => vec![take - 1],
                Logits::Last => Vec::new(),
                Logits::All => (0..take).collect(),
            };
            parts.push(Part {
                cache: &mut *seq.cache,
                tokens: &seq.tokens[a..b],
                want,
            });
            owners.push(s);
            done[s] = b;
        }
        if parts.is_empty() {
            break;
        }
        let n: usize = parts.iter().map(|p| p.tokens.len()).sum();
        let mut logits = Vec::new();
        for (i, st) in stages.iter_mut().enumerate() {
            let input = (i > 0).then_some(&hidden[..]);
            let result = st.pass(model, experts, &mut parts, input);
            // Whatever happened, the stream drains and RAM leases go back.
            let drained = st.dev.synchronize();
            st.experts.release_leases();
            logits = result?;
            drained?;
            if !st.is_last() {
                // The next stage's input: this one's hidden rows, read
                // back into its pinned buffer by the pass.
                hidden.clear();
                hidden.extend_from_slice(&st.io.x.typed::<f32>()[..n * hd]);
            }
        }
        for p in parts.iter_mut() {
            p.cache.append_external(p.tokens.len())?;
        }
        for (o, l) in owners.iter().zip(logits) {
            // A decode step's logits move (608 KB for a 152K vocabulary);
            // a sequence split over passes appends.
            if out[*o].is_empty() {
                out[*o] = l;
            } else {
                out[*o].extend_from_slice(&l);
            }
        }
    }
    Ok(out)
}

impl State {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: CudaDevice,
        k: KernelSet,
        model: &Model,
        plan: &VramPlan,
        dims: Dims,
        classes: Classes,
        shapes: &[Option<ExpertShape>],
        rope: Rope,
        rope_positions: usize,
        registrations: Vec<HostRegistration>,
        arenas: Vec<Arc<PinnedArena>>,
        max_held: usize,
        ahead: usize,
        stage: StageOf,
    ) -> Result<State, GpuError> {
        let mla_fallback = mla_needs_fallback(model);
        let z = sizes(&dims, mla_fallback, rope_positions);
        let f = |n: usize| zeros::<f32>(&dev, n);
        let s = Scratch {
            x: f(z.hidden_rows)?,
            h: f(z.hidden_rows)?,
            a: f(z.hidden_rows)?,
            q: f(z.q)?,
            k: f(z.kv)?,
            v: f(z.kv)?,
            ql: f(z.ql)?,
            ckv: f(z.ckv)?,
            qa: f(z.qa)?,
            ctx: f(z.ctx)?,
            ctxq: zeros::<u8>(&dev, z.ctxq)?,
            mo: f(z.mo)?,
            mtmp: f(z.mtmp)?,
            fg: f(z.mlp)?,
            fu: f(z.mlp)?,
            sh: f(z.hidden_rows)?,
            gl: f(z.rows)?,
            rl: f(z.rl)?,
            pos: zeros::<u32>(&dev, z.rows)?,
            slot0: zeros::<u32>(&dev, z.rows)?,
            want: zeros::<u32>(&dev, LM_ROWS)?,
            hn: f(z.hn)?,
            lg: f(z.lg)?,
            split: SplitScratch {
                records: f(z.at_rec)?,
                counters: zeros::<u32>(&dev, z.at_cnt)?,
                chunks: z.at_chunks,
            },
        };
        let io = HostIo {
            x: dev.alloc_host(4 * z.hidden_rows)?,
            pos: dev.alloc_host(4 * z.rows)?,
            rl: dev.alloc_host(4 * z.rl)?,
            want: dev.alloc_host(4 * LM_ROWS)?,
            lg: dev.alloc_host(4 * z.lg)?,
        };
        let half = rope.dim() / 2;
        let (mut cos_all, mut sin_all) = (
            Vec::with_capacity(half * rope_positions),
            Vec::with_capacity(half * rope_positions),
        );
        let (mut c, mut sn) = (Vec::new(), Vec::new());
        for p in 0..rope_positions {
            rope.cos_sin(p, &mut c, &mut sn);
            cos_all.extend_from_slice(&c);
            sin_all.extend_from_slice(&sn);
        }
        let rope_interleaved = matches!(
            model.spec.attention,
            colibri_model::config::AttentionSpec::Mla {
                rope_interleave: true,
                ..
            }
        );
        let held = |b: usize| plan.holds_block(b);
        let dense = DenseBlocks::load(&dev, &model.weights, &plan.dense_resident, &held)?;
        let experts = ExpertTier::new(&dev, classes, shapes, dims.experts, plan, max_held, ahead)?;
        let moe = MoeBufs::new(&dev, &dims)?;
        let (a, b) = dims.kv_parts();
        // COLIBRI_GPU_HOST_ROUTE=1 routes every layer on the host (for
        // comparing the two paths; the results are the same bits).
        let device_router = device_router(model)
            .filter(|_| std::env::var_os("COLIBRI_GPU_HOST_ROUTE").is_none_or(|v| v != "1"));
        let bias = model
            .weights
            .layers
            .iter()
            .map(|l| match &l.ffn {
                FfnWeights::Moe(m) => match (&m.selection_bias, device_router) {
                    (Some(b), Some(DeviceRouter::SigmoidGrouped { .. })) => dev.upload(b).map(Some),
                    _ => Ok(None),
                },
                FfnWeights::Dense(_) => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let profile = std::env::var_os("COLIBRI_GPU_PROFILE")
            .is_some_and(|v| v == "1")
            .then(Profile::default);
        let state = State {
            registrations,
            arenas,
            experts,
            dense,
            s,
            moe,
            io,
            rope: RopeDev {
                cos: dev.upload(&cos_all)?,
                sin: dev.upload(&sin_all)?,
                dim: rope.dim(),
                positions: rope_positions,
                interleaved: rope_interleaved,
            },
            mla_fallback,
            kv_grant: KvGrant::new(plan.kv_vram_bytes),
            kv_shape: KvShape {
                tier: stage.tier,
                stage: stage.index,
                stages: stage.count,
                layers: stage.layers,
                a,
                b,
            },
            dims,
            passes: 0,
            rows: 0,
            device_router,
            bias,
            graph: None,
            graphs_captured: 0,
            graph_gpu_us: 0.0,
            graphs_off: std::env::var_os("COLIBRI_GPU_NO_GRAPH").is_some_and(|v| v == "1"),
            profile,
            k,
            dev,
        };
        state.dev.synchronize()?;
        Ok(state)
    }

    /// Loads every routed expert into VRAM when the cache has room for
    /// all (see `ExpertTier::preload_all`).
    pub fn preload_all(&mut self, source: &dyn ExpertSource) -> Result<usize, GpuError> {
        self.experts.preload_all(&self.dev, source)
    }

    /// When VRAM cannot hold every routed expert but the RAM tier's
    /// pinned arenas hold them all: reads the ones without a VRAM slot in
    /// place (see `ExpertTier::map_ram`). Returns how many.
    pub fn map_ram(&mut self, source: &dyn ExpertSource) -> Result<usize, GpuError> {
        self.experts
            .map_ram(&self.dev, &self.dims, source, &self.registrations)
    }

    pub fn stats(&self) -> GpuStats {
        let c = self.experts.counters;
        let dc = self.dev.counters();
        GpuStats {
            passes: self.passes,
            rows: self.rows,
            cache: self.experts.cache_stats(),
            experts_copied: c.copied,
            expert_h2d_bytes: c.h2d_bytes,
            expert_h2d_copies: c.h2d_copies,
            dense_h2d_bytes: self.dense.streamed_bytes,
            promotions: c.promotions + self.experts.in_place.promotions,
            kv_vram_bytes: self
                .kv_grant
                .in_vram
                .load(std::sync::atomic::Ordering::Relaxed),
            kv_host_bytes: self
                .kv_grant
                .in_host
                .load(std::sync::atomic::Ordering::Relaxed),
            arenas_registered: self.registrations.len().min(self.arenas.len()),
            dense_resident_blocks: self.dense.resident_count(),
            device_routed_layers: c.device_routed,
            graphs_captured: self.graphs_captured,
            graph_gpu_us: self.graph_gpu_us as u64,
            launches: dc.launches,
            graph_launches: dc.graph_launches,
            host_waits: dc.host_waits,
            copies: dc.copies,
            ahead_copied: c.ahead_copied,
            ahead_bytes: c.ahead_bytes,
            ahead_used: c.ahead_used,
            in_place_passes: self.experts.in_place.passes,
            in_place_reads: self.experts.in_place.reads,
            in_place_bytes: self.experts.in_place.bytes,
            route_switches: self.experts.in_place.switches,
        }
    }

    pub fn preload_pinned(
        &mut self,
        pinned: &[(usize, usize)],
        source: &dyn ExpertSource,
        plan: &VramPlan,
    ) -> Result<usize, GpuError> {
        self.experts.preload_pinned(&self.dev, pinned, source, plan)
    }

    fn sync_compute(&self) -> Result<(), GpuError> {
        self.dev.record_compute()?.synchronize()?;
        Ok(())
    }

    /// The first MoE layer after `l` and its router, if this stage holds
    /// it.
    fn next_moe(&self, l: usize) -> Option<(usize, MatRef)> {
        ((l + 1)..self.kv_shape.layers.end).find_map(|l2| match self.dense.layers.get(l2)?.ffn {
            FfnRef::Moe { router, .. } => Some((l2, router)),
            FfnRef::Dense(_) => None,
        })
    }

    /// Whether layer `l` is this stage's.
    pub fn holds_layer(&self, l: usize) -> bool {
        self.kv_shape.layers.contains(&l)
    }

    /// Whether this stage runs the head (the last of the tier's devices).
    fn is_last(&self) -> bool {
        self.kv_shape.stage + 1 == self.kv_shape.stages
    }

    /// This stage's share of a pass: the embedded tokens (first stage) or
    /// the previous stage's hidden rows (`hidden`) through this stage's
    /// layers; the last stage returns the wanted rows' logits, the others
    /// leave their hidden rows in `io.x` (read back before this returns
    /// and the stream drains).
    fn pass(
        &mut self,
        model: &Model,
        experts: &dyn ExpertSource,
        parts: &mut [Part<'_>],
        hidden: Option<&[f32]>,
    ) -> Result<Vec<Vec<f32>>, GpuError> {
        let d = self.dims;
        let hd = d.hidden;
        let n: usize = parts.iter().map(|p| p.tokens.len()).sum();
        self.mark(Phase::Input)?;
        let mut starts = Vec::with_capacity(parts.len());
        {
            let x_h = self.io.x.typed_mut::<f32>();
            let mut r = 0;
            for p in parts.iter() {
                starts.push(r);
                r += p.tokens.len();
            }
            match hidden {
                Some(h) => {
                    if h.len() != n * hd {
                        return Err(GpuError::Internal(format!(
                            "{} hidden floats for {n} rows",
                            h.len()
                        )));
                    }
                    x_h[..n * hd].copy_from_slice(h);
                }
                None => {
                    let rows = parts.iter().flat_map(|p| p.tokens.iter());
                    for (r, &t) in rows.enumerate() {
                        model
                            .weights
                            .embed
                            .row_to_f32(t as usize, &mut x_h[r * hd..(r + 1) * hd]);
                    }
                }
            }
            let pos_h = self.io.pos.typed_mut::<u32>();
            let mut r = 0;
            for p in parts.iter() {
                for i in 0..p.tokens.len() {
                    pos_h[r] = (p.cache.len() + i) as u32;
                    r += 1;
                }
            }
        }
        for p in parts.iter_mut() {
            let need = p.cache.len() + p.tokens.len();
            kv::ensure(
                p.cache,
                need,
                &self.kv_shape,
                &self.dev,
                &self.k,
                &self.kv_grant,
            )?;
        }
        // The head (last stage), for the rows that want logits.
        let mut wanted = Vec::new();
        for (pi, p) in parts.iter().enumerate().filter(|_| self.is_last()) {
            for &i in &p.want {
                wanted.push((pi, starts[pi] + i));
            }
        }
        let mut logits: Vec<Vec<f32>> = vec![Vec::new(); parts.len()];
        let mut replayed = false;
        // Promotions of the last pass are in their slots now; a pass that
        // routes on the device reads some experts in place and promotes.
        let device_routed = self.dims.experts > 0 && self.device_routes(n);
        // A pass that could read in place is timed for the route picker.
        let timed = (self.dims.experts > 0
            && self.device_router.is_some()
            && self.experts.reads_in_place()
            && n <= DEVICE_ROUTE_MAX_ROWS)
            .then(std::time::Instant::now);
        self.experts.settle()?;
        if device_routed {
            self.experts.begin_device_pass(&self.dev)?;
        }
        if self.graphable(n, &wanted) {
            match self.replay_step(model, experts, n, parts, &starts, &wanted) {
                Ok(()) => {
                    replayed = true;
                    let vocab = d.vocab;
                    let lg = self.io.lg.typed::<f32>();
                    for (j, &(pi, _)) in wanted.iter().enumerate() {
                        logits[pi].extend_from_slice(&lg[j * vocab..(j + 1) * vocab]);
                    }
                }
                Err(e) => {
                    // The step is recomputed from its inputs below (the
                    // KV rows it may have appended are rewritten with the
                    // same values); graphs stay off from now on.
                    tracing::warn!("GPU tier: a captured decode step failed ({e}); graphs are off");
                    self.graphs_off = true;
                    self.graph = None;
                    self.dev.synchronize()?;
                }
            }
        }
        if !replayed {
            self.upload_inputs(n)?;
            self.mark(Phase::Input)?;
            for l in self.kv_shape.layers.clone() {
                self.dense.prepare(&self.dev, l)?;
                let r = self.layer(model, experts, l, n, parts, &starts);
                self.dense.finish(&self.dev)?;
                r?;
            }
            if device_routed {
                self.experts.download_log(&self.dev)?;
            }
            if !self.is_last() {
                self.download_hidden(n)?;
            } else if !wanted.is_empty() {
                let head = self.dense.head_block();
                self.dense.prepare(&self.dev, head)?;
                let r = self.head(n, &wanted, &mut logits);
                self.dense.finish(&self.dev)?;
                r?;
            }
            self.mark(Phase::Head)?;
            self.profile_pass(self.kv_shape.layers.len())?;
        }
        if device_routed && self.experts.reads_in_place() {
            if !replayed {
                self.sync_compute()?;
            }
            self.experts.end_device_pass(n);
        }
        if let Some(t0) = timed {
            if !device_routed {
                self.sync_compute()?;
            }
            self.experts.record_pass(t0.elapsed().as_secs_f64());
        }
        self.passes += 1;
        self.rows += n as u64;
        Ok(logits)
    }

    fn upload_inputs(&mut self, n: usize) -> Result<(), GpuError> {
        let hd = self.dims.hidden;
        // SAFETY: the pinned inputs are written only between passes, and
        // every pass ends with the compute stream drained (a captured step
        // reads them when it is replayed, after the host wrote them).
        unsafe {
            self.dev.upload_async(
                &self.io.x.typed::<f32>()[..n * hd],
                self.s.x.view_mut(0..n * hd)?,
            )?;
            self.dev
                .upload_async(&self.io.pos.typed::<u32>()[..n], self.s.pos.view_mut(0..n)?)?;
        }
        Ok(())
    }

    /// The hidden rows into `io.x` (a stage before the last), read by the
    /// host once the stream has drained.
    fn download_hidden(&mut self, n: usize) -> Result<(), GpuError> {
        let hd = self.dims.hidden;
        // SAFETY: `io.x` is read by the host only after the pass's stream
        // has drained, and written again only by the next pass.
        unsafe {
            self.dev.download_async(
                self.s.x.view(0..n * hd)?,
                &mut self.io.x.typed_mut::<f32>()[..n * hd],
            )?;
        }
        Ok(())
    }

    /// Whether this pass can run as a captured graph: every MoE layer
    /// routes on the device (the device table knows where every expert is,
    /// few rows), nothing
    /// streams, the logits fit one head chunk (or a stage before the last
    /// hands its hidden rows on), and no profile is taken.
    fn graphable(&self, n: usize, wanted: &[(usize, usize)]) -> bool {
        self.profile.is_none()
            && !self.graphs_off
            && (self.dims.experts == 0 || self.device_routes(n))
            && n <= DEVICE_ROUTE_MAX_ROWS
            && self.dense.all_resident()
            && (!self.is_last() || (!wanted.is_empty() && wanted.len() <= LM_ROWS))
    }

    /// Whether the MoE layers of a pass of `n` rows route on the device:
    /// it knows where every expert is (VRAM, or pinned RAM read in place)
    /// and the pass is small (larger ones, prefill, route on the host: the
    /// same bits either way, and the host's plan launches only the experts
    /// in use).
    fn device_routes(&self, n: usize) -> bool {
        self.device_router.is_some()
            && self.experts.routes_on_device()
            && n <= DEVICE_ROUTE_MAX_ROWS
    }

    /// Runs the pass as one graph replay, capturing it first when its
    /// shape (rows, KV caches, wanted rows) differs from the last one's.
    /// The inputs were written to pinned memory; the logits of the wanted
    /// rows are in `io.lg` when this returns.
    fn replay_step(
        &mut self,
        model: &Model,
        experts: &dyn ExpertSource,
        n: usize,
        parts: &mut [Part<'_>],
        starts: &[usize],
        wanted: &[(usize, usize)],
    ) -> Result<(), GpuError> {
        let mut key = GraphKey {
            parts: Vec::with_capacity(parts.len()),
            wanted: wanted.iter().map(|&(_, r)| r).collect(),
        };
        for p in parts.iter_mut() {
            let m = p.tokens.len();
            let kv = kv::attached(p.cache, self.kv_shape.stage)?;
            key.parts.push((m, kv.device_ptr(), kv.capacity()));
        }
        for (j, &(_, row)) in wanted.iter().enumerate() {
            self.io.want.typed_mut::<u32>()[j] = row as u32;
        }
        if self.graph.as_ref().is_none_or(|(k, _)| *k != key) {
            self.graph = None;
            self.dev.begin_capture()?;
            let r = self.enqueue_step(model, experts, n, parts, starts, wanted.len());
            // The capture ends whatever happened, so the stream is usable.
            let g = self.dev.end_capture();
            r?;
            let g = g?.ok_or_else(|| GpuError::Internal("an empty graph was captured".into()))?;
            self.graph = Some((key, g));
            self.graphs_captured += 1;
        }
        let (_, g) = self
            .graph
            .as_ref()
            .ok_or_else(|| GpuError::Internal("no graph".into()))?;
        let t0 = self.dev.record_compute_timed()?;
        // SAFETY: the graph was captured for exactly these rows and KV
        // caches (the key: their device addresses and capacities), and
        // every other buffer it touches is the tier's own, alive and of
        // the same size as at capture. Its pinned inputs were written
        // above and before.
        unsafe { self.dev.replay(g)? };
        let t1 = self.dev.record_compute_timed()?;
        self.sync_compute()?;
        self.graph_gpu_us += 1e3 * f64::from(t0.elapsed_ms(&t1)?);
        Ok(())
    }

    /// The work of a pass whose every MoE layer routes on the device, up to
    /// the logits' read-back into `io.lg`, without waiting for anything.
    fn enqueue_step(
        &mut self,
        model: &Model,
        experts: &dyn ExpertSource,
        n: usize,
        parts: &mut [Part<'_>],
        starts: &[usize],
        wanted: usize,
    ) -> Result<(), GpuError> {
        let d = self.dims;
        let (hd, vocab) = (d.hidden, d.vocab);
        self.upload_inputs(n)?;
        for l in self.kv_shape.layers.clone() {
            self.dense.prepare(&self.dev, l)?;
            let r = self.layer(model, experts, l, n, parts, starts);
            self.dense.finish(&self.dev)?;
            r?;
        }
        self.experts.download_log(&self.dev)?;
        if !self.is_last() {
            return self.download_hidden(n);
        }
        let head = self.dense.head_block();
        self.dense.prepare(&self.dev, head)?;
        let base = self.dense.view(head)?;
        let href = self.dense.head;
        let norm = href.norm.view(base)?;
        let lm = href.lm_head.view(base)?;
        // SAFETY: `want` was written by the host before the capture and
        // before each replay (the same rows: they are part of the key);
        // every row is < n.
        unsafe {
            self.dev.upload_async(
                &self.io.want.typed::<u32>()[..wanted],
                self.s.want.view_mut(0..wanted)?,
            )?;
            self.k.gather_rows(
                &self.dev,
                self.s.x.view(0..n * hd)?,
                hd,
                n,
                self.s.want.view(0..wanted)?,
                self.s.hn.view_mut(0..wanted * hd)?,
                hd,
                hd,
            )?;
        }
        self.k.rms_norm_inplace(
            &self.dev,
            self.s.hn.view_mut(0..wanted * hd)?,
            norm,
            wanted,
            hd,
            d.eps,
        )?;
        self.k.matvec(
            &self.dev,
            &lm,
            self.s.hn.view(0..wanted * hd)?,
            wanted,
            self.s.lg.view_mut(0..wanted * vocab)?,
        )?;
        // SAFETY: the pinned logits are read only after the replay's sync.
        unsafe {
            self.dev.download_async(
                self.s.lg.view(0..wanted * vocab)?,
                &mut self.io.lg.typed_mut::<f32>()[..wanted * vocab],
            )?;
        }
        self.dense.finish(&self.dev)
    }

    /// Profile: the phase that just ended.
    fn mark(&mut self, phase: Phase) -> Result<(), GpuError> {
        let Some(p) = self.profile.as_mut() else {
            return Ok(());
        };
        let now = std::time::Instant::now();
        if let Some(t) = p.last_host {
            p.host_ms[phase as usize] += now.duration_since(t).as_secs_f64() * 1e3;
        }
        p.last_host = Some(now);
        p.marks.push((phase, self.dev.record_compute_timed()?));
        Ok(())
    }

    /// Profile: the GPU time between the pass's marks, once it has drained.
    fn profile_pass(&mut self, layers: usize) -> Result<(), GpuError> {
        let Some(p) = self.profile.as_mut() else {
            return Ok(());
        };
        let marks = std::mem::take(&mut p.marks);
        if let Some((_, last)) = marks.last() {
            last.synchronize()?;
        }
        for w in marks.windows(2) {
            p.gpu_ms[w[1].0 as usize] += w[0].1.elapsed_ms(&w[1].1)? as f64;
        }
        p.passes += 1;
        p.layers += layers as u64;
        p.last_host = None;
        Ok(())
    }

    pub fn reset_profile(&mut self) {
        if let Some(p) = self.profile.as_mut() {
            *p = Profile::default();
        }
    }

    pub fn profile(&self) -> Option<&Profile> {
        self.profile.as_ref()
    }

    fn head(
        &mut self,
        n: usize,
        wanted: &[(usize, usize)],
        logits: &mut [Vec<f32>],
    ) -> Result<(), GpuError> {
        let d = self.dims;
        let (hd, vocab) = (d.hidden, d.vocab);
        let head = self.dense.head_block();
        let base = self.dense.view(head)?;
        let href = self.dense.head;
        let norm = href.norm.view(base)?;
        let lm = href.lm_head.view(base)?;
        for chunk in wanted.chunks(LM_ROWS) {
            let c = chunk.len();
            for (j, &(_, row)) in chunk.iter().enumerate() {
                self.io.want.typed_mut::<u32>()[j] = row as u32;
            }
            // SAFETY: `want` is written only here, after the previous
            // chunk's read-back drained the stream; rows are < n.
            unsafe {
                self.dev.upload_async(
                    &self.io.want.typed::<u32>()[..c],
                    self.s.want.view_mut(0..c)?,
                )?;
                self.k.gather_rows(
                    &self.dev,
                    self.s.x.view(0..n * hd)?,
                    hd,
                    n,
                    self.s.want.view(0..c)?,
                    self.s.hn.view_mut(0..c * hd)?,
                    hd,
                    hd,
                )?;
            }
            self.k.rms_norm_inplace(
                &self.dev,
                self.s.hn.view_mut(0..c * hd)?,
                norm,
                c,
                hd,
                d.eps,
            )?;
            self.k.matvec(
                &self.dev,
                &lm,
                self.s.hn.view(0..c * hd)?,
                c,
                self.s.lg.view_mut(0..c * vocab)?,
            )?;
            // SAFETY: the pinned logits are read only after the sync below.
            unsafe {
                self.dev.download_async(
                    self.s.lg.view(0..c * vocab)?,
                    &mut self.io.lg.typed_mut::<f32>()[..c * vocab],
                )?;
            }
            self.sync_compute()?;
            let lg = self.io.lg.typed::<f32>();
            for (j, &(pi, _)) in chunk.iter().enumerate() {
                logits[pi].extend_from_slice(&lg[j * vocab..(j + 1) * vocab]);
            }
        }
        Ok(())
    }

    fn layer(
        &mut self,
        model: &Model,
        experts: &dyn ExpertSource,
        l: usize,
        n: usize,
        parts: &mut [Part<'_>],
        starts: &[usize],
    ) -> Result<(), GpuError> {
        let d = self.dims;
        let hd = d.hidden;
        let lr = self.dense.layers[l];
        {
            let base = self.dense.view(l)?;
            self.k.rms_norm(
                &self.dev,
                self.s.x.view(0..n * hd)?,
                lr.attn_norm.view(base)?,
                self.s.h.view_mut(0..n * hd)?,
                n,
                hd,
                d.eps,
            )?;
        }
        self.attention(model, l, n, parts, starts, &lr.attn)?;
        {
            // The residual add and the FFN norm in one pass.
            let base = self.dense.view(l)?;
            self.k.add_rms_norm(
                &self.dev,
                self.s.x.view_mut(0..n * hd)?,
                self.s.a.view(0..n * hd)?,
                lr.ffn_norm.view(base)?,
                self.s.h.view_mut(0..n * hd)?,
                n,
                hd,
                d.eps,
            )?;
        }
        self.mark(Phase::Attention)?;
        match lr.ffn {
            FfnRef::Dense(m) => {
                let base = self.dense.view(l)?;
                mlp(
                    &self.dev,
                    &self.k,
                    base,
                    &m,
                    self.s.h.view(0..n * hd)?,
                    n,
                    self.s.a.view_mut(0..n * hd)?,
                    &mut self.s.fg,
                    &mut self.s.fu,
                )?;
                self.k.add_inplace(
                    &self.dev,
                    self.s.x.view_mut(0..n * hd)?,
                    self.s.a.view(0..n * hd)?,
                )?;
            }
            // The combine adds the MoE output into the residual stream.
            FfnRef::Moe {
                router,
                shared,
                shared_gate,
            } => self.moe(model, experts, l, n, &router, shared, shared_gate)?,
        }
        self.mark(Phase::Combine)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn moe(
        &mut self,
        model: &Model,
        source: &dyn ExpertSource,
        l: usize,
        n: usize,
        router: &MatRef,
        shared: Option<MlpRef>,
        shared_gate: Option<MatRef>,
    ) -> Result<(), GpuError> {
        let d = self.dims;
        let (hd, ne, k) = (d.hidden, d.experts, d.top_k);
        let spec = model
            .spec
            .moe
            .as_ref()
            .ok_or_else(|| GpuError::Internal("MoE layer without MoE spec".into()))?;
        let selection_bias = match &model.weights.layers[l].ffn {
            FfnWeights::Moe(m) => m.selection_bias.as_deref(),
            FfnWeights::Dense(_) => None,
        };
        {
            let base = self.dense.view(l)?;
            let w = router.view(base)?;
            self.k.matvec(
                &self.dev,
                &w,
                self.s.h.view(0..n * hd)?,
                n,
                self.s.rl.view_mut(0..n * ne)?,
            )?;
        }
        match self.device_router {
            Some(router) if self.device_routes(n) => {
                // The device knows where every expert is: route and plan
                // there, no read-back, no wait.
                self.mark(Phase::Router)?;
                let bias = self.bias[l].as_ref().map(|b| b.as_view());
                self.experts.moe_layer_resident(
                    &self.dev,
                    &self.k,
                    &d,
                    l,
                    n,
                    self.s.rl.view(0..n * ne)?,
                    router,
                    bias,
                    self.s.h.view(0..n * hd)?,
                    &mut self.moe,
                )?;
                self.mark(Phase::Experts)?;
            }
            _ => {
                // The host must know the routing to fetch what is missing.
                // The next MoE layer's router on this layer's input guesses
                // that layer's experts, to copy them ahead while this one
                // computes (read back with this layer's logits).
                let nl = n * ne;
                let ahead = match self.next_moe(l) {
                    Some((l2, r2)) if self.experts.can_stage_ahead(l2) => {
                        match self.dense.vram_view(l2) {
                            Some(base) => {
                                let w = r2.view(base)?;
                                self.k.matvec(
                                    &self.dev,
                                    &w,
                                    self.s.h.view(0..n * hd)?,
                                    n,
                                    self.s.rl.view_mut(nl..2 * nl)?,
                                )?;
                                Some(l2)
                            }
                            None => None,
                        }
                    }
                    _ => None,
                };
                let read = if ahead.is_some() { 2 * nl } else { nl };
                // SAFETY: the pinned router logits are read after the sync
                // below.
                unsafe {
                    self.dev.download_async(
                        self.s.rl.view(0..read)?,
                        &mut self.io.rl.typed_mut::<f32>()[..read],
                    )?;
                }
                self.sync_compute()?;
                let logits = &self.io.rl.typed::<f32>()[..read];
                let routing: Vec<Routing> = logits[..nl]
                    .chunks_exact(ne)
                    .map(|row| route_portable(spec, row, selection_bias))
                    .collect();
                let guesses = match ahead {
                    Some(l2) => {
                        let bias = match &model.weights.layers[l2].ffn {
                            FfnWeights::Moe(m) => m.selection_bias.as_deref(),
                            FfnWeights::Dense(_) => None,
                        };
                        let rows: Vec<Routing> = logits[nl..]
                            .chunks_exact(ne)
                            .map(|row| route_portable(spec, row, bias))
                            .collect();
                        Some((l2, crate::prefetch::router::likely_first(&rows, ne)))
                    }
                    None => None,
                };
                self.mark(Phase::Router)?;
                self.experts.moe_layer(
                    &self.dev,
                    &self.k,
                    &d,
                    l,
                    &routing,
                    self.s.h.view(0..n * hd)?,
                    &mut self.moe,
                    source,
                )?;
                if let Some((l2, ids)) = guesses {
                    self.experts.stage_ahead(&self.dev, l2, &ids, source)?;
                }
                self.mark(Phase::Experts)?;
            }
        }
        let base = self.dense.view(l)?;
        let has_shared = shared.is_some();
        if let Some(m) = shared {
            mlp(
                &self.dev,
                &self.k,
                base,
                &m,
                self.s.h.view(0..n * hd)?,
                n,
                self.s.sh.view_mut(0..n * hd)?,
                &mut self.s.fg,
                &mut self.s.fu,
            )?;
        }
        let has_gate = shared_gate.is_some();
        if let Some(g) = shared_gate {
            let w = g.view(base)?;
            self.k.matvec(
                &self.dev,
                &w,
                self.s.h.view(0..n * hd)?,
                n,
                self.s.gl.view_mut(0..n)?,
            )?;
        }
        // SAFETY: the slot rows are pair rows < n·k (comb_slot_rows), in
        // stream order before this launch.
        unsafe {
            self.k.moe_combine_rows_into(
                &self.dev,
                self.moe.eo.view(0..n * k * hd)?,
                self.moe.comb_slot_rows(n * k)?,
                self.experts
                    .routed_ids(&self.moe, l, n * k, self.device_routes(n))?,
                self.moe.comb_w(n * k)?,
                if has_shared {
                    Some(self.s.sh.view(0..n * hd)?)
                } else {
                    None
                },
                if has_gate {
                    Some(self.s.gl.view(0..n)?)
                } else {
                    None
                },
                self.s.x.view_mut(0..n * hd)?,
                n,
                k,
                hd,
                true,
            )?;
        }
        Ok(())
    }
}
