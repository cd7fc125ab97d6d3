//! A Hugging Face checkpoint: `*.safetensors` shards (found through
//! `model.safetensors.index.json` or by listing the directory), memory-mapped
//! read-only, with an index from tensor name to its bytes.
//!
//! Tensors are returned as they are stored: the kernels run every supported
//! format directly. The index also answers *where* a tensor lives (file,
//! absolute offset, length), which the streaming tiers use to read experts
//! without the mapping.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ::safetensors::{Dtype, SafeTensors};

use crate::error::{ModelError, Result};
use crate::format::{WeightFormat, bf16_to_f32, f16_to_f32};
use crate::tensor::{BlockScales, ByteStorage, Bytes, QMatrix};

struct Shard {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    /// Offset of the data section (8 + header length).
    data_start: usize,
}

/// One tensor of the checkpoint.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    shard: usize,
    /// Byte range within the shard's data section.
    start: usize,
    end: usize,
}

/// Where a tensor's bytes are on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLocation {
    pub path: PathBuf,
    pub offset: u64,
    pub len: u64,
}

pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    index: HashMap<String, TensorEntry>,
}

const SUPPORTED: &str = "F32, F16, BF16, F8_E4M3 (with weight_scale_inv)";

impl Checkpoint {
    /// Opens every shard of the checkpoint in `dir`.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let files = shard_files(dir)?;
        if files.is_empty() {
            return Err(ModelError::Invalid(format!(
                "{}: no *.safetensors files found",
                dir.display()
            )));
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for path in files {
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the mapping is read-only and private to this process.
            // Checkpoints are not modified while a model runs; a concurrent
            // writer is outside what colibri supports (as for every engine
            // that maps weights).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let (n, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| ModelError::Safetensors {
                    file: path.clone(),
                    reason: e.to_string(),
                })?;
            let shard = shards.len();
            for (name, info) in meta.tensors() {
                let (start, end) = info.data_offsets;
                index.insert(
                    name,
                    TensorEntry {
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        shard,
                        start,
                        end,
                    },
                );
            }
            shards.push(Shard {
                path,
                map: Arc::new(map),
                data_start: 8 + n,
            });
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            index,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Drops the shards' mapped pages from the resident set (see
    /// [`ByteStorage::release`]).
    pub fn release_pages(&self) {
        for s in &self.shards {
            s.map.release();
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// Where `name`'s bytes are on disk.
    pub fn location(&self, name: &str) -> Result<TensorLocation> {
        let e = self.entry(name)?;
        let shard = &self.shards[e.shard];
        Ok(TensorLocation {
            path: shard.path.clone(),
            offset: (shard.data_start + e.start) as u64,
            len: (e.end - e.start) as u64,
        })
    }

    /// The raw stored bytes of `name`, without copying.
    pub fn bytes(&self, name: &str) -> Result<Bytes> {
        let e = self.entry(name)?;
        let shard = &self.shards[e.shard];
        let owner: Arc<dyn ByteStorage> = shard.map.clone();
        Bytes::new(owner, shard.data_start + e.start, e.end - e.start)
    }

    fn check_shape(&self, name: &str, expected: &[usize]) -> Result<&TensorEntry> {
        let e = self.entry(name)?;
        if e.shape != expected {
            return Err(ModelError::Shape {
                name: name.to_string(),
                got: e.shape.clone(),
                expected: expected.to_vec(),
            });
        }
        Ok(e)
    }

    /// A `rows × cols` weight matrix in its stored format. FP8 weights take
    /// their scales from the sibling `<name>_scale_inv` tensor.
    pub fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        fp8_block: usize,
    ) -> Result<QMatrix> {
        self.matrix_with_shape(name, &[rows, cols], rows, cols, fp8_block)
    }

    /// A tensor of shape `shape` viewed as a `rows × cols` matrix (stacked
    /// expert tensors). FP8 is not accepted here: stacked FP8 scales have
    /// no agreed name.
    pub fn matrix_reshaped(
        &self,
        name: &str,
        shape: &[usize],
        rows: usize,
        cols: usize,
    ) -> Result<QMatrix> {
        if self.entry(name)?.dtype == Dtype::F8_E4M3 {
            return Err(ModelError::UnsupportedDtype {
                name: name.to_string(),
                dtype: "F8_E4M3 (stacked)".into(),
                supported: "F32, F16, BF16 for stacked expert tensors",
            });
        }
        self.matrix_with_shape(name, shape, rows, cols, 128)
    }

    fn matrix_with_shape(
        &self,
        name: &str,
        shape: &[usize],
        rows: usize,
        cols: usize,
        fp8_block: usize,
    ) -> Result<QMatrix> {
        let e = self.check_shape(name, shape)?;
        let format = match e.dtype {
            Dtype::F32 => WeightFormat::F32,
            Dtype::F16 => WeightFormat::F16,
            Dtype::BF16 => WeightFormat::Bf16,
            Dtype::F8_E4M3 => WeightFormat::F8E4M3,
            other => {
                return Err(ModelError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                    supported: SUPPORTED,
                });
            }
        };
        let scales = if format == WeightFormat::F8E4M3 {
            let sname = format!("{name}_scale_inv");
            let grid = [rows.div_ceil(fp8_block), cols.div_ceil(fp8_block)];
            let values = self.vector_f32(&sname, &grid)?;
            Some(BlockScales {
                block: fp8_block,
                grid_cols: grid[1],
                scales: values.into(),
            })
        } else {
            None
        };
        QMatrix::new(name, rows, cols, format, self.bytes(name)?, scales)
    }

