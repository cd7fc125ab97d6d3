//! Weight storage: shared byte views and typed weight matrices.
//!
//! A [`Bytes`] is a cheap, cloneable view into storage owned elsewhere (a
//! memory-mapped checkpoint, an owned buffer, later a pinned read slot whose
//! lease is released when the last view drops). A [`QMatrix`] is a row-major
//! weight matrix in one [`WeightFormat`] over such a view.

use std::sync::Arc;

use crate::error::{ModelError, Result};
use crate::format::WeightFormat;

/// Something that owns bytes and keeps them alive and unchanged while any
/// view of it exists.
pub trait ByteStorage: Send + Sync {
    fn bytes(&self) -> &[u8];

    /// Takes this storage's pages out of the process's resident set where
    /// that loses nothing: a read-only file mapping (the page cache keeps
    /// them; the next access maps them again). Owned buffers ignore it.
    /// `colibri convert` calls it between layers so that reading a source
    /// larger than RAM does not show up as a resident set of its size.
    fn release(&self) {}
}

impl ByteStorage for memmap2::Mmap {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn release(&self) {
        // SAFETY: colibri maps model files read-only and never writes
        // through a mapping, so this private mapping has no copy-on-write
        // pages for MADV_DONTNEED to discard: a later access reads the same
        // bytes from the file again. Failing only leaves pages resident.
        let _ = unsafe { self.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
    }
}

/// Whether large owned buffers ask for transparent huge pages (the default;
/// `COLIBRI_NO_HUGEPAGES=1` turns it off). Streaming kernels touch weights
/// a page at a time: with 2 MiB pages a gigabyte costs 512 TLB fills
/// instead of 262144, which in a virtual machine are two-level walks.
pub fn huge_pages_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var_os("COLIBRI_NO_HUGEPAGES").is_none_or(|v| v == "0"))
}

/// Owned, zero-initialised anonymous memory that asks the kernel for
/// transparent huge pages ([`huge_pages_wanted`]): the home of weights that
/// colibri copies out of the checkpoint to keep in RAM (repacked Q4_0
/// tiles) and of the bandwidth probe that bounds them.
///
/// A storage of at least [`HUGE_PAGE`] bytes starts on a huge page's
/// boundary: the kernel backs only the whole, aligned 2 MiB stretches of a
/// mapping with huge pages, so an unaligned 4.7 MB matrix got one huge page
/// and 2.7 MB of small ones.
pub struct AnonStorage {
    map: memmap2::MmapMut,
    /// Where the bytes start in `map` (the padding before is never touched,
    /// so it costs address space, not memory).
    start: usize,
    len: usize,
}

/// A transparent huge page on x86-64 (and arm64 with 4 KiB pages).
pub const HUGE_PAGE: usize = 2 << 20;

impl AnonStorage {
    /// `len` zero bytes (a mapping of at least one byte, so `len` may be 0).
    pub fn zeroed(len: usize) -> Result<Self> {
        let huge = cfg!(target_os = "linux") && huge_pages_wanted();
        let pad = if huge && len >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            0
        };
        let map = len
            .max(1)
            .checked_add(pad)
            .ok_or_else(|| ModelError::Invalid(format!("{len} bytes of memory")))
            .and_then(|n| {
                memmap2::MmapMut::map_anon(n)
                    .map_err(|e| ModelError::Invalid(format!("mapping {len} bytes of memory: {e}")))
            })?;
        // A mapping starts on a page, so the offset to the next huge page
        // is below `HUGE_PAGE` (0 without padding: `min`).
        let start = map.as_ptr().align_offset(HUGE_PAGE).min(pad);
        #[cfg(target_os = "linux")]
        if huge {
            // A hint: where the kernel has no huge page the memory is
            // ordinary pages, so a failure changes nothing but speed.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Ok(AnonStorage { map, start, len })
    }

    /// A copy of `src`.
    pub fn copy_of(src: &[u8]) -> Result<Self> {
        let mut s = Self::zeroed(src.len())?;
        s.bytes_mut().copy_from_slice(src);
        Ok(s)
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map[self.start..self.start + self.len]
    }
}

impl ByteStorage for AnonStorage {
    fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
}

impl ByteStorage for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// f32 data owned as f32 so it is always 4-byte aligned.
struct F32Storage(Vec<f32>);

