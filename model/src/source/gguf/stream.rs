//! A GGUF writer that streams: the header (every tensor's name, dims,
//! type and offset) goes first, then each tensor's data in order, in
//! pieces of any size, so a file larger than memory can be written (`colibri
//! synth` writes a 17 GB model this way). The file appears under its name
//! only when complete: it is written as `NAME.partial`, synced and renamed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::header::{DEFAULT_ALIGNMENT, GgmlType, GgufValue};
use super::write::{TensorHeader, header_bytes};
use crate::error::{ModelError, Result};

/// A GGUF file being written.
pub struct GgufStreamWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: BufWriter<File>,
    tensors: Vec<(String, u64)>,
    next: usize,
    /// Bytes of tensor `next` written so far.
    in_tensor: u64,
    alignment: u64,
    written: u64,
}

impl GgufStreamWriter {
    /// Writes the header of a file holding `tensors` (name, ggml dims, type)
    /// with `metadata`; the data follows through [`write`](Self::write).
    pub fn create(
        path: &Path,
        metadata: &[(String, GgufValue)],
        tensors: &[(String, Vec<u64>, GgmlType)],
    ) -> Result<GgufStreamWriter> {
        if path.exists() {
            return Err(ModelError::Invalid(format!(
                "{} already exists; remove it or choose another output",
                path.display()
            )));
        }
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            Some((_, GgufValue::U32(a))) if *a > 0 && a.is_power_of_two() => *a as u64,
            Some(_) => {
                return Err(ModelError::Invalid(
                    "general.alignment must be a power-of-two u32".into(),
                ));
            }
            None => DEFAULT_ALIGNMENT,
        };
        let mut sizes = Vec::with_capacity(tensors.len());
        let mut infos = Vec::with_capacity(tensors.len());
        for (name, ne, ty) in tensors {
            let bytes = ty
                .tensor_bytes(ne)
                .map_err(|e| ModelError::Invalid(format!("gguf tensor `{name}`: {e}")))?;
            sizes.push((name.clone(), bytes));
            infos.push(TensorHeader {
                name,
                ne,
                ty: *ty,
                bytes,
            });
        }
        let header = header_bytes(metadata, &infos, alignment);
        let file_name = path
            .file_name()
            .ok_or_else(|| ModelError::Invalid(format!("{}: not a file path", path.display())))?;
        let tmp = path.with_file_name(format!("{}.partial", file_name.to_string_lossy()));
        let f = File::create(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
        let mut w = GgufStreamWriter {
            path: path.to_path_buf(),
            tmp,
            out: BufWriter::with_capacity(4 << 20, f),
            tensors: sizes,
            next: 0,
            in_tensor: 0,
            alignment,
            written: 0,
        };
        w.put(&header)?;
        w.skip_empty()?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .map_err(|e| ModelError::io(&self.tmp, e))?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Pads to the alignment after each finished tensor (and skips empty
    /// ones).
    fn skip_empty(&mut self) -> Result<()> {
        while let Some((_, size)) = self.tensors.get(self.next) {
            if self.in_tensor < *size {
                break;
            }
            let pad = self.written.div_ceil(self.alignment) * self.alignment - self.written;
            self.put(&vec![0u8; pad as usize])?;
            self.next += 1;
            self.in_tensor = 0;
        }
        Ok(())
    }

    /// The name of the tensor the next bytes belong to.
    pub fn current(&self) -> Option<&str> {
        self.tensors.get(self.next).map(|(n, _)| n.as_str())
    }

    /// Appends data of the current tensor (a piece must not run past it).
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let (name, size) = self.tensors.get(self.next).cloned().ok_or_else(|| {
            ModelError::Invalid("gguf stream: more data than the header declares".into())
        })?;
        if self.in_tensor + bytes.len() as u64 > size {
            return Err(ModelError::Invalid(format!(
                "gguf stream: tensor `{name}` gets more than its {size} bytes"
            )));
        }
        self.put(bytes)?;
        self.in_tensor += bytes.len() as u64;
        self.skip_empty()
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Checks every tensor is complete, syncs and renames into place.
    pub fn finish(mut self) -> Result<u64> {
        if let Some((name, _)) = self.tensors.get(self.next) {
            return Err(ModelError::Invalid(format!(
                "gguf stream: tensor `{name}` is incomplete"
            )));
        }
        self.out.flush().map_err(|e| ModelError::io(&self.tmp, e))?;
        let f = self
            .out
            .into_inner()
            .map_err(|e| ModelError::io(&self.tmp, e.into_error()))?;
        f.sync_all().map_err(|e| ModelError::io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.path).map_err(|e| ModelError::io(&self.path, e))?;
        Ok(self.written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::gguf::GgufWriter;

    #[test]
    fn streamed_file_equals_the_in_memory_writer() {
        let dir = tempfile::tempdir().unwrap();
        let meta = vec![
            (
                "general.architecture".to_string(),
                GgufValue::String("qwen3moe".into()),
            ),
            ("x.count".to_string(), GgufValue::U32(7)),
        ];
        let a: Vec<f32> = (0..10).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..96).map(|i| (i as f32).sin()).collect();
        let mut w = GgufWriter::new();
        for (k, v) in &meta {
            w.add(k, v.clone()).unwrap();
        }
        w.add_f32_tensor("a", &[10], &a).unwrap();
        w.add_f32_tensor("b", &[32, 3], &b).unwrap();
        let want = w.to_bytes();
        let path = dir.path().join("s.gguf");
        let mut s = GgufStreamWriter::create(
            &path,
            &meta,
            &[
                ("a".into(), vec![10], GgmlType::F32),
                ("b".into(), vec![32, 3], GgmlType::F32),
            ],
        )
        .unwrap();
        let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        s.write(&bytes(&a)).unwrap();
        assert_eq!(s.current(), Some("b"));
        assert!(s.write(&bytes(&b[..40])).is_ok());
        assert!(s.write(&bytes(&b[..60])).is_err(), "past the tensor's end");
        s.write(&bytes(&b[40..])).unwrap();
        assert!(!path.exists(), "only complete files appear");
        s.finish().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), want);
    }
}
