//! `colibri synth`: a synthetic model with the real geometry of a released
//! checkpoint (or of any `config.json`), random weights from a fixed seed,
//! written as a packed store or a GGUF file in f32, bf16, q8_0 or q4_0.
//!
//! It is for measuring a drive and the engine before downloading a model:
//! the files have exactly the sizes, layouts and read patterns of the real
//! ones. The weights are noise (uniform, bf16-valued, scaled so activations
//! stay finite through every layer; see [`random`]).
//!
//! - [`presets`]: real `config.json` values;
//! - [`random`]: deterministic, row-addressable random values;
//! - [`gguf`]: the GGUF layout of a synthetic model.
//!
//! Writing streams like `colibri convert` (the packed store *is* written by
//! [`crate::convert::write_store`] from a generating source): one tensor
//! piece or one expert at a time, whatever the model's size.

pub mod gguf;
pub mod presets;
pub mod random;

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use serde_json::Value;

pub use self::gguf::GgufMix;
use self::random::SynthMatrix;
use crate::config::{AttentionSpec, FfnKind, ModelSpec};
use crate::convert::cast::{Quant, RowSource};
use crate::convert::memory::PeakMemory;
use crate::convert::tensors::{self, Role, Shape};
use crate::convert::{ConvertOptions, ConvertSource, Progress, SourceTensor, TensorData};
use crate::error::{ModelError, Result};
use crate::format::WeightFormat;
use crate::source::packed::Unit;
use crate::source::packed::manifest::Architecture;
use crate::weights::TensorNames;

/// The seed when none is given.
pub const DEFAULT_SEED: u64 = 0xC011_B121;

/// What file synth writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SynthFormat {
    /// A packed expert store (directory).
    Packed,
    /// A GGUF file.
    Gguf,
}

/// A synthetic model: its `config.json` and seed.
pub struct SynthSource {
    spec: ModelSpec,
    config: Value,
    seed: u64,
    /// The formats of a GGUF file's head and experts, when not `quant`'s.
    mix: GgufMix,
}

impl SynthSource {
    pub fn new(config: Value, seed: u64) -> Result<SynthSource> {
        let spec = ModelSpec::from_json(&config)?;
        if spec.fp8_block != 128 || config.get("quantization_config").is_some() {
            return Err(ModelError::Config(
                "synth writes f32/bf16/q8_0/q4_0 weights: remove `quantization_config`".into(),
            ));
        }
        Ok(SynthSource {
            spec,
            config,
            seed,
            mix: GgufMix::default(),
        })
    }

    /// The output head stored as `head` in a GGUF file (llama.cpp's Q4_0
    /// and k-quant files store it as Q6_K) instead of in bf16.
    pub fn with_head(mut self, head: WeightFormat) -> SynthSource {
        self.mix.head = Some(head);
        self
    }

    /// The routed experts stored as `experts` in a GGUF file (a Q4_K_M
    /// file's are mostly Q4_K) instead of in `quant`'s format.
    pub fn with_experts(mut self, experts: WeightFormat) -> SynthSource {
        self.mix.experts = Some(experts);
        self
    }

    /// The routed experts as a Q4_K_M file stores them: Q4_K, but the
    /// down projections of llama.cpp's `use_more_bits` layers in Q6_K.
    pub fn with_q4_k_m_experts(mut self) -> SynthSource {
        self.mix.experts = Some(WeightFormat::Q4K);
        self.mix.more_bits_down = true;
        self
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Expert `e` of `layer`: gate, up, down.
    fn expert(&self, layer: usize, e: usize) -> Result<[SynthMatrix; 3]> {
        let moe = self
            .spec
            .moe
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("the model has no experts".into()))?;
        let (h, i) = (self.spec.hidden_size, moe.intermediate_size);
        let [g, u, d] = TensorNames::new(self.spec.family).expert(layer, e);
        let m = |name: &str, rows, cols| {
            SynthMatrix::new(self.seed, name, Role::RoutedExpert, rows, cols)
        };
        Ok([m(&g, i, h), m(&u, i, h), m(&d, h, i)])
    }
}

impl ConvertSource for SynthSource {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn architecture(&self) -> Result<Architecture> {
        Ok(Architecture {
            config: self.config.clone(),
            generation_config: None,
        })
    }

    fn tokenizer_files(&self) -> Vec<PathBuf> {
        Vec::new()
    }