impl ByteStorage for F32Storage {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// u16 data (f16/bf16) owned as u16 so it is always 2-byte aligned.
struct U16Storage(Vec<u16>);

impl ByteStorage for U16Storage {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// A view of `len` bytes at `start` in shared storage.
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn ByteStorage>,
    start: usize,
    len: usize,
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} bytes at {})", self.len, self.start)
    }
}

impl Bytes {
    /// A view of `owner[start..start + len]`; fails if out of range.
    pub fn new(owner: Arc<dyn ByteStorage>, start: usize, len: usize) -> Result<Self> {
        let total = owner.bytes().len();
        if start.checked_add(len).is_none_or(|end| end > total) {
            return Err(ModelError::Invalid(format!(
                "byte range {start}+{len} outside storage of {total} bytes"
            )));
        }
        Ok(Bytes { owner, start, len })
    }

    /// A view of all of `s`.
    pub fn from_anon(s: AnonStorage) -> Self {
        let len = s.len;
        Bytes {
            owner: Arc::new(s),
            start: 0,
            len,
        }
    }

    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        Bytes {
            owner: Arc::new(v),
            start: 0,
            len,
        }
    }

    pub fn from_f32(v: Vec<f32>) -> Self {
        let len = v.len() * 4;
        Bytes {
            owner: Arc::new(F32Storage(v)),
            start: 0,
            len,
        }
    }

    pub fn from_u16(v: Vec<u16>) -> Self {
        let len = v.len() * 2;
        Bytes {
            owner: Arc::new(U16Storage(v)),
            start: 0,
            len,
        }
    }

    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        &self.owner.bytes()[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A sub-view `[offset, offset + len)` of this view.
    pub fn slice(&self, offset: usize, len: usize) -> Result<Bytes> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(ModelError::Invalid(format!(
                "sub-range {offset}+{len} outside a view of {} bytes",
                self.len
            )));
        }
        Ok(Bytes {
            owner: self.owner.clone(),
            start: self.start + offset,
            len,
        })
    }

    /// The shortest stretch of one storage that holds every view of
    /// `views` (and whatever lies between them), with each view's offset
    /// into it; `None` when `views` is empty or they are views of
    /// different storages. Lets a caller move several views that share a
    /// buffer with one copy.
    pub fn common_span<const N: usize>(views: [&Bytes; N]) -> Option<(&[u8], [usize; N])> {
        let first = views.first()?;
        let owner = Arc::as_ptr(&first.owner).cast::<()>();
        if views
            .iter()
            .any(|v| Arc::as_ptr(&v.owner).cast::<()>() != owner)
        {
            return None;
        }
        let start = views.iter().map(|v| v.start).min()?;
        let end = views.iter().map(|v| v.start + v.len).max()?;
        let span = first.owner.bytes().get(start..end)?;
        Some((span, views.map(|v| v.start - start)))
    }

    /// This view with its start aligned to `align` bytes: itself when already
    /// aligned, otherwise an owned, aligned copy. Safetensors files do not
    /// promise element alignment, the kernels need it.
    pub fn aligned(self, align: usize) -> Bytes {
        if (self.as_slice().as_ptr() as usize).is_multiple_of(align) {
            return self;
        }
        let src = self.as_slice();
        match align {
            4 => Bytes::from_f32(
                src.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            2 => Bytes::from_u16(
                src.chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            _ => Bytes::from_vec(src.to_vec()),
        }
    }
}

/// FP8 block scales: one f32 per `block × block` tile, row-major over the
/// tile grid (`ceil(rows/block) × ceil(cols/block)`).
#[derive(Clone, Debug)]
pub struct BlockScales {
    pub block: usize,
    pub grid_cols: usize,
    pub scales: Arc<[f32]>,
}

/// A row-major weight matrix of `rows × cols` elements stored in `format`.
#[derive(Clone, Debug)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    data: Bytes,
    scales: Option<BlockScales>,
    /// How the rows lie in `data`.
    layout: Layout,
}

