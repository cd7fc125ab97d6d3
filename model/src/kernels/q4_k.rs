//! Q4_K and Q5_K weights (ggml's k-quants of llama.cpp's Q4_K_M and Q5_K
//! files; see [`crate::quant::dequantize_q4_k`]) against activations
//! quantized to 8-bit blocks of 32 ([`Q8Activation`]). A sub-block of
//! these formats is a block of the activation, so block `b` (sub-block
//! `b mod 8` of super-block `b / 8`, scale `sc`, min `m`) gives two exact
//! integers:
//!
//! - `A_b = sc · Σ q·a` over its 32 codes `q` and quants `a`
//!   (|A_b| ≤ 63 · 32 · 31 · 127 < 2²⁴: exact in f32 too);
//! - `B_b = m · Σ a` (|B_b| ≤ 63 · 32 · 127).
//!
//! Its value `t_b = fma(f16(d) · x.d_b, A_b, −((f16(dmin) · x.d_b) · B_b))`
//! takes four f32 roundings (the two scale products, the min term's
//! product and the fused multiply-add), and is added into accumulator lane
//! `b mod 4`; the lanes are reduced as `(a0 + a2) + (a1 + a3)`, as the
//! Q4_0 and Q6_K kernels do.
//!
//! The scalar [`dot_q4_k_q8`] and [`dot_q5_k_q8`] are the references; the
//! vector kernels give their bits (the tests check it on every level the
//! CPU has).

use super::q4_0::{LANES, tree4};
use super::q8act::Q8Activation;
use crate::quant::{
    K_SCALE_BYTES, K_SCALES, Q4_K_BLOCK_BYTES, Q5_K_BLOCK_BYTES, QK, QK_K, k4_d_dmin, k4_scale_min,
    q4_k_code, q5_k_code,
};

/// Blocks of 32 in a super-block.
pub(crate) const BLOCKS: usize = QK_K / QK;

/// Block `b`'s term from its integers and scales, in the reference's
/// order of operations (every kernel computes exactly this).
#[inline(always)]
pub(crate) fn term(d: f32, dmin: f32, xd: f32, a: i32, b: i32) -> f32 {
    (d * xd).mul_add(a as f32, -((dmin * xd) * b as f32))
}

fn dot_k4(w: &[u8], x: &Q8Activation, size: usize, code: fn(&[u8], usize) -> i32) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (i, blk) in w.chunks_exact(size).enumerate() {
        let (d, dmin) = k4_d_dmin(blk);
        let scales = &blk[K_SCALES..K_SCALES + K_SCALE_BYTES];
        for j in 0..BLOCKS {
            let b = i * BLOCKS + j;
            let q = &x.quants[b * QK..(b + 1) * QK];
            let (sc, m) = k4_scale_min(scales, j);
            let dot: i32 = (0..QK).map(|l| code(blk, QK * j + l) * q[l] as i32).sum();
            let sum = x.bsums8[b] / 8;
            acc[b % LANES] += term(d, dmin, x.scales[b], sc * dot, m * sum);
        }
    }
    tree4(acc)
}

/// Scalar reference: a Q4_K row (`n/256` super-blocks of 144 bytes) ·
/// activation.
pub fn dot_q4_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
    dot_k4(w, x, Q4_K_BLOCK_BYTES, q4_k_code)
}

