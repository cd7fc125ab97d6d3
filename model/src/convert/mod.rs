//! `colibri convert`: any source (Hugging Face directory, GGUF file, packed
//! store) to a packed store, optionally re-quantized.
//!
//! - [`tensors`]: the dense tensors by Hugging Face name, with roles;
//! - [`cast`]: format conversions, a chunk of rows at a time;
//! - [`arch`]: the architecture and tokenizer files the store records;
//! - [`memory`]: the peak memory the conversion reports.
//!
//! The conversion streams: a [`ConvertSource`] hands out one layer's dense
//! tensors (views into the source's memory map) and one routed expert at a
//! time, each matrix is converted [`cast::CHUNK_BYTES`] at a time straight
//! into the [`PackedWriter`], and nothing else is kept. Memory is bounded by
//! one layer's dense weights (views, except where a GGUF source must
//! rebuild a tensor) plus one chunk per thread, whatever the model's size.
//! The store is planned whole before anything is written, written in
//! `OUT.partial/`, resumable per layer, and renamed into place at the end.
//! [`write_store`] is also what `colibri synth` uses, with a generating
//! source.

pub mod arch;
pub mod cast;
pub mod memory;
pub mod tensors;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use self::cast::{CastOutcome, KeptReason, Quant, RowSource, convert_rows, target_format};
use self::memory::PeakMemory;
use self::tensors::{Role, Shape, TensorRef};
use crate::config::{FfnKind, ModelSpec};
use crate::error::{ModelError, Result};
use crate::experts::{ExpertLoader, ExpertStore};
use crate::format::WeightFormat;
use crate::source::WeightSource;
use crate::source::packed::manifest::{Architecture, DenseSpec, ExpertLayerSpec, MatrixSpec};
use crate::source::packed::writer::copied_files;
use crate::source::packed::{Manifest, PackedWriter, Unit};

/// A dense tensor's data as a source hands it out.
pub enum TensorData<'a> {
    Matrix(&'a dyn RowSource),
    Vector(Cow<'a, [f32]>),
}

/// A dense tensor of a source.
pub struct SourceTensor<'a> {
    pub name: String,
    pub role: Role,
    pub shape: Shape,
    pub data: TensorData<'a>,
}

/// What convert and synth read from: a model, a unit (globals or layer)
/// or one routed expert at a time.
pub trait ConvertSource {
    fn spec(&self) -> &ModelSpec;
    fn architecture(&self) -> Result<Architecture>;
    /// Tokenizer files to copy alongside.
    fn tokenizer_files(&self) -> Vec<PathBuf>;
    /// Calls `f` with the dense tensors of `unit`, in store order.
    fn with_unit(
        &self,
        unit: Unit,
        f: &mut dyn FnMut(&[SourceTensor<'_>]) -> Result<()>,
    ) -> Result<()>;
    /// Called after each unit: a mapped source drops the pages it read
    /// from the resident set (they stay in the page cache).
    fn release(&self) {}
    /// Calls `f` with expert `expert` of `layer`'s gate, up and down.
    fn with_expert(
        &self,
        layer: usize,
        expert: usize,
        f: &mut dyn FnMut([&dyn RowSource; 3]) -> Result<()>,
    ) -> Result<()>;
}

/// A loaded model source: Hugging Face, GGUF or packed.
pub struct SourceReader<'a> {
    spec: &'a ModelSpec,
    src: &'a WeightSource,
    loader: ExpertLoader<'a>,
}

impl<'a> SourceReader<'a> {
    pub fn new(spec: &'a ModelSpec, src: &'a WeightSource) -> Result<SourceReader<'a>> {
        Ok(SourceReader {
            spec,
            src,
            loader: src.expert_loader(spec)?,
        })
    }
}

