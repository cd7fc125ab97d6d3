//! Usage history: how often each routed expert of a model was selected, kept
//! across runs so the next start can pin the hottest experts.
//!
//! One file per model under `$XDG_CACHE_HOME/colibri/usage/` (or
//! `~/.cache/colibri/usage/`), named by the model key: a hash of
//! `config.json` and of every expert's location (file name, offset, length,
//! format, shape), so a re-quantized or re-packed copy of the same model
//! gets its own history and a stale history never pins the wrong bytes.
//!
//! The file is JSON (small: one counter per expert) with a format name and
//! a version. It is written atomically: a temporary file in the same
//! directory, `fsync`, `rename` over the old one, `fsync` of the directory,
//! so a crash leaves either the old or the new history, never a torn one.
//! A history that is corrupt, of another version, of another model or of
//! another shape is ignored with a warning: it is an optimisation, and
//! losing it must never stop a model from running.
//!
//! Counts are per *step*: one fetch of a layer (all rows of a batch) counts
//! each selected expert once, because that is what costs a read. The rate
//! `count / steps` is the probability that a step of that layer needs the
//! expert.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::layout::ExpertLayout;

/// The `format` field of a history file.
pub const USAGE_FORMAT: &str = "colibri-expert-usage";
/// The version written (and the only one read).
pub const USAGE_VERSION: u32 = 1;

/// Why a history could not be written.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error("writing usage history {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("encoding usage history: {0}")]
    Encode(#[from] serde_json::Error),
}

/// Selection counts of one model's routed experts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageHistory {
    pub format: String,
    pub version: u32,
    /// The model key (see [`model_key`]).
    pub model_key: String,
    /// One entry per MoE layer.
    pub layers: Vec<LayerUsage>,
}

/// Counts of one MoE layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerUsage {
    pub layer: usize,
    /// Fetches of this layer.
    pub steps: u64,
    /// Per expert: fetches that selected it.
    pub counts: Vec<u64>,
}

/// The default directory of usage histories.
pub fn default_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|home| PathBuf::from(home).join(".cache"))
        })?;
    Some(base.join("colibri").join("usage"))
}

/// FNV-1a, 64 bits: stable across runs, platforms and Rust versions (the
/// standard library's hasher promises none of that). Not cryptographic; it
/// only has to tell models apart.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn bytes(&mut self, data: &[u8]) {
        for &b in data {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.bytes(s.as_bytes());
    }
}

