//! Row dequantization for the formats whose product is the exact one (the
//! row dequantized as ggml does, then the f32 kernel): Q4_1, Q5_0, Q5_1,
//! Q2_K, Q3_K, IQ4_NL and IQ4_XS always, the k-quants under
//! `--exact-quant`.
//!
//! The functions of [`crate::quant`] are plain scalar code that the
//! compiler vectorizes. Built for the x86-64 baseline it may use SSE2
//! only, so each has a twin compiled with AVX2 (the same code inlined under
//! `#[target_feature]`), chosen at run time. The operations are the same
//! IEEE ones in the same order (Rust never contracts a multiply and an add
//! into an FMA by itself), so both give the same bits; the tests compare
//! them.

use crate::format::WeightFormat;
use crate::quant;

/// Dequantizes whole rows: `(row bytes, out)`.
pub type RowFn = fn(&[u8], &mut [f32]);

/// The scalar functions of `f`, if it is dequantized row by row here.
fn baseline(f: WeightFormat) -> Option<RowFn> {
    Some(match f {
        WeightFormat::Q4_1 => quant::dequantize_q4_1,
        WeightFormat::Q5_0 => quant::dequantize_q5_0,
        WeightFormat::Q5_1 => quant::dequantize_q5_1,
        WeightFormat::Q2K => quant::dequantize_q2_k,
        WeightFormat::Q3K => quant::dequantize_q3_k,
        WeightFormat::Iq4Nl => quant::dequantize_iq4_nl,
        WeightFormat::Iq4Xs => quant::dequantize_iq4_xs,
        WeightFormat::Q6K => quant::dequantize_q6_k,
        WeightFormat::Q4K => quant::dequantize_q4_k,
        WeightFormat::Q5K => quant::dequantize_q5_k,
        _ => return None,
    })
}

/// The fastest dequantizer of `f` this CPU runs, `None` for the formats
/// not dequantized row by row here (f32, f16, bf16, fp8, Q8_0, Q4_0).
pub fn row_fn(f: WeightFormat) -> Option<RowFn> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        return avx2::row_fn(f);
    }
    baseline(f)
}

/// Both forms of `f`'s dequantizer where this CPU runs both (tests).
pub fn both(f: WeightFormat) -> Option<(RowFn, RowFn)> {
    Some((baseline(f)?, row_fn(f)?))
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::RowFn;
    use crate::format::WeightFormat;
    use crate::quant;

    /// `$name`: `$base` compiled with AVX2, behind a safe wrapper that only
    /// [`row_fn`] hands out, after checking the CPU.
    macro_rules! twins {
        ($($name:ident => $base:path),* $(,)?) => {
            $(
                fn $name(bytes: &[u8], out: &mut [f32]) {
                    #[target_feature(enable = "avx2")]
                    unsafe fn inner(bytes: &[u8], out: &mut [f32]) {
                        $base(bytes, out)
                    }
                    // SAFETY: `row_fn` gives this function out only where
                    // the CPU has AVX2.
                    unsafe { inner(bytes, out) }
                }
            )*
        };
    }

    twins! {
        q4_1 => quant::dequantize_q4_1,
        q5_0 => quant::dequantize_q5_0,
        q5_1 => quant::dequantize_q5_1,
        q2_k => quant::dequantize_q2_k,
        q3_k => quant::dequantize_q3_k,
        iq4_nl => quant::dequantize_iq4_nl,
        iq4_xs => quant::dequantize_iq4_xs,
        q6_k => quant::dequantize_q6_k,
        q4_k => quant::dequantize_q4_k,
        q5_k => quant::dequantize_q5_k,
    }

    /// Callers check AVX2 first ([`super::row_fn`]).
    pub(super) fn row_fn(f: WeightFormat) -> Option<RowFn> {
        Some(match f {
            WeightFormat::Q4_1 => q4_1,
            WeightFormat::Q5_0 => q5_0,
            WeightFormat::Q5_1 => q5_1,
            WeightFormat::Q2K => q2_k,
            WeightFormat::Q3K => q3_k,
            WeightFormat::Iq4Nl => iq4_nl,
            WeightFormat::Iq4Xs => iq4_xs,
            WeightFormat::Q6K => q6_k,
            WeightFormat::Q4K => q4_k,
            WeightFormat::Q5K => q5_k,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random rows of every format here (random bytes with finite f16
    /// scales) dequantize to the same bits through both forms.
    #[test]
    fn both_forms_give_the_same_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(61);
        for f in [
            WeightFormat::Q4_1,
            WeightFormat::Q5_0,
            WeightFormat::Q5_1,
            WeightFormat::Q2K,
            WeightFormat::Q3K,
            WeightFormat::Iq4Nl,
            WeightFormat::Iq4Xs,
            WeightFormat::Q6K,
            WeightFormat::Q4K,
            WeightFormat::Q5K,
        ] {
            let (base, best) = both(f).expect("dequantized here");
            let cols = 1536;
            let rb = f.row_bytes(cols).expect("whole blocks");
            // Random bytes; every 16-bit word made a finite f16 whose
            // exponent stays small, wherever the format keeps its scales.
            let bytes: Vec<u8> = (0..rb)
                .map(|i| {
                    let b: u8 = rng.random();
                    if i % 2 == 1 { b & 0x9f } else { b }
                })
                .collect();
            let (mut a, mut b) = (vec![f32::NAN; cols], vec![f32::NAN; cols]);
            base(&bytes, &mut a);
            best(&bytes, &mut b);
            assert!(a.iter().all(|v| v.is_finite()), "{f:?}");
            assert!(a.iter().any(|&v| v != 0.0), "{f:?}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "{f:?}");
        }
    }
}
