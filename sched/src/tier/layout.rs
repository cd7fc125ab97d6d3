//! Where each routed expert's bytes are and how they are read: one
//! [`ExpertRecord`] per (layer, expert), and the [`SizeClass`]es of the slots
//! they are read into.
//!
//! A record turns the locator's three matrix extents into as few reads as
//! possible **without reading one byte more**: extents of the same file whose
//! aligned supersets touch or overlap are merged into one read (a packed
//! store's record, or the three adjacent tensors of one expert in a
//! safetensors shard, become a single read); extents far apart stay separate
//! reads into the same slot (a GGUF's stacked `*_exps` tensors).
//!
//! Extents are widened to at least [`MIN_GRANULE`] bytes even on files read
//! without `O_DIRECT`, so that the bytes land in the slot at the same
//! alignment they have in the file (as in a memory map) and the kernels can
//! use them in place instead of copying a misaligned tensor.
//!
//! The slot a record needs is computed with exactly the layout rule the
//! reader uses (each read at the next multiple of its file's alignment), so
//! a slot sized here always fits. Slots are priced by the real record sizes,
//! never by a global widest record: records of very different sizes (a model
//! whose layers are quantized differently) get separate size classes, each
//! with its own arena.

use std::ops::Range;

use colibri_io::{Alignment, AlignmentSource, FileId, FileSet, SLOT_GRANULE, align_down, align_up};
use colibri_model::config::FfnKind;
use colibri_model::source::{ExpertLocation, ExpertLocator};
use colibri_model::{ModelError, ModelSpec};

/// Extents are widened to at least this granule, so buffered reads keep
/// the file's alignment modulo 64 bytes (cache lines, every element type).
pub const MIN_GRANULE: u64 = 64;

/// A record joins an existing size class when its slot would waste at most
/// this fraction of the class's slot size (or [`CLASS_SLACK_BYTES`], the
/// alignment slack every unaligned record has anyway, whichever is larger);
/// otherwise it starts a new class.
pub const CLASS_WASTE_DIVISOR: u64 = 8;

/// Two pages: an unaligned record's aligned superset varies by up to one
/// page at each end, which is no reason for a separate class.
pub const CLASS_SLACK_BYTES: u64 = 2 * SLOT_GRANULE as u64;

/// What the layout needs to know about one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileFacts {
    /// Direct-I/O alignment granule (1 when the file is read buffered).
    pub unit: u64,
    /// Length of the file.
    pub len: u64,
}

impl FileFacts {
    /// Facts of every file of an open set, in id order.
    pub fn of(files: &FileSet) -> Vec<FileFacts> {
        files
            .infos()
            .map(|info| FileFacts {
                unit: info.alignment.unit(),
                len: info.len_at_open,
            })
            .collect()
    }
}

/// One routed expert: what to read and where its matrices end up.
#[derive(Clone, Debug)]
pub struct ExpertRecord {
    pub layer: usize,
    pub expert: usize,
    /// The locator's answer (formats, shapes, scales).
    pub location: ExpertLocation,
    /// The reads, in slot order (1 to 3).
    pub reads: Vec<colibri_io::Extent>,
    /// For gate, up and down: which read holds it and at which offset from
    /// the start of that read's wanted bytes.
    pub matrices: [(usize, u64); 3],
    /// Where each of gate, up and down begins in the slot under the
    /// reader's layout rule (what [`matrix_ranges`](Self::matrix_ranges)
    /// gives once the reads are done): the GPU tier lays its device slots
    /// out the same way, so that one host-to-device copy moves a whole
    /// expert even when its matrices were separate reads.
    pub slot_offsets: [u64; 3],
    /// Slot bytes the reads need under the reader's layout rule.
    pub slot_bytes: u64,
    /// Bytes the kernel transfers for one load (aligned reads).
    pub read_bytes: u64,
    /// Index into [`ExpertLayout::classes`].
    pub class: usize,
}

impl ExpertRecord {
    /// Where each matrix's bytes are in a slot, given where the reader put
    /// each read's wanted bytes (`Completion::result`).
    pub fn matrix_ranges(&self, read_ranges: &[Range<usize>]) -> Option<[Range<usize>; 3]> {
        let mats = self.location.matrices();
        let mut out: [Range<usize>; 3] = [0..0, 0..0, 0..0];
        for (i, m) in mats.iter().enumerate() {
            let (read, offset) = self.matrices[i];
            let base = read_ranges.get(read)?;
            let start = base.start.checked_add(usize::try_from(offset).ok()?)?;
            let end = start.checked_add(usize::try_from(m.extent.len).ok()?)?;
            if end > base.end {
                return None;
            }
            out[i] = start..end;
        }
        Some(out)
    }
}