    /// A small tensor (norm weights, biases, scales) widened to f32.
    pub fn vector_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let e = self.check_shape(name, shape)?;
        let bytes = self.bytes(name)?;
        let b = bytes.as_slice();
        Ok(match e.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            other => {
                return Err(ModelError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                    supported: "F32, F16, BF16",
                });
            }
        })
    }
}

/// Routed experts of a Hugging Face checkpoint, located in its shards.
pub struct HfExpertLocator {
    spec: crate::config::ModelSpec,
    files: Vec<PathBuf>,
    locations: HashMap<(usize, usize), super::ExpertLocation>,
}

impl HfExpertLocator {
    /// Locates every routed expert of `spec` in `ck`. FP8 scales are read
    /// now (they are small) and kept.
    pub fn new(spec: &crate::config::ModelSpec, ck: &Checkpoint) -> Result<HfExpertLocator> {
        let files: Vec<PathBuf> = ck.shards.iter().map(|s| s.path.clone()).collect();
        let names = crate::weights::TensorNames::new(spec.family);
        let mut locations = HashMap::new();
        if let Some(moe) = &spec.moe {
            for (l, ls) in spec.layers.iter().enumerate() {
                if ls.ffn != crate::config::FfnKind::Moe {
                    continue;
                }
                for e in 0..moe.num_experts {
                    let [g, u, d] = names.expert(l, e);
                    if !ck.contains(&g) {
                        // The fused layout has no per-expert extents.
                        return Err(ModelError::MissingTensor(g));
                    }
                    let (h, i) = (spec.hidden_size, moe.intermediate_size);
                    let loc =
                        |name: &str, rows: usize, cols: usize| -> Result<super::MatrixLocation> {
                            let m = ck.matrix(name, rows, cols, spec.fp8_block)?;
                            let entry = ck.entry(name)?;
                            let shard = &ck.shards[entry.shard];
                            Ok(super::MatrixLocation {
                                extent: super::Extent {
                                    file: entry.shard,
                                    offset: (shard.data_start + entry.start) as u64,
                                    len: (entry.end - entry.start) as u64,
                                },
                                rows,
                                cols,
                                format: m.format,
                                scales: m.scales().cloned(),
                            })
                        };
                    locations.insert(
                        (l, e),
                        super::ExpertLocation {
                            layer: l,
                            expert: e,
                            gate: loc(&g, i, h)?,
                            up: loc(&u, i, h)?,
                            down: loc(&d, h, i)?,
                            record: None,
                        },
                    );
                }
            }
        }
        Ok(HfExpertLocator {
            spec: spec.clone(),
            files,
            locations,
        })
    }

    pub fn spec(&self) -> &crate::config::ModelSpec {
        &self.spec
    }
}

impl super::ExpertLocator for HfExpertLocator {
    fn files(&self) -> &[PathBuf] {
        &self.files
    }

    fn locate(&self, layer: usize, expert: usize) -> Result<super::ExpertLocation> {
        self.locations
            .get(&(layer, expert))
            .cloned()
            .ok_or_else(|| ModelError::Expert {
                layer,
                expert,
                reason: "not a routed expert of this model".into(),
            })
    }
}

/// The shard files of a checkpoint: those the index names, else every
/// `*.safetensors` in the directory (sorted).
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.exists() {
        let text =
            std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: index_path.clone(),
            source: e,
        })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::Safetensors {
                file: index_path.clone(),
                reason: "missing `weight_map`".into(),
            })?;
        let mut names = BTreeSet::new();
        for (tensor, file) in map {
            let f = file.as_str().ok_or_else(|| ModelError::Safetensors {
                file: index_path.clone(),
                reason: format!("weight_map entry for `{tensor}` is not a file name"),
            })?;
            if f.contains('/') || f.contains("..") {
                return Err(ModelError::Safetensors {
                    file: index_path.clone(),
                    reason: format!("shard name `{f}` must be a plain file name"),
                });
            }
            names.insert(f.to_string());
        }
        return Ok(names.into_iter().map(|n| dir.join(n)).collect());
    }
    let rd = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut files = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| ModelError::io(dir, e))?;
        let p = entry.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}
