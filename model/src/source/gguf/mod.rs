//! GGUF files, read by our own parser: the format most local users already
//! have their models in.
//!
//! - [`header`]: the byte-level parser (metadata, tensor infos, alignment),
//!   strict about every count and offset.
//! - [`write`]: our writer (tests, small files); [`stream`]: the same
//!   files streamed, for models larger than memory (`colibri synth`).
//! - [`arch`]: a [`ModelSpec`] from llama.cpp's metadata keys for
//!   `qwen3moe`, `qwen2moe`, `llama` (Mixtral), `olmoe` and `deepseek2`.
//! - [`load`]: the dense weights, undoing what llama.cpp's converter did
//!   to them (q/k row permutation for `llama`, the split of DeepSeek's
//!   `kv_b_proj`), so the engine computes what transformers computes.
//! - [`experts`]: routed experts of stacked `*_exps` tensors (three
//!   contiguous slabs per expert): an [`crate::source::ExpertLocator`] and
//!   a resident [`crate::experts::ExpertSource`].
//! - [`vocab`]: the `tokenizer.ggml.*` vocabulary and the chat template.

pub mod arch;
pub mod experts;
pub mod header;
pub mod load;
pub mod stream;
pub mod vocab;
pub mod write;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use self::experts::{GgufExpertLocator, GgufExperts};
pub use self::header::{GgmlType, GgufArray, GgufHeader, GgufType, GgufValue, TensorInfo};
pub use self::stream::GgufStreamWriter;
pub use self::vocab::GgufVocab;
pub use self::write::GgufWriter;
use crate::config::ModelSpec;
use crate::error::{ModelError, Result};
use crate::format::{WeightFormat, bf16_to_f32, f16_to_f32};
use crate::forward::Model;
use crate::tensor::{ByteStorage, Bytes, QMatrix};

/// The largest size or count accepted from metadata.
pub const MAX_DIM: u64 = 1 << 31;

/// An open GGUF file: its parsed header over a read-only memory map.
pub struct GgufFile {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    header: GgufHeader,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GgufFile({})", self.path.display())
    }
}

