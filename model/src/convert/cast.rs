//! Converting a matrix to another format, rows at a time.
//!
//! - to its own format: the stored bytes, unchanged (this is `keep`, and
//!   any tensor already in the target format: re-quantizing Q4_0 to Q4_0
//!   would not be the identity);
//! - to f32: every element's exact value (every format widens exactly);
//! - to bf16 / f16: the exact value rounded to nearest, ties to even
//!   (bf16: add `0x7fff` plus the lowest kept bit and truncate, the rule
//!   PyTorch and ggml use; NaN stays NaN). Exact for bf16 sources, for f16
//!   sources converted to f16, and for any value the target can represent;
//!   the conversion reports the tensors where rounding changed a value;
//! - to q8_0 / q4_0: the exact f32 row quantized by ggml's reference
//!   quantizers ([`crate::quant`]). FP8 rows are dequantized exactly
//!   (element × its block's scale) first.
//!
//! Rows are independent, so a chunk of rows is converted in parallel and
//! the bytes are the same whatever the thread count.

use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::format::WeightFormat;
use crate::tensor::{BlockScales, QMatrix};

/// Output bytes converted per piece (then handed to the sink): bounds the
/// memory a conversion holds whatever the tensor's size.
pub const CHUNK_BYTES: usize = 8 << 20;

/// What `--quant` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Quant {
    /// Every tensor in its stored format.
    Keep,
    F32,
    Bf16,
    Q8_0,
    Q4_0,
}

impl Quant {
    pub const ALL: [Quant; 5] = [
        Quant::Keep,
        Quant::F32,
        Quant::Bf16,
        Quant::Q8_0,
        Quant::Q4_0,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Quant::Keep => "keep",
            Quant::F32 => "f32",
            Quant::Bf16 => "bf16",
            Quant::Q8_0 => "q8_0",
            Quant::Q4_0 => "q4_0",
        }
    }

    pub fn parse(s: &str) -> Result<Quant> {
        Quant::ALL
            .into_iter()
            .find(|q| q.name() == s)
            .ok_or_else(|| {
                ModelError::Invalid(format!(
                    "unknown quantization `{s}` (keep, f32, bf16, q8_0, q4_0)"
                ))
            })
    }
}

/// Why a matrix is not written in the requested format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KeptReason {
    /// Its rows are not whole 32-element blocks.
    RowNotBlocks,
}

/// The format `quant` writes a matrix of `role` stored as `stored` in,
/// and the reason when a quantizable matrix cannot be quantized.
pub fn target_format(
    quant: Quant,
    role: super::tensors::Role,
    stored: WeightFormat,
    cols: usize,
) -> (WeightFormat, Option<KeptReason>) {
    let block = |f: WeightFormat| {
        if !role.quantizable() {
            (stored, None)
        } else if !cols.is_multiple_of(crate::quant::QK) {
            (stored, Some(KeptReason::RowNotBlocks))
        } else {
            (f, None)
        }
    };
    match quant {
        Quant::Keep => (stored, None),
        Quant::F32 => (WeightFormat::F32, None),
        Quant::Bf16 => (WeightFormat::Bf16, None),
        Quant::Q8_0 => block(WeightFormat::Q8_0),
        Quant::Q4_0 => block(WeightFormat::Q4_0),
    }
}

/// Rows of a matrix, from storage or generated.
pub trait RowSource: Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// The format the rows are (nominally) in: `keep` writes this one.
    fn format(&self) -> WeightFormat;
    /// The stored bytes of rows `[r0, r1)`, when the rows are stored in
    /// [`format`](Self::format) (so converting to it is a copy).
    fn stored_rows(&self, r0: usize, r1: usize) -> Option<&[u8]>;
    /// Row `r`'s exact values.
    fn row_f32(&self, r: usize, out: &mut [f32]);
    /// FP8 block scales.
    fn scales(&self) -> Option<&BlockScales>;
}

impl RowSource for QMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn format(&self) -> WeightFormat {
        self.format
    }

    fn stored_rows(&self, r0: usize, r1: usize) -> Option<&[u8]> {
        let rb = self.format.row_bytes(self.cols).ok()?;
        self.data().as_slice().get(r0 * rb..r1 * rb)
    }

    fn row_f32(&self, r: usize, out: &mut [f32]) {
        self.row_to_f32(r, out)
    }

    fn scales(&self) -> Option<&BlockScales> {
        QMatrix::scales(self)
    }
}

