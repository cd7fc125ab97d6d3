//! `manifest.json` of a packed store: the architecture, the tensor index,
//! the expert records and every checksum, and the rules a manifest must
//! obey before any of its offsets is trusted.
//!
//! The same structure is the writer's *plan*: every offset and size is
//! fixed before the first byte is written (a store's layout follows from
//! its tensors' shapes and formats alone), so a conversion can be resumed
//! into the same places and an interrupted and an uninterrupted run give
//! byte-identical files. A plan is a manifest whose checksums are still 0.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::format::WeightFormat;

/// `format` of every manifest.
pub const FORMAT: &str = "colibri-packed-experts";
/// Bump on any change of the layout rules.
pub const VERSION: u32 = 1;
/// Alignment of every tensor and record: the page size and the `O_DIRECT`
/// granule of the file systems colibri reads from.
pub const ALIGN: u64 = 4096;
/// The store's files.
pub const MANIFEST_FILE: &str = "manifest.json";
pub const DENSE_FILE: &str = "dense.bin";
pub const EXPERTS_FILE: &str = "experts.bin";

/// An xxh3-64 checksum, written as 16 hex digits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Checksum(pub u64);

impl Serialize for Checksum {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{:016x}", self.0))
    }
}

impl<'de> Deserialize<'de> for Checksum {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.len() != 16 {
            return Err(serde::de::Error::custom(format!(
                "checksum `{s}` is not 16 hex digits"
            )));
        }
        u64::from_str_radix(&s, 16)
            .map(Checksum)
            .map_err(|_| serde::de::Error::custom(format!("checksum `{s}` is not hex")))
    }
}

/// The inputs of the model's [`crate::ModelSpec`]: the `config.json` (the
/// original one for Hugging Face sources, rebuilt from the spec for GGUF
/// sources) and `generation_config.json` when the source had one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Architecture {
    pub config: Value,
    pub generation_config: Option<Value>,
}

/// A file copied alongside (tokenizer files).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopiedFile {
    /// A plain file name in the store directory.
    pub name: String,
    pub bytes: u64,
    pub xxh3: Checksum,
}

/// FP8 block scales: `grid[0] × grid[1]` little-endian f32, one per
/// `block × block` tile, stored right after the data they scale.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalesEntry {
    pub block: usize,
    pub grid: [usize; 2],
    /// Absolute in `dense.bin`; from the record's start in `experts.bin`.
    pub offset: u64,
    pub bytes: u64,
}

/// One dense tensor of `dense.bin`, by its Hugging Face name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenseEntry {
    pub name: String,
    /// The layer it belongs to (`None`: embedding, final norm, output head).
    pub layer: Option<usize>,
    pub format: WeightFormat,
    /// `[rows, cols]` of a matrix, `[n]` of a vector (vectors are f32).
    pub shape: Vec<usize>,
    pub offset: u64,
    pub bytes: u64,
    pub scales: Option<ScalesEntry>,
    /// Of the data, then the scales.
    pub xxh3: Checksum,
}

/// One matrix of every record of a layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordMatrix {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    /// From the record's start.
    pub offset: u64,
    pub bytes: u64,
    pub scales: Option<ScalesEntry>,
}

/// The records of one MoE layer: expert `e` is the record at
/// `offset + e · record_bytes`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertLayer {
    pub layer: usize,
    pub offset: u64,
    /// The record's size on disk: `payload_bytes` padded to [`ALIGN`].
    pub record_bytes: u64,
    /// gate ‖ up ‖ down ‖ scales.
    pub payload_bytes: u64,
    pub gate: RecordMatrix,
    pub up: RecordMatrix,
    pub down: RecordMatrix,
    /// Per expert: xxh3-64 of the payload.
    pub xxh3: Vec<Checksum>,
}

impl ExpertLayer {
    pub fn matrices(&self) -> [&RecordMatrix; 3] {
        [&self.gate, &self.up, &self.down]
    }

    pub fn experts(&self) -> usize {
        self.xxh3.len()
    }