/// Records of one slot size.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SizeClass {
    /// Bytes per slot (a multiple of the arena granule).
    pub slot_bytes: u64,
    /// Records in the class.
    pub records: usize,
    /// MoE layers with at least one record in the class.
    pub layers: Vec<usize>,
}

/// Every routed expert of a model, indexed densely.
#[derive(Clone, Debug)]
pub struct ExpertLayout {
    /// Records, entry `base[layer] + expert`.
    pub records: Vec<ExpertRecord>,
    /// Entry index of expert 0 of each layer (`None`: dense layer).
    pub base: Vec<Option<usize>>,
    /// Routed experts per MoE layer.
    pub experts_per_layer: usize,
    /// Experts each token selects per layer.
    pub top_k: usize,
    /// Size classes, largest slot first.
    pub classes: Vec<SizeClass>,
}

impl ExpertLayout {
    /// Locates and lays out every routed expert of `spec`.
    pub fn build(
        spec: &ModelSpec,
        locator: &dyn ExpertLocator,
        files: &[FileFacts],
    ) -> Result<ExpertLayout, ModelError> {
        let (experts_per_layer, top_k) = spec
            .moe
            .as_ref()
            .map_or((0, 0), |m| (m.num_experts, m.top_k));
        let mut records = Vec::new();
        let mut base = Vec::with_capacity(spec.num_layers());
        for (layer, ls) in spec.layers.iter().enumerate() {
            if ls.ffn != FfnKind::Moe || experts_per_layer == 0 {
                base.push(None);
                continue;
            }
            base.push(Some(records.len()));
            for expert in 0..experts_per_layer {
                let location = locator.locate(layer, expert)?;
                records.push(plan_record(location, files)?);
            }
        }
        let classes = assign_classes(&mut records);
        Ok(ExpertLayout {
            records,
            base,
            experts_per_layer,
            top_k,
            classes,
        })
    }

    /// Entry index of (layer, expert), if it is a routed expert.
    pub fn entry(&self, layer: usize, expert: usize) -> Option<usize> {
        if expert >= self.experts_per_layer {
            return None;
        }
        Some(self.base.get(layer).copied().flatten()? + expert)
    }

    /// MoE layers, in order.
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.base
            .iter()
            .enumerate()
            .filter_map(|(l, b)| b.map(|_| l))
    }

    /// Number of routed experts.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the model has no routed experts.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The most common aligned read size of one expert (the block size that
    /// represents this model's expert reads in a raw disk benchmark).
    pub fn typical_read_bytes(&self) -> u64 {
        let mut sizes: Vec<u64> = self
            .records
            .iter()
            .flat_map(|r| r.reads.iter().map(|e| e.len))
            .collect();
        sizes.sort_unstable();
        sizes.get(sizes.len() / 2).copied().unwrap_or(0)
    }
}

fn bad(location: &ExpertLocation, reason: String) -> ModelError {
    ModelError::Expert {
        layer: location.layer,
        expert: location.expert,
        reason,
    }
}