    fn with_unit(
        &self,
        unit: Unit,
        f: &mut dyn FnMut(&[SourceTensor<'_>]) -> Result<()>,
    ) -> Result<()> {
        let ts = match unit {
            Unit::Globals => tensors::global_tensors(&self.spec, None)?,
            Unit::Layer(i) => tensors::layer_tensors(&self.spec, i, None)?,
        };
        let mats: Vec<SynthMatrix> = ts
            .iter()
            .map(|t| {
                let (rows, cols) = match t.shape {
                    Shape::Matrix { rows, cols } => (rows, cols),
                    Shape::Vector(n) => (1, n),
                };
                SynthMatrix::new(self.seed, &t.name, t.role, rows, cols)
            })
            .collect();
        let st: Vec<SourceTensor<'_>> = ts
            .iter()
            .zip(&mats)
            .map(|(t, m)| SourceTensor {
                name: t.name.clone(),
                role: t.role,
                shape: t.shape,
                data: match t.shape {
                    Shape::Matrix { .. } => TensorData::Matrix(m),
                    Shape::Vector(_) => TensorData::Vector(Cow::Owned(m.values())),
                },
            })
            .collect();
        f(&st)
    }

    fn with_expert(
        &self,
        layer: usize,
        expert: usize,
        f: &mut dyn FnMut([&dyn RowSource; 3]) -> Result<()>,
    ) -> Result<()> {
        let [g, u, d] = self.expert(layer, expert)?;
        f([&g, &u, &d])
    }
}

/// The shape of a model, as `synth` documents it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Geometry {
    pub model_type: &'static str,
    pub hidden_size: usize,
    pub layers: usize,
    pub moe_layers: usize,
    pub dense_layers: usize,
    pub attention: &'static str,
    pub heads: usize,
    pub kv_heads: usize,
    pub experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate_size: usize,
    pub shared_intermediate_size: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    /// Parameters outside the routed experts.
    pub dense_params: u64,
    /// Parameters of all routed experts.
    pub expert_params: u64,
    /// Parameters one token uses (dense + `experts_per_token` per layer).
    pub active_params: u64,
    pub total_params: u64,
}

/// The geometry of `spec`.
pub fn geometry(spec: &ModelSpec) -> Result<Geometry> {
    let mut dense = 0u64;
    let count = |ts: Vec<tensors::DenseTensor<'_>>| -> u64 {
        ts.iter()
            .map(|t| t.shape.dims().iter().product::<usize>() as u64)
            .sum()
    };
    dense += count(tensors::global_tensors(spec, None)?);
    for i in 0..spec.num_layers() {
        dense += count(tensors::layer_tensors(spec, i, None)?);
    }
    let moe_layers = spec.layers.iter().filter(|l| l.ffn == FfnKind::Moe).count();
    let (experts, top_k, inter, shared) = spec.moe.as_ref().map_or((0, 0, 0, 0), |m| {
        (
            m.num_experts,
            m.top_k,
            m.intermediate_size,
            m.shared.as_ref().map_or(0, |s| s.intermediate_size),
        )
    });
    let per_expert = 3 * (spec.hidden_size * inter) as u64;
    let expert_params = per_expert * (experts * moe_layers) as u64;
    let (attention, heads, kv_heads) = match &spec.attention {
        AttentionSpec::Gqa {
            num_heads,
            num_kv_heads,
            ..
        } => ("gqa", *num_heads, *num_kv_heads),
        AttentionSpec::Mla { num_heads, .. } => ("mla", *num_heads, *num_heads),
    };
    Ok(Geometry {
        model_type: spec.family.model_type(),
        hidden_size: spec.hidden_size,
        layers: spec.num_layers(),
        moe_layers,
        dense_layers: spec.num_layers() - moe_layers,
        attention,
        heads,
        kv_heads,
        experts,
        experts_per_token: top_k,
        expert_intermediate_size: inter,
        shared_intermediate_size: shared,
        vocab_size: spec.vocab_size,
        max_position_embeddings: spec.max_position_embeddings,
        dense_params: dense,
        expert_params,
        active_params: dense + per_expert * (top_k * moe_layers) as u64,
        total_params: dense + expert_params,
    })
}

/// What `synth` writes (or would write, for a dry run).
#[derive(Clone, Debug, serde::Serialize)]
pub struct SynthSummary {
    pub out: PathBuf,
    pub format: SynthFormat,
    pub quant: Quant,
    pub seed: u64,
    pub geometry: Geometry,
    /// Size of the output (both data files of a packed store).
    pub file_bytes: u64,
    /// One routed expert's bytes on disk (a packed record, padding
    /// included; GGUF: its three slabs).
    pub expert_bytes: u64,
    /// Whether anything was written (`false` for a dry run).
    pub written: bool,
    pub seconds: f64,
    pub bytes_per_second: f64,
    pub peak_rss_anon_bytes: u64,
    pub peak_rss_bytes: u64,
}