fn source_tensors<'b>(ts: Vec<tensors::DenseTensor<'b>>) -> Result<Vec<SourceTensor<'b>>> {
    ts.into_iter()
        .map(|t| {
            let data = match t.data {
                Some(TensorRef::Matrix(m)) => TensorData::Matrix(m),
                Some(TensorRef::Vector(v)) => TensorData::Vector(Cow::Borrowed(v)),
                None => {
                    return Err(ModelError::Invalid(format!(
                        "tensor `{}` has no data",
                        t.name
                    )));
                }
            };
            Ok(SourceTensor {
                name: t.name,
                role: t.role,
                shape: t.shape,
                data,
            })
        })
        .collect()
}

impl ConvertSource for SourceReader<'_> {
    fn spec(&self) -> &ModelSpec {
        self.spec
    }

    fn architecture(&self) -> Result<Architecture> {
        Ok(match self.src {
            WeightSource::Hf(ck) => Architecture {
                config: arch::read_json(ck.dir(), "config.json")?.ok_or_else(|| {
                    ModelError::Config(format!("{}: no config.json", ck.dir().display()))
                })?,
                generation_config: arch::read_json(ck.dir(), "generation_config.json")?,
            },
            WeightSource::Gguf(_) => Architecture {
                config: arch::config_json(self.spec)?,
                generation_config: None,
            },
            WeightSource::Packed(p) => p.manifest().architecture.clone(),
        })
    }

    fn tokenizer_files(&self) -> Vec<PathBuf> {
        match self.src {
            WeightSource::Hf(ck) => arch::tokenizer_files(ck.dir()),
            // GGUF vocabularies are not tokenizer.json files; token ids work.
            WeightSource::Gguf(_) => Vec::new(),
            WeightSource::Packed(p) => p.tokenizer_files(),
        }
    }

    fn release(&self) {
        self.src.release_pages();
    }

    fn with_unit(
        &self,
        unit: Unit,
        f: &mut dyn FnMut(&[SourceTensor<'_>]) -> Result<()>,
    ) -> Result<()> {
        match unit {
            Unit::Globals => {
                let g = self.src.load_globals(self.spec)?;
                f(&source_tensors(tensors::global_tensors(
                    self.spec,
                    Some(&g),
                )?)?)
            }
            Unit::Layer(i) => {
                let lw = self.src.load_layer(self.spec, i)?;
                f(&source_tensors(tensors::layer_tensors(
                    self.spec,
                    i,
                    Some(&lw),
                )?)?)
            }
        }
    }

    fn with_expert(
        &self,
        layer: usize,
        expert: usize,
        f: &mut dyn FnMut([&dyn RowSource; 3]) -> Result<()>,
    ) -> Result<()> {
        // A packed source's records are verified before being trusted.
        let w = (self.loader)(layer, expert)?.verified()?;
        f([&w.gate, &w.up, &w.down])
    }
}

/// Progress of a long conversion (the binary draws a bar).
pub trait Progress: Sync {
    /// `total` bytes of data to write, `done` of them kept from an
    /// interrupted run.
    fn begin(&self, _total: u64, _done: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn message(&self, _msg: &str) {}
}

/// No progress display.
pub struct Silent;
impl Progress for Silent {}

#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub quant: Quant,
    /// Test hook: stop with [`ModelError::Interrupted`] after writing this
    /// many layers, leaving `OUT.partial/` to resume from.
    pub stop_after_layers: Option<usize>,
}

impl ConvertOptions {
    pub fn new(quant: Quant) -> ConvertOptions {
        ConvertOptions {
            quant,
            stop_after_layers: None,
        }
    }
}

/// What a conversion did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ConvertSummary {
    pub out: PathBuf,
    pub quant: Quant,
    /// Bytes of tensor and record data in the store.
    pub data_bytes: u64,
    /// Bytes of `dense.bin` + `experts.bin` (with alignment padding).
    pub file_bytes: u64,
    /// Bytes written by this run (less when resumed).
    pub written_bytes: u64,
    pub dense_tensors: usize,
    pub experts: usize,
    /// Smallest and largest expert record on disk.
    pub record_bytes: (u64, u64),
    /// Units (globals, layers) kept from an interrupted run.
    pub resumed_units: usize,
    pub written_units: usize,
    /// Matrices not written in the requested format, and why.
    pub kept: Vec<String>,
    /// Matrices where rounding to bf16/f16 changed a value.
    pub rounded_matrices: usize,
    /// Peak anonymous memory (what the conversion allocated).
    pub peak_rss_anon_bytes: u64,
    /// Peak resident set, mapped source pages included.
    pub peak_rss_bytes: u64,
    pub seconds: f64,
    /// Written bytes per second.
    pub bytes_per_second: f64,
}

