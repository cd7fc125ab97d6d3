//! Our GGUF writer (version 3, little-endian): metadata key/values of every
//! type and tensors placed at `general.alignment` boundaries. Used by
//! `colibri synth` and `colibri convert`, and by the tests to build files.
//!
//! Tensors are added with their ggml dims (`ne[0]` innermost) and their
//! stored bytes; the writer computes offsets, pads, and writes atomically
//! (a temporary file in the same directory, then a rename).

use std::io::Write;
use std::path::Path;

use super::header::{DEFAULT_ALIGNMENT, GgmlType, GgufArray, GgufType, GgufValue};
use crate::error::{ModelError, Result};

struct PendingTensor {
    name: String,
    ne: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// What the header says about one tensor.
pub struct TensorHeader<'a> {
    pub name: &'a str,
    pub ne: &'a [u64],
    pub ty: GgmlType,
    /// Bytes of its data.
    pub bytes: u64,
}

/// The header of a GGUF file (magic, version 3, metadata, tensor infos
/// with offsets of data laid out in order at `alignment` boundaries),
/// padded to `alignment`: the tensors' data follows.
pub fn header_bytes(
    metadata: &[(String, GgufValue)],
    tensors: &[TensorHeader<'_>],
    alignment: u64,
) -> Vec<u8> {
    let a = alignment as usize;
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut out, k);
        out.extend_from_slice(&v.ty().to_u32().to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offset = 0usize;
    for t in tensors {
        put_str(&mut out, t.name);
        out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
        for d in t.ne {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.id().to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offset = (offset + t.bytes as usize).div_ceil(a) * a;
    }
    out.resize(out.len().div_ceil(a) * a, 0);
    out
}

/// Builds a GGUF file in memory or on disk.
pub struct GgufWriter {
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<PendingTensor>,
    alignment: u64,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.push(*x as u8),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(*x as u8),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::Array(a) => {
            out.extend_from_slice(&a.elem.to_u32().to_le_bytes());
            out.extend_from_slice(&(a.values.len() as u64).to_le_bytes());
            for e in &a.values {
                put_value(out, e);
            }
        }
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            metadata: Vec::new(),
            tensors: Vec::new(),
            alignment: DEFAULT_ALIGNMENT,
        }
    }

    /// Adds a key/value. `general.alignment` (a power-of-two u32) also sets
    /// the alignment tensors are written at.
    pub fn add(&mut self, key: &str, value: GgufValue) -> Result<&mut Self> {
        if self.metadata.iter().any(|(k, _)| k == key) {
            return Err(ModelError::Invalid(format!(
                "gguf writer: key `{key}` added twice"
            )));
        }
        if let GgufValue::Array(a) = &value
            && let Some(bad) = a.values.iter().find(|v| v.ty() != a.elem)
        {
            return Err(ModelError::Invalid(format!(
                "gguf writer: `{key}`: array of {:?} holds a {:?}",
                a.elem,
                bad.ty()
            )));
        }
        if key == "general.alignment" {
            match value {
                GgufValue::U32(a) if a > 0 && a.is_power_of_two() => self.alignment = a as u64,
                _ => {
                    return Err(ModelError::Invalid(
                        "gguf writer: general.alignment must be a power-of-two u32".into(),
                    ));
                }
            }
        }
        self.metadata.push((key.to_string(), value));
        Ok(self)
    }

    pub fn add_str(&mut self, key: &str, v: &str) -> Result<&mut Self> {
        self.add(key, GgufValue::String(v.to_string()))
    }

    pub fn add_u32(&mut self, key: &str, v: u32) -> Result<&mut Self> {
        self.add(key, GgufValue::U32(v))
    }

    pub fn add_f32(&mut self, key: &str, v: f32) -> Result<&mut Self> {
        self.add(key, GgufValue::F32(v))
    }

    pub fn add_bool(&mut self, key: &str, v: bool) -> Result<&mut Self> {
        self.add(key, GgufValue::Bool(v))
    }

    /// An array of strings (token lists, merges).
    pub fn add_str_array(&mut self, key: &str, v: &[String]) -> Result<&mut Self> {
        self.add(
            key,
            GgufValue::Array(GgufArray {
                elem: GgufType::String,
                values: v.iter().cloned().map(GgufValue::String).collect(),
            }),
        )
    }

    /// Adds a tensor of ggml dims `ne` whose stored bytes are `data`.
    pub fn add_tensor(
        &mut self,
        name: &str,
        ne: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let want = ty
            .tensor_bytes(ne)
            .map_err(|e| ModelError::Invalid(format!("gguf writer: tensor `{name}`: {e}")))?;
        if data.len() as u64 != want {
            return Err(ModelError::Invalid(format!(
                "gguf writer: tensor `{name}`: {} bytes given, {want} expected for {ne:?} {}",
                data.len(),
                ty.name()
            )));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(ModelError::Invalid(format!(
                "gguf writer: tensor `{name}` added twice"
            )));
        }
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            ne: ne.to_vec(),
            ty,
            data,
        });
        Ok(self)
    }

    /// An f32 tensor from values.
    pub fn add_f32_tensor(&mut self, name: &str, ne: &[u64], values: &[f32]) -> Result<&mut Self> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add_tensor(name, ne, GgmlType::F32, data)
    }

    /// The whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let infos: Vec<TensorHeader<'_>> = self
            .tensors
            .iter()
            .map(|t| TensorHeader {
                name: &t.name,
                ne: &t.ne,
                ty: t.ty,
                bytes: t.data.len() as u64,
            })
            .collect();
        let a = self.alignment as usize;
        let mut out = header_bytes(&self.metadata, &infos, self.alignment);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            out.resize(out.len().div_ceil(a) * a, 0);
        }
        out
    }

    /// Writes the file atomically: a temporary sibling, synced, renamed.
    pub fn write(&self, path: &Path) -> Result<()> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let file_name = path
            .file_name()
            .ok_or_else(|| ModelError::Invalid(format!("{}: not a file path", path.display())))?;
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            file_name.to_string_lossy(),
            std::process::id()
        ));
        let result = (|| -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&self.to_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(ModelError::io(path, e));
        }
        Ok(())
    }
}
