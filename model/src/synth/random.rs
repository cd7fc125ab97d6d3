//! Deterministic random weights that any row (or element) can be drawn
//! from independently: element `i` of a tensor is a hash of (the tensor's
//! seed, `i`), so rows are generated in parallel, in any order, and
//! transposed or permuted copies (the GGUF layout) hold the same values.
//!
//! Values are uniform in `mean ± amp` and rounded to bf16, as a released
//! bf16 checkpoint's would be: every output format then holds exactly the
//! same model (f32 and bf16 exactly, q8_0/q4_0 quantized from it), and no
//! tensor is all zero.

use crate::convert::cast::{RowSource, f32_to_bf16_rne};
use crate::convert::tensors::Role;
use crate::format::{WeightFormat, bf16_to_f32};
use crate::tensor::BlockScales;

/// splitmix64's finaliser: a fast, well-mixed 64-bit hash.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of a named tensor.
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), seed)
}

/// How large a tensor's values are: standard deviation `1/√cols` for
/// projections (outputs of unit scale), so activations stay finite
/// through any number of layers.
pub fn scale(role: Role, rows: usize, cols: usize) -> (f32, f32) {
    let _ = rows;
    let inv = 1.0 / (cols.max(1) as f32).sqrt();
    // (mean, amplitude); uniform ±a has standard deviation a/√3.
    let sqrt3 = 3f32.sqrt();
    match role {
        Role::Embedding => (0.0, sqrt3),
        Role::Norm => (1.0, 0.1),
        Role::Bias => (0.0, 0.02),
        _ => (0.0, sqrt3 * inv),
    }
}

/// A `rows × cols` matrix of generated bf16 values.
#[derive(Clone, Debug)]
pub struct SynthMatrix {
    pub seed: u64,
    pub rows: usize,
    pub cols: usize,
    pub mean: f32,
    pub amp: f32,
}

impl SynthMatrix {
    pub fn new(seed: u64, name: &str, role: Role, rows: usize, cols: usize) -> SynthMatrix {
        let (mean, amp) = scale(role, rows, cols);
        SynthMatrix {
            seed: tensor_seed(seed, name),
            rows,
            cols,
            mean,
            amp,
        }
    }

    /// Element (`r`, `c`).
    #[inline]
    pub fn value(&self, r: usize, c: usize) -> f32 {
        let i = (r * self.cols + c) as u64;
        let h = mix(self.seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        // 24 random bits to a uniform in [-1, 1).
        let u = (h >> 40) as f32 * (2.0 / (1u64 << 24) as f32) - 1.0;
        bf16_to_f32(f32_to_bf16_rne(self.mean + self.amp * u))
    }

    /// The whole matrix as a vector (vectors and 1-row tensors only).
    pub fn values(&self) -> Vec<f32> {
        (0..self.rows)
            .flat_map(|r| (0..self.cols).map(move |c| (r, c)))
            .map(|(r, c)| self.value(r, c))
            .collect()
    }
}

impl RowSource for SynthMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn format(&self) -> WeightFormat {
        WeightFormat::Bf16
    }

    fn stored_rows(&self, _r0: usize, _r1: usize) -> Option<&[u8]> {
        None
    }

    fn row_f32(&self, r: usize, out: &mut [f32]) {
        for (c, o) in out.iter_mut().enumerate().take(self.cols) {
            *o = self.value(r, c);
        }
    }

    fn scales(&self) -> Option<&BlockScales> {
        None
    }
}

/// Rows of a generated matrix seen through an element mapping: row `r`,
/// column `c` of the view is element `map(r, c)` of `inner` (GGUF's
/// permuted and transposed copies of a Hugging Face tensor).
pub struct MappedRows<'a, F: Fn(usize, usize) -> (usize, usize) + Sync> {
    pub inner: &'a SynthMatrix,
    pub rows: usize,
    pub cols: usize,
    pub map: F,
}

