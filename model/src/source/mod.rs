//! Weight sources, and where routed experts live on disk.
//!
//! Every source (Hugging Face safetensors, GGUF, colibri's packed expert
//! store) gives the dense weights and an [`ExpertLocator`]: for each
//! (layer, expert), the byte extents of its gate, up and down matrices and
//! their formats. The streaming tiers read exactly those bytes into a buffer
//! and [`ExpertLocation::assemble`] turns the buffer into weights the kernels
//! run, so every source computes bit-identical results for the same weights.
//!
//! The packed store adds one thing to a location: its [`RecordExtent`], the
//! single 4 KiB-aligned extent that holds all three matrices back to back,
//! with the checksum [`ExpertLocation::assemble`] verifies on every read.
//! The three matrix extents stay as they are (adjacent inside the record),
//! so a reader that merges adjacent extents reads one record in one read.

pub mod gguf;
pub mod packed;
pub mod safetensors;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use self::gguf::{GgufExpertLocator, GgufExperts, GgufFile, load_gguf};
pub use self::packed::{PackedExpertLocator, PackedStore, is_packed, load_packed};
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

/// A packed store's record: one extent that holds an expert's gate, up and
/// down matrices back to back from its start (then their FP8 scales, if
/// any, then zero padding), and the checksum that verifies them.
#[derive(Clone, Debug)]
pub struct RecordExtent {
    /// The whole record; offset and length are multiples of the store's
    /// alignment (4 KiB), so one `O_DIRECT` read fetches exactly it.
    pub extent: Extent,
    /// xxh3-64 of gate ‖ up ‖ down ‖ the three matrices' FP8 scales (f32,
    /// little-endian, in that order): the record without its padding.
    pub checksum: u64,
    /// The record's file, named by checksum errors.
    pub path: Arc<Path>,
}

/// Where the gate, up and down matrices of one routed expert are.
#[derive(Clone, Debug)]
pub struct ExpertLocation {
    pub layer: usize,
    pub expert: usize,
    pub gate: MatrixLocation,
    pub up: MatrixLocation,
    pub down: MatrixLocation,
    /// The packed store's single record holding all three (`None` for
    /// sources whose matrices are separate tensors).
    pub record: Option<RecordExtent>,
}

/// The checksum of a packed record from its parts: the three matrices'
/// stored bytes, then their FP8 scales as little-endian f32.
pub fn record_checksum(parts: [&[u8]; 3], scales: [Option<&BlockScales>; 3]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for p in parts {
        h.update(p);
    }
    for s in scales.into_iter().flatten() {
        for v in s.scales.iter() {
            h.update(&v.to_le_bytes());
        }
    }
    h.digest()
}

impl ExpertLocation {
    pub fn matrices(&self) -> [&MatrixLocation; 3] {
        [&self.gate, &self.up, &self.down]
    }

    /// Bytes the three matrices occupy on disk.
    pub fn stored_bytes(&self) -> u64 {
        self.matrices().iter().map(|m| m.extent.len).sum()
    }

    /// Checks `parts` (the bytes of `matrices()`' extents) against the
    /// record's checksum; a no-op for sources without records. The error
    /// names the file, the layer and the expert.
    pub fn verify(&self, parts: [&[u8]; 3]) -> Result<()> {
        let Some(r) = &self.record else {
            return Ok(());
        };
        let scales = [
            self.gate.scales.as_ref(),
            self.up.scales.as_ref(),
            self.down.scales.as_ref(),
        ];
        let got = record_checksum(parts, scales);
        if got != r.checksum {
            return Err(ModelError::Checksum {
                file: r.path.to_path_buf(),
                what: format!("layer {} expert {}", self.layer, self.expert),
                expected: r.checksum,
                got,
            });
        }
        Ok(())
    }

    /// [`verify`](Self::verify) over an assembled expert's bytes (resident
    /// sources check an expert once, when it is first used).
    pub fn verify_weights(&self, w: &ExpertWeights) -> Result<()> {
        self.verify([
            w.gate.data().as_slice(),
            w.up.data().as_slice(),
            w.down.data().as_slice(),
        ])
    }

    /// Builds the expert from `parts[i]`, the bytes of `matrices()[i]`'s
    /// extent (views into a read buffer: no copy), after verifying them
    /// against the record's checksum when the source has one.
    pub fn assemble(&self, parts: [Bytes; 3]) -> Result<ExpertWeights> {
        self.verify([
            parts[0].as_slice(),
            parts[1].as_slice(),
            parts[2].as_slice(),
        ])?;
        self.assemble_unverified(parts)
    }