/// The `config.json` to synthesise: a preset's or a given one, with the
/// layer count overridden when asked.
pub fn config(preset: Option<&str>, config: Option<Value>, layers: Option<usize>) -> Result<Value> {
    let base = match (preset, config) {
        (Some(p), None) => presets::preset(p).ok_or_else(|| {
            ModelError::Invalid(format!(
                "unknown preset `{p}` (presets: {})",
                presets::PRESETS.join(", ")
            ))
        })?,
        (None, Some(c)) => c,
        _ => {
            return Err(ModelError::Invalid(
                "give exactly one of a preset and a config.json".into(),
            ));
        }
    };
    Ok(match layers {
        Some(0) => return Err(ModelError::Invalid("--layers must be at least 1".into())),
        Some(n) => presets::with_layers(&base, n),
        None => base,
    })
}

/// A small Qwen3-MoE geometry for tests and smoke runs: 2 layers, hidden
/// size 256, 8 experts of width 256 (2 per token), a 512-token
/// vocabulary. Its Q4_0 expert matrices are 36 KiB, whole 4 KiB units as
/// in the released models, so every expert of a GGUF's stacked tensor
/// sits alike relative to the disk's alignment.
pub fn small_qwen3_moe() -> Value {
    let mut c = presets::with_layers(&presets::preset("qwen3-30b-a3b").unwrap_or_default(), 2);
    for (k, v) in [
        ("hidden_size", 256),
        ("moe_intermediate_size", 256),
        ("intermediate_size", 512),
        ("num_experts", 8),
        ("num_experts_per_tok", 2),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("head_dim", 64),
        ("vocab_size", 512),
    ] {
        c[k] = v.into();
    }
    c
}

/// The summary of writing `source` as `format` in `quant`, without writing.
pub fn plan(
    source: &SynthSource,
    quant: Quant,
    format: SynthFormat,
    out: &Path,
) -> Result<SynthSummary> {
    let (file_bytes, expert_bytes) = match format {
        SynthFormat::Gguf => gguf::planned_bytes(&source.spec, quant, source.mix)?,
        SynthFormat::Packed if source.mix != GgufMix::default() => {
            return Err(ModelError::Invalid(
                "a packed store keeps the output head and experts in `--quant`'s format: \
                 choose other formats for them in GGUF output only"
                    .into(),
            ));
        }
        SynthFormat::Packed => {
            let m = crate::convert::plan_store(source, quant)?;
            let rec = m.experts.layers.first().map_or(0, |l| l.record_bytes);
            (m.dense.bytes + m.experts.bytes, rec)
        }
    };
    Ok(SynthSummary {
        out: out.to_path_buf(),
        format,
        quant,
        seed: source.seed,
        geometry: geometry(&source.spec)?,
        file_bytes,
        expert_bytes,
        written: false,
        seconds: 0.0,
        bytes_per_second: 0.0,
        peak_rss_anon_bytes: 0,
        peak_rss_bytes: 0,
    })
}

/// Writes `source` to `out` as `format` in `quant`.
pub fn write(
    source: &SynthSource,
    quant: Quant,
    format: SynthFormat,
    out: &Path,
    progress: &dyn Progress,
) -> Result<SynthSummary> {
    let mut s = plan(source, quant, format, out)?;
    match format {
        SynthFormat::Packed => {
            let c =
                crate::convert::write_store(source, out, &ConvertOptions::new(quant), progress)?;
            s.file_bytes = c.file_bytes;
            s.seconds = c.seconds;
            s.bytes_per_second = c.written_bytes as f64 / c.seconds.max(1e-9);
            s.peak_rss_anon_bytes = c.peak_rss_anon_bytes;
        }
        SynthFormat::Gguf => {
            let g = gguf::write(&source.spec, quant, source.mix, source.seed, out, progress)?;
            s.file_bytes = g.file_bytes;
            s.seconds = g.seconds;
            s.bytes_per_second = g.file_bytes as f64 / g.seconds.max(1e-9);
            s.peak_rss_anon_bytes = g.peak_rss_anon_bytes;
        }
    }
    s.written = true;
    s.peak_rss_bytes = PeakMemory::peak_rss();
    Ok(s)
}