/// Matrices that keep their format although quantizing was asked for.
#[derive(Default)]
struct Kept(BTreeMap<(Role, usize, &'static str, KeptReason), usize>);

impl Kept {
    fn add(
        &mut self,
        role: Role,
        cols: usize,
        format: WeightFormat,
        why: Option<KeptReason>,
        n: usize,
    ) {
        if let Some(why) = why {
            *self.0.entry((role, cols, format.name(), why)).or_default() += n;
        }
    }

    fn lines(&self) -> Vec<String> {
        self.0
            .iter()
            .map(|((role, cols, format, why), n)| match why {
                KeptReason::RowNotBlocks => format!(
                    "{n} {} matri{} with rows of {cols} elements (not a multiple of 32) stay {format}",
                    role.name(),
                    if *n == 1 { "x" } else { "ces" }
                ),
            })
            .collect()
    }
}

/// MoE layers with routed experts.
fn moe_layers(spec: &ModelSpec) -> Vec<(usize, usize)> {
    match &spec.moe {
        None => Vec::new(),
        Some(moe) => spec
            .layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.ffn == FfnKind::Moe)
            .map(|(i, _)| (i, moe.num_experts))
            .collect(),
    }
}

fn all_units(spec: &ModelSpec) -> Vec<Unit> {
    std::iter::once(Unit::Globals)
        .chain((0..spec.num_layers()).map(Unit::Layer))
        .collect()
}

/// The formats `quant` writes an expert's matrices in.
fn expert_formats(
    quant: Quant,
    mats: [&dyn RowSource; 3],
) -> [(WeightFormat, Option<usize>, Option<KeptReason>); 3] {
    mats.map(|m| {
        let (f, why) = target_format(quant, Role::RoutedExpert, m.format(), m.cols());
        let block = (f == WeightFormat::F8E4M3)
            .then(|| m.scales().map(|s| s.block))
            .flatten();
        (f, block, why)
    })
}

/// Plans the store: every tensor's format, size and place.
fn plan(src: &dyn ConvertSource, quant: Quant, kept: &mut Kept) -> Result<Manifest> {
    let spec = src.spec();
    let mut dense = Vec::new();
    for unit in all_units(spec) {
        let layer = match unit {
            Unit::Globals => None,
            Unit::Layer(l) => Some(l),
        };
        src.with_unit(unit, &mut |ts| {
            for t in ts {
                let (format, fp8_block) = match &t.data {
                    TensorData::Vector(_) => (WeightFormat::F32, None),
                    TensorData::Matrix(m) => {
                        let (f, why) = target_format(quant, t.role, m.format(), m.cols());
                        kept.add(t.role, m.cols(), f, why, 1);
                        let block = (f == WeightFormat::F8E4M3)
                            .then(|| m.scales().map(|s| s.block))
                            .flatten();
                        (f, block)
                    }
                };
                dense.push(DenseSpec {
                    name: t.name.clone(),
                    layer,
                    format,
                    shape: t.shape.dims(),
                    fp8_block,
                });
            }
            Ok(())
        })?;
    }
    let mut experts = Vec::new();
    for (l, n) in moe_layers(spec) {
        src.with_expert(l, 0, &mut |mats| {
            let f = expert_formats(quant, mats);
            for (m, (format, _, why)) in mats.iter().zip(&f) {
                kept.add(Role::RoutedExpert, m.cols(), *format, *why, n);
            }
            let spec_of = |k: usize| MatrixSpec {
                format: f[k].0,
                rows: mats[k].rows(),
                cols: mats[k].cols(),
                fp8_block: f[k].1,
            };
            experts.push(ExpertLayerSpec {
                layer: l,
                experts: n,
                matrices: [spec_of(0), spec_of(1), spec_of(2)],
            });
            Ok(())
        })?;
    }
    let copied = copied_files(&src.tokenizer_files())?;
    Manifest::layout(src.architecture()?, copied, &dense, &experts)
}

/// The store `src` converted with `quant` would be (nothing is written).
pub fn plan_store(src: &dyn ConvertSource, quant: Quant) -> Result<Manifest> {
    plan(src, quant, &mut Kept::default())
}

struct RunStats {
    written: u64,
    rounded: usize,
}

/// Converts `m` to `format` into the open tensor or record.
fn write_matrix(
    w: &mut PackedWriter,
    m: &dyn RowSource,
    format: WeightFormat,
    progress: &dyn Progress,
    stats: &mut RunStats,
) -> Result<CastOutcome> {
    let o = convert_rows(m, format, &mut |b| {
        w.write(b)?;
        progress.advance(b.len() as u64);
        Ok(())
    })?;
    stats.written += o.bytes;
    stats.rounded += o.rounded as usize;
    Ok(o)
}

fn write_scales(
    w: &mut PackedWriter,
    m: &dyn RowSource,
    name: &str,
    stats: &mut RunStats,
) -> Result<()> {
    let s = m
        .scales()
        .ok_or_else(|| ModelError::Invalid(format!("{name}: fp8 matrix without scales")))?;
    let b = cast::scales_bytes(s);
    w.write(&b)?;
    stats.written += b.len() as u64;
    Ok(())
}

fn write_unit(
    src: &dyn ConvertSource,
    w: &mut PackedWriter,
    unit: Unit,
    quant: Quant,
    progress: &dyn Progress,
    mem: &PeakMemory,
    stats: &mut RunStats,
) -> Result<()> {
    let formats: HashMap<String, WeightFormat> = w
        .plan()
        .dense
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.format))
        .collect();
    src.with_unit(unit, &mut |ts| {
        for t in ts {
            let format = *formats.get(&t.name).ok_or_else(|| {
                ModelError::Invalid(format!("tensor `{}` is not in the plan", t.name))
            })?;
            w.begin_dense(&t.name)?;
            match &t.data {
                TensorData::Vector(v) => {
                    let b = cast::vector_bytes(v);
                    w.write(&b)?;
                    progress.advance(b.len() as u64);
                    stats.written += b.len() as u64;
                }
                TensorData::Matrix(m) => {
                    write_matrix(w, *m, format, progress, stats)?;
                    if format == WeightFormat::F8E4M3 {
                        write_scales(w, *m, &t.name, stats)?;
                    }
                }
            }
            w.end()?;
            mem.sample();
            src.release();
        }
        Ok(())
    })?;
    if let Unit::Layer(l) = unit
        && let Some(layer) = w
            .plan()
            .experts
            .layers
            .iter()
            .find(|x| x.layer == l)
            .cloned()
    {
        for e in 0..layer.experts() {
            src.with_expert(l, e, &mut |mats| {
                let f = expert_formats(quant, mats);
                for (k, pm) in layer.matrices().iter().enumerate() {
                    let block = pm.scales.as_ref().map(|s| s.block);
                    if (f[k].0, f[k].1) != (pm.format, block) {
                        return Err(ModelError::Invalid(format!(
                            "layer {l} expert {e}: {} in {} (scale block {:?}), expert 0's is {} ({block:?}): experts of a layer must share a format; choose --quant f32, bf16, q8_0 or q4_0",
                            ["gate", "up", "down"][k],
                            f[k].0.name(),
                            f[k].1,
                            pm.format.name()
                        )));
                    }
                }
                w.begin_record(l, e)?;
                for (m, pm) in mats.iter().zip(layer.matrices()) {
                    write_matrix(w, *m, pm.format, progress, stats)?;
                }
                for (k, (m, pm)) in mats.iter().zip(layer.matrices()).enumerate() {
                    if pm.format == WeightFormat::F8E4M3 {
                        write_scales(w, *m, &format!("layer {l} expert {e} {}", ["gate", "up", "down"][k]), stats)?;
                    }
                }
                w.end()
            })?;
            mem.sample();
            // One expert's source pages at a time in the resident set (a
            // layer of a large bf16 model is tens of GB).
            src.release();
        }
    }
    w.finish_unit(unit)
}