/// Turns one expert's extents into reads and computes its slot size.
fn plan_record(location: ExpertLocation, files: &[FileFacts]) -> Result<ExpertRecord, ModelError> {
    // Widen each matrix's extent to the file's granule (at least
    // MIN_GRANULE), clamped to the end of the file.
    let mut spans: Vec<(usize, u64, u64, usize)> = Vec::with_capacity(3);
    for (i, m) in location.matrices().iter().enumerate() {
        let e = &m.extent;
        let facts = files.get(e.file).ok_or_else(|| {
            bad(
                &location,
                format!("extent names file #{} of {}", e.file, files.len()),
            )
        })?;
        let end = e
            .offset
            .checked_add(e.len)
            .filter(|&end| end <= facts.len)
            .ok_or_else(|| {
                bad(
                    &location,
                    format!(
                        "extent {}+{} lies beyond the end of file #{} ({} bytes)",
                        e.offset, e.len, e.file, facts.len
                    ),
                )
            })?;
        if e.len == 0 {
            return Err(bad(&location, "empty matrix extent".into()));
        }
        let granule = facts.unit.max(MIN_GRANULE);
        let start = align_down(e.offset, granule);
        let wide_end = align_up(end, granule)
            .ok_or_else(|| bad(&location, "extent overflows".into()))?
            .min(facts.len);
        spans.push((e.file, start, wide_end, i));
    }
    spans.sort_by_key(|&(file, start, _, _)| (file, start));
    // Merge spans of one file that touch or overlap: the union reads no byte
    // that the separate reads would not have read.
    let mut reads: Vec<colibri_io::Extent> = Vec::with_capacity(3);
    let mut matrices = [(0usize, 0u64); 3];
    let mut members: Vec<Vec<usize>> = Vec::new();
    for (file, start, end, i) in spans {
        let merge = reads
            .last()
            .is_some_and(|r| r.file == FileId(file as u32) && start <= r.offset + r.len);
        if merge {
            let last = reads.len() - 1;
            let r = &mut reads[last];
            r.len = (r.offset + r.len).max(end) - r.offset;
            members[last].push(i);
        } else {
            reads.push(colibri_io::Extent {
                file: FileId(file as u32),
                offset: start,
                len: end - start,
            });
            members.push(vec![i]);
        }
    }
    let mats = location.matrices();
    for (read, ms) in members.iter().enumerate() {
        for &i in ms {
            matrices[i] = (read, mats[i].extent.offset - reads[read].offset);
        }
    }
    // The reader's slot layout: each read starts at the next multiple of its
    // file's unit and occupies its unit-aligned superset.
    let mut cursor = 0u64;
    let mut read_bytes = 0u64;
    let mut wanted_at = Vec::with_capacity(reads.len());
    for r in &reads {
        let unit = files[r.file.0 as usize].unit.max(1);
        let alignment = unit_alignment(unit);
        let widened = alignment
            .widen(r.offset, r.len)
            .map_err(|e| bad(&location, e.to_string()))?;
        let start =
            align_up(cursor, unit).ok_or_else(|| bad(&location, "slot overflows".into()))?;
        wanted_at.push(start + widened.skip);
        cursor = start + widened.len;
        read_bytes += widened.len;
    }
    let slot_offsets = matrices.map(|(read, offset)| wanted_at[read] + offset);
    Ok(ExpertRecord {
        layer: location.layer,
        expert: location.expert,
        location,
        reads,
        matrices,
        slot_offsets,
        slot_bytes: cursor,
        read_bytes,
        class: 0,
    })
}

fn unit_alignment(unit: u64) -> Alignment {
    if unit <= 1 {
        return Alignment::BUFFERED;
    }
    let unit = u32::try_from(unit).unwrap_or(u32::MAX);
    Alignment {
        mem: unit,
        offset: unit,
        source: AlignmentSource::Statx,
    }
}

/// Groups records by slot size: each class holds records whose size is
/// within 1/[`CLASS_WASTE_DIVISOR`] (or [`CLASS_SLACK_BYTES`]) of the
/// class's largest.
fn assign_classes(records: &mut [ExpertRecord]) -> Vec<SizeClass> {
    let granule = SLOT_GRANULE as u64;
    let rounded = |bytes: u64| bytes.max(1).div_ceil(granule) * granule;
    let mut sizes: Vec<u64> = records.iter().map(|r| rounded(r.slot_bytes)).collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    let mut leaders: Vec<u64> = Vec::new();
    for size in sizes {
        let fits = leaders.last().is_some_and(|&leader| {
            leader - size <= (leader / CLASS_WASTE_DIVISOR).max(CLASS_SLACK_BYTES)
        });
        if !fits {
            leaders.push(size);
        }
    }
    let mut classes: Vec<SizeClass> = leaders
        .iter()
        .map(|&slot_bytes| SizeClass {
            slot_bytes,
            records: 0,
            layers: Vec::new(),
        })
        .collect();
    for r in records.iter_mut() {
        let size = rounded(r.slot_bytes);
        // Leaders are descending: the last one still ≥ size is the class.
        let class = leaders
            .iter()
            .rposition(|&leader| leader >= size)
            .unwrap_or(0);
        r.class = class;
        let c = &mut classes[class];
        c.records += 1;
        if c.layers.last() != Some(&r.layer) {
            c.layers.push(r.layer);
        }
    }
    classes
}

#[cfg(test)]
mod tests {
    use super::*;
    use colibri_model::format::WeightFormat;
    use colibri_model::source::{Extent, MatrixLocation};

    fn matrix(file: usize, offset: u64, len: u64) -> MatrixLocation {
        MatrixLocation {
            extent: Extent { file, offset, len },
            rows: 1,
            cols: len as usize / 4,
            format: WeightFormat::F32,
            scales: None,
        }
    }

    fn location(gate: MatrixLocation, up: MatrixLocation, down: MatrixLocation) -> ExpertLocation {
        ExpertLocation {
            layer: 0,
            expert: 0,
            gate,
            up,
            down,
            record: None,
        }
    }

