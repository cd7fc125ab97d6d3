//! Q6_K weights (ggml's k-quant of llama.cpp's output matrices; see
//! [`crate::quant::dequantize_q6_k`]) against activations quantized to
//! 8-bit blocks of 32, the arithmetic of the Q4_0 kernels
//! ([`super::q4_0`]) with a Q6_K row read as blocks of 32:
//!
//! - block `b` (elements `32b .. 32b + 32`, sub-blocks `2b mod 16` and
//!   `2b + 1 mod 16` of super-block `b / 8`) gives the exact integer
//!   `s_b = sc₀ · Σ₀ q·a + sc₁ · Σ₁ q·a` over its two halves of 16
//!   (|s_b| ≤ 2 · 128 · 16 · 32 · 127 < 2²⁴: exact in f32 too);
//! - its scale is `d_b = f16(d) · x.d_b`, one f32 rounding;
//! - `d_b · s_b` is added with one fused multiply-add into accumulator
//!   lane `b mod 4`, and the lanes are reduced as `(a0 + a2) + (a1 + a3)`.
//!
//! The scalar [`dot_q6_k_q8`] is the reference; the vector kernels give its
//! bits (the tests check it on every level the CPU has).

use super::q4_0::{LANES, tree4};
use super::q8act::Q8Activation;
use crate::quant::{Q6_K_BLOCK_BYTES, QK, QK_K, q6_k_code, q6_k_d, q6_k_scale};

/// Blocks of 32 in a super-block.
const BLOCKS: usize = QK_K / QK;