    pub fn record_offset(&self, e: usize) -> u64 {
        self.offset + e as u64 * self.record_bytes
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenseIndex {
    pub file: String,
    pub bytes: u64,
    pub tensors: Vec<DenseEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertIndex {
    pub file: String,
    pub bytes: u64,
    pub layers: Vec<ExpertLayer>,
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub alignment: u64,
    pub architecture: Architecture,
    pub tokenizer_files: Vec<CopiedFile>,
    pub dense: DenseIndex,
    pub experts: ExpertIndex,
}

/// A dense tensor to place: what the layout needs before any data exists.
#[derive(Clone, Debug)]
pub struct DenseSpec {
    pub name: String,
    pub layer: Option<usize>,
    pub format: WeightFormat,
    pub shape: Vec<usize>,
    /// FP8 scale block (the grid follows from the shape).
    pub fp8_block: Option<usize>,
}

/// One matrix of a layer's records, to place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixSpec {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub fp8_block: Option<usize>,
}

/// A MoE layer's records, to place.
#[derive(Clone, Debug)]
pub struct ExpertLayerSpec {
    pub layer: usize,
    pub experts: usize,
    pub matrices: [MatrixSpec; 3],
}

pub fn align_up(v: u64) -> u64 {
    v.div_ceil(ALIGN) * ALIGN
}

/// Bytes of `rows × cols` elements in `format`.
pub fn data_bytes(format: WeightFormat, rows: usize, cols: usize) -> crate::Result<u64> {
    Ok(rows as u64 * format.row_bytes(cols)? as u64)
}

fn scales_entry(
    block: Option<usize>,
    rows: usize,
    cols: usize,
    offset: u64,
) -> Option<ScalesEntry> {
    block.map(|b| {
        let grid = [rows.div_ceil(b), cols.div_ceil(b)];
        ScalesEntry {
            block: b,
            grid,
            offset,
            bytes: (grid[0] * grid[1] * 4) as u64,
        }
    })
}

impl Manifest {
    /// Places every tensor and record: dense tensors in the order given,
    /// each at the next [`ALIGN`] boundary; records layer by layer, each
    /// `payload` padded to [`ALIGN`]. Checksums are left at 0.
    pub fn layout(
        architecture: Architecture,
        tokenizer_files: Vec<CopiedFile>,
        dense: &[DenseSpec],
        experts: &[ExpertLayerSpec],
    ) -> crate::Result<Manifest> {
        let mut pos = 0u64;
        let mut tensors = Vec::with_capacity(dense.len());
        for d in dense {
            let (rows, cols) = match d.shape.as_slice() {
                [n] => (1, *n),
                [r, c] => (*r, *c),
                other => {
                    return Err(crate::ModelError::Invalid(format!(
                        "tensor `{}`: shape {other:?} is neither a vector nor a matrix",
                        d.name
                    )));
                }
            };
            let bytes = data_bytes(d.format, rows, cols)?;
            let scales = scales_entry(d.fp8_block, rows, cols, pos + bytes);
            let end = pos + bytes + scales.as_ref().map_or(0, |s| s.bytes);
            tensors.push(DenseEntry {
                name: d.name.clone(),
                layer: d.layer,
                format: d.format,
                shape: d.shape.clone(),
                offset: pos,
                bytes,
                scales,
                xxh3: Checksum(0),
            });
            pos = align_up(end);
        }
        let dense_bytes = pos;
        let mut pos = 0u64;
        let mut layers = Vec::with_capacity(experts.len());
        for l in experts {
            let mut off = 0u64;
            let mut mats = Vec::with_capacity(3);
            for m in &l.matrices {
                let bytes = data_bytes(m.format, m.rows, m.cols)?;
                mats.push(RecordMatrix {
                    format: m.format,
                    rows: m.rows,
                    cols: m.cols,
                    offset: off,
                    bytes,
                    scales: None,
                });
                off += bytes;
            }
            // Scales follow the three matrices, so the matrices stay
            // adjacent (one extent) for readers that ignore scales.
            for (mat, m) in mats.iter_mut().zip(&l.matrices) {
                mat.scales = scales_entry(m.fp8_block, m.rows, m.cols, off);
                off += mat.scales.as_ref().map_or(0, |s| s.bytes);
            }
            let record_bytes = align_up(off.max(1));
            let [gate, up, down]: [RecordMatrix; 3] = mats
                .try_into()
                .map_err(|_| crate::ModelError::Invalid("three matrices per expert".into()))?;
            layers.push(ExpertLayer {
                layer: l.layer,
                offset: pos,
                record_bytes,
                payload_bytes: off,
                gate,
                up,
                down,
                xxh3: vec![Checksum(0); l.experts],
            });
            pos += record_bytes * l.experts as u64;
        }
        Ok(Manifest {
            format: FORMAT.into(),
            version: VERSION,
            alignment: ALIGN,
            architecture,
            tokenizer_files,
            dense: DenseIndex {
                file: DENSE_FILE.into(),
                bytes: dense_bytes,
                tensors,
            },
            experts: ExpertIndex {
                file: EXPERTS_FILE.into(),
                bytes: pos,
                layers,
            },
        })
    }

    /// Checks the layout rules, so that no offset read from the manifest
    /// can point outside its file or overlap another tensor. `Err` is the
    /// reason, for the caller to attach the file name to.
    pub fn validate(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!(
                "`format` is `{}`, expected `{FORMAT}`",
                self.format
            ));
        }
        if self.version != VERSION {
            return Err(format!(
                "format version {} is not supported (this colibri reads version {VERSION}); convert the model again",
                self.version
            ));
        }
        if self.alignment != ALIGN {
            return Err(format!("alignment {} (expected {ALIGN})", self.alignment));
        }
        if self.dense.file != DENSE_FILE || self.experts.file != EXPERTS_FILE {
            return Err(format!(
                "data files must be `{DENSE_FILE}` and `{EXPERTS_FILE}`"
            ));
        }
        for f in &self.tokenizer_files {
            if f.name.is_empty()
                || f.name.contains('/')
                || f.name.contains('\\')
                || f.name.starts_with('.')
            {
                return Err(format!(
                    "tokenizer file `{}` is not a plain file name",
                    f.name
                ));
            }
        }
        let mut end = 0u64;
        for t in &self.dense.tensors {
            let what = |r: String| format!("tensor `{}`: {r}", t.name);
            let (rows, cols) = match t.shape.as_slice() {
                [n] if t.format == WeightFormat::F32 => (1, *n),
                [r, c] => (*r, *c),
                s => return Err(what(format!("bad shape {s:?} for {}", t.format.name()))),
            };
            let want = data_bytes(t.format, rows, cols).map_err(|e| what(e.to_string()))?;
            if t.bytes != want {
                return Err(what(format!("{} bytes, its shape needs {want}", t.bytes)));
            }
            if t.offset % ALIGN != 0 || t.offset < end {
                return Err(what(format!(
                    "offset {} is unaligned or overlaps the previous tensor",
                    t.offset
                )));
            }
            end = t.offset + t.bytes;
            check_scales(t.format, rows, cols, t.scales.as_ref(), end).map_err(what)?;
            end += t.scales.as_ref().map_or(0, |s| s.bytes);
        }
        if end > self.dense.bytes {
            return Err(format!(
                "dense tensors end at byte {end}, past the declared {} bytes",
                self.dense.bytes
            ));
        }
        let mut end = 0u64;
        for l in &self.experts.layers {
            let what = |r: String| format!("experts of layer {}: {r}", l.layer);
            if l.offset % ALIGN != 0 || l.offset < end {
                return Err(what(format!(
                    "offset {} is unaligned or overlaps",
                    l.offset
                )));
            }
            if l.record_bytes % ALIGN != 0 || l.record_bytes != align_up(l.payload_bytes.max(1)) {
                return Err(what(format!(
                    "record size {} is not the payload {} padded to {ALIGN}",
                    l.record_bytes, l.payload_bytes
                )));
            }
            let mut off = 0u64;
            for m in l.matrices() {
                let want = data_bytes(m.format, m.rows, m.cols).map_err(|e| what(e.to_string()))?;
                if m.offset != off || m.bytes != want {
                    return Err(what(format!(
                        "matrices must lie back to back from the record's start ({}+{} bytes, expected {off}+{want})",
                        m.offset, m.bytes
                    )));
                }
                off += m.bytes;
            }
            for m in l.matrices() {
                check_scales(m.format, m.rows, m.cols, m.scales.as_ref(), off).map_err(what)?;
                off += m.scales.as_ref().map_or(0, |s| s.bytes);
            }
            if off != l.payload_bytes {
                return Err(what(format!(
                    "payload is {off} bytes, the manifest says {}",
                    l.payload_bytes
                )));
            }
            end = l.offset + l.record_bytes * l.experts() as u64;
        }
        if end > self.experts.bytes {
            return Err(format!(
                "expert records end at byte {end}, past the declared {} bytes",
                self.experts.bytes
            ));
        }
        Ok(())
    }

