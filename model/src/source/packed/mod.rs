//! The packed expert store: colibri's own on-disk format, laid out for the
//! disk path. `colibri convert` and `colibri synth` write it.
//!
//! # Format (version 1)
//!
//! A directory:
//!
//! ```text
//! manifest.json   format, version, alignment (4096), the architecture
//!                 (config.json and generation_config.json as objects), the
//!                 tokenizer files, the dense tensor index, the expert
//!                 records and an xxh3-64 checksum of every tensor and record
//! dense.bin       every dense tensor (embedding, norms, attention, router,
//!                 shared experts, dense MLPs, output head), each at a
//!                 4 KiB-aligned offset: data, then FP8 block scales (f32 LE)
//! experts.bin     every routed expert as ONE record at a 4 KiB-aligned
//!                 offset: gate ‖ up ‖ down (back to back from the record's
//!                 start) ‖ FP8 scales of the three, if any ‖ zero padding
//!                 to the next 4 KiB. Expert `e` of a MoE layer is at
//!                 `layer.offset + e · layer.record_bytes`.
//! tokenizer.json, tokenizer_config.json, chat_template.jinja, …
//!                 copied from the source when it has them
//! ```
//!
//! Matrices are row-major in a [`WeightFormat`] (f32, f16, bf16, fp8-e4m3
//! with `block × block` f32 scales, ggml Q8_0/Q4_0 blocks); vectors (norms,
//! biases) are f32. Tensors keep their Hugging Face names. A record's
//! checksum covers its payload (gate ‖ up ‖ down ‖ scales), not the padding.
//!
//! One expert is one aligned read of `record_bytes` that lands at the
//! alignment the kernels use it at, with no slack beyond the padding
//! (LESSONS: "align records so the read lands where it is used").
//!
//! The dense tensors are in our own file rather than a safetensors file:
//! safetensors has no dtype for ggml's Q8_0/Q4_0 blocks, does not align
//! tensor data (unaligned tensors get copied at load) and would need a
//! second index beside the manifest's.
//!
//! Every read is verified: dense tensors when they are loaded, experts by
//! [`crate::source::ExpertLocation::assemble`] after every streaming read
//! and by the resident source on first use. A mismatch names the file and
//! the tensor or the layer and expert.

pub mod manifest;
pub mod writer;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use self::manifest::{DenseEntry, ExpertLayer};
use crate::config::{FfnKind, ModelSpec};
use crate::error::{ModelError, Result};
use crate::experts::{ExpertLoader, ExpertStore, LoadedExpert};
use crate::format::WeightFormat;
use crate::forward::Model;
use crate::source::{ExpertLocation, ExpertLocator, Extent, MatrixLocation, RecordExtent};
use crate::tensor::{BlockScales, ByteStorage, Bytes, QMatrix};
use crate::weights::TensorReader;

pub use self::manifest::Manifest;
pub use self::writer::{PackedWriter, Unit};

/// Whether `path` is a packed store: a directory with a `manifest.json`
/// and no `config.json` (a Hugging Face directory may carry a file of that
/// name; a store keeps its config inside the manifest).
pub fn is_packed(path: &Path) -> bool {
    path.is_dir()
        && path.join(manifest::MANIFEST_FILE).is_file()
        && !path.join("config.json").exists()
}

/// An open packed store: its manifest over read-only maps of its files.
pub struct PackedStore {
    dir: PathBuf,
    /// Boxed: a manifest is large and stores live in `WeightSource`.
    manifest: Box<Manifest>,
    dense_path: PathBuf,
    experts_path: Arc<Path>,
    dense: Arc<dyn ByteStorage>,
    experts: Arc<dyn ByteStorage>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for PackedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedStore({})", self.dir.display())
    }
}

/// A mapping of a file, or nothing for an empty one (which cannot be
/// mapped).
fn map(path: &Path) -> Result<Arc<dyn ByteStorage>> {
    let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    let len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
    if len == 0 {
        return Ok(Arc::new(Vec::<u8>::new()));
    }
    // SAFETY: the mapping is read-only and private to this process. Stores
    // are not modified while a model runs; a concurrent writer is outside
    // what colibri supports (as for every engine that maps weights).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
    Ok(Arc::new(map))
}

/// Hashes `parts` with xxh3-64 (streaming).
pub(crate) fn xxh3(parts: &[&[u8]]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for p in parts {
        h.update(p);
    }
    h.digest()
}

