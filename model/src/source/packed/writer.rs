//! Writing a packed store: streamed, atomic and resumable.
//!
//! The writer is handed the whole [`Manifest`] as a plan (every offset is
//! known before any data exists) and works in `OUT.partial/` beside the
//! final directory `OUT`:
//!
//! - data is written with positioned writes at the planned offsets, a
//!   tensor or a record at a time, in pieces of any size (so a caller never
//!   holds more than a piece), and hashed as it goes;
//! - the work is cut into [`Unit`]s (the globals, then each layer with its
//!   dense tensors and its expert records). When a unit is complete the data
//!   files are synced and `progress/<unit>.json` records its checksums;
//! - [`PackedWriter::create`] on an existing `OUT.partial/` with the same
//!   plan re-hashes what each finished unit wrote and keeps the units whose
//!   bytes still match, so an interrupted conversion resumes without redoing
//!   finished layers and without trusting bytes it cannot verify;
//! - [`PackedWriter::commit`] copies the tokenizer files, writes
//!   `manifest.json` and renames `OUT.partial` to `OUT`.
//!
//! Nothing is written outside `OUT.partial/` and `OUT`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::manifest::{self, Checksum, CopiedFile, Manifest};
use crate::error::{ModelError, Result};

/// A piece of work whose completion is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Unit {
    /// Embedding, final norm, output head.
    Globals,
    /// A layer's dense tensors and expert records.
    Layer(usize),
}

impl Unit {
    fn of(layer: Option<usize>) -> Unit {
        layer.map_or(Unit::Globals, Unit::Layer)
    }

    fn file_name(self) -> String {
        match self {
            Unit::Globals => "globals.json".into(),
            Unit::Layer(l) => format!("layer-{l:05}.json"),
        }
    }
}

impl std::fmt::Display for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unit::Globals => write!(f, "globals"),
            Unit::Layer(l) => write!(f, "layer {l}"),
        }
    }
}

/// What a finished unit wrote.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Progress {
    dense: BTreeMap<String, Checksum>,
    records: Vec<Checksum>,
}

const PLAN_FILE: &str = "plan.json";
const PROGRESS_DIR: &str = "progress";
/// Chunk size when re-hashing written data on resume.
const VERIFY_CHUNK: usize = 8 << 20;

#[derive(Clone, Copy, Debug)]
enum Target {
    Dense(usize),
    /// (index into `experts.layers`, expert)
    Record(usize, usize),
}

struct Cursor {
    target: Target,
    pos: u64,
    end: u64,
    pad_to: u64,
    hasher: xxhash_rust::xxh3::Xxh3,
}

/// The temporary directory a store bound for `out` is written in.
pub fn temp_dir(out: &Path) -> Result<PathBuf> {
    let name = out
        .file_name()
        .ok_or_else(|| ModelError::Invalid(format!("{}: not a directory path", out.display())))?;
    Ok(out.with_file_name(format!("{}.partial", name.to_string_lossy())))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |e| ModelError::io(path, e)
}

/// Writes `bytes` to `path` atomically (temporary sibling, sync, rename).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    std::io::Write::write_all(&mut f, bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// Checksums and sizes of the files to copy alongside.
pub fn copied_files(paths: &[PathBuf]) -> Result<Vec<CopiedFile>> {
    paths
        .iter()
        .map(|p| {
            let bytes = std::fs::read(p).map_err(io(p))?;
            let name = p
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| ModelError::Invalid(format!("{}: bad file name", p.display())))?;
            Ok(CopiedFile {
                name: name.to_string(),
                bytes: bytes.len() as u64,
                xxh3: Checksum(super::xxh3(&[&bytes])),
            })
        })
        .collect()
}

/// A packed store being written.
pub struct PackedWriter {
    out: PathBuf,
    tmp: PathBuf,
    plan: Manifest,
    dense: File,
    experts: File,
    dense_path: PathBuf,
    experts_path: PathBuf,
    copy_from: Vec<PathBuf>,
    done: BTreeSet<Unit>,
    resumed: Vec<Unit>,
    cur: Option<Cursor>,
    /// Checksums written in this session, per unit, until it finishes.
    written: BTreeMap<Unit, Progress>,
}