/// Writes `src` as a packed store at `out` (see the module docs).
pub fn write_store(
    src: &dyn ConvertSource,
    out: &Path,
    opts: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    let t0 = Instant::now();
    let mem = PeakMemory::new();
    let mut kept = Kept::default();
    let plan = plan(src, opts.quant, &mut kept)?;
    src.release();
    let kept = kept.lines();
    for k in &kept {
        tracing::warn!("{k}");
    }
    let mut w = PackedWriter::create(out, plan, src.tokenizer_files())?;
    let total = w.plan().payload_bytes();
    let resumed: u64 = w.resumed().iter().map(|&u| w.unit_bytes(u)).sum();
    if !w.resumed().is_empty() {
        progress.message(&format!(
            "resuming: {} of {} units already written and verified",
            w.resumed().len(),
            w.units().len()
        ));
        tracing::info!(
            "resuming {}: {} units already written and verified",
            out.display(),
            w.resumed().len()
        );
    }
    progress.begin(total, resumed);
    let mut stats = RunStats {
        written: 0,
        rounded: 0,
    };
    let units = w.units();
    let mut layers_written = 0;
    let mut written_units = 0;
    for (k, &unit) in units.iter().enumerate() {
        if w.is_done(unit) {
            continue;
        }
        progress.message(&unit.to_string());
        write_unit(src, &mut w, unit, opts.quant, progress, &mem, &mut stats)?;
        src.release();
        written_units += 1;
        if let Unit::Layer(_) = unit {
            layers_written += 1;
            if opts.stop_after_layers == Some(layers_written) && k + 1 < units.len() {
                return Err(ModelError::Interrupted(layers_written));
            }
        }
    }
    let resumed_units = w.resumed().len();
    let manifest = w.commit()?;
    mem.sample();
    let seconds = t0.elapsed().as_secs_f64();
    let records = manifest.experts.layers.iter().map(|l| l.record_bytes);
    Ok(ConvertSummary {
        out: out.to_path_buf(),
        quant: opts.quant,
        data_bytes: manifest.payload_bytes(),
        file_bytes: manifest.dense.bytes + manifest.experts.bytes,
        written_bytes: stats.written,
        dense_tensors: manifest.dense.tensors.len(),
        experts: manifest.experts.layers.iter().map(|l| l.experts()).sum(),
        record_bytes: (
            records.clone().min().unwrap_or(0),
            records.max().unwrap_or(0),
        ),
        resumed_units,
        written_units,
        kept,
        rounded_matrices: stats.rounded,
        peak_rss_anon_bytes: mem.peak_anon(),
        peak_rss_bytes: PeakMemory::peak_rss(),
        seconds,
        bytes_per_second: stats.written as f64 / seconds.max(1e-9),
    })
}

/// Converts the model at `src` (Hugging Face directory, GGUF file or
/// packed store) to a packed store at `out`.
pub fn convert(
    src: &Path,
    out: &Path,
    opts: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    let (spec, ws) = crate::source::open_source(src)?;
    let reader = SourceReader::new(&spec, &ws)?;
    write_store(&reader, out, opts, progress)
}