impl PackedStore {
    /// Opens the store in `dir`: parses and validates the manifest and
    /// checks that both data files have exactly the declared length.
    pub fn open(dir: &Path) -> Result<PackedStore> {
        let mpath = dir.join(manifest::MANIFEST_FILE);
        let text = std::fs::read_to_string(&mpath).map_err(|e| ModelError::io(&mpath, e))?;
        let manifest: Manifest = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: mpath.clone(),
            source: e,
        })?;
        manifest.validate().map_err(|reason| ModelError::Packed {
            file: mpath.clone(),
            reason,
        })?;
        let dense_path = dir.join(&manifest.dense.file);
        let experts_path = dir.join(&manifest.experts.file);
        for (path, want) in [
            (&dense_path, manifest.dense.bytes),
            (&experts_path, manifest.experts.bytes),
        ] {
            let len = std::fs::metadata(path)
                .map_err(|e| ModelError::io(path, e))?
                .len();
            if len != want {
                return Err(ModelError::Packed {
                    file: path.clone(),
                    reason: format!(
                        "{len} bytes, the manifest says {want}{}",
                        if len < want {
                            " (truncated: copy or convert the model again)"
                        } else {
                            ""
                        }
                    ),
                });
            }
        }
        let by_name = manifest
            .dense
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(PackedStore {
            dir: dir.to_path_buf(),
            dense: map(&dense_path)?,
            experts: map(&experts_path)?,
            dense_path,
            experts_path: experts_path.into(),
            manifest: Box::new(manifest),
            by_name,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Drops the store's mapped pages from the resident set (see
    /// [`ByteStorage::release`]).
    pub fn release_pages(&self) {
        self.dense.release();
        self.experts.release();
    }

    pub fn experts_path(&self) -> &Path {
        &self.experts_path
    }

    pub fn dense_path(&self) -> &Path {
        &self.dense_path
    }

    /// The model's spec, from the architecture the manifest carries.
    pub fn spec(&self) -> Result<ModelSpec> {
        let a = &self.manifest.architecture;
        ModelSpec::from_parts(&a.config, a.generation_config.as_ref())
    }

    /// The tokenizer files copied alongside, as paths.
    pub fn tokenizer_files(&self) -> Vec<PathBuf> {
        self.manifest
            .tokenizer_files
            .iter()
            .map(|f| self.dir.join(&f.name))
            .collect()
    }

    fn entry(&self, name: &str) -> Result<&DenseEntry> {
        self.by_name
            .get(name)
            .map(|&i| &self.manifest.dense.tensors[i])
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    /// The entry's data and scales bytes, verified against its checksum.
    fn verified(&self, t: &DenseEntry) -> Result<(Bytes, Option<Bytes>)> {
        let data = Bytes::new(self.dense.clone(), t.offset as usize, t.bytes as usize)?;
        let scales = t
            .scales
            .as_ref()
            .map(|s| Bytes::new(self.dense.clone(), s.offset as usize, s.bytes as usize))
            .transpose()?;
        let got = xxh3(&[
            data.as_slice(),
            scales.as_ref().map_or(&[][..], |s| s.as_slice()),
        ]);
        if got != t.xxh3.0 {
            return Err(ModelError::Checksum {
                file: self.dense_path.clone(),
                what: format!("tensor `{}`", t.name),
                expected: t.xxh3.0,
                got,
            });
        }
        Ok((data, scales))
    }

    /// The layer entry of MoE layer `layer`.
    pub fn expert_layer(&self, layer: usize) -> Option<&ExpertLayer> {
        self.manifest
            .experts
            .layers
            .iter()
            .find(|l| l.layer == layer)
    }

    /// A view of `len` bytes of `experts.bin` at `offset`.
    pub fn expert_bytes(&self, offset: u64, len: u64) -> Result<Bytes> {
        Bytes::new(self.experts.clone(), offset as usize, len as usize)
    }
}

fn f32_values(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl TensorReader for PackedStore {
    fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize, _fp8_block: usize) -> Result<QMatrix> {
        let t = self.entry(name)?;
        if t.shape != [rows, cols] {
            return Err(ModelError::Shape {
                name: name.to_string(),
                got: t.shape.clone(),
                expected: vec![rows, cols],
            });
        }
        let (data, scales) = self.verified(t)?;
        // The store's own scale block is the one its scales were made with.
        let scales = match (&t.scales, scales) {
            (Some(s), Some(b)) => Some(BlockScales {
                block: s.block,
                grid_cols: s.grid[1],
                scales: f32_values(b.as_slice()).into(),
            }),
            _ => None,
        };
        QMatrix::new(name, rows, cols, t.format, data, scales)
    }

    fn vector_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.entry(name)?;
        if t.shape != shape {
            return Err(ModelError::Shape {
                name: name.to_string(),
                got: t.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        if t.format != WeightFormat::F32 {
            return Err(ModelError::UnsupportedDtype {
                name: name.to_string(),
                dtype: t.format.name().to_string(),
                supported: "f32 for vectors in a packed store",
            });
        }
        let (data, _) = self.verified(t)?;
        Ok(f32_values(data.as_slice()))
    }
}

/// Per MoE layer: the manifest's entry and, for FP8 records, every
/// expert's scales (kept resident, as [`MatrixLocation::scales`] wants).
struct LayerRecords {
    entry: ExpertLayer,
    scales: Vec<[Option<BlockScales>; 3]>,
}

/// Where every routed expert of a packed store is: one record each.
pub struct PackedExpertLocator {
    files: Vec<PathBuf>,
    path: Arc<Path>,
    layers: Vec<Option<LayerRecords>>,
}

impl PackedExpertLocator {
    /// Indexes the store's records for `spec`, checking that every MoE
    /// layer has one record per expert with the spec's shapes.
    pub fn new(spec: &ModelSpec, store: &PackedStore) -> Result<PackedExpertLocator> {
        let bad = |reason: String| ModelError::Packed {
            file: store.dir.join(manifest::MANIFEST_FILE),
            reason,
        };
        let mut layers = Vec::with_capacity(spec.num_layers());
        for (l, ls) in spec.layers.iter().enumerate() {
            let entry = store.expert_layer(l);
            let moe = match (&ls.ffn, &spec.moe) {
                (FfnKind::Moe, Some(moe)) => moe,
                _ => {
                    if entry.is_some() {
                        return Err(bad(format!("layer {l} is dense but has expert records")));
                    }
                    layers.push(None);
                    continue;
                }
            };
            let entry = entry
                .ok_or_else(|| bad(format!("MoE layer {l} has no expert records")))?
                .clone();
            let (h, i) = (spec.hidden_size, moe.intermediate_size);
            let want = [(i, h), (i, h), (h, i)];
            for (m, (rows, cols)) in entry.matrices().iter().zip(want) {
                if (m.rows, m.cols) != (rows, cols) {
                    return Err(bad(format!(
                        "layer {l}: expert matrix {}x{}, the model needs {rows}x{cols}",
                        m.rows, m.cols
                    )));
                }
            }
            if entry.experts() != moe.num_experts {
                return Err(bad(format!(
                    "layer {l}: {} expert records, the model has {} experts",
                    entry.experts(),
                    moe.num_experts
                )));
            }
            let mut scales = Vec::new();
            if entry.matrices().iter().any(|m| m.scales.is_some()) {
                for e in 0..entry.experts() {
                    let base = entry.record_offset(e);
                    let mut three: [Option<BlockScales>; 3] = [None, None, None];
                    for (k, m) in entry.matrices().iter().enumerate() {
                        if let Some(s) = &m.scales {
                            let b = store.expert_bytes(base + s.offset, s.bytes)?;
                            three[k] = Some(BlockScales {
                                block: s.block,
                                grid_cols: s.grid[1],
                                scales: f32_values(b.as_slice()).into(),
                            });
                        }
                    }
                    scales.push(three);
                }
            }
            layers.push(Some(LayerRecords { entry, scales }));
        }
        Ok(PackedExpertLocator {
            files: vec![store.experts_path.to_path_buf()],
            path: store.experts_path.clone(),
            layers,
        })
    }
}

impl ExpertLocator for PackedExpertLocator {
    fn files(&self) -> &[PathBuf] {
        &self.files
    }

    fn locate(&self, layer: usize, expert: usize) -> Result<ExpertLocation> {
        let not_routed = || ModelError::Expert {
            layer,
            expert,
            reason: "not a routed expert of this model".into(),
        };
        let lr = self
            .layers
            .get(layer)
            .and_then(Option::as_ref)
            .ok_or_else(not_routed)?;
        let l = &lr.entry;
        if expert >= l.experts() {
            return Err(not_routed());
        }
        let base = l.record_offset(expert);
        let mat = |k: usize| {
            let m = l.matrices()[k];
            MatrixLocation {
                extent: Extent {
                    file: 0,
                    offset: base + m.offset,
                    len: m.bytes,
                },
                rows: m.rows,
                cols: m.cols,
                format: m.format,
                scales: lr.scales.get(expert).and_then(|s| s[k].clone()),
            }
        };
        Ok(ExpertLocation {
            layer,
            expert,
            gate: mat(0),
            up: mat(1),
            down: mat(2),
            record: Some(RecordExtent {
                extent: Extent {
                    file: 0,
                    offset: base,
                    len: l.record_bytes,
                },
                checksum: l.xxh3[expert].0,
                path: self.path.clone(),
            }),
        })
    }
}

impl ExpertStore for PackedStore {
    /// Experts as views into the map; the checksum is left to the caller
    /// ([`crate::ResidentExperts`] verifies each on first use).
    fn expert_loader<'a>(&'a self, spec: &'a ModelSpec) -> Result<ExpertLoader<'a>> {
        let locator = PackedExpertLocator::new(spec, self)?;
        Ok(Box::new(move |l, e| {
            let loc = locator.locate(l, e)?;
            let view = |m: &MatrixLocation| self.expert_bytes(m.extent.offset, m.extent.len);
            let weights =
                loc.assemble_unverified([view(&loc.gate)?, view(&loc.up)?, view(&loc.down)?])?;
            Ok(LoadedExpert {
                weights,
                check: Some(loc),
            })
        }))
    }
}

/// Loads the spec and dense weights of the store in `dir`. Routed experts
/// come from [`crate::ResidentExperts::load`] over the store or from a
/// [`PackedExpertLocator`].
pub fn load_packed(dir: &Path) -> Result<(Model, PackedStore)> {
    let store = PackedStore::open(dir)?;
    let spec = store.spec()?;
    let weights = crate::weights::DenseWeights::load(&spec, &store)?;
    Ok((Model::new(spec, weights), store))
}