impl PackedWriter {
    /// Starts writing the store `plan` describes to `out`, or resumes an
    /// interrupted run of the same plan. `copy_from` are the tokenizer
    /// files `plan.tokenizer_files` lists, in that order.
    pub fn create(out: &Path, plan: Manifest, copy_from: Vec<PathBuf>) -> Result<PackedWriter> {
        if out.exists() {
            return Err(ModelError::Invalid(format!(
                "{} already exists; remove it or choose another output",
                out.display()
            )));
        }
        let parent = out
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if !parent.is_dir() {
            return Err(ModelError::Invalid(format!(
                "{}: the parent directory does not exist",
                out.display()
            )));
        }
        if copy_from.len() != plan.tokenizer_files.len() {
            return Err(ModelError::Invalid(
                "tokenizer files and their plan entries differ".into(),
            ));
        }
        plan.validate()
            .map_err(|r| ModelError::Invalid(format!("store plan: {r}")))?;
        let plan = plan.as_plan();
        let tmp = temp_dir(out)?;
        let plan_path = tmp.join(PLAN_FILE);
        let mut resuming = false;
        if tmp.exists() {
            let old: Option<Manifest> = std::fs::read_to_string(&plan_path)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok());
            match old {
                Some(old) if old == plan => resuming = true,
                Some(_) => {
                    tracing::warn!(
                        "{}: left by a conversion with other inputs or options; starting over",
                        tmp.display()
                    );
                    std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
                }
                None => {
                    return Err(ModelError::Invalid(format!(
                        "{} exists but is not an interrupted colibri conversion (no readable {PLAN_FILE}); remove it",
                        tmp.display()
                    )));
                }
            }
        }
        if !resuming {
            std::fs::create_dir(&tmp).map_err(io(&tmp))?;
            std::fs::create_dir(tmp.join(PROGRESS_DIR)).map_err(io(&tmp))?;
            let text = serde_json::to_vec_pretty(&plan)
                .map_err(|e| ModelError::Invalid(format!("store plan: {e}")))?;
            write_atomic(&plan_path, &text)?;
        }
        let open = |name: &str, len: u64| -> Result<(File, PathBuf)> {
            let p = tmp.join(name);
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&p)
                .map_err(io(&p))?;
            // Sparse until written; the planned length from the start, so
            // positioned writes can go anywhere and resume can read back.
            f.set_len(len).map_err(io(&p))?;
            Ok((f, p))
        };
        let (dense, dense_path) = open(manifest::DENSE_FILE, plan.dense.bytes)?;
        let (experts, experts_path) = open(manifest::EXPERTS_FILE, plan.experts.bytes)?;
        let mut w = PackedWriter {
            out: out.to_path_buf(),
            tmp,
            plan,
            dense,
            experts,
            dense_path,
            experts_path,
            copy_from,
            done: BTreeSet::new(),
            resumed: Vec::new(),
            cur: None,
            written: BTreeMap::new(),
        };
        if resuming {
            w.resume()?;
        }
        Ok(w)
    }

    /// Keeps every finished unit whose bytes still hash to what its
    /// progress file recorded.
    fn resume(&mut self) -> Result<()> {
        for unit in self.units() {
            let p = self.tmp.join(PROGRESS_DIR).join(unit.file_name());
            let Ok(text) = std::fs::read_to_string(&p) else {
                continue;
            };
            let Ok(progress) = serde_json::from_str::<Progress>(&text) else {
                tracing::warn!("{}: unreadable, redoing {unit}", p.display());
                continue;
            };
            if self.verify_unit(unit, &progress)? {
                self.done.insert(unit);
                self.resumed.push(unit);
            } else {
                tracing::warn!("{unit}: written bytes do not match their checksums, redoing it");
                let _ = std::fs::remove_file(&p);
            }
        }
        Ok(())
    }

    fn hash_range(&self, file: &File, path: &Path, offset: u64, len: u64) -> Result<u64> {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut buf = vec![0u8; VERIFY_CHUNK.min(len as usize)];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            file.read_exact_at(&mut buf[..n], offset + done)
                .map_err(io(path))?;
            h.update(&buf[..n]);
            done += n as u64;
        }
        Ok(h.digest())
    }

    fn verify_unit(&mut self, unit: Unit, p: &Progress) -> Result<bool> {
        let mut dense = Vec::new();
        for (i, t) in self.plan.dense.tensors.iter().enumerate() {
            if Unit::of(t.layer) != unit {
                continue;
            }
            let Some(want) = p.dense.get(&t.name) else {
                return Ok(false);
            };
            let len = t.bytes + t.scales.as_ref().map_or(0, |s| s.bytes);
            if self.hash_range(&self.dense, &self.dense_path, t.offset, len)? != want.0 {
                return Ok(false);
            }
            dense.push((i, *want));
        }
        let mut records = Vec::new();
        if let Unit::Layer(l) = unit
            && let Some(li) = self.plan.experts.layers.iter().position(|x| x.layer == l)
        {
            let layer = &self.plan.experts.layers[li];
            if p.records.len() != layer.experts() {
                return Ok(false);
            }
            for (e, want) in p.records.iter().enumerate() {
                let got = self.hash_range(
                    &self.experts,
                    &self.experts_path,
                    layer.record_offset(e),
                    layer.payload_bytes,
                )?;
                if got != want.0 {
                    return Ok(false);
                }
            }
            records.push((li, p.records.clone()));
        }
        for (i, c) in dense {
            self.plan.dense.tensors[i].xxh3 = c;
        }
        for (li, rs) in records {
            self.plan.experts.layers[li].xxh3 = rs;
        }
        Ok(true)
    }

    /// Every unit of the plan, in writing order.
    pub fn units(&self) -> Vec<Unit> {
        let mut units: BTreeSet<Unit> = self
            .plan
            .dense
            .tensors
            .iter()
            .map(|t| Unit::of(t.layer))
            .collect();
        units.extend(
            self.plan
                .experts
                .layers
                .iter()
                .map(|l| Unit::Layer(l.layer)),
        );
        units.into_iter().collect()
    }

    pub fn is_done(&self, unit: Unit) -> bool {
        self.done.contains(&unit)
    }

    /// Units kept from an interrupted run.
    pub fn resumed(&self) -> &[Unit] {
        &self.resumed
    }

    pub fn plan(&self) -> &Manifest {
        &self.plan
    }

    /// Bytes of data a unit writes (for progress).
    pub fn unit_bytes(&self, unit: Unit) -> u64 {
        let dense: u64 = self
            .plan
            .dense
            .tensors
            .iter()
            .filter(|t| Unit::of(t.layer) == unit)
            .map(|t| t.bytes + t.scales.as_ref().map_or(0, |s| s.bytes))
            .sum();
        let records = match unit {
            Unit::Globals => 0,
            Unit::Layer(l) => self
                .plan
                .experts
                .layers
                .iter()
                .filter(|x| x.layer == l)
                .map(|x| x.payload_bytes * x.experts() as u64)
                .sum(),
        };
        dense + records
    }

    fn open_cursor(&mut self, target: Target, pos: u64, end: u64, pad_to: u64) -> Result<()> {
        if self.cur.is_some() {
            return Err(ModelError::Invalid(
                "packed writer: a tensor or record is still open".into(),
            ));
        }
        self.cur = Some(Cursor {
            target,
            pos,
            end,
            pad_to,
            hasher: xxhash_rust::xxh3::Xxh3::new(),
        });
        Ok(())
    }

    /// Starts the dense tensor `name`: its data, then (FP8) its scales as
    /// little-endian f32, follow through [`write`](Self::write).
    pub fn begin_dense(&mut self, name: &str) -> Result<()> {
        let (i, t) = self
            .plan
            .dense
            .tensors
            .iter()
            .enumerate()
            .find(|(_, t)| t.name == name)
            .ok_or_else(|| ModelError::Invalid(format!("tensor `{name}` is not in the plan")))?;
        let end = t.offset + t.bytes + t.scales.as_ref().map_or(0, |s| s.bytes);
        self.open_cursor(Target::Dense(i), t.offset, end, manifest::align_up(end))
    }

    /// Starts expert `expert` of layer `layer`: gate, up, down, then their
    /// scales follow through [`write`](Self::write).
    pub fn begin_record(&mut self, layer: usize, expert: usize) -> Result<()> {
        let (li, l) = self
            .plan
            .experts
            .layers
            .iter()
            .enumerate()
            .find(|(_, l)| l.layer == layer)
            .ok_or_else(|| {
                ModelError::Invalid(format!("layer {layer} has no experts in the plan"))
            })?;
        if expert >= l.experts() {
            return Err(ModelError::Invalid(format!(
                "layer {layer} has {} experts, not {expert}",
                l.experts()
            )));
        }
        let pos = l.record_offset(expert);
        let (end, pad_to) = (pos + l.payload_bytes, pos + l.record_bytes);
        self.open_cursor(Target::Record(li, expert), pos, end, pad_to)
    }

    /// Appends bytes to the open tensor or record.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let cur = self
            .cur
            .as_mut()
            .ok_or_else(|| ModelError::Invalid("packed writer: nothing is open".into()))?;
        if cur.pos + bytes.len() as u64 > cur.end {
            return Err(ModelError::Invalid(format!(
                "packed writer: {:?} gets more bytes than planned",
                cur.target
            )));
        }
        let (file, path) = match cur.target {
            Target::Dense(_) => (&self.dense, &self.dense_path),
            Target::Record(..) => (&self.experts, &self.experts_path),
        };
        file.write_all_at(bytes, cur.pos).map_err(io(path))?;
        cur.hasher.update(bytes);
        cur.pos += bytes.len() as u64;
        Ok(())
    }

    /// Closes the open tensor or record: checks it got exactly its planned
    /// size, zeroes its padding and records its checksum.
    pub fn end(&mut self) -> Result<()> {
        let cur = self
            .cur
            .take()
            .ok_or_else(|| ModelError::Invalid("packed writer: nothing is open".into()))?;
        if cur.pos != cur.end {
            return Err(ModelError::Invalid(format!(
                "packed writer: {:?} got {} bytes fewer than planned",
                cur.target,
                cur.end - cur.pos
            )));
        }
        let (file, path) = match cur.target {
            Target::Dense(_) => (&self.dense, &self.dense_path),
            Target::Record(..) => (&self.experts, &self.experts_path),
        };
        let limit = match cur.target {
            Target::Dense(_) => self.plan.dense.bytes,
            Target::Record(..) => self.plan.experts.bytes,
        };
        let pad = cur.pad_to.min(limit).saturating_sub(cur.end) as usize;
        if pad > 0 {
            file.write_all_at(&vec![0u8; pad], cur.end)
                .map_err(io(path))?;
        }
        let sum = Checksum(cur.hasher.digest());
        match cur.target {
            Target::Dense(i) => {
                let t = &mut self.plan.dense.tensors[i];
                t.xxh3 = sum;
                self.written
                    .entry(Unit::of(t.layer))
                    .or_default()
                    .dense
                    .insert(t.name.clone(), sum);
            }
            Target::Record(li, e) => {
                let l = &mut self.plan.experts.layers[li];
                l.xxh3[e] = sum;
                let p = self.written.entry(Unit::Layer(l.layer)).or_default();
                if p.records.len() < l.xxh3.len() {
                    p.records.resize(l.xxh3.len(), Checksum(0));
                }
                p.records[e] = sum;
            }
        }
        Ok(())
    }

    /// Marks `unit` finished: every tensor and record of it must have been
    /// written; the data is synced before the progress file says so.
    pub fn finish_unit(&mut self, unit: Unit) -> Result<()> {
        let p = self.written.remove(&unit).unwrap_or_default();
        let want_dense = self
            .plan
            .dense
            .tensors
            .iter()
            .filter(|t| Unit::of(t.layer) == unit)
            .count();
        let want_records = match unit {
            Unit::Globals => 0,
            Unit::Layer(l) => self
                .plan
                .experts
                .layers
                .iter()
                .find(|x| x.layer == l)
                .map_or(0, |x| x.experts()),
        };
        if p.dense.len() != want_dense || p.records.len() != want_records {
            return Err(ModelError::Invalid(format!(
                "packed writer: {unit} is incomplete ({}/{want_dense} tensors, {}/{want_records} records)",
                p.dense.len(),
                p.records.len()
            )));
        }
        self.dense.sync_data().map_err(io(&self.dense_path))?;
        self.experts.sync_data().map_err(io(&self.experts_path))?;
        let text = serde_json::to_vec(&p).map_err(|e| ModelError::Invalid(e.to_string()))?;
        let dir = self.tmp.join(PROGRESS_DIR);
        write_atomic(&dir.join(unit.file_name()), &text)?;
        sync_dir(&dir)?;
        self.done.insert(unit);
        Ok(())
    }

    /// Copies the tokenizer files, writes `manifest.json` and moves the
    /// store into place. Returns the manifest.
    pub fn commit(self) -> Result<Manifest> {
        if let Some(u) = self.units().into_iter().find(|u| !self.done.contains(u)) {
            return Err(ModelError::Invalid(format!(
                "packed writer: {u} was not written"
            )));
        }
        for (src, entry) in self.copy_from.iter().zip(&self.plan.tokenizer_files) {
            let bytes = std::fs::read(src).map_err(io(src))?;
            if super::xxh3(&[&bytes]) != entry.xxh3.0 {
                return Err(ModelError::Invalid(format!(
                    "{} changed during the conversion",
                    src.display()
                )));
            }
            let dst = self.tmp.join(&entry.name);
            write_atomic(&dst, &bytes)?;
        }
        let text = serde_json::to_vec_pretty(&self.plan)
            .map_err(|e| ModelError::Invalid(format!("manifest: {e}")))?;
        write_atomic(&self.tmp.join(manifest::MANIFEST_FILE), &text)?;
        let progress = self.tmp.join(PROGRESS_DIR);
        std::fs::remove_dir_all(&progress).map_err(io(&progress))?;
        let plan = self.tmp.join(PLAN_FILE);
        std::fs::remove_file(&plan).map_err(io(&plan))?;
        self.dense.sync_all().map_err(io(&self.dense_path))?;
        self.experts.sync_all().map_err(io(&self.experts_path))?;
        sync_dir(&self.tmp)?;
        std::fs::rename(&self.tmp, &self.out).map_err(io(&self.out))?;
        if let Some(parent) = self.out.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
        Ok(self.plan)
    }
}