/// Scalar reference: a Q6_K row (`n/256` super-blocks of 210 bytes) ·
/// activation.
pub fn dot_q6_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (i, blk) in w.chunks_exact(Q6_K_BLOCK_BYTES).enumerate() {
        let d = q6_k_d(blk);
        for g in 0..BLOCKS {
            let b = i * BLOCKS + g;
            let q = &x.quants[b * QK..(b + 1) * QK];
            let half = |h: usize| -> i32 {
                (0..16)
                    .map(|l| q6_k_code(blk, 32 * g + 16 * h + l) * q[16 * h + l] as i32)
                    .sum()
            };
            let s = q6_k_scale(blk, 2 * g) * half(0) + q6_k_scale(blk, 2 * g + 1) * half(1);
            acc[b % LANES] = (d * x.scales[b]).mul_add(s as f32, acc[b % LANES]);
        }
    }
    tree4(acc)
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! # Safety
    //! Every function needs AVX2, FMA and F16C (the caller checked them at
    //! run time), `w` whole super-blocks and `x` of `w`'s length in
    //! elements.
    //!
    //! A super-block is taken a half (4 blocks, 8 sub-blocks of 16) at a
    //! time: each block's 16 pair sums `Σ code · q` (`maddubs` of the
    //! unsigned codes, exact: |·| ≤ 2 · 63 · 127), widened to 8 i32 lanes
    //! (lanes 0–3 its first sub-block, 4–7 its second); two rounds of
    //! `hadd` over the 4 blocks leave the 8 sub-block sums, which are
    //! multiplied by their scales at once and added in pairs into the 4
    //! block sums; less the codes' offset `32 · Σ sc·Σ q` (one `pmaddwd` of
    //! the scales against the activation's `bsums16`) they are the exact
    //! integers `s_b = Σ sc·Σ (code − 32)·q`, then converted and
    //! fused-added.

    use std::arch::x86_64::*;

    use super::super::q8act::Q8Activation;
    use super::BLOCKS;
    use crate::quant::{Q6_K_BLOCK_BYTES, Q6_K_D, Q6_K_QH, Q6_K_SCALES, QK};

    /// How far ahead of the super-block being read its bytes are asked of
    /// L2.
    const PREFETCH: usize = 4096;

    /// How far ahead they are asked of L1 as well (eight super-blocks):
    /// lines the L2 request has already sent for, so that the loads do not
    /// wait on L2's latency. The LM head's product (`cargo bench --bench
    /// kernels -- --format q6_k --batches 1`, 2 threads, the AMX Xeon VM)
    /// went from 73–74% of the read pass to 78–82% on this kernel, and
    /// from 82–89% to 95–100% on the AVX-512 one (docs/benchmarks.md,
    /// "The decode's tiles asked of L1 as well").
    pub(super) const NEAR: usize = 8 * Q6_K_BLOCK_BYTES;

    /// One block's 8 lane sums of `code · q` (lanes 0–3: its first 16
    /// elements, 4–7 its last 16) from its 32 unsigned codes (0..=63; pair
    /// sums at most 2 · 63 · 127, exact in 16 bits).
    #[inline(always)]
    unsafe fn block_lanes(codes: __m256i, q: *const i8) -> __m256i {
        // SAFETY: 32 quants at `q` (caller); register arithmetic under the
        // module's guarantee.
        unsafe {
            let xq = _mm256_loadu_si256(q as *const __m256i);
            _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq), _mm256_set1_epi16(1))
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q6_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        let supers = w.len() / Q6_K_BLOCK_BYTES;
        let (wp, qp) = (w.as_ptr(), x.quants.as_ptr());
        // SAFETY: super-blocks i < supers are read, with their 8 blocks of
        // quants and scales (module docs).
        unsafe {
            let m4 = _mm256_set1_epi8(0x0f);
            let m2 = _mm256_set1_epi8(0x30);
            // Sub-block scales in the order the hadd rounds leave the sums
            // of a half: sub-blocks 0, 2, 4, 6 of it in the low 128 bits,
            // 1, 3, 5, 7 in the high (each half's 8 scale bytes).
            let order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
            let mut acc = _mm_setzero_ps();
            for i in 0..supers {
                let blk = wp.add(i * Q6_K_BLOCK_BYTES);
                // The bytes 4 KiB ahead asked of L2 (a hint: it never
                // faults, past the row it reaches the task's next rows),
                // as the Q4_0 tile kernels do: one core's stream of
                // demand loads alone leaves memory idle on a server CPU.
                for line in 0..4 {
                    _mm_prefetch::<_MM_HINT_T1>(blk.wrapping_add(PREFETCH + 64 * line) as *const i8);
                }
                for line in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(NEAR + 64 * line) as *const i8);
                }
                let scales = _mm_shuffle_epi8(
                    _mm_loadu_si128(blk.add(Q6_K_SCALES) as *const __m128i),
                    order,
                );
                let dw = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([
                    *blk.add(Q6_K_D),
                    *blk.add(Q6_K_D + 1),
                ]) as i32)));
                let dw = _mm_set1_ps(dw);
                for n in 0..2 {
                    let ql0 = _mm256_loadu_si256(blk.add(64 * n) as *const __m256i);
                    let ql1 = _mm256_loadu_si256(blk.add(64 * n + 32) as *const __m256i);
                    let qh = _mm256_loadu_si256(blk.add(Q6_K_QH + 32 * n) as *const __m256i);
                    // The four blocks of this half: low nibbles of ql0, ql1,
                    // then high nibbles, with qh's bit pairs 0–1 .. 6–7 as
                    // bits 4–5 (16-bit shifts: the masks drop what crosses
                    // a byte).
                    let codes = [
                        _mm256_or_si256(
                            _mm256_and_si256(ql0, m4),
                            _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(ql1, m4),
                            _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                            _mm256_and_si256(qh, m2),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                        ),
                    ];
                    let q = qp.add((i * BLOCKS + 4 * n) * QK);
                    let v: [__m256i; 4] =
                        std::array::from_fn(|k| block_lanes(codes[k], q.add(k * QK)));
                    // Low 128 bits: sub-blocks 0, 2, 4, 6 of the half (each
                    // block's first), high: 1, 3, 5, 7.
                    let subs = _mm256_hadd_epi32(
                        _mm256_hadd_epi32(v[0], v[1]),
                        _mm256_hadd_epi32(v[2], v[3]),
                    );
                    let sc = _mm256_cvtepi8_epi32(if n == 0 {
                        scales
                    } else {
                        _mm_unpackhi_epi64(scales, scales)
                    });
                    let scaled = _mm256_mullo_epi32(subs, sc);
                    // The codes' offset: 32 · Σ sc·Σ q over each block's
                    // two sub-blocks, one `pmaddwd` of the half's 8 scales
                    // (in sub-block order) against the activation's sums of
                    // 16 quants.
                    let natural = _mm_loadl_epi64(blk.add(Q6_K_SCALES + 8 * n) as *const __m128i);
                    let sums16 = _mm_loadu_si128(
                        x.bsums16.as_ptr().add(2 * (i * BLOCKS + 4 * n)) as *const __m128i
                    );
                    let offset = _mm_madd_epi16(_mm_cvtepi8_epi16(natural), sums16);
                    let sums = _mm_cvtepi32_ps(_mm_sub_epi32(
                        _mm_add_epi32(
                            _mm256_castsi256_si128(scaled),
                            _mm256_extracti128_si256::<1>(scaled),
                        ),
                        _mm_slli_epi32::<5>(offset),
                    ));
                    let d = _mm_mul_ps(dw, _mm_loadu_ps(x.scales.as_ptr().add(i * BLOCKS + 4 * n)));
                    // Blocks 8i + 4n .. + 4 into lanes 0..4: block order
                    // within each lane.
                    acc = _mm_fmadd_ps(d, sums, acc);
                }
            }
            // (a0 + a2) + (a1 + a3), as `tree4`.
            let h2 = _mm_add_ps(acc, _mm_movehl_ps(acc, acc));
            _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)))
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    //! # Safety
    //! Every function needs AVX-512 F/BW/VL/VNNI, FMA and F16C (the
    //! caller checked them at run time), `w` whole super-blocks and `x` of
    //! `w`'s length in elements.
    //!
    //! A super-block at a time: its 256 codes in four registers of two
    //! blocks each (a half's 64 `ql` bytes as they lie, its 32 `qh` bytes
    //! in both 256-bit halves, shifted per half by `vpsllvw`/`vpsrlvw`),
    //! each against the two blocks' 64 activation quants as they lie by
    //! one `vpdpbusd` (the unsigned codes' four-product sums, exact). Two
    //! rounds of unpack-and-add leave the 16 sub-block sums, which one
    //! permutation orders as (even sub-blocks, odd ones) beside their
    //! scales; multiplied, the halves added and the codes' offset `32 ·
    //! Σ sc·Σ q` (a `pmaddwd` against the activation's `bsums16`) taken
    //! off, they are the 8 exact block integers, converted and fused-added
    //! into the 4 lanes blocks 0–3 then 4–7, as the reference adds them.
    //! The AVX2 kernel was compute-bound at about 19 GB/s of Q6_K a core,
    //! below the memory's rate (docs/benchmarks.md).

    use std::arch::x86_64::*;

    use super::super::q8act::Q8Activation;
    use super::BLOCKS;
    use crate::quant::{Q6_K_BLOCK_BYTES, Q6_K_D, Q6_K_QH, Q6_K_SCALES, QK};

    /// How far ahead of the super-block being read its bytes are asked of
    /// L2 and of L1 (as the AVX2 kernel).
    const PREFETCH: usize = 4096;
    use super::avx2::NEAR;

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    pub unsafe fn dot_q6_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        let supers = w.len() / Q6_K_BLOCK_BYTES;
        let (wp, qp) = (w.as_ptr(), x.quants.as_ptr());
        // SAFETY: super-blocks i < supers are read, with their 8 blocks of
        // quants, scales and sums of 16 (module docs); the rest is
        // register arithmetic under this function's target features.
        unsafe {
            let m4 = _mm512_set1_epi8(0x0f);
            let m2 = _mm512_set1_epi8(0x30);
            // qh's bit pairs to bits 4–5: blocks 4n + 0 | 4n + 1 (<< 4 | << 2)
            // and 4n + 2 | 4n + 3 (as they are | >> 2), per 256-bit half.
            let lo_shift = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
            let hi_shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
            // After the unpack rounds, dword 4j + m holds sub-block 4m + j;
            // gathered as the 8 even sub-blocks, then the 8 odd ones.
            let gather = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
            // The scale bytes in the same order: even sub-blocks, then odd.
            let split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            let mut acc = _mm_setzero_ps();
            for i in 0..supers {
                let blk = wp.add(i * Q6_K_BLOCK_BYTES);
                for line in 0..4 {
                    _mm_prefetch::<_MM_HINT_T1>(blk.wrapping_add(PREFETCH + 64 * line) as *const i8);
                }
                for line in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(NEAR + 64 * line) as *const i8);
                }
                let q = qp.add(i * BLOCKS * QK);
                let mut z = [_mm512_setzero_si512(); 4];
                for n in 0..2 {
                    let l = _mm512_loadu_si512(blk.add(64 * n) as *const __m512i);
                    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        blk.add(Q6_K_QH + 32 * n) as *const __m256i
                    ));
                    let lo = _mm512_or_si512(
                        _mm512_and_si512(l, m4),
                        _mm512_and_si512(_mm512_sllv_epi16(qh, lo_shift), m2),
                    );
                    let hi = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(l), m4),
                        _mm512_and_si512(_mm512_srlv_epi16(qh, hi_shift), m2),
                    );
                    // Blocks 4n, 4n + 1 and 4n + 2, 4n + 3: 64 quants each.
                    let q0 = _mm512_loadu_si512(q.add((4 * n) * QK) as *const __m512i);
                    let q1 = _mm512_loadu_si512(q.add((4 * n + 2) * QK) as *const __m512i);
                    z[2 * n] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, q0);
                    z[2 * n + 1] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, q1);
                }
                // z[m]'s 128-bit lane j: sub-block 4m + j's four sums.
                let u = _mm512_add_epi32(
                    _mm512_unpacklo_epi32(z[0], z[1]),
                    _mm512_unpackhi_epi32(z[0], z[1]),
                );
                let v = _mm512_add_epi32(
                    _mm512_unpacklo_epi32(z[2], z[3]),
                    _mm512_unpackhi_epi32(z[2], z[3]),
                );
                let subs =
                    _mm512_add_epi32(_mm512_unpacklo_epi64(u, v), _mm512_unpackhi_epi64(u, v));
                let subs = _mm512_permutexvar_epi32(gather, subs);
                let natural = _mm_loadu_si128(blk.add(Q6_K_SCALES) as *const __m128i);
                let sc = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(natural, split));
                let scaled = _mm512_mullo_epi32(subs, sc);
                let blocks = _mm256_add_epi32(
                    _mm512_castsi512_si256(scaled),
                    _mm512_extracti64x4_epi64::<1>(scaled),
                );
                let sums16 =
                    _mm256_loadu_si256(x.bsums16.as_ptr().add(2 * i * BLOCKS) as *const __m256i);
                let offset = _mm256_madd_epi16(_mm256_cvtepi8_epi16(natural), sums16);
                let exact =
                    _mm256_cvtepi32_ps(_mm256_sub_epi32(blocks, _mm256_slli_epi32::<5>(offset)));
                let dw = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                    u16::from_le_bytes([*blk.add(Q6_K_D), *blk.add(Q6_K_D + 1)]) as i32,
                ))));
                let d = _mm256_mul_ps(dw, _mm256_loadu_ps(x.scales.as_ptr().add(i * BLOCKS)));
                // Blocks 8i .. 8i + 4 into lanes 0..4, then 8i + 4 .. 8i + 8.
                acc = _mm_fmadd_ps(
                    _mm256_castps256_ps128(d),
                    _mm256_castps256_ps128(exact),
                    acc,
                );
                acc = _mm_fmadd_ps(
                    _mm256_extractf128_ps::<1>(d),
                    _mm256_extractf128_ps::<1>(exact),
                    acc,
                );
            }
            // (a0 + a2) + (a1 + a3), as `tree4`.
            let h2 = _mm_add_ps(acc, _mm_movehl_ps(acc, acc));
            _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::{dequantize_q6_k, quantize_q6_k};
    use rand::{Rng, SeedableRng};

    /// Random super-blocks: every code, every scale sign, finite `d`s.
    pub(crate) fn random_row(rng: &mut impl Rng, supers: usize) -> Vec<u8> {
        let mut w: Vec<u8> = (0..supers * Q6_K_BLOCK_BYTES)
            .map(|_| rng.random())
            .collect();
        for blk in w.chunks_exact_mut(Q6_K_BLOCK_BYTES) {
            let d = half::f16::from_f32(rng.random_range(-0.02f32..0.02));
            blk[Q6_K_BLOCK_BYTES - 2..].copy_from_slice(&d.to_bits().to_le_bytes());
        }
        w
    }

    #[test]
    fn the_integer_dot_is_close_to_the_exact_product() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(61);
        for supers in [1, 3, 8] {
            let n = supers * QK_K;
            let w = random_row(&mut rng, supers);
            let x: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let a = Q8Activation::quantize(&x);
            let mut wf = vec![0.0f32; n];
            dequantize_q6_k(&w, &mut wf);
            // The same products in f64 on the quantized activation: only
            // the f32 accumulation differs.
            let exact: f64 = (0..n)
                .map(|e| wf[e] as f64 * a.quants[e] as f64 * a.scales[e / QK] as f64)
                .sum();
            let mag: f64 = (0..n)
                .map(|e| (wf[e] as f64 * a.quants[e] as f64 * a.scales[e / QK] as f64).abs())
                .sum();
            let got = dot_q6_k_q8(&w, &a) as f64;
            assert!((got - exact).abs() <= 1e-5 * mag, "{got} vs {exact}");
            // And the quantized activation costs about what it costs Q4_0.
            let full: f64 = wf.iter().zip(&x).map(|(&w, &x)| w as f64 * x as f64).sum();
            assert!((got - full).abs() <= 0.02 * mag, "{got} vs {full}");
        }
    }

    #[test]
    fn the_vector_kernels_equal_the_reference_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(62);
        for k in crate::kernels::tests::simd_sets() {
            for supers in [1, 2, 5, 9] {
                let n = supers * QK_K;
                let w = random_row(&mut rng, supers);
                let mut x: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
                // Extremes: a block at ±127 everywhere, a zero block.
                for v in &mut x[..QK] {
                    *v = if rng.random() { 1.0 } else { -1.0 };
                }
                x[QK..2 * QK].fill(0.0);
                let a = Q8Activation::quantize(&x);
                assert_eq!(
                    (k.dot_q6_k_q8)(&w, &a).to_bits(),
                    dot_q6_k_q8(&w, &a).to_bits(),
                    "{} at {supers} super-blocks",
                    k.name
                );
            }
        }
    }

    #[test]
    fn extreme_codes_and_scales_stay_exact() {
        // Codes −32 and 31 under scales −128 and 127 against ±127 quants:
        // the largest integer sums a block can have.
        let mut w = vec![0u8; Q6_K_BLOCK_BYTES];
        w[..128].fill(0x00); // low bits 0: with qh 0, code −32
        for (j, s) in w[crate::quant::Q6_K_SCALES..crate::quant::Q6_K_D]
            .iter_mut()
            .enumerate()
        {
            *s = if j % 2 == 0 { 0x80 } else { 0x7f };
        }
        w[crate::quant::Q6_K_D..]
            .copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
        let x = vec![-1.0f32; QK_K];
        let a = Q8Activation::quantize(&x);
        // Each block: (−128 + 127) · 16 · (−32) · (−127) = −65024.
        let want = 8.0 * -65024.0 * a.scales[0];
        assert_eq!(dot_q6_k_q8(&w, &a), want);
        for k in crate::kernels::tests::simd_sets() {
            assert_eq!((k.dot_q6_k_q8)(&w, &a), want, "{}", k.name);
        }
        // A quantized row reads back through the same kernel.
        let v: Vec<f32> = (0..QK_K).map(|i| (i as f32 * 0.37).sin()).collect();
        let q = quantize_q6_k(&v).unwrap();
        let r = dot_q6_k_q8(&q, &Q8Activation::quantize(&v));
        let norm: f32 = v.iter().map(|x| x * x).sum();
        assert!((r - norm).abs() < 0.03 * norm, "{r} vs {norm}");
    }
}