    /// [`assemble`](Self::assemble) without the checksum: for resident
    /// sources, which verify on first use instead of at load.
    pub fn assemble_unverified(&self, parts: [Bytes; 3]) -> Result<ExpertWeights> {
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
            QMatrix::named(
                &MatrixName {
                    layer: self.layer,
                    expert: self.expert,
                    which,
                },
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

/// An expert matrix's name in errors (`layer 3 expert 17 gate`), formatted
/// only when one is.
struct MatrixName<'a> {
    layer: usize,
    expert: usize,
    which: &'a str,
}

impl std::fmt::Display for MatrixName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "layer {} expert {} {}",
            self.layer, self.expert, self.which
        )
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
/// directory, a GGUF file or a packed expert store.
pub enum WeightSource {
    Hf(Checkpoint),
    Gguf(GgufFile),
    Packed(PackedStore),
}

impl WeightSource {
    /// An expert locator over this source.
    pub fn locator(&self, spec: &ModelSpec) -> Result<Box<dyn ExpertLocator>> {
        Ok(match self {
            WeightSource::Hf(ck) => Box::new(HfExpertLocator::new(spec, ck)?),
            WeightSource::Gguf(f) => Box::new(GgufExpertLocator::new(spec, f)?),
            WeightSource::Packed(p) => Box::new(PackedExpertLocator::new(spec, p)?),
        })
    }

    /// The embedding, final norm and (untied) output head.
    pub fn load_globals(&self, spec: &ModelSpec) -> Result<crate::weights::GlobalWeights> {
        match self {
            WeightSource::Hf(ck) => crate::weights::GlobalWeights::load(spec, ck),
            WeightSource::Gguf(f) => gguf::load::global_weights(spec, f),
            WeightSource::Packed(p) => crate::weights::GlobalWeights::load(spec, p),
        }
    }

    /// The dense weights of layer `i` (attention, norms, router, shared
    /// experts or dense MLP).
    pub fn load_layer(&self, spec: &ModelSpec, i: usize) -> Result<crate::weights::LayerWeights> {
        match self {
            WeightSource::Hf(ck) => crate::weights::load_layer(spec, ck, i),
            WeightSource::Gguf(f) => gguf::load::layer_weights(spec, f, i),
            WeightSource::Packed(p) => crate::weights::load_layer(spec, p, i),
        }
    }

    /// Drops the source's mapped pages from the resident set; views stay
    /// valid (see [`crate::tensor::ByteStorage::release`]).
    pub fn release_pages(&self) {
        match self {
            WeightSource::Hf(ck) => ck.release_pages(),
            WeightSource::Gguf(f) => f.release_pages(),
            WeightSource::Packed(p) => p.release_pages(),
        }
    }

    /// All dense weights.
    pub fn load_dense(&self, spec: &ModelSpec) -> Result<crate::weights::DenseWeights> {
        let g = self.load_globals(spec)?;
        let layers = (0..spec.num_layers())
            .map(|i| self.load_layer(spec, i))
            .collect::<Result<Vec<_>>>()?;
        Ok(g.with_layers(layers))
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

/// Opens a checkpoint directory, a GGUF file or a packed store (directory
/// with a `manifest.json`) and reads its spec, without loading weights.
pub fn open_source(path: &Path) -> Result<(ModelSpec, WeightSource)> {
    if is_gguf(path) {
        let file = GgufFile::open(path)?;
        return Ok((file.spec()?, WeightSource::Gguf(file)));
    }
    if is_packed(path) {
        let store = PackedStore::open(path)?;
        return Ok((store.spec()?, WeightSource::Packed(store)));
    }
    let spec = ModelSpec::from_dir(path)?;
    let ck = Checkpoint::open(path)?;
    Ok((spec, WeightSource::Hf(ck)))
}

/// Loads the spec and dense weights from a checkpoint directory, a GGUF
/// file or a packed store.
pub fn load_model(path: &Path) -> Result<(crate::forward::Model, WeightSource)> {
    let (spec, src) = open_source(path)?;
    let weights = src.load_dense(&spec)?;
    Ok((crate::forward::Model::new(spec, weights), src))
}