    /// The same manifest with every data checksum at 0 (what a plan is).
    pub fn as_plan(&self) -> Manifest {
        let mut m = self.clone();
        for t in &mut m.dense.tensors {
            t.xxh3 = Checksum(0);
        }
        for l in &mut m.experts.layers {
            l.xxh3.iter_mut().for_each(|c| *c = Checksum(0));
        }
        m
    }

    /// Bytes of data (tensors and record payloads) the store holds.
    pub fn payload_bytes(&self) -> u64 {
        let dense: u64 = self
            .dense
            .tensors
            .iter()
            .map(|t| t.bytes + t.scales.as_ref().map_or(0, |s| s.bytes))
            .sum();
        let experts: u64 = self
            .experts
            .layers
            .iter()
            .map(|l| l.payload_bytes * l.experts() as u64)
            .sum();
        dense + experts
    }
}

fn check_scales(
    format: WeightFormat,
    rows: usize,
    cols: usize,
    scales: Option<&ScalesEntry>,
    at: u64,
) -> Result<(), String> {
    match (format, scales) {
        (WeightFormat::F8E4M3, Some(s)) => {
            let grid = [rows.div_ceil(s.block.max(1)), cols.div_ceil(s.block.max(1))];
            if s.block == 0 || s.grid != grid || s.bytes != (grid[0] * grid[1] * 4) as u64 {
                return Err(format!(
                    "scales {:?} of block {} do not fit {rows}x{cols}",
                    s.grid, s.block
                ));
            }
            if s.offset != at {
                return Err(format!(
                    "scales at {} must follow the data (at {at})",
                    s.offset
                ));
            }
            Ok(())
        }
        (WeightFormat::F8E4M3, None) => Err("fp8 data without block scales".into()),
        (_, Some(_)) => Err(format!("block scales given for {}", format.name())),
        (_, None) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arch() -> Architecture {
        Architecture {
            config: serde_json::json!({"model_type": "qwen3_moe"}),
            generation_config: None,
        }
    }

    #[test]
    fn layout_aligns_everything_and_validates() {
        let dense = vec![
            DenseSpec {
                name: "a".into(),
                layer: None,
                format: WeightFormat::F32,
                shape: vec![3],
                fp8_block: None,
            },
            DenseSpec {
                name: "b".into(),
                layer: Some(0),
                format: WeightFormat::F8E4M3,
                shape: vec![130, 64],
                fp8_block: Some(128),
            },
        ];
        let m = |format, rows, cols| MatrixSpec {
            format,
            rows,
            cols,
            fp8_block: None,
        };
        let experts = vec![ExpertLayerSpec {
            layer: 0,
            experts: 3,
            matrices: [
                m(WeightFormat::Q4_0, 64, 64),
                m(WeightFormat::Q4_0, 64, 64),
                m(WeightFormat::Q8_0, 64, 64),
            ],
        }];
        let man = Manifest::layout(arch(), vec![], &dense, &experts).unwrap();
        assert_eq!(man.dense.tensors[1].offset, ALIGN);
        assert_eq!(man.dense.tensors[1].scales.as_ref().unwrap().grid, [2, 1]);
        assert_eq!(
            man.dense.tensors[1].scales.as_ref().unwrap().offset,
            ALIGN + 130 * 64
        );
        let l = &man.experts.layers[0];
        assert_eq!(l.payload_bytes, 2 * 64 * 36 + 64 * 68);
        assert_eq!(l.record_bytes, ALIGN * 3);
        assert_eq!(l.up.offset, l.gate.bytes);
        assert_eq!(man.experts.bytes, 3 * 3 * ALIGN);
        man.validate().unwrap();
        let text = serde_json::to_string(&man).unwrap();
        let back: Manifest = serde_json::from_str(&text).unwrap();
        assert_eq!(back, man);

        let mut bad = man.clone();
        bad.experts.layers[0].up.offset += 1;
        assert!(bad.validate().unwrap_err().contains("back to back"));
        let mut bad = man.clone();
        bad.dense.tensors[1].offset = 100;
        assert!(bad.validate().unwrap_err().contains("unaligned"));
        let mut bad = man;
        bad.version = 99;
        assert!(bad.validate().unwrap_err().contains("version 99"));
    }
}
