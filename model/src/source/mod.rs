//! Weight sources, and where routed experts live on disk.
//!
//! Every source (Hugging Face safetensors today; GGUF and the packed expert
//! store next) gives the dense weights and an [`ExpertLocator`]: for each
//! (layer, expert), the byte extents of its gate, up and down matrices and
//! their formats. The streaming tiers read exactly those bytes into a buffer
//! and [`ExpertLocation::assemble`] turns the buffer into weights the kernels
//! run, so every source computes bit-identical results for the same weights.

pub mod safetensors;

use std::path::PathBuf;

pub use self::safetensors::{Checkpoint, HfExpertLocator, TensorEntry, TensorLocation};
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