/// The arrangement of a matrix's rows in its bytes. Only whole-matrix
/// products read the CPU layouts; code that reads the bytes directly (a
/// copy to a GPU, a checksum) needs [`Layout::RowMajor`] and must check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Row after row, as files store them.
    RowMajor,
    /// Q4_0 rows in tiles of 16 ([`crate::kernels::q4_0_tiles`]).
    Q4_0Tiles,
    /// 16-bit rows interleaved by fours ([`crate::kernels::quads16`]).
    Quads16,
    /// k-quant (Q2_K to Q6_K) or IQ4_XS rows in panels of 16, in place
    /// ([`crate::kernels::k_panels::panels_in_place`]; the rows past the
    /// last panel as stored).
    KPanels,
}

impl QMatrix {
    /// Wraps stored bytes, checking size and alignment against the format.
    pub fn new(
        name: &str,
        rows: usize,
        cols: usize,
        format: WeightFormat,
        data: Bytes,
        scales: Option<BlockScales>,
    ) -> Result<Self> {
        Self::named(&name, rows, cols, format, data, scales)
    }

    /// [`new`](Self::new) with a name that is formatted only into an
    /// error: the RAM tier wraps a decode's every expert matrix anew (24 a
    /// layer), where formatting each name was serial work of every MoE
    /// layer (docs/benchmarks.md).
    pub fn named(
        name: &dyn std::fmt::Display,
        rows: usize,
        cols: usize,
        format: WeightFormat,
        data: Bytes,
        scales: Option<BlockScales>,
    ) -> Result<Self> {
        let expect = rows * format.row_bytes(cols)?;
        if data.len() != expect {
            return Err(ModelError::Invalid(format!(
                "tensor `{name}`: {} bytes, expected {expect} for {rows}x{cols} {}",
                data.len(),
                format.name()
            )));
        }
        let data = match format {
            WeightFormat::F32 => data.aligned(4),
            WeightFormat::F16 | WeightFormat::Bf16 => data.aligned(2),
            // Block formats are read byte-wise (scales via from_le_bytes).
            WeightFormat::F8E4M3
            | WeightFormat::Q8_0
            | WeightFormat::Q4_0
            | WeightFormat::Q6K
            | WeightFormat::Q4K
            | WeightFormat::Q5K
            | WeightFormat::Q4_1
            | WeightFormat::Q5_0
            | WeightFormat::Q5_1
            | WeightFormat::Q2K
            | WeightFormat::Q3K
            | WeightFormat::Iq4Nl
            | WeightFormat::Iq4Xs => data,
        };
        match (&scales, format) {
            (None, WeightFormat::F8E4M3) => {
                return Err(ModelError::Invalid(format!(
                    "tensor `{name}`: fp8 weights need block scales (weight_scale_inv)"
                )));
            }
            (Some(s), WeightFormat::F8E4M3) => {
                let gr = rows.div_ceil(s.block);
                let gc = cols.div_ceil(s.block);
                if s.grid_cols != gc || s.scales.len() != gr * gc {
                    return Err(ModelError::Shape {
                        name: format!("{name}_scale_inv"),
                        got: vec![s.scales.len() / s.grid_cols.max(1), s.grid_cols],
                        expected: vec![gr, gc],
                    });
                }
            }
            (Some(_), _) => {
                return Err(ModelError::Invalid(format!(
                    "tensor `{name}`: block scales given for a {} matrix",
                    format.name()
                )));
            }
            (None, _) => {}
        }
        Ok(QMatrix {
            rows,
            cols,
            format,
            data,
            scales,
            layout: Layout::RowMajor,
        })
    }

    /// This matrix with its bytes read as Q4_0 tiles: for bytes that
    /// [`crate::kernels::q4_0_tiles::tile_in_place`] has rearranged (the
    /// RAM tier tiles experts in place once they are read and verified).
    pub fn tiled_q4_0(self) -> Result<QMatrix> {
        if self.format != WeightFormat::Q4_0 || self.layout != Layout::RowMajor {
            return Err(ModelError::Invalid(format!(
                "only a row-major Q4_0 matrix can be read as tiles, not {} as {:?}",
                self.format.name(),
                self.layout
            )));
        }
        Ok(QMatrix {
            layout: Layout::Q4_0Tiles,
            ..self
        })
    }

