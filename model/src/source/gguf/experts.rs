//! Routed experts of a GGUF file. llama.cpp stacks each layer's experts
//! into `ffn_{gate,up,down}_exps` tensors of dims `[cols, rows, n_expert]`,
//! so expert `e` of each is one contiguous slab at `e · rows · row_bytes`:
//! three extents per expert, which the streaming tiers read directly.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::GgufFile;
use crate::config::{FfnKind, ModelSpec};
use crate::error::{ModelError, Result};
use crate::experts::{ExpertSource, ExpertWeights};
use crate::source::{ExpertLocation, ExpertLocator, Extent, MatrixLocation};

/// Where every routed expert of a GGUF model is in its file.
pub struct GgufExpertLocator {
    files: Vec<PathBuf>,
    locations: HashMap<(usize, usize), ExpertLocation>,
}

impl GgufExpertLocator {
    pub fn new(spec: &ModelSpec, file: &GgufFile) -> Result<GgufExpertLocator> {
        let mut locations = HashMap::new();
        if let Some(moe) = &spec.moe {
            let (h, i, n) = (spec.hidden_size, moe.intermediate_size, moe.num_experts);
            for (l, ls) in spec.layers.iter().enumerate() {
                if ls.ffn != FfnKind::Moe {
                    continue;
                }
                // (name, rows, cols) of gate, up, down.
                let parts = [("gate", i, h), ("up", i, h), ("down", h, i)];
                let mut mats = Vec::with_capacity(3);
                for (which, rows, cols) in parts {
                    let name = format!("blk.{l}.ffn_{which}_exps.weight");
                    // Checks dims and format once for the whole stack.
                    let m = file.matrix_ne(&name, &[cols as u64, rows as u64, n as u64])?;
                    let t = file.tensor(&name)?;
                    let slab = (rows * m.format.row_bytes(cols)?) as u64;
                    mats.push((file.tensor_offset(t), slab, rows, cols, m.format));
                }
                for e in 0..n {
                    let loc = |k: usize| {
                        let (off, slab, rows, cols, format) = mats[k];
                        MatrixLocation {
                            extent: Extent {
                                file: 0,
                                offset: off + e as u64 * slab,
                                len: slab,
                            },
                            rows,
                            cols,
                            format,
                            scales: None,
                        }
                    };
                    locations.insert(
                        (l, e),
                        ExpertLocation {
                            layer: l,
                            expert: e,
                            gate: loc(0),
                            up: loc(1),
                            down: loc(2),
                            record: None,
                        },
                    );
                }
            }
        }
        Ok(GgufExpertLocator {
            files: vec![file.path().to_path_buf()],
            locations,
        })
    }
}

impl ExpertLocator for GgufExpertLocator {
    fn files(&self) -> &[PathBuf] {
        &self.files
    }

    fn locate(&self, layer: usize, expert: usize) -> Result<ExpertLocation> {
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

/// Every routed expert of a GGUF file, as views into its memory map (the
/// page cache holds them), assembled through the locator exactly as the
/// streaming tiers assemble read buffers.
pub struct GgufExperts {
    layers: Vec<Vec<Arc<ExpertWeights>>>,
}

impl GgufExperts {
    pub fn load(spec: &ModelSpec, file: &GgufFile) -> Result<GgufExperts> {
        let locator = GgufExpertLocator::new(spec, file)?;
        let mut layers = Vec::with_capacity(spec.num_layers());
        for (l, ls) in spec.layers.iter().enumerate() {
            let mut experts = Vec::new();
            if ls.ffn == FfnKind::Moe
                && let Some(moe) = &spec.moe
            {
                for e in 0..moe.num_experts {
                    experts.push(Arc::new(load_expert(&locator, file, l, e)?));
                }
            }
            layers.push(experts);
        }
        Ok(GgufExperts { layers })
    }
}

/// Expert `e` of layer `l` as views into the file's map.
pub fn load_expert(
    locator: &GgufExpertLocator,
    file: &GgufFile,
    l: usize,
    e: usize,
) -> Result<ExpertWeights> {
    let loc = locator.locate(l, e)?;
    let view = |m: &MatrixLocation| file.extent_bytes(m.extent.offset, m.extent.len);
    loc.assemble([view(&loc.gate)?, view(&loc.up)?, view(&loc.down)?])
}

impl ExpertSource for GgufExperts {
    fn fetch(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<()>,
    ) -> Result<()> {
        let experts = self.layers.get(layer).ok_or_else(|| ModelError::Expert {
            layer,
            expert: ids.first().copied().unwrap_or(0),
            reason: "no such layer".into(),
        })?;
        for &e in ids {
            let w = experts.get(e).ok_or_else(|| ModelError::Expert {
                layer,
                expert: e,
                reason: "no such expert".into(),
            })?;
            ready(e, w.clone())?;
        }
        Ok(())
    }

    fn fetch_groups(
        &self,
        layer: usize,
        ids: &[usize],
        ready: &mut dyn FnMut(crate::experts::ExpertGroup) -> Result<()>,
    ) -> Result<()> {
        crate::experts::one_group(self, layer, ids, ready)
    }
}