/// Scalar reference: a Q5_K row (`n/256` super-blocks of 176 bytes) ·
/// activation.
pub fn dot_q5_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
    dot_k4(w, x, Q5_K_BLOCK_BYTES, q5_k_code)
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! # Safety
    //! Every function needs AVX2, FMA and F16C (the caller checked them at
    //! run time), `w` whole super-blocks and `x` of `w`'s length in
    //! elements.
    //!
    //! A super-block's 8 blocks are taken 32 codes at a time: `maddubs`
    //! (unsigned codes · signed quants, pairs exact: |·| ≤ 2 · 31 · 127)
    //! and `madd` by ones leave each block's 8 lane sums; two rounds of
    //! `hadd` over 4 blocks and the two 128-bit halves added give their 4
    //! sums `Σ q·a`. The 8 sums, scales, mins and `Σ a` are then one
    //! vector each: `A`, `B` by `vpmulld` (exact integers), the terms by one
    //! fused multiply-subtract, added into the 4 lanes as blocks 0–3, then
    //! 4–7 (the reference's order).

    use std::arch::x86_64::*;

    use super::super::q8act::Q8Activation;
    use super::BLOCKS;
    use crate::quant::{K_SCALES, Q4_K_BLOCK_BYTES, Q4_K_QS, Q5_K_BLOCK_BYTES, Q5_K_QH, Q5_K_QS};

    /// How far ahead of the super-block being read its bytes are asked of
    /// L2 (as the Q6_K and Q4_0 kernels do).
    const PREFETCH: usize = 4096;

    /// The 8 scales and 8 mins of a super-block (ggml's
    /// `get_scale_min_k4` on all 8 sub-blocks at once), as i32 lanes.
    #[inline(always)]
    unsafe fn scales_mins(blk: *const u8) -> (__m256i, __m256i) {
        // SAFETY: 12 scale bytes at `blk + K_SCALES` (module contract).
        unsafe {
            let word = |k: usize| {
                u32::from_le_bytes(std::ptr::read_unaligned(
                    blk.add(K_SCALES + 4 * k) as *const [u8; 4]
                ))
            };
            let (w0, w1, w2) = (word(0), word(1), word(2));
            let sc_lo = w0 & 0x3f3f_3f3f;
            let m_lo = w1 & 0x3f3f_3f3f;
            let sc_hi = (w2 & 0x0f0f_0f0f) | (((w0 >> 6) & 0x0303_0303) << 4);
            let m_hi = ((w2 >> 4) & 0x0f0f_0f0f) | (((w1 >> 6) & 0x0303_0303) << 4);
            let widen = |lo: u32, hi: u32| {
                _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((lo as u64 | (hi as u64) << 32) as i64))
            };
            (widen(sc_lo, sc_hi), widen(m_lo, m_hi))
        }
    }

    /// One block's 8 lane sums of `code · a` from its 32 codes.
    #[inline(always)]
    unsafe fn block_lanes(codes: __m256i, q: *const i8) -> __m256i {
        // SAFETY: 32 quants at `q` (caller); register arithmetic under the
        // module's guarantee.
        unsafe {
            let xq = _mm256_loadu_si256(q as *const __m256i);
            _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq), _mm256_set1_epi16(1))
        }
    }

    /// The 4 block sums of 4 blocks' lane sums, in block order.
    #[inline(always)]
    fn four_sums(v: &[__m256i; 4]) -> __m128i {
        // SAFETY: register arithmetic; AVX2 per the module contract (the
        // callers are `target_feature` functions, and this is inlined).
        unsafe {
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
        }
    }

    /// The shared body: `codes(blk, c)` gives the codes of blocks `2c` and
    /// `2c + 1` of a super-block.
    #[inline(always)]
    unsafe fn dot_k4(
        w: &[u8],
        x: &Q8Activation,
        size: usize,
        codes: impl Fn(*const u8, usize) -> (__m256i, __m256i),
    ) -> f32 {
        let supers = w.len() / size;
        let (wp, qp) = (w.as_ptr(), x.quants.as_ptr());
        // SAFETY: super-blocks i < supers are read, with their 8 blocks of
        // quants, scales and sums (module docs).
        unsafe {
            let mut acc = _mm_setzero_ps();
            for i in 0..supers {
                let blk = wp.add(i * size);
                // A hint: it never faults; past the row it reaches the
                // task's next rows.
                for line in 0..3 {
                    _mm_prefetch::<_MM_HINT_T1>(blk.wrapping_add(PREFETCH + 64 * line) as *const i8);
                }
                let q = qp.add(i * BLOCKS * 32);
                let mut v = [_mm256_setzero_si256(); 8];
                for c in 0..4 {
                    let (lo, hi) = codes(blk, c);
                    v[2 * c] = block_lanes(lo, q.add(64 * c));
                    v[2 * c + 1] = block_lanes(hi, q.add(64 * c + 32));
                }
                let dots = _mm256_set_m128i(
                    four_sums(&[v[4], v[5], v[6], v[7]]),
                    four_sums(&[v[0], v[1], v[2], v[3]]),
                );
                let (sc, m) = scales_mins(blk);
                let a = _mm256_cvtepi32_ps(_mm256_mullo_epi32(dots, sc));
                let sums = _mm256_srai_epi32::<3>(_mm256_loadu_si256(
                    x.bsums8.as_ptr().add(i * BLOCKS) as *const __m256i,
                ));
                let b = _mm256_cvtepi32_ps(_mm256_mullo_epi32(sums, m));
                let dd = _mm256_cvtph_ps(_mm_cvtsi32_si128(u32::from_le_bytes(
                    std::ptr::read_unaligned(blk as *const [u8; 4]),
                ) as i32));
                let xd = _mm256_loadu_ps(x.scales.as_ptr().add(i * BLOCKS));
                let d = _mm256_mul_ps(_mm256_permutevar8x32_ps(dd, _mm256_setzero_si256()), xd);
                let dmin = _mm256_mul_ps(_mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(1)), xd);
                // t = fma(d·xd, A, −((dmin·xd)·B)), one rounding each.
                let t = _mm256_fmsub_ps(d, a, _mm256_mul_ps(dmin, b));
                acc = _mm_add_ps(acc, _mm256_castps256_ps128(t));
                acc = _mm_add_ps(acc, _mm256_extractf128_ps::<1>(t));
            }
            // (a0 + a2) + (a1 + a3), as `tree4`.
            let h2 = _mm_add_ps(acc, _mm_movehl_ps(acc, acc));
            _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)))
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract; each super-block has 128 bytes of
        // nibbles at Q4_K_QS.
        unsafe {
            let m4 = _mm256_set1_epi8(0x0f);
            dot_k4(w, x, Q4_K_BLOCK_BYTES, |blk, c| {
                let qs = _mm256_loadu_si256(blk.add(Q4_K_QS + 32 * c) as *const __m256i);
                (
                    _mm256_and_si256(qs, m4),
                    _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4),
                )
            })
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract; each super-block has 32 bytes of
        // fifth bits at Q5_K_QH and 128 of nibbles at Q5_K_QS.
        unsafe {
            let m4 = _mm256_set1_epi8(0x0f);
            let b4 = _mm256_set1_epi8(0x10);
            // Sub-block j's fifth bit is bit j of qh[l]: as 0x10 where set.
            let fifth = |qh: __m256i, j: usize| {
                let bit = _mm256_set1_epi8(1i8 << j);
                _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), b4)
            };
            dot_k4(w, x, Q5_K_BLOCK_BYTES, |blk, c| {
                let qs = _mm256_loadu_si256(blk.add(Q5_K_QS + 32 * c) as *const __m256i);
                let qh = _mm256_loadu_si256(blk.add(Q5_K_QH) as *const __m256i);
                (
                    _mm256_or_si256(_mm256_and_si256(qs, m4), fifth(qh, 2 * c)),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4),
                        fifth(qh, 2 * c + 1),
                    ),
                )
            })
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::{dequantize_q4_k, dequantize_q5_k};
    use rand::{Rng, SeedableRng};

    type Dot = fn(&[u8], &Q8Activation) -> f32;

    /// Random super-blocks: every code, scale and min; finite `d`, `dmin`
    /// of both signs.
    pub(crate) fn random_row(rng: &mut impl Rng, supers: usize, size: usize) -> Vec<u8> {
        let mut w: Vec<u8> = (0..supers * size).map(|_| rng.random()).collect();
        for blk in w.chunks_exact_mut(size) {
            for at in [0, 2] {
                let v = half::f16::from_f32(rng.random_range(-0.02f32..0.02));
                blk[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        w
    }

    #[test]
    fn the_integer_dots_are_close_to_the_exact_products() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(44);
        type Deq = fn(&[u8], &mut [f32]);
        let formats: [(usize, Deq, Dot); 2] = [
            (Q4_K_BLOCK_BYTES, dequantize_q4_k, dot_q4_k_q8),
            (Q5_K_BLOCK_BYTES, dequantize_q5_k, dot_q5_k_q8),
        ];
        for (size, deq, dot) in formats {
            for supers in [1, 3, 8] {
                let n = supers * QK_K;
                let w = random_row(&mut rng, supers, size);
                let x: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let mut wf = vec![0.0f32; n];
                deq(&w, &mut wf);
                let exact: f64 = wf.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                let scale: f64 = wf.iter().map(|&a| (a as f64).abs()).sum();
                let a = Q8Activation::quantize(&x);
                let got = dot(&w, &a) as f64;
                // x's quantization error (half a step of amax/127 per
                // element) bounds the difference.
                assert!(
                    (got - exact).abs() <= scale / 127.0 + 1e-4,
                    "{size}: {got} against {exact} (scale {scale})"
                );
                assert!(got.abs() > 0.0);
            }
        }
    }

    #[test]
    fn the_min_term_is_subtracted_per_block() {
        // All codes 0, scale 0, min 1 in every sub-block and dmin 1: the
        // row is −1 everywhere, so the product is −Σ x (to x's
        // quantization), whatever the other fields say.
        let mut blk = vec![0u8; Q4_K_BLOCK_BYTES];
        blk[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        blk[2..4].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
        for j in 4..8 {
            blk[K_SCALES + j] = 1;
        }
        for j in 8..12 {
            blk[K_SCALES + j] = 0x10;
        }
        let x: Vec<f32> = (0..QK_K).map(|i| (i % 7) as f32 * 0.25 - 0.5).collect();
        let a = Q8Activation::quantize(&x);
        let want: f32 = -(a.quants.iter().enumerate())
            .map(|(i, &q)| q as f32 * a.scales[i / QK])
            .sum::<f32>();
        let got = dot_q4_k_q8(&blk, &a);
        assert!((got - want).abs() < 1e-3, "{got} against {want}");
        let mut y = vec![0.0f32; QK_K];
        dequantize_q4_k(&blk, &mut y);
        assert!(y.iter().all(|&v| v == -1.0));
    }

    #[test]
    fn the_vector_kernels_equal_the_reference_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(45);
        type Pick = fn(&crate::kernels::KernelSet) -> fn(&[u8], &Q8Activation) -> f32;
        let formats: [(&str, usize, Pick, Dot); 2] = [
            ("q4_k", Q4_K_BLOCK_BYTES, |k| k.dot_q4_k_q8, dot_q4_k_q8),
            ("q5_k", Q5_K_BLOCK_BYTES, |k| k.dot_q5_k_q8, dot_q5_k_q8),
        ];
        for k in crate::kernels::tests::simd_sets() {
            for (name, size, pick, reference) in formats {
                for supers in [1, 2, 5, 9] {
                    let n = supers * QK_K;
                    let w = random_row(&mut rng, supers, size);
                    let mut x: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
                    // Extremes: a block at ±127 everywhere, a zero block.
                    for v in &mut x[..QK] {
                        *v = if rng.random() { 1.0 } else { -1.0 };
                    }
                    x[QK..2 * QK].fill(0.0);
                    let a = Q8Activation::quantize(&x);
                    assert_eq!(
                        pick(&k)(&w, &a).to_bits(),
                        reference(&w, &a).to_bits(),
                        "{} {name} at {supers} super-blocks",
                        k.name
                    );
                }
            }
        }
    }

    #[test]
    fn extreme_codes_scales_and_mins_stay_exact() {
        // Every code at its largest (15 or 31), every scale and min 63,
        // against quants of −127: the largest integers a block can have.
        for (size, reference, pick) in [
            (
                Q4_K_BLOCK_BYTES,
                dot_q4_k_q8 as Dot,
                (|k: &crate::kernels::KernelSet| k.dot_q4_k_q8) as fn(&_) -> Dot,
            ),
            (Q5_K_BLOCK_BYTES, dot_q5_k_q8, |k| k.dot_q5_k_q8),
        ] {
            let mut w = vec![0xffu8; size];
            w[..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
            w[2..4].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
            let x = vec![-1.0f32; QK_K];
            let a = Q8Activation::quantize(&x);
            let top = if size == Q4_K_BLOCK_BYTES { 15 } else { 31 };
            // Each block: 63 · 32 · top · (−127) − 0.5 · 63 · 32 · (−127).
            let xd = a.scales[0];
            let t = term(1.0, 0.5, xd, 63 * 32 * top * -127, 63 * 32 * -127);
            let want = tree4([2.0 * t; LANES]);
            assert_eq!(reference(&w, &a), want);
            for k in crate::kernels::tests::simd_sets() {
                assert_eq!(pick(&k)(&w, &a), want, "{}", k.name);
            }
        }
    }
}