/// The key of a model: `config.json`'s bytes and every expert's location.
/// File names enter without their directory, so moving a model keeps its
/// history.
pub fn model_key(config_json: &[u8], layout: &ExpertLayout, files: &[PathBuf]) -> String {
    let mut h = Fnv::new();
    h.str("colibri-usage-key-1");
    h.u64(config_json.len() as u64);
    h.bytes(config_json);
    for r in &layout.records {
        h.u64(r.layer as u64);
        h.u64(r.expert as u64);
        for m in r.location.matrices() {
            let name = files
                .get(m.extent.file)
                .and_then(|p| p.file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            h.str(&name);
            h.u64(m.extent.offset);
            h.u64(m.extent.len);
            h.str(m.format.name());
            h.u64(m.rows as u64);
            h.u64(m.cols as u64);
        }
    }
    format!("{:016x}", h.0)
}

impl UsageHistory {
    /// An empty history for `layout`.
    pub fn empty(model_key: &str, layout: &ExpertLayout) -> UsageHistory {
        UsageHistory {
            format: USAGE_FORMAT.into(),
            version: USAGE_VERSION,
            model_key: model_key.into(),
            layers: layout
                .moe_layers()
                .map(|layer| LayerUsage {
                    layer,
                    steps: 0,
                    counts: vec![0; layout.experts_per_layer],
                })
                .collect(),
        }
    }

    /// The file of `model_key` in `dir`.
    pub fn path(dir: &Path, model_key: &str) -> PathBuf {
        dir.join(format!("{model_key}.json"))
    }

    /// Loads the history of `model_key` from `dir`. A missing file is an
    /// empty history; an unreadable, corrupt, foreign or misshapen one is
    /// ignored with a warning (and also gives an empty history).
    pub fn load(dir: &Path, model_key: &str, layout: &ExpertLayout) -> UsageHistory {
        let path = Self::path(dir, model_key);
        let empty = Self::empty(model_key, layout);
        let text = match std::fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return empty,
            Err(e) => {
                tracing::warn!("ignoring usage history {}: {e}", path.display());
                return empty;
            }
        };
        match Self::parse(&text, model_key, layout) {
            Ok(history) => history,
            Err(reason) => {
                tracing::warn!(
                    "ignoring usage history {}: {reason}; starting a new one",
                    path.display()
                );
                empty
            }
        }
    }

    /// Parses and checks a history file's bytes.
    pub fn parse(bytes: &[u8], model_key: &str, layout: &ExpertLayout) -> Result<Self, String> {
        let h: UsageHistory =
            serde_json::from_slice(bytes).map_err(|e| format!("not a usage history ({e})"))?;
        if h.format != USAGE_FORMAT {
            return Err(format!("format {:?}, expected {USAGE_FORMAT:?}", h.format));
        }
        if h.version != USAGE_VERSION {
            return Err(format!(
                "version {}, this colibri reads version {USAGE_VERSION}",
                h.version
            ));
        }
        if h.model_key != model_key {
            return Err(format!(
                "recorded for model {}, not {model_key}",
                h.model_key
            ));
        }
        let want: Vec<usize> = layout.moe_layers().collect();
        let got: Vec<usize> = h.layers.iter().map(|l| l.layer).collect();
        if want != got {
            return Err(format!("MoE layers {got:?}, expected {want:?}"));
        }
        for l in &h.layers {
            if l.counts.len() != layout.experts_per_layer {
                return Err(format!(
                    "layer {}: {} counts for {} experts",
                    l.layer,
                    l.counts.len(),
                    layout.experts_per_layer
                ));
            }
            if let Some(c) = l.counts.iter().find(|&&c| c > l.steps) {
                return Err(format!(
                    "layer {}: a count of {c} exceeds its {} steps",
                    l.layer, l.steps
                ));
            }
        }
        Ok(h)
    }

    fn layer_mut(&mut self, layer: usize) -> Option<&mut LayerUsage> {
        // Layers are sorted; a binary search keeps recording O(log L).
        let i = self.layers.binary_search_by_key(&layer, |l| l.layer).ok()?;
        self.layers.get_mut(i)
    }

    /// Records one fetch of `layer` that selected `experts`.
    pub fn record(&mut self, layer: usize, experts: &[usize]) {
        if let Some(l) = self.layer_mut(layer) {
            l.steps += 1;
            for &e in experts {
                if let Some(c) = l.counts.get_mut(e) {
                    *c += 1;
                }
            }
        }
    }

    /// Steps recorded over all layers.
    pub fn total_steps(&self) -> u64 {
        self.layers.iter().map(|l| l.steps).sum()
    }

    /// The probability that a step of `layer` selects `expert` (`None`
    /// without data for that layer).
    pub fn rate(&self, layer: usize, expert: usize) -> Option<f64> {
        let i = self.layers.binary_search_by_key(&layer, |l| l.layer).ok()?;
        let l = &self.layers[i];
        if l.steps == 0 {
            return None;
        }
        Some(*l.counts.get(expert)? as f64 / l.steps as f64)
    }

    /// Writes the history to `dir` atomically; returns the file written.
    pub fn save(&self, dir: &Path) -> Result<PathBuf, UsageError> {
        let path = Self::path(dir, &self.model_key);
        let err = |source| UsageError::Write {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(err)?;
        let text = serde_json::to_vec(self)?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tmp = dir.join(format!(
            ".{}.tmp.{}.{nanos}",
            self.model_key,
            std::process::id()
        ));
        let written = (|| {
            let mut file = File::create(&tmp)?;
            file.write_all(&text)?;
            file.sync_all()?;
            drop(file);
            std::fs::rename(&tmp, &path)?;
            // The rename is durable once the directory is.
            File::open(dir)?.sync_all()
        })();
        if let Err(source) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(err(source));
        }
        Ok(path)
    }
}