impl<F: Fn(usize, usize) -> (usize, usize) + Sync> RowSource for MappedRows<'_, F> {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn format(&self) -> WeightFormat {
        WeightFormat::Bf16
    }

    fn stored_rows(&self, _r0: usize, _r1: usize) -> Option<&[u8]> {
        None
    }

    fn row_f32(&self, r: usize, out: &mut [f32]) {
        for (c, o) in out.iter_mut().enumerate().take(self.cols) {
            let (ir, ic) = (self.map)(r, c);
            *o = self.inner.value(ir, ic);
        }
    }

    fn scales(&self) -> Option<&BlockScales> {
        None
    }
}

/// Where a read-only format's block keeps its f16 scale and, for the
/// formats with one, its f16 min; and what the min is set to, as a
/// multiple of the scale, so the block's values centre near zero.
struct BlockFields {
    elements: usize,
    scale_at: usize,
    /// (where, the min as a multiple of the scale): Q4_1's and Q5_1's
    /// `m` is added (`−mean code · d`); Q2_K's `dmin` multiplies a mean
    /// 4-bit min of 7.5 against a mean `scale · code` of 7.5 · 1.5.
    min: Option<(usize, f32)>,
}

fn block_fields(format: WeightFormat) -> Option<BlockFields> {
    use crate::quant::{Q2_K_D, Q3_K_D, QK, QK_K};
    let (elements, scale_at, min) = match format {
        WeightFormat::Q4_1 => (QK, 0, Some((2, -7.5))),
        WeightFormat::Q5_1 => (QK, 0, Some((2, -15.5))),
        WeightFormat::Q5_0 | WeightFormat::Iq4Nl => (QK, 0, None),
        WeightFormat::Q2K => (QK_K, Q2_K_D, Some((Q2_K_D + 2, 1.5))),
        WeightFormat::Q3K => (QK_K, Q3_K_D, None),
        WeightFormat::Iq4Xs => (QK_K, 0, None),
        _ => return None,
    };
    Some(BlockFields {
        elements,
        scale_at,
        min,
    })
}

/// Whether [`RandomBlocks`] writes `format`: the formats colibri reads
/// but does not quantize to (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS).
pub fn writes_random_blocks(format: WeightFormat) -> bool {
    block_fields(format).is_some()
}

/// Random bytes for blocks, element `i` of the stream a hash of (`seed`,
/// `i`), with each block's scale (and min) set to `d` (and its multiple).
fn fill_blocks(seed: u64, format: WeightFormat, d: f32, out: &mut [u8]) {
    let Some(f) = block_fields(format) else {
        return;
    };
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let h = mix(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes();
        chunk.copy_from_slice(&h[..chunk.len()]);
    }
    let block = format.row_bytes(f.elements).unwrap_or(usize::MAX);
    let put = |b: &mut [u8], at: usize, v: f32| {
        b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
    };
    for b in out.chunks_exact_mut(block) {
        put(b, f.scale_at, d);
        if let Some((at, k)) = f.min {
            put(b, at, k * d);
        }
    }
}

/// The standard deviation of `format`'s values with a scale of 1 (the
/// blocks [`fill_blocks`] writes, measured once on 256 of them).
fn unit_std(format: WeightFormat) -> f32 {
    let Some(f) = block_fields(format) else {
        return 1.0;
    };
    let n = 256 * f.elements;
    let Ok(bytes) = format.row_bytes(n) else {
        return 1.0;
    };
    let mut raw = vec![0u8; bytes];
    fill_blocks(0x5eed, format, 1.0, &mut raw);
    let mut v = vec![0.0f32; n];
    match crate::kernels::dequant::row_fn(format) {
        Some(deq) => deq(&raw, &mut v),
        None => return 1.0,
    }
    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64;
    let var = v
        .iter()
        .map(|&x| (f64::from(x) - mean).powi(2))
        .sum::<f64>()
        / n as f64;
    var.sqrt() as f32
}

/// A matrix as random blocks of a format colibri reads but has no
/// quantizer for ([`writes_random_blocks`]): the codes are noise from the
/// matrix's seed and the row, every block's scale is chosen so the values
/// have the matrix's standard deviation (`amp/√3`). A synthetic model's
/// weights are noise either way; this writes those formats to measure
/// them.
pub struct RandomBlocks {
    seed: u64,
    format: WeightFormat,
    d: f32,
}