impl GgufFile {
    /// Opens and parses `path`.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the mapping is read-only and private to this process.
        // Model files are not modified while a model runs; a concurrent
        // writer is outside what colibri supports (as for every engine
        // that maps weights).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let header = header::parse(&map).map_err(|reason| ModelError::Gguf {
            file: path.to_path_buf(),
            reason,
        })?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            map: Arc::new(map),
            header,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Drops the file's mapped pages from the resident set (see
    /// [`ByteStorage::release`]).
    pub fn release_pages(&self) {
        self.map.release();
    }

    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// An error about this file.
    pub fn err(&self, reason: impl Into<String>) -> ModelError {
        ModelError::Gguf {
            file: self.path.clone(),
            reason: reason.into(),
        }
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.header.get(key)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get("general.architecture")
            .and_then(GgufValue::as_str)
            .ok_or_else(|| self.err("metadata `general.architecture` is missing or not a string"))
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                self.err(format!(
                    "metadata `{key}`: expected a non-negative integer, got {v:?}"
                ))
            }),
        }
    }

    /// A size or count. Anything above 2^31 is no real model's and is
    /// refused, so sizes can be multiplied pairwise without overflow.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.opt_u64(key)? {
            Some(v) if v > MAX_DIM => Err(self.err(format!(
                "metadata `{key}`: {v} is larger than any model dimension (max {MAX_DIM})"
            ))),
            v => Ok(v.map(|v| v as usize)),
        }
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(format!("metadata `{key}` is missing")))
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(format!("metadata `{key}`: expected a number, got {v:?}"))),
        }
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(format!("metadata `{key}`: expected a bool, got {v:?}"))),
        }
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(format!("metadata `{key}`: expected a string, got {v:?}"))),
        }
    }

    pub fn contains(&self, tensor: &str) -> bool {
        self.header.tensor(tensor).is_some()
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.header
            .tensor(name)
            .ok_or_else(|| self.err(format!("tensor `{name}` is missing")))
    }

    /// Absolute file offset of a tensor's data.
    pub fn tensor_offset(&self, t: &TensorInfo) -> u64 {
        self.header.data_offset + t.offset
    }

    /// The stored bytes of `name`, without copying.
    pub fn bytes(&self, name: &str) -> Result<Bytes> {
        let t = self.tensor(name)?;
        let owner: Arc<dyn ByteStorage> = self.map.clone();
        Bytes::new(owner, self.tensor_offset(t) as usize, t.size as usize)
    }

    /// A view of `len` bytes at absolute file offset `offset`.
    pub fn extent_bytes(&self, offset: u64, len: u64) -> Result<Bytes> {
        let owner: Arc<dyn ByteStorage> = self.map.clone();
        Bytes::new(owner, offset as usize, len as usize)
    }

    /// The weight format colibri computes a tensor's type in.
    pub fn format_of(&self, t: &TensorInfo) -> Result<WeightFormat> {
        Ok(match t.ty {
            GgmlType::F32 => WeightFormat::F32,
            GgmlType::F16 => WeightFormat::F16,
            GgmlType::BF16 => WeightFormat::Bf16,
            GgmlType::Q8_0 => WeightFormat::Q8_0,
            GgmlType::Q4_0 => WeightFormat::Q4_0,
            GgmlType::Q6_K => WeightFormat::Q6K,
            GgmlType::Q4_K => WeightFormat::Q4K,
            GgmlType::Q5_K => WeightFormat::Q5K,
            GgmlType::Q4_1 => WeightFormat::Q4_1,
            GgmlType::Q5_0 => WeightFormat::Q5_0,
            GgmlType::Q5_1 => WeightFormat::Q5_1,
            GgmlType::Q2_K => WeightFormat::Q2K,
            GgmlType::Q3_K => WeightFormat::Q3K,
            GgmlType::IQ4_NL => WeightFormat::Iq4Nl,
            GgmlType::IQ4_XS => WeightFormat::Iq4Xs,
            other => {
                return Err(ModelError::UnsupportedDtype {
                    name: format!("{}: {}", self.path.display(), t.name),
                    dtype: other.name().to_string(),
                    supported: "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, \
                                IQ4_NL, IQ4_XS",
                });
            }
        })
    }

    fn check_dims(&self, t: &TensorInfo, ne: &[u64]) -> Result<()> {
        // Trailing dimensions of 1 are the same shape (llama.cpp agrees).
        let pad = |v: &[u64]| {
            let mut v = v.to_vec();
            v.resize(header::MAX_DIMS, 1);
            v
        };
        if pad(&t.ne) != pad(ne) {
            return Err(ModelError::Shape {
                name: format!("{}: {}", self.path.display(), t.name),
                got: t.ne.iter().map(|&d| d as usize).collect(),
                expected: ne.iter().map(|&d| d as usize).collect(),
            });
        }
        Ok(())
    }

    /// A `rows × cols` weight matrix (ggml dims `[cols, rows]`), as stored.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QMatrix> {
        let t = self.tensor(name)?;
        self.check_dims(t, &[cols as u64, rows as u64])?;
        let format = self.format_of(t)?;
        QMatrix::new(name, rows, cols, format, self.bytes(name)?, None)
    }

    /// A tensor of ggml dims `ne` viewed as a matrix of rows of `ne[0]`.
    pub fn matrix_ne(&self, name: &str, ne: &[u64]) -> Result<QMatrix> {
        let t = self.tensor(name)?;
        self.check_dims(t, ne)?;
        let cols = ne[0] as usize;
        let rows = ne[1..].iter().product::<u64>() as usize;
        QMatrix::new(
            name,
            rows,
            cols,
            self.format_of(t)?,
            self.bytes(name)?,
            None,
        )
    }

    /// A small tensor (norms, biases) of `len` elements widened to f32.
    pub fn vector_f32(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        self.check_dims(t, &[len as u64])?;
        let bytes = self.bytes(name)?;
        let b = bytes.as_slice();
        Ok(match t.ty {
            GgmlType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            GgmlType::F16 => b
                .chunks_exact(2)
                .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            GgmlType::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            other => {
                return Err(ModelError::UnsupportedDtype {
                    name: format!("{}: {name}", self.path.display()),
                    dtype: other.name().to_string(),
                    supported: "F32, F16, BF16 for 1-D tensors",
                });
            }
        })
    }

    /// The vocabulary and chat template.
    pub fn vocab(&self) -> Result<GgufVocab> {
        vocab::read(self)
    }

    /// The model's spec from the metadata (and which tensors exist).
    pub fn spec(&self) -> Result<ModelSpec> {
        arch::spec(self)
    }
}

/// Loads the spec and dense weights of a GGUF file. Routed experts come
/// from [`GgufExperts::load`] (resident) or a [`GgufExpertLocator`].
pub fn load_gguf(path: &Path) -> Result<(Model, GgufFile)> {
    let file = GgufFile::open(path)?;
    let spec = file.spec()?;
    let weights = load::dense_weights(&spec, &file)?;
    Ok((Model::new(spec, weights), file))
}
