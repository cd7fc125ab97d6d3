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
}