    /// This matrix with its bytes read as panels in place (Q2_K to Q6_K
    /// or IQ4_XS): for bytes that
    /// [`crate::kernels::k_panels::panels_in_place`] has rearranged (the
    /// RAM tier packs experts in place once they are read and verified).
    pub fn k_panels(self) -> Result<QMatrix> {
        let k = crate::kernels::k_panels::in_place(self.format);
        if !k || self.layout != Layout::RowMajor {
            return Err(ModelError::Invalid(format!(
                "only a row-major Q2_K to Q6_K or IQ4_XS matrix can be read as panels, not {} as {:?}",
                self.format.name(),
                self.layout
            )));
        }
        Ok(QMatrix {
            layout: Layout::KPanels,
            ..self
        })
    }

    /// This matrix with its bytes read as quads of 16-bit rows: for bytes
    /// that [`crate::kernels::quads16::to_quads`] has rearranged.
    pub fn quads16(self) -> Result<QMatrix> {
        let sixteen = matches!(self.format, WeightFormat::Bf16 | WeightFormat::F16);
        if !sixteen
            || self.layout != Layout::RowMajor
            || !crate::kernels::quads16::fits(self.rows, self.cols)
        {
            return Err(ModelError::Invalid(format!(
                "a {}x{} {} matrix as {:?} cannot be read as quads of 16-bit rows",
                self.rows,
                self.cols,
                self.format.name(),
                self.layout
            )));
        }
        Ok(QMatrix {
            layout: Layout::Quads16,
            ..self
        })
    }

    /// How the rows lie in the bytes.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Whether the bytes are Q4_0 tiles rather than row-major rows: code
    /// that reads [`data`](Self::data) directly (a copy to a GPU, a
    /// checksum) needs row-major bytes and must check.
    pub fn is_tiled(&self) -> bool {
        self.layout == Layout::Q4_0Tiles
    }

    /// Whether the bytes are panels in place
    /// ([`crate::kernels::k_panels::panels_in_place`]).
    pub fn is_k_panels(&self) -> bool {
        self.layout == Layout::KPanels
    }

    /// Whether the bytes are quads of 16-bit rows
    /// ([`crate::kernels::quads16`]).
    pub fn is_quads(&self) -> bool {
        self.layout == Layout::Quads16
    }

