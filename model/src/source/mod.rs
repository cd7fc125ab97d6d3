//! Weight sources, and where routed experts live on disk.
//!
//! Every source (Hugging Face safetensors, GGUF; the packed expert store
//! next) gives the dense weights and an [`ExpertLocator`]: for each
//! (layer, expert), the byte extents of its gate, up and down matrices and
//! their formats. The streaming tiers read exactly those bytes into a buffer
//! and [`ExpertLocation::assemble`] turns the buffer into weights the kernels
//! run, so every source computes bit-identical results for the same weights.

pub mod gguf;
pub mod safetensors;

use std::path::{Path, PathBuf};

pub use self::gguf::{GgufExpertLocator, GgufExperts, GgufFile, load_gguf};
pub use self::safetensors::{Checkpoint, HfExpertLocator, TensorEntry, TensorLocation};
use crate::config::ModelSpec;
use crate::error::{ModelError, Result};
use crate::experts::ExpertWeights;
use crate::format::WeightFormat;
use crate::tensor::{BlockScales, Bytes, QMatrix};

/// A byte range of one of the locator's files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Index into [`ExpertLocator::files`].
    pub file: usize,
    pub offset: u64,
    pub len: u64,
}

/// One stored matrix of an expert.
#[derive(Clone, Debug)]
pub struct MatrixLocation {
    pub extent: Extent,
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    /// FP8 block scales: small, kept resident rather than read each time.
    pub scales: Option<BlockScales>,
}

/// Where the gate, up and down matrices of one routed expert are.
#[derive(Clone, Debug)]
pub struct ExpertLocation {
    pub layer: usize,
    pub expert: usize,
    pub gate: MatrixLocation,
    pub up: MatrixLocation,
    pub down: MatrixLocation,
}

impl ExpertLocation {
    pub fn matrices(&self) -> [&MatrixLocation; 3] {
        [&self.gate, &self.up, &self.down]
    }

    /// Bytes the three matrices occupy on disk.
    pub fn stored_bytes(&self) -> u64 {
        self.matrices().iter().map(|m| m.extent.len).sum()
    }

    /// Builds the expert from `parts[i]`, the bytes of `matrices()[i]`'s
    /// extent (views into a read buffer: no copy).
    pub fn assemble(&self, parts: [Bytes; 3]) -> Result<ExpertWeights> {
        let name = |which: &str| format!("layer {} expert {} {which}", self.layer, self.expert);
        let [g, u, d] = parts;
        let m = |loc: &MatrixLocation, b: Bytes, which: &str| -> Result<QMatrix> {
            if b.len() as u64 != loc.extent.len {
                return Err(ModelError::Expert {
                    layer: self.layer,
                    expert: self.expert,
                    reason: format!(
                        "{which}: got {} bytes, expected {}",
                        b.len(),
                        loc.extent.len
                    ),
                });
            }
            QMatrix::new(
                &name(which),
                loc.rows,
                loc.cols,
                loc.format,
                b,
                loc.scales.clone(),
            )
        };
        Ok(ExpertWeights {
            gate: m(&self.gate, g, "gate")?,
            up: m(&self.up, u, "up")?,
            down: m(&self.down, d, "down")?,
        })
    }
}

/// Maps (layer, expert) to bytes on disk.
pub trait ExpertLocator: Send + Sync {
    /// The files extents refer to.
    fn files(&self) -> &[PathBuf];
    /// Where expert `expert` of MoE layer `layer` is.
    fn locate(&self, layer: usize, expert: usize) -> Result<ExpertLocation>;
}

/// The weights a model was loaded from: a Hugging Face checkpoint
/// directory or a GGUF file.
pub enum WeightSource {
    Hf(Checkpoint),
    Gguf(GgufFile),
}

impl WeightSource {
    /// An expert locator over this source.
    pub fn locator(&self, spec: &ModelSpec) -> Result<Box<dyn ExpertLocator>> {
        Ok(match self {
            WeightSource::Hf(ck) => Box::new(HfExpertLocator::new(spec, ck)?),
            WeightSource::Gguf(f) => Box::new(GgufExpertLocator::new(spec, f)?),
        })
    }
}

/// Whether `path` names a GGUF file (by extension, else by its magic).
pub fn is_gguf(path: &Path) -> bool {
    if path.is_dir() {
        return false;
    }
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// Loads the spec and dense weights from a checkpoint directory or a GGUF
/// file.
pub fn load_model(path: &Path) -> Result<(crate::forward::Model, WeightSource)> {
    if is_gguf(path) {
        let (model, file) = load_gguf(path)?;
        return Ok((model, WeightSource::Gguf(file)));
    }
    let spec = ModelSpec::from_dir(path)?;
    let ck = Checkpoint::open(path)?;
    let weights = crate::weights::DenseWeights::load(&spec, &ck)?;
    Ok((
        crate::forward::Model::new(spec, weights),
        WeightSource::Hf(ck),
    ))
}
