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
                        #[allow(unused_unsafe)]
                        // SAFETY: AVX2 is enabled here; the IQ4 forms need
                        // nothing else.
                        unsafe {
                            $base(bytes, out)
                        }
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
        iq4_nl => iq4::dequantize_nl,
        iq4_xs => iq4::dequantize_xs,
        q6_k => quant::dequantize_q6_k,
        q4_k => quant::dequantize_q4_k,
        q5_k => quant::dequantize_q5_k,
    }

    /// IQ4_NL and IQ4_XS, whose table lookups the compiler leaves scalar:
    /// one byte shuffle looks up 16 nibbles at once. Each element is `dl ·
    /// value` as in [`quant::dequantize_iq4_nl`], the same single rounding.
    mod iq4 {
        use std::arch::x86_64::*;

        use crate::format::f16_to_f32;
        use crate::quant::{
            IQ4_NL_BLOCK_BYTES, IQ4_NL_VALUES, IQ4_XS_BLOCK_BYTES, IQ4_XS_QS, QK, QK_K,
            iq4_xs_scale,
        };

        /// 32 elements: `dl ·` the table value of each nibble of `qs` (low
        /// nibbles: elements 0..16, high: 16..32).
        #[inline(always)]
        unsafe fn block(dl: f32, qs: &[u8], out: &mut [f32]) {
            assert!(qs.len() >= QK / 2 && out.len() >= QK);
            // SAFETY: AVX2 (and so SSSE3/SSE4.1) is enabled by the callers'
            // #[target_feature]; the loads read the 16 table bytes and the
            // 16 bytes of `qs`, the stores write `out[..32]`: all in bounds
            // (asserted above), unaligned forms.
            unsafe {
                let table = _mm_loadu_si128(IQ4_NL_VALUES.as_ptr().cast());
                let q = _mm_loadu_si128(qs.as_ptr().cast());
                let mask = _mm_set1_epi8(0x0f);
                let halves = [
                    _mm_shuffle_epi8(table, _mm_and_si128(q, mask)),
                    _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), mask)),
                ];
                let d = _mm256_set1_ps(dl);
                for (h, v) in halves.into_iter().enumerate() {
                    let a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                    let b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
                    let o = out.as_mut_ptr().add(16 * h);
                    _mm256_storeu_ps(o, _mm256_mul_ps(d, a));
                    _mm256_storeu_ps(o.add(8), _mm256_mul_ps(d, b));
                }
            }
        }

        fn f16_at(blk: &[u8]) -> f32 {
            f16_to_f32(u16::from_le_bytes([blk[0], blk[1]]))
        }

        #[inline(always)]
        pub(super) unsafe fn dequantize_nl(bytes: &[u8], out: &mut [f32]) {
            for (blk, o) in bytes
                .chunks_exact(IQ4_NL_BLOCK_BYTES)
                .zip(out.chunks_exact_mut(QK))
            {
                // SAFETY: the caller enables AVX2.
                unsafe { block(f16_at(blk), &blk[2..], o) };
            }
        }

        #[inline(always)]
        pub(super) unsafe fn dequantize_xs(bytes: &[u8], out: &mut [f32]) {
            for (blk, o) in bytes
                .chunks_exact(IQ4_XS_BLOCK_BYTES)
                .zip(out.chunks_exact_mut(QK_K))
            {
                let d = f16_at(blk);
                let qs = &blk[IQ4_XS_QS..];
                for (ib, sub) in o.chunks_exact_mut(QK).enumerate() {
                    let dl = d * iq4_xs_scale(blk, ib) as f32;
                    // SAFETY: the caller enables AVX2.
                    unsafe { block(dl, &qs[ib * QK / 2..], sub) };
                }
            }
        }
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