    /// An f32 matrix over owned values (tests, small derived weights).
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>) -> Result<Self> {
        QMatrix::new(
            "f32",
            rows,
            cols,
            WeightFormat::F32,
            Bytes::from_f32(values),
            None,
        )
    }

    pub fn data(&self) -> &Bytes {
        &self.data
    }

    pub fn scales(&self) -> Option<&BlockScales> {
        self.scales.as_ref()
    }

    /// Bytes of the stored matrix (not counting scales).
    pub fn stored_bytes(&self) -> usize {
        self.data.len()
    }

    /// A view of rows `[start, start + n)`; `start` must be a multiple of
    /// the scale block for FP8 matrices so that the tiles stay aligned.
    pub fn rows_view(&self, start: usize, n: usize) -> Result<QMatrix> {
        if self.layout != Layout::RowMajor {
            return Err(ModelError::Invalid(format!(
                "a matrix laid out as {:?} has no row views",
                self.layout
            )));
        }
        if start + n > self.rows {
            return Err(ModelError::Invalid(format!(
                "rows {start}+{n} outside a matrix of {} rows",
                self.rows
            )));
        }
        let rb = self.format.row_bytes(self.cols)?;
        let data = self.data.slice(start * rb, n * rb)?;
        let scales = match &self.scales {
            None => None,
            Some(s) => {
                if !start.is_multiple_of(s.block) {
                    return Err(ModelError::Invalid(format!(
                        "fp8 row view at {start} is not aligned to the {}-row scale block",
                        s.block
                    )));
                }
                let g0 = start / s.block;
                let g1 = (start + n).div_ceil(s.block);
                Some(BlockScales {
                    block: s.block,
                    grid_cols: s.grid_cols,
                    scales: s.scales[g0 * s.grid_cols..g1 * s.grid_cols].into(),
                })
            }
        };
        Ok(QMatrix {
            rows: n,
            cols: self.cols,
            format: self.format,
            data,
            scales,
            layout: Layout::RowMajor,
        })
    }

    /// Row `r` widened to f32 (exact for every format).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        crate::kernels::row_to_f32(self, r, out)
    }

    /// The whole matrix widened to f32 (tests and small tensors only).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for r in 0..self.rows {
            self.row_to_f32(r, &mut out[r * self.cols..(r + 1) * self.cols]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_storage_holds_exactly_the_bytes_copied_in() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        let copy = AnonStorage::copy_of(&src).unwrap();
        assert_eq!(copy.bytes(), &src[..]);
        let view = Bytes::from_anon(copy);
        assert_eq!(view.as_slice(), &src[..]);
        let empty = AnonStorage::zeroed(0).unwrap();
        assert!(empty.bytes().is_empty());
        let mut zeros = AnonStorage::zeroed(4097).unwrap();
        assert!(zeros.bytes().iter().all(|&b| b == 0));
        zeros.bytes_mut()[4096] = 9;
        assert_eq!(zeros.bytes()[4096], 9);
        assert_eq!(zeros.bytes().len(), 4097);
    }

    /// Huge pages back only whole, aligned 2 MiB stretches of a mapping, so
    /// a storage that can hold one starts on one.
    #[test]
    fn a_storage_of_a_huge_page_or_more_starts_on_one() {
        for len in [HUGE_PAGE, HUGE_PAGE + 1, 5 * HUGE_PAGE / 2 + 4097] {
            let mut s = AnonStorage::zeroed(len).unwrap();
            assert_eq!(s.bytes().len(), len);
            if cfg!(target_os = "linux") && huge_pages_wanted() {
                let at = s.bytes().as_ptr() as usize;
                assert_eq!(at % HUGE_PAGE, 0, "{len} bytes at {at:#x}");
            }
            // Every byte is the storage's own: written at both ends.
            let b = s.bytes_mut();
            b[0] = 1;
            b[len - 1] = 2;
            assert_eq!((s.bytes()[0], s.bytes()[len - 1]), (1, 2));
            assert!(s.bytes()[1..len - 1].iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn a_common_span_covers_views_of_one_storage_in_any_order() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i * 13 + 5) as u8).collect();
        let all = Bytes::from_vec(src.clone());
        // Out of order, with gaps, one view inside the span's ends.
        let a = all.slice(600, 100).unwrap();
        let b = all.slice(100, 50).unwrap();
        let c = all.slice(300, 20).unwrap();
        let (span, at) = Bytes::common_span([&a, &b, &c]).expect("one storage");
        assert_eq!(span, &src[100..700]);
        assert_eq!(at, [500, 0, 200]);
        for (v, o) in [&a, &b, &c].iter().zip(at) {
            assert_eq!(&span[o..o + v.len()], v.as_slice());
        }
        // A view of another storage with the same bytes is not the same one.
        let other = Bytes::from_vec(src.clone()).slice(100, 50).unwrap();
        assert!(Bytes::common_span([&a, &other]).is_none());
        assert!(Bytes::common_span::<0>([]).is_none());
        let (one, at) = Bytes::common_span([&c]).unwrap();
        assert_eq!((one, at), (&src[300..320], [0]));
    }

    /// A name given as `Display` is formatted into the errors only, and
    /// reads as the `&str` one does.
    #[test]
    fn a_matrix_named_lazily_names_itself_in_errors() {
        struct Counted<'a>(&'a std::cell::Cell<usize>);
        impl std::fmt::Display for Counted<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.set(self.0.get() + 1);
                write!(f, "layer 3 expert 17 gate")
            }
        }
        let formatted = std::cell::Cell::new(0);
        let ok = QMatrix::named(
            &Counted(&formatted),
            2,
            32,
            WeightFormat::Q8_0,
            Bytes::from_vec((0..68u8).collect()),
            None,
        );
        assert!(ok.is_ok());
        assert_eq!(formatted.get(), 0, "no name formatted without an error");
        let short = || Bytes::from_vec((0..67u8).collect());
        let lazy = QMatrix::named(
            &Counted(&formatted),
            2,
            32,
            WeightFormat::Q8_0,
            short(),
            None,
        );
        let eager = QMatrix::new(
            "layer 3 expert 17 gate",
            2,
            32,
            WeightFormat::Q8_0,
            short(),
            None,
        );
        let (Err(lazy), Err(eager)) = (lazy, eager) else {
            panic!("67 bytes are not two Q8_0 rows of 32");
        };
        assert_eq!(formatted.get(), 1);
        assert_eq!(lazy.to_string(), eager.to_string());
        assert!(lazy.to_string().contains("tensor `layer 3 expert 17 gate`"));
    }
}