/// f32 to bf16 bits, round to nearest, ties to even; NaN stays a (quiet)
/// NaN with its sign.
#[inline]
pub fn f32_to_bf16_rne(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// Encodes one row of exact values in `to`, appending to `out`. Returns
/// whether rounding changed a value (bf16/f16).
fn encode_row(x: &[f32], to: WeightFormat, out: &mut [u8]) -> Result<bool> {
    let mut rounded = false;
    match to {
        WeightFormat::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        WeightFormat::Bf16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                let b = f32_to_bf16_rne(v);
                rounded |= crate::format::bf16_to_f32(b).to_bits() != v.to_bits() && !v.is_nan();
                o.copy_from_slice(&b.to_le_bytes());
            }
        }
        WeightFormat::F16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                let h = half::f16::from_f32(v);
                rounded |= h.to_f32().to_bits() != v.to_bits() && !v.is_nan();
                o.copy_from_slice(&h.to_bits().to_le_bytes());
            }
        }
        WeightFormat::Q8_0 => out.copy_from_slice(&crate::quant::quantize_q8_0(x)?),
        WeightFormat::Q4_0 => out.copy_from_slice(&crate::quant::quantize_q4_0(x)?),
        WeightFormat::Q6K => out.copy_from_slice(&crate::quant::quantize_q6_k(x)?),
        WeightFormat::Q4K => out.copy_from_slice(&crate::quant::quantize_q4_k(x)?),
        WeightFormat::Q5K => out.copy_from_slice(&crate::quant::quantize_q5_k(x)?),
        WeightFormat::F8E4M3
        | WeightFormat::Q4_1
        | WeightFormat::Q5_0
        | WeightFormat::Q5_1
        | WeightFormat::Q2K
        | WeightFormat::Q3K
        | WeightFormat::Iq4Nl
        | WeightFormat::Iq4Xs => {
            return Err(ModelError::Invalid(format!(
                "{} is a source format only: colibri does not quantize to it",
                to.name()
            )));
        }
    }
    Ok(rounded)
}

/// What a conversion did to a matrix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CastOutcome {
    /// Bytes handed to the sink.
    pub bytes: u64,
    /// Rounding to bf16/f16 changed at least one value.
    pub rounded: bool,
}

/// Converts `src` to `to`, handing the bytes to `sink` in pieces of about
/// [`CHUNK_BYTES`]. FP8 scales are not included (see [`scales_bytes`]).
pub fn convert_rows(
    src: &dyn RowSource,
    to: WeightFormat,
    sink: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<CastOutcome> {
    let (rows, cols) = (src.rows(), src.cols());
    let rb = to.row_bytes(cols)?;
    let per = (CHUNK_BYTES / rb.max(1)).max(1);
    let mut outcome = CastOutcome::default();
    let copy = to == src.format() && src.stored_rows(0, 0).is_some();
    if !copy && to == WeightFormat::F8E4M3 {
        return Err(ModelError::Invalid(
            "fp8-e4m3 is a source format only: colibri does not quantize to it".into(),
        ));
    }
    let mut buf = Vec::new();
    let mut r0 = 0;
    while r0 < rows {
        let r1 = (r0 + per).min(rows);
        if copy {
            let bytes = src.stored_rows(r0, r1).ok_or_else(|| {
                ModelError::Invalid(format!("rows {r0}..{r1} outside the stored matrix"))
            })?;
            sink(bytes)?;
            outcome.bytes += bytes.len() as u64;
        } else {
            buf.resize((r1 - r0) * rb, 0);
            let rounded = buf
                .par_chunks_mut(rb)
                .enumerate()
                .map_init(
                    || vec![0f32; cols],
                    |x, (k, out)| {
                        src.row_f32(r0 + k, x);
                        encode_row(x, to, out)
                    },
                )
                .try_reduce(|| false, |a, b| Ok(a | b))?;
            outcome.rounded |= rounded;
            sink(&buf)?;
            outcome.bytes += buf.len() as u64;
        }
        r0 = r1;
    }
    Ok(outcome)
}

/// FP8 block scales as stored: little-endian f32, row-major over the grid.
pub fn scales_bytes(s: &BlockScales) -> Vec<u8> {
    s.scales.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A vector as stored (f32, little-endian).
pub fn vector_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn bf16_rounding_is_round_to_nearest_even() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for _ in 0..100_000 {
            let v = f32::from_bits(rng.random::<u32>());
            let ours = f32_to_bf16_rne(v);
            let theirs = half::bf16::from_f32(v).to_bits();
            if v.is_nan() {
                assert!(crate::format::bf16_to_f32(ours).is_nan());
            } else {
                assert_eq!(ours, theirs, "{v:e}");
            }
        }
        // Ties go to the even neighbour.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16_rne(f32::MAX), 0x7f80); // rounds to +inf
    }

    #[test]
    fn conversions_are_exact_or_ggml() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let (rows, cols) = (37, 64);
        let vals: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let m = QMatrix::from_f32(rows, cols, vals.clone()).unwrap();
        let run = |to| {
            let mut out = Vec::new();
            let o = convert_rows(&m, to, &mut |b| {
                out.extend_from_slice(b);
                Ok(())
            })
            .unwrap();
            (out, o)
        };
        let (f, o) = run(WeightFormat::F32);
        assert_eq!(f, vector_bytes(&vals));
        assert!(!o.rounded);
        let (q, _) = run(WeightFormat::Q4_0);
        let want: Vec<u8> = vals
            .chunks(cols)
            .flat_map(|r| crate::quant::quantize_q4_0(r).unwrap())
            .collect();
        assert_eq!(q, want);
        let (b, o) = run(WeightFormat::Bf16);
        assert!(o.rounded);
        // bf16 -> bf16 copies; bf16 -> f32 is exact.
        let bm = QMatrix::new(
            "b",
            rows,
            cols,
            WeightFormat::Bf16,
            crate::tensor::Bytes::from_vec(b.clone()),
            None,
        )
        .unwrap();
        let mut again = Vec::new();
        let o = convert_rows(&bm, WeightFormat::Bf16, &mut |x| {
            again.extend_from_slice(x);
            Ok(())
        })
        .unwrap();
        assert_eq!(again, b);
        assert!(!o.rounded);
    }
}