    const DIRECT: FileFacts = FileFacts {
        unit: 4096,
        len: 1 << 30,
    };

    #[test]
    fn adjacent_extents_become_one_read_without_extra_bytes() {
        // down, gate, up stored back to back (safetensors' name order).
        let loc = location(
            matrix(0, 10_000 + 8192, 8192),
            matrix(0, 10_000 + 16384, 8192),
            matrix(0, 10_000, 8192),
        );
        let r = plan_record(loc, &[DIRECT]).expect("record");
        assert_eq!(r.reads.len(), 1);
        assert_eq!(r.reads[0].offset, 8192);
        assert_eq!(r.reads[0].offset + r.reads[0].len, 36864);
        assert_eq!(r.read_bytes, 28672);
        // gate at 18192 in the file, the read starts at 8192.
        assert_eq!(r.matrices, [(0, 10_000), (0, 18_192), (0, 1808)]);
        assert_eq!(r.slot_offsets, [10_000, 18_192, 1808]);
        assert_eq!(r.slot_bytes, 28672);
        let read = 100..100 + 28672;
        let ranges = r
            .matrix_ranges(std::slice::from_ref(&read))
            .expect("ranges");
        assert_eq!(ranges[2], 1908..1908 + 8192);
    }

    #[test]
    fn distant_extents_stay_separate_reads() {
        let loc = location(
            matrix(0, 1 << 20, 4000),
            matrix(0, 2 << 20, 4000),
            matrix(1, 4096 * 3 + 100, 4000),
        );
        let r = plan_record(loc, &[DIRECT, DIRECT]).expect("record");
        assert_eq!(r.reads.len(), 3);
        // 4096 + 4096 + (the third straddles two units) 8192.
        assert_eq!(r.read_bytes, 16384);
        assert_eq!(r.slot_bytes, 16384);
        // One read per unit-aligned stretch, back to back in the slot; the
        // third matrix 100 bytes into its read.
        assert_eq!(r.slot_offsets, [0, 4096, 8192 + 100]);
    }

    #[test]
    fn buffered_files_keep_alignment_mod_64_and_stop_at_the_end_of_file() {
        let facts = FileFacts { unit: 1, len: 1000 };
        let loc = location(
            matrix(0, 100, 200),
            matrix(0, 300, 200),
            matrix(0, 900, 100),
        );
        let r = plan_record(loc, &[facts]).expect("record");
        assert_eq!(r.reads.len(), 2);
        assert_eq!((r.reads[0].offset, r.reads[0].len), (64, 448));
        assert_eq!((r.reads[1].offset, r.reads[1].len), (896, 104));
        // Offsets within the reads preserve the file offsets modulo 64.
        assert_eq!(r.matrices[0].1 % 64, 100 % 64);
        assert_eq!(r.matrices[2].1 % 64, 900 % 64);
    }

    #[test]
    fn extents_past_the_end_of_the_file_are_refused() {
        let loc = location(matrix(0, 0, 64), matrix(0, 64, 64), matrix(0, 128, 64));
        let err =
            plan_record(loc.clone(), &[FileFacts { unit: 1, len: 150 }]).expect_err("past the end");
        assert!(err.to_string().contains("beyond the end"), "{err}");
        let err = plan_record(loc, &[]).expect_err("no file");
        assert!(err.to_string().contains("file #0"), "{err}");
    }

    #[test]
    fn size_classes_follow_real_record_sizes() {
        let mut records: Vec<ExpertRecord> = [1u64 << 20, 1 << 20, 15 << 16, 1 << 18, 1 << 18]
            .iter()
            .enumerate()
            .map(|(i, &bytes)| {
                let loc = location(matrix(0, 0, 64), matrix(0, 64, 64), matrix(0, 128, 64));
                let mut r = plan_record(loc, &[DIRECT]).expect("record");
                r.layer = i;
                r.slot_bytes = bytes;
                r
            })
            .collect();
        let classes = assign_classes(&mut records);
        // 1 MiB and 960 KiB share a class (6% waste); 256 KiB is its own.
        assert_eq!(classes.len(), 2);
        assert_eq!(classes[0].slot_bytes, 1 << 20);
        assert_eq!(classes[0].records, 3);
        assert_eq!(classes[1].slot_bytes, 1 << 18);
        assert_eq!(classes[1].layers, vec![3, 4]);
        assert_eq!(
            records.iter().map(|r| r.class).collect::<Vec<_>>(),
            vec![0, 0, 0, 1, 1]
        );
    }
}