impl RandomBlocks {
    /// `None` for a format [`writes_random_blocks`] does not write.
    pub fn new(m: &SynthMatrix, format: WeightFormat) -> Option<RandomBlocks> {
        writes_random_blocks(format).then(|| RandomBlocks {
            seed: m.seed,
            format,
            d: m.amp / 3f32.sqrt() / unit_std(format),
        })
    }

    /// Bytes of a row of `cols` values.
    pub fn row_bytes(&self, cols: usize) -> crate::error::Result<usize> {
        self.format.row_bytes(cols)
    }

    /// Row `r`'s bytes into `out` (the row's length).
    pub fn row(&self, r: usize, out: &mut [u8]) {
        let seed = mix(self.seed ^ (r as u64).wrapping_mul(0xd1b5_4a32_d192_ed03));
        fill_blocks(seed, self.format, self.d, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_deterministic_spread_and_bf16() {
        let m = SynthMatrix::new(7, "x", Role::Attention, 64, 256);
        let v = m.values();
        assert_eq!(
            v,
            SynthMatrix::new(7, "x", Role::Attention, 64, 256).values()
        );
        assert_ne!(
            v,
            SynthMatrix::new(8, "x", Role::Attention, 64, 256).values()
        );
        assert_ne!(
            v,
            SynthMatrix::new(7, "y", Role::Attention, 64, 256).values()
        );
        assert!(v.iter().all(|x| x.to_bits() & 0xffff == 0));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        // Standard deviation 1/√cols.
        assert!((var.sqrt() * 16.0 - 1.0).abs() < 0.05, "{}", var.sqrt());
        assert!(mean.abs() < 0.01);
        assert!(v.iter().filter(|x| **x == 0.0).count() < v.len() / 100);
    }

    #[test]
    fn random_blocks_have_the_matrix_spread_and_differ_by_row() {
        let formats = [
            WeightFormat::Q4_1,
            WeightFormat::Q5_0,
            WeightFormat::Q5_1,
            WeightFormat::Q2K,
            WeightFormat::Q3K,
            WeightFormat::Iq4Nl,
            WeightFormat::Iq4Xs,
        ];
        let (rows, cols) = (8, 2048);
        let m = SynthMatrix::new(7, "x", Role::RoutedExpert, rows, cols);
        let want = 1.0 / (cols as f64).sqrt();
        for f in formats {
            assert!(writes_random_blocks(f));
            let rb = f.row_bytes(cols).unwrap();
            let blocks = RandomBlocks::new(&m, f).unwrap();
            let mut bytes = vec![0u8; rows * rb];
            for (r, row) in bytes.chunks_exact_mut(rb).enumerate() {
                blocks.row(r, row);
            }
            let mut again = vec![0u8; rb];
            RandomBlocks::new(&m, f).unwrap().row(3, &mut again);
            assert_eq!(again, bytes[3 * rb..4 * rb], "{f:?}: same row, same bytes");
            assert_ne!(bytes[..rb], bytes[rb..2 * rb], "{f:?}: rows differ");
            let mut v = vec![0.0f32; rows * cols];
            crate::kernels::dequant::row_fn(f).unwrap()(&bytes, &mut v);
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
            let std = (v
                .iter()
                .map(|&x| (f64::from(x) - mean).powi(2))
                .sum::<f64>()
                / n)
                .sqrt();
            assert!(v.iter().all(|x| x.is_finite()), "{f:?}");
            assert!(
                (std / want - 1.0).abs() < 0.1,
                "{f:?}: std {std} against {want}"
            );
            assert!(
                mean.abs() < 0.3 * want,
                "{f:?}: mean {mean} against std {want}"
            );
        }
        assert!(RandomBlocks::new(&m, WeightFormat::Q4_0).is_none());
        assert!(RandomBlocks::new(&m, WeightFormat::Q4K).is_none());
    }
}
