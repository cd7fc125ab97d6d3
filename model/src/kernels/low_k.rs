//! Q2_K, Q3_K and IQ4_XS weights (the Q2_K, Q3_K_S/M/L and IQ4_XS files;
//! see [`crate::quant::dequantize_q2_k`], [`crate::quant::dequantize_q3_k`]
//! and [`crate::quant::dequantize_iq4_xs`]) against activations quantized
//! to 8-bit blocks of 32 ([`Q8Activation`]), the arithmetic of the Q4_K
//! kernels ([`super::q4_k`]): activation block `b` (elements `32b .. 32b +
//! 32`, block `k = b mod 8` of super-block `b / 8`, scale `x.d_b`, quants
//! `a`) gives exact integers, which one or two f32 scales turn into its
//! term, added into accumulator lane `b mod 4`; the lanes are reduced as
//! `(a0 + a2) + (a1 + a3)` ([`tree4`]).
//!
//! - **Q2_K**: the block is sub-blocks `2k`, `2k + 1` of 16 (4-bit scale
//!   `sc`, 4-bit min `m` each), codes `q` in 0..=3. Element = `d·sc·q −
//!   dmin·m`, so with `Σ₀`, `Σ₁` over the block's two halves
//!   - `A_b = sc₀·Σ₀ q·a + sc₁·Σ₁ q·a` (|A_b| ≤ 2·15·16·3·127 < 2¹⁸),
//!   - `B_b = m₀·Σ₀ a + m₁·Σ₁ a` (|B_b| ≤ 15·32·127 < 2¹⁶),
//!
//!   both exact in i32 and in f32, and `t_b = fma(d·x.d_b, A_b,
//!   −((dmin·x.d_b)·B_b))` ([`super::q4_k::term`]): four roundings (the
//!   two scale products, the min term's product, the fused multiply-add),
//!   then `lane += t_b`.
//! - **Q3_K**: sub-blocks `2k`, `2k + 1` of 16, 6-bit signed scales `sc`
//!   (−32..=31), codes `q` in −4..=3. `A_b = sc₀·Σ₀ q·a + sc₁·Σ₁ q·a`
//!   (|A_b| ≤ 2·32·16·4·127 < 2²⁰: exact in f32); `lane = fma(d·x.d_b,
//!   A_b, lane)`: two roundings (the scale product and the fused
//!   multiply-add), as the Q6_K kernel ([`super::q6_k`]).
//! - **IQ4_XS**: the block is a sub-block (6-bit signed scale `ls`), codes
//!   `v` = [`IQ4_NL_VALUES`]`[nibble]` in −127..=113. `A_b = ls · Σ v·a`
//!   (|A_b| ≤ 32·32·127·127 = 16 516 096 < 2²⁴: exact in f32); `lane =
//!   fma(d·x.d_b, A_b, lane)`: two roundings.
//!
//! The scalar `dot_*_q8` functions are the references (a block's codes
//! decoded into an array first, so that the integer products vectorize
//! with the baseline SIMD, SSE2 or NEON); the AVX2 kernels ([`avx2`]) and
//! the AVX-512 VNNI ones ([`avx512`]) give their bits:
//! the integers are exact whichever way they are summed, and the f32
//! operations are the same ones in the same order.

use super::q4_0::{LANES, tree4};
use super::q4_k::term;
use super::q8act::Q8Activation;
use crate::format::f16_to_f32;
use crate::quant::{
    IQ4_NL_VALUES, IQ4_XS_BLOCK_BYTES, IQ4_XS_QS, Q2_K_BLOCK_BYTES, Q2_K_D, Q2_K_QS,
    Q3_K_BLOCK_BYTES, Q3_K_D, Q3_K_QS, Q3_K_SCALES, QK, QK_K, iq4_xs_scale, q3_k_scale,
};

/// Blocks of 32 in a super-block.
const BLOCKS: usize = QK_K / QK;

/// Elements of a Q2_K/Q3_K sub-block.
const SUB: usize = 16;

/// The little-endian f16 at `at` of a block.
#[inline(always)]
fn f16_at(blk: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([blk[at], blk[at + 1]]))
}

/// The 2-bit codes of block `k` (< 8) of a Q2_K/Q3_K super-block, from
/// its 64 code bytes `qs`: each half of 128 elements (4 blocks) takes 32
/// bytes, element `l` (< 32) of block `k` bits `2·(k mod 4)`, `2·(k mod
/// 4) + 1` of byte `32·(k / 4) + l` (ggml's layout).
#[inline(always)]
fn two_bits(qs: &[u8], k: usize) -> [i8; QK] {
    let bytes = &qs[QK * (k / 4)..][..QK];
    let shift = 2 * (k % 4);
    let mut codes = [0i8; QK];
    for (c, &byte) in codes.iter_mut().zip(bytes) {
        *c = ((byte >> shift) & 3) as i8;
    }
    codes
}

/// The Q3_K codes (−4..=3) of block `k` of a super-block: its 2-bit
/// codes, less 4 unless bit `k` of the element's byte of `hmask` (the
/// super-block's first 32 bytes, one per element `l` of a block) is set.
#[inline(always)]
fn q3_codes(blk: &[u8], k: usize) -> [i8; QK] {
    let mut codes = two_bits(&blk[Q3_K_QS..], k);
    for (c, &hmask) in codes.iter_mut().zip(&blk[..QK]) {
        let high = ((hmask >> k) & 1) as i8;
        *c -= 4 * (1 - high);
    }
    codes
}

/// `Σ code[l] · q[l]` (codes and quants of the same length; exact in i32
/// for the lengths and codes here, whatever the order of the sum).
#[inline(always)]
fn dot(codes: &[i8], q: &[i8]) -> i32 {
    codes
        .iter()
        .zip(q)
        .map(|(&c, &a)| i32::from(c) * i32::from(a))
        .sum()
}

/// [`IQ4_NL_VALUES`] of a byte's low and high nibbles, for every byte.
const IQ4_PAIRS: [[i8; 2]; 256] = {
    let mut pairs = [[0i8; 2]; 256];
    let mut byte = 0;
    while byte < 256 {
        pairs[byte] = [IQ4_NL_VALUES[byte & 0x0f], IQ4_NL_VALUES[byte >> 4]];
        byte += 1;
    }
    pairs
};

/// Scalar reference: a Q2_K row (`n/256` super-blocks of 84 bytes) ·
/// activation.
pub fn dot_q2_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (i, blk) in w.chunks_exact(Q2_K_BLOCK_BYTES).enumerate() {
        let (d, dmin) = (f16_at(blk, Q2_K_D), f16_at(blk, Q2_K_D + 2));
        let qs = &blk[Q2_K_QS..Q2_K_D];
        for k in 0..BLOCKS {
            let b = i * BLOCKS + k;
            let codes = two_bits(qs, k);
            let q = &x.quants[b * QK..][..QK];
            let (mut a, mut s) = (0i32, 0i32);
            for h in 0..2 {
                let j = 2 * k + h;
                let (sc, m) = (i32::from(blk[j] & 0x0f), i32::from(blk[j] >> 4));
                let (c, q) = (&codes[SUB * h..][..SUB], &q[SUB * h..][..SUB]);
                a += sc * dot(c, q);
                s += m * q.iter().map(|&a| i32::from(a)).sum::<i32>();
            }
            acc[b % LANES] += term(d, dmin, x.scales[b], a, s);
        }
    }
    tree4(acc)
}

/// Scalar reference: a Q3_K row (`n/256` super-blocks of 110 bytes) ·
/// activation.
pub fn dot_q3_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (i, blk) in w.chunks_exact(Q3_K_BLOCK_BYTES).enumerate() {
        let d = f16_at(blk, Q3_K_D);
        let scales = &blk[Q3_K_SCALES..Q3_K_D];
        for k in 0..BLOCKS {
            let b = i * BLOCKS + k;
            let codes = q3_codes(blk, k);
            let q = &x.quants[b * QK..][..QK];
            let mut a = 0i32;
            for h in 0..2 {
                let (c, q) = (&codes[SUB * h..][..SUB], &q[SUB * h..][..SUB]);
                a += q3_k_scale(scales, 2 * k + h) * dot(c, q);
            }
            acc[b % LANES] = (d * x.scales[b]).mul_add(a as f32, acc[b % LANES]);
        }
    }
    tree4(acc)
}

/// Scalar reference: an IQ4_XS row (`n/256` super-blocks of 136 bytes) ·
/// activation.
pub fn dot_iq4_xs_q8(w: &[u8], x: &Q8Activation) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (i, blk) in w.chunks_exact(IQ4_XS_BLOCK_BYTES).enumerate() {
        let d = f16_at(blk, 0);
        // Block k's 16 bytes: element l in the low nibble of byte l,
        // element l + 16 in its high one. The whole super-block's values
        // first: decoded a block at a time, LLVM folds the lookups into
        // the products and leaves them scalar.
        let mut values = [0i8; QK_K];
        let qs = blk[IQ4_XS_QS..].chunks_exact(QK / 2);
        for (v, qs) in values.chunks_exact_mut(QK).zip(qs) {
            let (lo, hi) = v.split_at_mut(QK / 2);
            for ((lo, hi), &byte) in lo.iter_mut().zip(hi).zip(qs) {
                [*lo, *hi] = IQ4_PAIRS[usize::from(byte)];
            }
        }
        for k in 0..BLOCKS {
            let b = i * BLOCKS + k;
            let q = &x.quants[b * QK..][..QK];
            let a = iq4_xs_scale(blk, k) * dot(&values[QK * k..][..QK], q);
            acc[b % LANES] = (d * x.scales[b]).mul_add(a as f32, acc[b % LANES]);
        }
    }
    tree4(acc)
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! # Safety
    //! Every function needs AVX2, FMA and F16C (the caller checked them at
    //! run time), `w` whole super-blocks and every activation of `w`'s
    //! length in elements (IQ4_XS's `split` quants and Q2_K's and Q3_K's
    //! `bsums16` included); the
    //! several-token kernels at most
    //! [`MULTI`](crate::kernels::q8act::MULTI) activations and an output
    //! for each.
    //!
    //! Each kernel is written once for `N` activations (the single-token
    //! kernels are `N = 1`): a super-block's codes and scales are decoded
    //! once and met by every activation's quants, each activation's
    //! integers, terms and lanes its own, the same operations in the same
    //! order as for one activation, so result `t` is the single-token
    //! kernel's for `xs[t]`.
    //!
    //! Q2_K and Q3_K take a super-block a half (4 blocks, 8 sub-blocks of
    //! 16) at a time, as the Q6_K kernel: each block's 32 codes are one
    //! vector; `maddubs` with its quants (pairs exact: |·| ≤ 2·7·127) and
    //! `madd` by ones leave 8 i32 lanes (0–3 its first sub-block, 4–7 its
    //! second); two rounds of `hadd` over the 4 blocks leave the 8
    //! sub-block sums (first sub-blocks in the low 128 bits, second ones in
    //! the high), multiplied by their scales at once (`vpmulld`) and the
    //! halves added: the 4 blocks' `A_b`. Q2_K's `B_b` is its 8 mins
    //! (16-bit lanes) against the activation's sums of 16 quants
    //! (`bsums16`): one `pmaddwd`. Q3_K's signed codes
    //! are taken as `u = q + 4` (0..=7): `A_b` from `maddubs(u, a)` as
    //! above, less `4 · Σ sc·Σ a`, one `pmaddwd` of the scales against
    //! `bsums16`.
    //!
    //! IQ4_XS takes two blocks per 32 bytes of nibbles: the low nibbles
    //! (each block's first 16 elements) and the high ones are looked up by
    //! `pshufb`, multiplied by the quants of the two blocks' first (or
    //! last) 16 elements, side by side in the activation's `split` copy,
    //! with the sign trick (`maddubs(|v|, sign(a, v))`, pairs ≤ 2·127·127 < 2¹⁵); three
    //! `hadd`s leave the 8 block sums.
    //!
    //! All integers are exact, so they equal the reference's; the f32
    //! steps are the reference's, lane for lane, blocks 0–3 before 4–7.

    use std::arch::x86_64::*;

    use super::super::q8act::{Q8Activation, Tokens, by_count};
    use super::BLOCKS;
    use crate::quant::{
        IQ4_NL_VALUES, IQ4_XS_BLOCK_BYTES, IQ4_XS_QS, IQ4_XS_SCALES_L, Q2_K_BLOCK_BYTES, Q2_K_D,
        Q2_K_QS, Q3_K_BLOCK_BYTES, Q3_K_D, Q3_K_QS, Q3_K_SCALES, QK,
    };

    /// How far ahead of the super-block being read its bytes are asked of
    /// L2 (as the Q4_K and Q6_K kernels do).
    const PREFETCH: usize = 4096;

    /// Asks L2 for the `lines` cache lines `PREFETCH` bytes past `blk`.
    #[inline(always)]
    pub(super) fn prefetch(blk: *const u8, lines: usize) {
        for line in 0..lines {
            // SAFETY: a hint: it never faults (past the row it reaches
            // the task's next rows); SSE per the module contract.
            unsafe {
                _mm_prefetch::<_MM_HINT_T1>(blk.wrapping_add(PREFETCH + 64 * line) as *const i8)
            };
        }
    }

    /// The 8 sub-block sums of 4 blocks' lane sums (each: lanes 0–3 its
    /// first sub-block, 4–7 its second): blocks 0–3's first sub-blocks in
    /// the low 128 bits, their second ones in the high.
    #[inline(always)]
    fn sub_sums(v: &[__m256i; 4]) -> __m256i {
        // SAFETY: register arithmetic; AVX2 per the module contract (the
        // callers are `target_feature` functions, and this is inlined).
        unsafe { _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3])) }
    }

    /// Sub-block sums (as [`sub_sums`] leaves them) times their scales,
    /// each block's two added: the 4 blocks' exact integers.
    #[inline(always)]
    fn scaled(subs: __m256i, scales: __m256i) -> __m128i {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let p = _mm256_mullo_epi32(subs, scales);
            _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256::<1>(p))
        }
    }

    /// `v` shifted right by `2s` bits in each 16-bit lane (`s` < 4 a
    /// constant once inlined): block `4n + s`'s codes in bits 0–1.
    #[inline(always)]
    fn shift2(v: __m256i, s: usize) -> __m256i {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            match s {
                0 => v,
                1 => _mm256_srli_epi16::<2>(v),
                2 => _mm256_srli_epi16::<4>(v),
                _ => _mm256_srli_epi16::<6>(v),
            }
        }
    }

    /// Sub-block scales in the order [`sub_sums`] leaves a half's sums
    /// (sub-blocks 0, 2, 4, 6 of the half, then 1, 3, 5, 7), as bytes: the
    /// first half's 8 in the low 64 bits, the second's in the high.
    #[inline(always)]
    fn order(scales: __m128i) -> __m128i {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
            _mm_shuffle_epi8(scales, order)
        }
    }

    /// Half `n`'s 8 byte scales of [`order`] as i32 lanes (`signed`: as
    /// i8, else as u8).
    #[inline(always)]
    fn widen(scales: __m128i, n: usize, signed: bool) -> __m256i {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let s = if n == 0 {
                scales
            } else {
                _mm_unpackhi_epi64(scales, scales)
            };
            if signed {
                _mm256_cvtepi8_epi32(s)
            } else {
                _mm256_cvtepu8_epi32(s)
            }
        }
    }

    /// The f16 at `p` as f32 lanes (the 4 bytes from `p` read: `d` in lane
    /// 0, the next f16 in lane 1).
    #[inline(always)]
    pub(super) unsafe fn halves(p: *const u8) -> __m128 {
        // SAFETY: 4 bytes at `p` (caller); F16C per the module contract.
        unsafe {
            let bits = u32::from_le_bytes(std::ptr::read_unaligned(p as *const [u8; 4]));
            _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))
        }
    }

    /// `acc + d·a` over 8 blocks in two 4-lane steps, blocks 0–3 first:
    /// block `b`'s term lands in lane `b mod 4`, as the module's order asks.
    #[inline(always)]
    pub(super) fn fma_halves(acc: __m128, d: __m256, a: __m256) -> __m128 {
        // SAFETY: register arithmetic under the module's guarantee (FMA).
        unsafe {
            let acc = _mm_fmadd_ps(_mm256_castps256_ps128(d), _mm256_castps256_ps128(a), acc);
            _mm_fmadd_ps(
                _mm256_extractf128_ps::<1>(d),
                _mm256_extractf128_ps::<1>(a),
                acc,
            )
        }
    }

    /// The 4 lanes' final reduction, `(a0 + a2) + (a1 + a3)` as `tree4`.
    #[inline(always)]
    pub(super) fn reduce(acc: __m128) -> f32 {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let h2 = _mm_add_ps(acc, _mm_movehl_ps(acc, acc));
            _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)))
        }
    }

    /// Q2_K for `N` activations: each half super-block's codes are split
    /// into its 4 blocks' registers and its scales and mins widened once,
    /// then met by every activation's quants.
    struct Q2K;

    impl Tokens for Q2K {
        #[inline(always)]
        unsafe fn run<const N: usize>(w: &[u8], xs: &[&Q8Activation; N]) -> [f32; N] {
            let supers = w.len() / Q2_K_BLOCK_BYTES;
            let wp = w.as_ptr();
            // SAFETY: super-blocks i < supers are read (84 bytes each: 16
            // of scales, 64 of codes at Q2_K_QS, d and dmin at Q2_K_D),
            // with their 8 blocks of every activation's quants and scales
            // and 16 sums of 16 (module docs).
            unsafe {
                let m3 = _mm256_set1_epi8(3);
                let m4 = _mm_set1_epi8(0x0f);
                let ones16 = _mm256_set1_epi16(1);
                let mut acc = [_mm_setzero_ps(); N];
                for i in 0..supers {
                    let blk = wp.add(i * Q2_K_BLOCK_BYTES);
                    prefetch(blk, 2);
                    let raw = _mm_loadu_si128(blk as *const __m128i);
                    let sc = _mm_and_si128(order(raw), m4);
                    // The mins in sub-block order, as bytes.
                    let mn = _mm_and_si128(_mm_srli_epi16::<4>(raw), m4);
                    let dd = halves(blk.add(Q2_K_D));
                    let d = _mm_broadcastss_ps(dd);
                    let dmin = _mm_shuffle_ps::<0b01_01_01_01>(dd, dd);
                    for n in 0..2 {
                        let codes = _mm256_loadu_si256(blk.add(Q2_K_QS + 32 * n) as *const __m256i);
                        let mut c = [_mm256_setzero_si256(); 4];
                        for (s, c) in c.iter_mut().enumerate() {
                            *c = _mm256_and_si256(shift2(codes, s), m3);
                        }
                        let scs = widen(sc, n, false);
                        // Sub-blocks 8n .. 8n + 8's mins as 16-bit lanes.
                        let mins =
                            _mm_cvtepu8_epi16(if n == 0 { mn } else { _mm_srli_si128::<8>(mn) });
                        for (x, acc) in xs.iter().zip(acc.iter_mut()) {
                            let q = x.quants.as_ptr().add((i * BLOCKS + 4 * n) * QK);
                            let mut dots = [_mm256_setzero_si256(); 4];
                            for (s, dot) in dots.iter_mut().enumerate() {
                                let xq = _mm256_loadu_si256(q.add(QK * s) as *const __m256i);
                                *dot = _mm256_madd_epi16(_mm256_maddubs_epi16(c[s], xq), ones16);
                            }
                            let a = scaled(sub_sums(&dots), scs);
                            // B_b from the activation's sums of 16 quants.
                            let sums =
                                _mm_loadu_si128(x.bsums16.as_ptr().add(2 * BLOCKS * i + 8 * n)
                                    as *const __m128i);
                            let b = _mm_madd_epi16(mins, sums);
                            let xd = _mm_loadu_ps(x.scales.as_ptr().add(i * BLOCKS + 4 * n));
                            // t = fma(d·xd, A, −((dmin·xd)·B)), one rounding each.
                            let t = _mm_fmsub_ps(
                                _mm_mul_ps(d, xd),
                                _mm_cvtepi32_ps(a),
                                _mm_mul_ps(_mm_mul_ps(dmin, xd), _mm_cvtepi32_ps(b)),
                            );
                            *acc = _mm_add_ps(*acc, t);
                        }
                    }
                }
                reduce_all(acc)
            }
        }
    }

    /// Every activation's lanes reduced by [`reduce`] (a loop: a closure
    /// handed to `array::map` may be left out of line, taking its vectors
    /// through memory).
    #[inline(always)]
    pub(super) fn reduce_all<const N: usize>(acc: [__m128; N]) -> [f32; N] {
        let mut out = [0.0f32; N];
        for (o, a) in out.iter_mut().zip(acc) {
            *o = reduce(a);
        }
        out
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q2_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract.
        unsafe { Q2K::run::<1>(w, &[x])[0] }
    }

    /// Up to [`MULTI`](crate::kernels::q8act::MULTI) activations against one Q2_K row: `out[t]` is
    /// [`dot_q2_k_q8`]`(w, xs[t])`, bit for bit.
    ///
    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q2_k_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: the module contract.
        unsafe { by_count::<Q2K>(w, xs, out) }
    }

    /// Bit `k` (< 8) of each byte of `hm` as 4 (bit 2), else 0. 16-bit
    /// shifts: bit 2 of a byte comes from bit `k` of the same byte.
    #[inline(always)]
    fn high_bit(hm: __m256i, k: usize) -> __m256i {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let v = match k {
                0 => _mm256_slli_epi16::<2>(hm),
                1 => _mm256_slli_epi16::<1>(hm),
                2 => hm,
                3 => _mm256_srli_epi16::<1>(hm),
                4 => _mm256_srli_epi16::<2>(hm),
                5 => _mm256_srli_epi16::<3>(hm),
                6 => _mm256_srli_epi16::<4>(hm),
                _ => _mm256_srli_epi16::<5>(hm),
            };
            _mm256_and_si256(v, _mm256_set1_epi8(4))
        }
    }

    /// A Q3_K super-block's 16 scales (−32..=31) as bytes, in sub-block
    /// order, from its 12 packed bytes at `s` (ggml's layout: the low
    /// nibbles of bytes 0–7 are sub-blocks 0–7's low 4 bits, the high
    /// nibbles 8–15's; bits `2·(j / 4)`, `2·(j / 4) + 1` of byte `8 + j mod
    /// 4` their high 2).
    #[inline(always)]
    pub(super) unsafe fn q3_scales(s: *const u8) -> __m128i {
        // SAFETY: 12 bytes at `s` (caller); SSE2 per the module contract.
        unsafe { _mm_sub_epi8(q3_scales_raw(s), _mm_set1_epi8(32)) }
    }

    /// [`q3_scales`] before the 32 is taken off: the raw 6-bit fields
    /// (0..=63).
    #[inline(always)]
    pub(super) unsafe fn q3_scales_raw(s: *const u8) -> __m128i {
        // SAFETY: 12 bytes at `s` (caller); SSE2 per the module contract.
        unsafe {
            let word = |k: usize| {
                u32::from_le_bytes(std::ptr::read_unaligned(s.add(4 * k) as *const [u8; 4]))
            };
            let (w0, w1, w2) = (word(0), word(1), word(2));
            let (lo, hi2) = (0x0f0f_0f0f, 0x0303_0303);
            let part = |low: u32, high: u32| low & lo | (high & hi2) << 4;
            _mm_setr_epi32(
                part(w0, w2) as i32,
                part(w1, w2 >> 2) as i32,
                part(w0 >> 4, w2 >> 4) as i32,
                part(w1 >> 4, w2 >> 6) as i32,
            )
        }
    }

    /// Q3_K for `N` activations: each half super-block's codes (with their
    /// hmask bits) become its 4 blocks' `u = q + 4` registers once, then
    /// meet every activation's quants.
    struct Q3K;

    impl Tokens for Q3K {
        #[inline(always)]
        unsafe fn run<const N: usize>(w: &[u8], xs: &[&Q8Activation; N]) -> [f32; N] {
            let supers = w.len() / Q3_K_BLOCK_BYTES;
            let wp = w.as_ptr();
            // SAFETY: super-blocks i < supers are read (110 bytes each: 32
            // of hmask, 64 of codes at Q3_K_QS, 12 of scales at
            // Q3_K_SCALES, d at Q3_K_D), with their 8 blocks of every
            // activation's quants and scales and 16 sums of 16 (module
            // docs).
            unsafe {
                let m3 = _mm256_set1_epi8(3);
                let ones16 = _mm256_set1_epi16(1);
                let mut acc = [_mm_setzero_ps(); N];
                for i in 0..supers {
                    let blk = wp.add(i * Q3_K_BLOCK_BYTES);
                    prefetch(blk, 2);
                    let natural = q3_scales(blk.add(Q3_K_SCALES));
                    let sc = order(natural);
                    // d is a super-block's last 2 bytes: read with the 2
                    // before it (scale bytes), it is lane 1.
                    let dd = halves(blk.add(Q3_K_D - 2));
                    let d = _mm_shuffle_ps::<0b01_01_01_01>(dd, dd);
                    let hm = _mm256_loadu_si256(blk as *const __m256i);
                    for n in 0..2 {
                        let codes = _mm256_loadu_si256(blk.add(Q3_K_QS + 32 * n) as *const __m256i);
                        let mut u = [_mm256_setzero_si256(); 4];
                        for (s, u) in u.iter_mut().enumerate() {
                            *u = _mm256_or_si256(
                                _mm256_and_si256(shift2(codes, s), m3),
                                high_bit(hm, 4 * n + s),
                            );
                        }
                        let scs = widen(sc, n, true);
                        // Sub-blocks 8n .. 8n + 8's scales as 16-bit lanes.
                        let sc16 = _mm_cvtepi8_epi16(if n == 0 {
                            natural
                        } else {
                            _mm_srli_si128::<8>(natural)
                        });
                        for (x, acc) in xs.iter().zip(acc.iter_mut()) {
                            let q = x.quants.as_ptr().add((i * BLOCKS + 4 * n) * QK);
                            let mut dots = [_mm256_setzero_si256(); 4];
                            for (s, dot) in dots.iter_mut().enumerate() {
                                let xq = _mm256_loadu_si256(q.add(QK * s) as *const __m256i);
                                *dot = _mm256_madd_epi16(_mm256_maddubs_epi16(u[s], xq), ones16);
                            }
                            // Σ sc·Σ u·a, less the 4 in u: 4·Σ sc·Σ a over
                            // the activation's sums of 16 quants.
                            let sums =
                                _mm_loadu_si128(x.bsums16.as_ptr().add(2 * BLOCKS * i + 8 * n)
                                    as *const __m128i);
                            let a = _mm_sub_epi32(
                                scaled(sub_sums(&dots), scs),
                                _mm_slli_epi32::<2>(_mm_madd_epi16(sc16, sums)),
                            );
                            let xd = _mm_loadu_ps(x.scales.as_ptr().add(i * BLOCKS + 4 * n));
                            *acc = _mm_fmadd_ps(_mm_mul_ps(d, xd), _mm_cvtepi32_ps(a), *acc);
                        }
                    }
                }
                reduce_all(acc)
            }
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q3_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract.
        unsafe { Q3K::run::<1>(w, &[x])[0] }
    }

    /// Up to [`MULTI`](crate::kernels::q8act::MULTI) activations against one Q3_K row: `out[t]` is
    /// [`dot_q3_k_q8`]`(w, xs[t])`, bit for bit.
    ///
    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q3_k_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: the module contract.
        unsafe { by_count::<Q3K>(w, xs, out) }
    }

    /// IQ4_XS for `N` activations: each pair of blocks' values (and their
    /// magnitudes) are looked up once, then meet every activation's
    /// quants, read from its `split` copy (the two blocks' first 16
    /// quants side by side, as the nibbles lie).
    struct Iq4Xs;

    impl Tokens for Iq4Xs {
        #[inline(always)]
        unsafe fn run<const N: usize>(w: &[u8], xs: &[&Q8Activation; N]) -> [f32; N] {
            let supers = w.len() / IQ4_XS_BLOCK_BYTES;
            let wp = w.as_ptr();
            // SAFETY: super-blocks i < supers are read (136 bytes each: d,
            // scales_h, 4 bytes of scales_l, 128 of nibbles at IQ4_XS_QS),
            // with their 8 blocks of every activation's split quants (2
            // groups of 4 blocks, 128 bytes each) and scales (module docs).
            unsafe {
                let m4 = _mm256_set1_epi8(0x0f);
                let ones16 = _mm256_set1_epi16(1);
                let values = IQ4_NL_VALUES;
                let table =
                    _mm256_broadcastsi128_si256(_mm_loadu_si128(values.as_ptr() as *const __m128i));
                // The order the hadd rounds leave the block sums in: blocks
                // 0, 2, 4, 6, then 1, 3, 5, 7; `back` undoes it.
                let shifts = _mm256_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14);
                let back = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
                let zero = _mm256_setzero_si256();
                let mut acc = [_mm_setzero_ps(); N];
                for i in 0..supers {
                    let blk = wp.add(i * IQ4_XS_BLOCK_BYTES);
                    prefetch(blk, 3);
                    // Scales in that order: the low nibbles of scales_l are
                    // blocks 0, 2, 4, 6, the high ones 1, 3, 5, 7; block
                    // j's high bits are bits 2j, 2j + 1 of scales_h.
                    let dh = halves(blk);
                    let l = u32::from_le_bytes(std::ptr::read_unaligned(
                        blk.add(IQ4_XS_SCALES_L) as *const [u8; 4]
                    ));
                    let low = (l & 0x0f0f_0f0f) as u64 | (((l >> 4) & 0x0f0f_0f0f) as u64) << 32;
                    let h = u16::from_le_bytes([*blk.add(2), *blk.add(3)]) as i32;
                    let high = _mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_set1_epi32(h), shifts),
                        _mm256_set1_epi32(3),
                    );
                    let ls = _mm256_sub_epi32(
                        _mm256_or_si256(
                            _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(low as i64)),
                            _mm256_slli_epi32::<4>(high),
                        ),
                        _mm256_set1_epi32(32),
                    );
                    let d = _mm256_broadcastss_ps(dh);
                    // Per activation, the first hadd round of pairs (0, 1)
                    // and of pairs (2, 3).
                    let mut hs = [[zero; 2]; N];
                    for half in 0..2 {
                        let mut v = [[zero; 2]; N];
                        for r in 0..2 {
                            // Blocks 2c (low 128 bits) and 2c + 1 (high).
                            let c = 2 * half + r;
                            let qs =
                                _mm256_loadu_si256(blk.add(IQ4_XS_QS + 32 * c) as *const __m256i);
                            let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(qs, m4));
                            let hi = _mm256_shuffle_epi8(
                                table,
                                _mm256_and_si256(_mm256_srli_epi16::<4>(qs), m4),
                            );
                            let (lo_mag, hi_mag) = (_mm256_abs_epi8(lo), _mm256_abs_epi8(hi));
                            // Split group 2i + half: blocks 2c, 2c + 1's
                            // first halves at 32r, their last 64 on.
                            let at = (2 * i + half) * 128 + 32 * r;
                            for (x, v) in xs.iter().zip(v.iter_mut()) {
                                let sp = x.split.as_ptr().add(at);
                                let xl = _mm256_loadu_si256(sp as *const __m256i);
                                let xh = _mm256_loadu_si256(sp.add(64) as *const __m256i);
                                let pl = _mm256_maddubs_epi16(lo_mag, _mm256_sign_epi8(xl, lo));
                                let ph = _mm256_maddubs_epi16(hi_mag, _mm256_sign_epi8(xh, hi));
                                v[r] = _mm256_add_epi32(
                                    _mm256_madd_epi16(pl, ones16),
                                    _mm256_madd_epi16(ph, ones16),
                                );
                            }
                        }
                        for (h, v) in hs.iter_mut().zip(&v) {
                            h[half] = _mm256_hadd_epi32(v[0], v[1]);
                        }
                    }
                    for ((x, h), acc) in xs.iter().zip(&hs).zip(acc.iter_mut()) {
                        let sums = _mm256_hadd_epi32(h[0], h[1]);
                        let a = _mm256_permutevar8x32_epi32(_mm256_mullo_epi32(sums, ls), back);
                        let a = _mm256_cvtepi32_ps(a);
                        let d =
                            _mm256_mul_ps(d, _mm256_loadu_ps(x.scales.as_ptr().add(i * BLOCKS)));
                        *acc = fma_halves(*acc, d, a);
                    }
                }
                reduce_all(acc)
            }
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq4_xs_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract.
        unsafe { Iq4Xs::run::<1>(w, &[x])[0] }
    }

    /// Up to [`MULTI`](crate::kernels::q8act::MULTI) activations against one IQ4_XS row: `out[t]` is
    /// [`dot_iq4_xs_q8`]`(w, xs[t])`, bit for bit.
    ///
    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq4_xs_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: the module contract.
        unsafe { by_count::<Iq4Xs>(w, xs, out) }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    //! # Safety
    //! Every function needs AVX-512 F, BW, VL, VNNI and VBMI, AVX2, FMA and
    //! F16C, and the Q3_K kernels GFNI too (the caller checked them at run
    //! time); `w` whole super-blocks and every activation of `w`'s length
    //! in elements (its `split` quants, `bsums8` and `bsums16` included); the
    //! several-token kernels at most
    //! [`MULTI`](crate::kernels::q8act::MULTI) activations and an output
    //! for each.
    //!
    //! As in [`super::avx2`], each kernel is written once for `N`
    //! activations (the single-token kernels are `N = 1`): a super-block's
    //! table bytes are built once and met by every activation's quants,
    //! each activation's sums, terms and lanes its own.
    //!
    //! A super-block is taken through the activation's `split` layout: its
    //! 256 quants are 4 vectors `S_t` (t = 2n + h) whose 128-bit lane `k`
    //! holds half `h` (16 quants) of block `4n + k`, that is sub-block `j =
    //! 8n + 2k + h`. The codes of `S_t`'s lane `k` are bits `2k`, `2k + 1`
    //! of the 16 code bytes at `16t`, so lane `k` of every vector is one
    //! sub-block, and `S_{2n}`, `S_{2n+1}` both cover blocks `4n .. 4n + 4`:
    //! one `vpdpbusd` accumulator per `n` sums block `4n + k`'s products in
    //! lane `k`, with the sub-block scale already in the unsigned byte
    //! `vpdpbusd` takes, looked up in a table built once per super-block
    //! (one `vpmulld` of the scales by constant bytes; no carries, as every
    //! byte of the products is in 0..=255).
    //!
    //! - **Q2_K**: the table is `sc_j · code` at byte `4j + code` (≤ 45),
    //!   looked up by `vpermb` with the codes (`vpsrlvw` by `2k`, per lane)
    //!   or'ed with `4j`: `A_b`. `B_b` is the mins (widened to 16 bits,
    //!   sub-block order) against the activation's sums of 16 quants
    //!   (`bsums16`): one `vpmaddwd` gives the 8 blocks' `B_b` in order.
    //! - **Q3_K**: `q` = code − 4 unless the hmask bit is set (then code),
    //!   `sc` signed. The byte is `128 − sc·q` (0..=252), at byte `u` of
    //!   qword `j` with `u = q + 4` (8 bytes a sub-block: lane `k` of the
    //!   table of `n` holds sub-blocks `8n + 2k`, `8n + 2k + 1`, looked up
    //!   by `vpshufb`), built from the raw 6-bit scales spread to their
    //!   qwords by one `vpermb` (the −32 folded into the constants). The
    //!   index: the hmask bytes' bits permuted once per half (a
    //!   `vgf2p8affineqb`), so that hmask bits `k`, `4 + k` sit off lane
    //!   `k`'s code bits `2k`, `2k + 1`; one bit-select (`vpternlogd`)
    //!   merges them into the code bytes and one `vgf2p8affineqb` moves the
    //!   code bits to bits 0–1, hmask bit `4n + k` to bit 2 and adds `8h`.
    //!   The block's sum is then `128 · Σ a − A_b`, and `128 · Σ a` is `16
    //!   · bsums8` (a shift, not a multiply).
    //! - **IQ4_XS**: block `4n + k`'s 16 nibble bytes are lane `k` of the
    //!   64 bytes at `64n` of the nibbles, its low nibbles half 0 and its
    //!   high ones half 1, just as `S_{2n}`, `S_{2n+1}` lie: `vpermb` of
    //!   those bytes (and of them shifted right by 4 bits) in a 64-byte
    //!   table of the values + 128 (1..=241, the table repeating every 16
    //!   bytes, so the index bits above the nibble do not matter) gives the
    //!   unsigned bytes. The block's sum is `Σ v·a + 128 · Σ a`; less `16 ·
    //!   bsums8` it is `Σ v·a`, times the 6-bit scale less 32 (`vpmulld`;
    //!   the 8 raw scales gathered from the super-block's first 8 bytes by
    //!   one `vpmultishiftqb`): `A_b`.
    //!
    //! All integers are exact, so they equal the reference's. Two rounds of
    //! unpack-and-add leave each block's sum in one 32-bit lane, permuted
    //! to block order; the f32 steps are then the
    //! reference's, lane for lane, blocks 0–3 before 4–7, as the AVX2
    //! kernels do them.

    use std::arch::x86_64::*;

    use super::super::q8act::{Q8Activation, Tokens, by_count};
    use super::BLOCKS;
    use super::avx2::{fma_halves, halves, prefetch, q3_scales_raw, reduce_all};
    use crate::quant::{
        IQ4_NL_VALUES, IQ4_XS_BLOCK_BYTES, IQ4_XS_QS, Q2_K_BLOCK_BYTES, Q2_K_D, Q2_K_QS,
        Q3_K_BLOCK_BYTES, Q3_K_D, Q3_K_QS, Q3_K_SCALES, QK_K,
    };

    /// Sub-block `j` of lane `k` of `S_t`.
    const fn sub(t: usize, k: usize) -> usize {
        8 * (t / 2) + 2 * k + t % 2
    }

    /// 64 bytes whose lane `k` (16 bytes) is `f(k)` throughout.
    const fn lanes(f: [u8; 4]) -> [u8; 64] {
        let mut v = [0u8; 64];
        let mut e = 0;
        while e < 64 {
            v[e] = f[e / 16];
            e += 1;
        }
        v
    }

    /// Per lane `k` of `S_t`, every byte `times · sub(t, k)`.
    const fn sub_lanes(t: usize, times: usize) -> [u8; 64] {
        let s = [sub(t, 0), sub(t, 1), sub(t, 2), sub(t, 3)];
        lanes([
            (times * s[0]) as u8,
            (times * s[1]) as u8,
            (times * s[2]) as u8,
            (times * s[3]) as u8,
        ])
    }

    /// Per lane `k` of `S_t`: `4·sub(t, k)`, the table index of its codes.
    const OFFSETS: [[u8; 64]; 4] = [
        sub_lanes(0, 4),
        sub_lanes(1, 4),
        sub_lanes(2, 4),
        sub_lanes(3, 4),
    ];

    /// Per lane `k`: `2k`, the shift of its codes (bytes; as 16-bit
    /// counts, the high byte 0).
    const SHIFTS: [u8; 64] = {
        let mut v = lanes([0, 2, 4, 6]);
        let mut e = 1;
        while e < 64 {
            v[e] = 0;
            e += 2;
        }
        v
    };

    /// Where the two unpack rounds leave block `b`'s sum (lane `k` of the
    /// result holds blocks `k`, `4 + k`, then the third and fourth
    /// inputs' `k`, `4 + k`): blocks 0–7, then the others'.
    const BACK: [i32; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];

    /// A constant's 64 bytes.
    #[inline(always)]
    fn load(v: &[u8; 64]) -> __m512i {
        // SAFETY: 64 bytes at `v`; AVX-512F per the module contract.
        unsafe { _mm512_loadu_si512(v.as_ptr() as *const __m512i) }
    }

    /// The 16 bytes at `p` in every 128-bit lane.
    #[inline(always)]
    unsafe fn lanes16(p: *const u8) -> __m512i {
        // SAFETY: 16 bytes at `p` (caller); AVX-512F per the module contract.
        unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i)) }
    }

    /// The table of `s_j · c` at byte `4j + c` (c < 4) from 16 byte scales
    /// `s` (each product < 256; `mul` the bytes c0, c1, c2, c3 as one i32).
    #[inline(always)]
    fn table(s: __m128i, mul: i32) -> __m512i {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe { _mm512_mullo_epi32(_mm512_cvtepu8_epi32(s), _mm512_set1_epi32(mul)) }
    }

    /// Each lane's table index: `4j` of its sub-block or'ed with the 2-bit
    /// codes of the 16 code bytes at `p` (lane `k`'s shifted by `2k`).
    #[inline(always)]
    unsafe fn indices(p: *const u8, t: usize) -> __m512i {
        // SAFETY: 16 bytes at `p` (caller); register arithmetic under the
        // module's guarantee.
        unsafe {
            let c = _mm512_srlv_epi16(lanes16(p), load(&SHIFTS));
            // (c & 3) | offset.
            _mm512_ternarylogic_epi32::<0xea>(c, _mm512_set1_epi8(3), load(&OFFSETS[t]))
        }
    }

    /// Lane `k` of `a` and of `b` (4 i32 each): their sums, in lanes `4k`
    /// and `4k + 1`, with those of `c`, `d` in `4k + 2`, `4k + 3`.
    #[inline(always)]
    fn lane_sums(a: __m512i, b: __m512i, c: __m512i, d: __m512i) -> __m512i {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
            let cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
            _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd))
        }
    }

    /// Q2_K for `N` activations: a super-block's 4 code vectors become
    /// their scaled table bytes, and its mins 16-bit lanes, once; every
    /// activation's quants and sums of 16 then meet them.
    struct Q2K;

    impl Tokens for Q2K {
        #[inline(always)]
        unsafe fn run<const N: usize>(w: &[u8], xs: &[&Q8Activation; N]) -> [f32; N] {
            let supers = w.len() / Q2_K_BLOCK_BYTES;
            let wp = w.as_ptr();
            // SAFETY: super-blocks i < supers are read (84 bytes each: 16
            // of scales, 64 of codes at Q2_K_QS, d and dmin at Q2_K_D),
            // with every activation's 256 split quants of them (2 groups
            // of 4 blocks, 128 bytes each), 8 scales and 16 sums of 16
            // (module docs).
            unsafe {
                let m4 = _mm_set1_epi8(0x0f);
                let back = _mm512_loadu_si512(BACK.as_ptr() as *const __m512i);
                let mut acc = [_mm_setzero_ps(); N];
                for i in 0..supers {
                    let blk = wp.add(i * Q2_K_BLOCK_BYTES);
                    prefetch(blk, 2);
                    let bytes = _mm_loadu_si128(blk as *const __m128i);
                    let scaled = table(_mm_and_si128(bytes, m4), 0x0302_0100);
                    // Sub-block j's min in 16-bit lane j.
                    let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(bytes), m4));
                    let dd = halves(blk.add(Q2_K_D));
                    let d = _mm256_broadcastss_ps(dd);
                    let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
                    let mut u = [_mm512_setzero_si512(); 4];
                    for (t, u) in u.iter_mut().enumerate() {
                        *u = _mm512_permutexvar_epi8(indices(blk.add(Q2_K_QS + 16 * t), t), scaled);
                    }
                    for (x, acc) in xs.iter().zip(acc.iter_mut()) {
                        let q = x.split.as_ptr().add(i * QK_K);
                        let mut a = [_mm512_setzero_si512(); 2];
                        for (t, &u) in u.iter().enumerate() {
                            let xq = _mm512_loadu_si512(q.add(64 * t) as *const __m512i);
                            a[t / 2] = _mm512_dpbusd_epi32(a[t / 2], u, xq);
                        }
                        let zero = _mm512_setzero_si512();
                        let a = _mm512_castsi512_si256(_mm512_permutexvar_epi32(
                            back,
                            lane_sums(a[0], a[1], zero, zero),
                        ));
                        // B_b = m₂ᵦ·Σ q + m₂ᵦ₊₁·Σ q over the block's halves.
                        let sums = _mm256_loadu_si256(
                            x.bsums16.as_ptr().add(2 * BLOCKS * i) as *const __m256i
                        );
                        let b = _mm256_madd_epi16(mins, sums);
                        let xd = _mm256_loadu_ps(x.scales.as_ptr().add(i * BLOCKS));
                        // t = fma(d·xd, A, −((dmin·xd)·B)), one rounding each.
                        let t = _mm256_fmsub_ps(
                            _mm256_mul_ps(d, xd),
                            _mm256_cvtepi32_ps(a),
                            _mm256_mul_ps(_mm256_mul_ps(dmin, xd), _mm256_cvtepi32_ps(b)),
                        );
                        *acc = _mm_add_ps(*acc, _mm256_castps256_ps128(t));
                        *acc = _mm_add_ps(*acc, _mm256_extractf128_ps::<1>(t));
                    }
                }
                reduce_all(acc)
            }
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    pub unsafe fn dot_q2_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract.
        unsafe { Q2K::run::<1>(w, &[x])[0] }
    }

    /// Up to [`MULTI`](crate::kernels::q8act::MULTI) activations against
    /// one Q2_K row: `out[t]` is [`dot_q2_k_q8`]`(w, xs[t])`, bit for bit.
    ///
    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    pub unsafe fn dot_q2_k_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: the module contract.
        unsafe { by_count::<Q2K>(w, xs, out) }
    }

    /// Where the hmask bit `b` of a byte goes before it meets the code
    /// bytes ([`HM_PERM`]): in lane `k`, bits `k` and `4 + k` (the hmask
    /// bits of the lane's blocks `k`, `4 + k`) land off bits `2k`, `2k +
    /// 1` (its code bits), so one bit-select merges the two.
    const PI: [u32; 8] = [2, 0, 6, 4, 3, 1, 7, 5];

    /// The GF(2) matrix moving bit `b` of a byte to bit `PI[b]`
    /// (`vgf2p8affineqb`: output bit `i` is the parity of the input and
    /// byte `7 − i` of the qword).
    const HM_PERM: u64 = {
        let mut m = 0u64;
        let mut b = 0;
        while b < 8 {
            m |= (1u64 << b) << (8 * (7 - PI[b]));
            b += 1;
        }
        m
    };

    /// Per lane `k`: bits `2k`, `2k + 1` set in every byte, the code bits
    /// the bit-select takes from the code bytes (the rest from the
    /// permuted hmask).
    const CODE_MASK: [u8; 64] = lanes([0x03, 0x0c, 0x30, 0xc0]);

    /// Per lane `k` (both its qwords), for `n` = 0, 1: the matrix taking
    /// the merged byte's bits `2k`, `2k + 1` to bits 0, 1 and `PI[4n + k]`
    /// (hmask bit `4n + k`) to bit 2.
    const INDEX_BITS: [[u64; 8]; 2] = {
        let mut v = [[0u64; 8]; 2];
        let mut n = 0;
        while n < 2 {
            let mut e = 0;
            while e < 8 {
                let k = e / 2;
                v[n][e] = (1u64 << (2 * k)) << 56
                    | (1u64 << (2 * k + 1)) << 48
                    | (1u64 << PI[4 * n + k]) << 40;
                e += 1;
            }
            n += 1;
        }
        v
    };

    /// Byte `e` of table `n`'s spread: the raw scale `8n + e / 8` at
    /// bytes `e` = 0, 4 mod 8, else byte 16 (past the 16 scales, 0).
    const SPREAD: [[u8; 64]; 2] = {
        let mut v = [[16u8; 64]; 2];
        let mut n = 0;
        while n < 2 {
            let mut e = 0;
            while e < 64 {
                v[n][e] = (8 * n + e / 8) as u8;
                e += 4;
            }
            n += 1;
        }
        v
    };

    /// Q3_K for `N` activations: a super-block's tables and its 4 vectors
    /// of table bytes are built once; every activation's quants then meet
    /// them.
    struct Q3K;

    impl Tokens for Q3K {
        #[inline(always)]
        unsafe fn run<const N: usize>(w: &[u8], xs: &[&Q8Activation; N]) -> [f32; N] {
            let supers = w.len() / Q3_K_BLOCK_BYTES;
            let wp = w.as_ptr();
            // SAFETY: super-blocks i < supers are read (110 bytes each: 32
            // of hmask, 64 of codes at Q3_K_QS, 12 of scales at
            // Q3_K_SCALES, d at Q3_K_D), with every activation's 256 split
            // quants of them, 8 scales and 8 bsums8 (module docs).
            unsafe {
                let back = _mm512_loadu_si512(BACK.as_ptr() as *const __m512i);
                let zero = _mm512_setzero_si512();
                // Qword j of a table, byte u: 128 − sc_j·(u − 4) with sc_j
                // = r_j − 32 (r_j the raw 6-bit scale), that is 32u +
                // r_j·(4 − u), in 0..=252: its low i32 0x60402000 +
                // r_j·0x01020304, its high 0xe0c0a080 − r_j·0x03020100
                // (exact modulo 2³², as every byte is in range).
                let mul =
                    _mm512_set1_epi64(((-0x0302_0100i32 as u32 as u64) << 32 | 0x0102_0304) as i64);
                let base = _mm512_set1_epi64((0xe0c0_a080u64 << 32 | 0x6040_2000) as i64);
                let hm_perm = _mm512_set1_epi64(HM_PERM as i64);
                let code_mask = load(&CODE_MASK);
                // (Loops, not closures, here and below: a closure in this
                // function, which is not itself a `target_feature` one, is
                // called out of line with its vectors in memory.)
                let mut index_bits = [zero; 2];
                for (h, b) in index_bits.iter_mut().zip(&INDEX_BITS) {
                    *h = _mm512_loadu_si512(b.as_ptr() as *const __m512i);
                }
                let mut spread = [zero; 2];
                for (s, v) in spread.iter_mut().zip(&SPREAD) {
                    *s = load(v);
                }
                let mut acc = [_mm_setzero_ps(); N];
                for i in 0..supers {
                    let blk = wp.add(i * Q3_K_BLOCK_BYTES);
                    prefetch(blk, 2);
                    // The 16 raw scales, bytes 16.. zero.
                    let raw = _mm512_zextsi128_si512(q3_scales_raw(blk.add(Q3_K_SCALES)));
                    // Table n, qword j − 8n, byte u: 128 − sc_j·(u − 4).
                    let mut tabs = [zero; 2];
                    for (tab, s) in tabs.iter_mut().zip(spread) {
                        let r = _mm512_permutexvar_epi8(s, raw);
                        *tab = _mm512_add_epi32(_mm512_mullo_epi32(r, mul), base);
                    }
                    let dd = halves(blk.add(Q3_K_D - 2));
                    let d = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
                    // The hmask bytes of half h (element l of every block),
                    // bits permuted by PI.
                    let mut hm = [zero; 2];
                    for (h, hm) in hm.iter_mut().enumerate() {
                        *hm = _mm512_gf2p8affine_epi64_epi8::<0>(lanes16(blk.add(16 * h)), hm_perm);
                    }
                    let mut u = [zero; 4];
                    for (t, u) in u.iter_mut().enumerate() {
                        let (n, h) = (t / 2, t % 2);
                        // Code bits from the code bytes, the rest from the
                        // permuted hmask.
                        let merged = _mm512_ternarylogic_epi32::<0xca>(
                            code_mask,
                            lanes16(blk.add(Q3_K_QS + 16 * t)),
                            hm[h],
                        );
                        // Bits 0–1: the code; bit 2: the hmask bit; bit 3:
                        // h, the qword of the lane.
                        let idx = if h == 0 {
                            _mm512_gf2p8affine_epi64_epi8::<0>(merged, index_bits[n])
                        } else {
                            _mm512_gf2p8affine_epi64_epi8::<8>(merged, index_bits[n])
                        };
                        *u = _mm512_shuffle_epi8(tabs[n], idx);
                    }
                    for (x, acc) in xs.iter().zip(acc.iter_mut()) {
                        let q = x.split.as_ptr().add(i * QK_K);
                        let mut a = [zero; 2];
                        for (t, u) in u.iter().enumerate() {
                            let xq = _mm512_loadu_si512(q.add(64 * t) as *const __m512i);
                            a[t / 2] = _mm512_dpbusd_epi32(a[t / 2], *u, xq);
                        }
                        // Lane k: blocks k, 4 + k, twice each.
                        let ab = _mm512_add_epi32(
                            _mm512_unpacklo_epi32(a[0], a[1]),
                            _mm512_unpackhi_epi32(a[0], a[1]),
                        );
                        let ab = _mm512_add_epi32(ab, _mm512_shuffle_epi32::<0b01_00_11_10>(ab));
                        let s = _mm512_permutexvar_epi32(back, ab);
                        // 128·Σ a of each block (bsums8 = 8·Σ a) less the
                        // sum: Σ sc·q·a.
                        let sums =
                            _mm256_loadu_si256(x.bsums8.as_ptr().add(i * BLOCKS) as *const __m256i);
                        let s = _mm256_sub_epi32(
                            _mm256_slli_epi32::<4>(sums),
                            _mm512_castsi512_si256(s),
                        );
                        let s = _mm256_cvtepi32_ps(s);
                        let xd = _mm256_loadu_ps(x.scales.as_ptr().add(i * BLOCKS));
                        let dx = _mm256_mul_ps(d, xd);
                        *acc = fma_halves(*acc, dx, s);
                    }
                }
                reduce_all(acc)
            }
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c")]
    pub unsafe fn dot_q3_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract.
        unsafe { Q3K::run::<1>(w, &[x])[0] }
    }

    /// Up to [`MULTI`](crate::kernels::q8act::MULTI) activations against
    /// one Q3_K row: `out[t]` is [`dot_q3_k_q8`]`(w, xs[t])`, bit for bit.
    ///
    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c")]
    pub unsafe fn dot_q3_k_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: the module contract.
        unsafe { by_count::<Q3K>(w, xs, out) }
    }

    /// [`IQ4_NL_VALUES`] + 128 (1..=241, unsigned for `vpdpbusd`) at
    /// every byte `e`, value `e mod 16`: `vpermb` reads an index's low 6
    /// bits, so bits 4–5 of a nibble byte (the other nibble's) fall on the
    /// same value.
    const IQ4_BIASED: [u8; 64] = {
        let mut v = [0u8; 64];
        let mut e = 0;
        while e < 64 {
            v[e] = (IQ4_NL_VALUES[e % 16] as i16 + 128) as u8;
            e += 1;
        }
        v
    };

    /// `vpmultishiftqb` shifts that bring an IQ4_XS super-block's raw
    /// scale bits to byte `k` (< 8) from its first 8 bytes as one u64 (`d`
    /// in bits 0–15, `scales_h` 16–31, `scales_l` 32–63): bytes 0–7 its
    /// low nibble (bits `32 + 4k` on, in bits 0–3), bytes 8–15 its high
    /// bits (bits `16 + 2k`, `17 + 2k`, in bits 4–5).
    const IQ4_SCALE_SHIFTS: [u8; 16] = [
        32, 36, 40, 44, 48, 52, 56, 60, 12, 14, 16, 18, 20, 22, 24, 26,
    ];

    /// IQ4_XS for `N` activations: a super-block's 4 vectors of biased
    /// values and its 8 scales are built once; every activation's quants
    /// then meet them.
    struct Iq4Xs;

    impl Tokens for Iq4Xs {
        #[inline(always)]
        unsafe fn run<const N: usize>(w: &[u8], xs: &[&Q8Activation; N]) -> [f32; N] {
            let supers = w.len() / IQ4_XS_BLOCK_BYTES;
            let wp = w.as_ptr();
            // SAFETY: super-blocks i < supers are read (136 bytes each: d,
            // scales_h and scales_l in the first 8, 128 of nibbles at
            // IQ4_XS_QS), with every activation's 256 split quants of them
            // (2 groups of 4 blocks, 128 bytes each), 8 scales and 8
            // bsums8 (module docs).
            unsafe {
                let back = _mm512_loadu_si512(BACK.as_ptr() as *const __m512i);
                let zero = _mm512_setzero_si512();
                let table = load(&IQ4_BIASED);
                let shifts = _mm_loadu_si128(IQ4_SCALE_SHIFTS.as_ptr() as *const __m128i);
                let masks = _mm_set_epi64x(0x3030_3030_3030_3030, 0x0f0f_0f0f_0f0f_0f0f);
                let mut acc = [_mm_setzero_ps(); N];
                for i in 0..supers {
                    let blk = wp.add(i * IQ4_XS_BLOCK_BYTES);
                    prefetch(blk, 3);
                    // The 8 raw 6-bit scales as bytes, less 32 as i32s.
                    let head = u64::from_le_bytes(std::ptr::read_unaligned(blk as *const [u8; 8]));
                    let bits = _mm_and_si128(
                        _mm_multishift_epi64_epi8(shifts, _mm_set1_epi64x(head as i64)),
                        masks,
                    );
                    let raw = _mm_or_si128(bits, _mm_unpackhi_epi64(bits, bits));
                    let ls = _mm256_sub_epi32(_mm256_cvtepu8_epi32(raw), _mm256_set1_epi32(32));
                    let d = _mm256_broadcastss_ps(halves(blk));
                    // u[2n + h], lane k: block 4n + k's half h (its 16
                    // bytes' low nibbles, h = 0, or high ones) as biased
                    // values, as S_{2n+h} lies.
                    let mut u = [zero; 4];
                    for n in 0..2 {
                        let qs = _mm512_loadu_si512(blk.add(IQ4_XS_QS + 64 * n) as *const __m512i);
                        u[2 * n] = _mm512_permutexvar_epi8(qs, table);
                        u[2 * n + 1] = _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(qs), table);
                    }
                    for (x, acc) in xs.iter().zip(acc.iter_mut()) {
                        let q = x.split.as_ptr().add(i * QK_K);
                        let mut a = [zero; 2];
                        for (t, u) in u.iter().enumerate() {
                            let xq = _mm512_loadu_si512(q.add(64 * t) as *const __m512i);
                            a[t / 2] = _mm512_dpbusd_epi32(a[t / 2], *u, xq);
                        }
                        // Lane k: blocks k, 4 + k, twice each.
                        let ab = _mm512_add_epi32(
                            _mm512_unpacklo_epi32(a[0], a[1]),
                            _mm512_unpackhi_epi32(a[0], a[1]),
                        );
                        let ab = _mm512_add_epi32(ab, _mm512_shuffle_epi32::<0b01_00_11_10>(ab));
                        let s = _mm512_castsi512_si256(_mm512_permutexvar_epi32(back, ab));
                        // Less 128·Σ a of each block (bsums8 = 8·Σ a): Σ
                        // v·a, then times the scale.
                        let sums =
                            _mm256_loadu_si256(x.bsums8.as_ptr().add(i * BLOCKS) as *const __m256i);
                        let s = _mm256_sub_epi32(s, _mm256_slli_epi32::<4>(sums));
                        let s = _mm256_cvtepi32_ps(_mm256_mullo_epi32(s, ls));
                        let xd = _mm256_loadu_ps(x.scales.as_ptr().add(i * BLOCKS));
                        let dx = _mm256_mul_ps(d, xd);
                        *acc = fma_halves(*acc, dx, s);
                    }
                }
                reduce_all(acc)
            }
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    pub unsafe fn dot_iq4_xs_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract.
        unsafe { Iq4Xs::run::<1>(w, &[x])[0] }
    }

    /// Up to [`MULTI`](crate::kernels::q8act::MULTI) activations against
    /// one IQ4_XS row: `out[t]` is [`dot_iq4_xs_q8`]`(w, xs[t])`, bit for
    /// bit.
    ///
    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    pub unsafe fn dot_iq4_xs_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: the module contract.
        unsafe { by_count::<Iq4Xs>(w, xs, out) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_iq4_xs, dequantize_q2_k, dequantize_q3_k};
    use rand::{Rng, SeedableRng};

    type Dot = fn(&[u8], &Q8Activation) -> f32;

    /// A vector kernel (its CPU features checked by the caller).
    #[cfg(target_arch = "x86_64")]
    type UnsafeDot = unsafe fn(&[u8], &Q8Activation) -> f32;

    /// A several-token vector kernel (its CPU features checked by the
    /// caller).
    #[cfg(target_arch = "x86_64")]
    type UnsafeMulti = unsafe fn(&[u8], &[&Q8Activation], &mut [f32]);

    /// f32's unit roundoff.
    const U: f64 = f32::EPSILON as f64 / 2.0;

    /// γ_k = k·u / (1 − k·u): the bound on `k` roundings' relative error.
    fn gamma(k: usize) -> f64 {
        k as f64 * U / (1.0 - k as f64 * U)
    }

    #[derive(Clone, Copy, Debug)]
    enum Format {
        Q2K,
        Q3K,
        Iq4Xs,
    }

    impl Format {
        fn size(self) -> usize {
            match self {
                Format::Q2K => Q2_K_BLOCK_BYTES,
                Format::Q3K => Q3_K_BLOCK_BYTES,
                Format::Iq4Xs => IQ4_XS_BLOCK_BYTES,
            }
        }

        /// Where a super-block's f16 scales are.
        fn f16s(self) -> &'static [usize] {
            match self {
                Format::Q2K => &[Q2_K_D, Q2_K_D + 2],
                Format::Q3K => &[Q3_K_D],
                Format::Iq4Xs => &[0],
            }
        }

        fn reference(self) -> Dot {
            match self {
                Format::Q2K => dot_q2_k_q8,
                Format::Q3K => dot_q3_k_q8,
                Format::Iq4Xs => dot_iq4_xs_q8,
            }
        }

        #[cfg(target_arch = "x86_64")]
        fn avx2(self) -> unsafe fn(&[u8], &Q8Activation) -> f32 {
            match self {
                Format::Q2K => avx2::dot_q2_k_q8,
                Format::Q3K => avx2::dot_q3_k_q8,
                Format::Iq4Xs => avx2::dot_iq4_xs_q8,
            }
        }

        /// The AVX-512 kernel, where there is one, and whether this CPU
        /// runs it.
        #[cfg(target_arch = "x86_64")]
        fn avx512(self) -> Option<(UnsafeDot, bool)> {
            let vnni = crate::kernels::has_avx512_vnni();
            match self {
                Format::Q2K => Some((avx512::dot_q2_k_q8, vnni)),
                Format::Q3K => Some((
                    avx512::dot_q3_k_q8,
                    vnni && is_x86_feature_detected!("gfni"),
                )),
                Format::Iq4Xs => Some((avx512::dot_iq4_xs_q8, vnni)),
            }
        }

        #[cfg(target_arch = "x86_64")]
        fn avx2_multi(self) -> UnsafeMulti {
            match self {
                Format::Q2K => avx2::dot_q2_k_q8_multi,
                Format::Q3K => avx2::dot_q3_k_q8_multi,
                Format::Iq4Xs => avx2::dot_iq4_xs_q8_multi,
            }
        }

        /// The AVX-512 several-token kernel, where there is one, and
        /// whether this CPU runs it.
        #[cfg(target_arch = "x86_64")]
        fn avx512_multi(self) -> Option<(UnsafeMulti, bool)> {
            let vnni = crate::kernels::has_avx512_vnni();
            match self {
                Format::Q2K => Some((avx512::dot_q2_k_q8_multi, vnni)),
                Format::Q3K => Some((
                    avx512::dot_q3_k_q8_multi,
                    vnni && is_x86_feature_detected!("gfni"),
                )),
                Format::Iq4Xs => Some((avx512::dot_iq4_xs_q8_multi, vnni)),
            }
        }

        fn weight_format(self) -> crate::format::WeightFormat {
            match self {
                Format::Q2K => crate::format::WeightFormat::Q2K,
                Format::Q3K => crate::format::WeightFormat::Q3K,
                Format::Iq4Xs => crate::format::WeightFormat::Iq4Xs,
            }
        }

        fn dequantize(self, w: &[u8], out: &mut [f32]) {
            match self {
                Format::Q2K => dequantize_q2_k(w, out),
                Format::Q3K => dequantize_q3_k(w, out),
                Format::Iq4Xs => dequantize_iq4_xs(w, out),
            }
        }

        /// Element `e`'s exact |parts|: `|d·sc·q| + |dmin·m|` for Q2_K
        /// (the dequantizer rounds their difference), else the exact
        /// |value| itself.
        fn parts(self, w: &[u8], e: usize, value: f32) -> f64 {
            match self {
                Format::Q2K => {
                    let blk = &w[e / QK_K * Q2_K_BLOCK_BYTES..][..Q2_K_BLOCK_BYTES];
                    let j = e % QK_K / SUB;
                    let (sc, m) = (f64::from(blk[j] & 0x0f), f64::from(blk[j] >> 4));
                    let q = f64::from(two_bits(&blk[Q2_K_QS..], e % QK_K / QK)[e % QK]);
                    let (d, dmin) = (f16_at(blk, Q2_K_D), f16_at(blk, Q2_K_D + 2));
                    (d as f64 * sc * q).abs() + (dmin as f64 * m).abs()
                }
                Format::Q3K | Format::Iq4Xs => (value as f64).abs(),
            }
        }

        /// The bound on |kernel − f64 product of the dequantized row| in
        /// units of P = Σₑ parts(e)·|x.d·a| for a row of `supers`
        /// super-blocks. Each lane holds 2·supers blocks and the tree adds
        /// 2 levels.
        ///
        /// Q2_K: a term rounds d·x.d (1) or dmin·x.d, ·B (2) and the fma
        /// (1): ≤ γ₃ of |d·x.d·A| + |dmin·x.d·B| ≤ P_b. A block's term
        /// then meets at most 2·supers − 1 lane additions (the first, to
        /// 0, is exact) and 2 of the tree: γ_{2s+1}. Together γ_{2s+4}.
        /// The dequantizer rounds each element's subtraction once: u·P
        /// more.
        ///
        /// Q3_K, IQ4_XS: d·x.d (1), then at most 2·supers fused adds into
        /// the lane (the term's own and every later one), 2 of the tree:
        /// γ_{2s+3}; the dequantizer is exact.
        ///
        /// Every product stays far from f32's subnormals here (the
        /// smallest, a subnormal f16 d times x.d ≥ 10⁻⁵, is ~10⁻¹³), so
        /// the relative model holds; the f64 sums' own error (< 10⁻¹² P)
        /// is covered by the factor 1 + 10⁻⁶.
        fn bound(self, supers: usize) -> f64 {
            let k = match self {
                Format::Q2K => gamma(2 * supers + 4) + U,
                Format::Q3K | Format::Iq4Xs => gamma(2 * supers + 3),
            };
            k * (1.0 + 1e-6)
        }
    }

    const FORMATS: [Format; 3] = [Format::Q2K, Format::Q3K, Format::Iq4Xs];

    /// A random f16 (bits): ordinary of both signs, subnormal, or large.
    fn random_f16(rng: &mut impl Rng) -> u16 {
        let sign = if rng.random() { 0x8000 } else { 0 };
        match rng.random_range(0..4) {
            0 => sign | rng.random_range(1u16..0x0400),
            1 => half::f16::from_f32(rng.random_range(1000.0f32..60000.0)).to_bits() | sign,
            _ => half::f16::from_f32(rng.random_range(1e-4f32..0.05)).to_bits() | sign,
        }
    }

    /// Random super-blocks: every byte random, then random f16 scales.
    fn random_row(rng: &mut impl Rng, f: Format, supers: usize) -> Vec<u8> {
        let mut w: Vec<u8> = (0..supers * f.size()).map(|_| rng.random()).collect();
        for blk in w.chunks_exact_mut(f.size()) {
            for &at in f.f16s() {
                blk[at..at + 2].copy_from_slice(&random_f16(rng).to_le_bytes());
            }
        }
        w
    }

    /// A random activation of `n` elements whose blocks' scales differ
    /// (magnitudes 10⁻³..10³), with block 0 of ±1 (quants ±127) and block
    /// 1 (or 0 of a one-block row... never: rows have ≥ 8) all zero.
    fn random_x(rng: &mut impl Rng, n: usize) -> Q8Activation {
        let mut x = vec![0.0f32; n];
        for (b, block) in x.chunks_exact_mut(QK).enumerate() {
            let scale = 10f32.powf(rng.random_range(-3.0f32..3.0));
            for v in block.iter_mut() {
                *v = match b {
                    0 => {
                        if rng.random() {
                            1.0
                        } else {
                            -1.0
                        }
                    }
                    1 => 0.0,
                    _ => rng.random_range(-1.0f32..1.0) * scale,
                };
            }
        }
        Q8Activation::quantize(&x)
    }

    /// The scalar reference within `f.bound` of the f64 product of the
    /// exact dequantized row with the activation's values, that product
    /// not all zero; and the AVX2 kernel giving the reference's bits.
    fn check(f: Format, w: &[u8], x: &Q8Activation, at: &str) {
        let n = w.len() / f.size() * QK_K;
        let mut wf = vec![0.0f32; n];
        f.dequantize(w, &mut wf);
        let xv = |e: usize| x.scales[e / QK] as f64 * x.quants[e] as f64;
        let exact: f64 = (0..n).map(|e| wf[e] as f64 * xv(e)).sum();
        let p: f64 = (0..n).map(|e| f.parts(w, e, wf[e]) * xv(e).abs()).sum();
        assert!(
            (0..n).any(|e| wf[e] as f64 * xv(e) != 0.0),
            "{f:?} {at}: an all-zero product proves nothing"
        );
        let got = (f.reference())(w, x);
        let bound = f.bound(n / QK_K);
        assert!(
            (got as f64 - exact).abs() <= bound * p,
            "{f:?} {at}: {got:e} vs {exact:e} (P {p:e}): off by {:.2}u·P, bound {:.2}u·P",
            (got as f64 - exact).abs() / (U * p),
            bound / U
        );
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU has AVX2, FMA and F16C; `w` is whole
            // super-blocks and `x` of its length.
            let v = unsafe { (f.avx2())(w, x) };
            assert_eq!(
                v.to_bits(),
                got.to_bits(),
                "{f:?} {at}: avx2 {v:e} vs reference {got:e}"
            );
        } else {
            eprintln!("SKIP avx2: this CPU has no AVX2+FMA+F16C");
        }
        same_bits_as_the_kernels(f, w, x, got, at);
    }

    /// Every vector kernel of `f` this CPU runs (the AVX-512 one and the
    /// one the chosen kernel set dispatches to, as well as AVX2's, which
    /// [`check`] runs) gives `want`, the reference's bits.
    fn same_bits_as_the_kernels(f: Format, w: &[u8], x: &Q8Activation, want: f32, at: &str) {
        #[cfg(target_arch = "x86_64")]
        if let Some((kernel, runs)) = f.avx512() {
            if runs {
                // SAFETY: the CPU has everything the AVX-512 module asks
                // for; `w` is whole super-blocks and `x` of its length.
                let v = unsafe { kernel(w, x) };
                assert_eq!(
                    v.to_bits(),
                    want.to_bits(),
                    "{f:?} {at}: avx512 {v:e} vs reference {want:e}"
                );
            } else {
                eprintln!("SKIP avx512 {f:?}: this CPU has no AVX-512 VNNI (or GFNI)");
            }
        }
        let wf = f.weight_format();
        for set in crate::kernels::tests::simd_sets() {
            let v = (set.dot_more_q8)(wf, w, x);
            assert_eq!(
                v.to_bits(),
                want.to_bits(),
                "{f:?} {at}: kernel set {} {v:e} vs reference {want:e}",
                set.name
            );
        }
    }

    /// Rows of 1 to 64 super-blocks, every byte random (so every code,
    /// scale, min and hmask bit), f16 scales from subnormal to ±6·10⁴,
    /// activations of magnitudes 10⁻³..10³ with a ±127 block: each vector
    /// kernel gives the reference's bits.
    #[test]
    fn every_vector_kernel_gives_the_reference_bits_on_rows_of_1_to_64_super_blocks() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed_0512);
        for f in FORMATS {
            for supers in (1..=64).chain([64, 64, 33, 17]) {
                for r in 0..4 {
                    let w = random_row(&mut rng, f, supers);
                    let x = random_x(&mut rng, supers * QK_K);
                    let want = (f.reference())(&w, &x);
                    same_bits_as_the_kernels(f, &w, &x, want, &format!("{supers}, row {r}"));
                }
            }
        }
    }

    #[test]
    fn random_rows_are_close_to_the_exact_product_and_avx2_gives_the_same_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x10_c0de);
        for f in FORMATS {
            for supers in [1, 3, 5, 7] {
                for r in 0..40 {
                    let w = random_row(&mut rng, f, supers);
                    let x = random_x(&mut rng, supers * QK_K);
                    check(f, &w, &x, &format!("{supers} super-blocks, row {r}"));
                }
            }
        }
    }

    #[test]
    fn extreme_codes_and_scales_stay_exact() {
        // All bytes 0xff: Q2_K codes 3, scales and mins 15; Q3_K codes 3,
        // scales 31; IQ4_XS values 113, scales 31. All 0x00: Q3_K codes
        // −4, scales −32; IQ4_XS values −127, scales −32 (their largest
        // integers; Q2_K's row is 0 there). Against quants of ±127.
        let supers = 3;
        for f in FORMATS {
            for fill in [0x00u8, 0xff] {
                if matches!(f, Format::Q2K) && fill == 0 {
                    continue;
                }
                for sign in [1i32, -1] {
                    let mut w = vec![fill; supers * f.size()];
                    for blk in w.chunks_exact_mut(f.size()) {
                        for &at in f.f16s() {
                            let d = half::f16::from_f32(-3.5).to_bits().to_le_bytes();
                            blk[at..at + 2].copy_from_slice(&d);
                        }
                    }
                    let x = Q8Activation::quantize(&vec![sign as f32; supers * QK_K]);
                    check(f, &w, &x, &format!("fill {fill:#x}, x {sign}"));
                    // Every block's integers are known: so is the result.
                    let a = 127 * sign;
                    let xd = x.scales[0];
                    let t = |acc: f32| match (f, fill) {
                        (Format::Q2K, _) => {
                            acc + term(-3.5, -3.5, xd, 15 * 32 * 3 * a, 15 * 32 * a)
                        }
                        (Format::Q3K, 0) => (-3.5 * xd).mul_add((-32 * 32 * -4 * a) as f32, acc),
                        (Format::Q3K, _) => (-3.5 * xd).mul_add((31 * 32 * 3 * a) as f32, acc),
                        (Format::Iq4Xs, 0) => {
                            (-3.5 * xd).mul_add((-32 * 32 * -127 * a) as f32, acc)
                        }
                        (Format::Iq4Xs, _) => (-3.5 * xd).mul_add((31 * 32 * 113 * a) as f32, acc),
                    };
                    let mut acc = [0.0f32; LANES];
                    for b in 0..supers * BLOCKS {
                        acc[b % LANES] = t(acc[b % LANES]);
                    }
                    assert_eq!((f.reference())(&w, &x), tree4(acc), "{f:?} fill {fill:#x}");
                }
            }
        }
    }

    /// A random activation of `n` elements, no block of it zero: block
    /// scales from 10⁻³ to 10³, and now and then a block of ±1 (quants
    /// ±127, the largest).
    fn nonzero_x(rng: &mut impl Rng, n: usize) -> Q8Activation {
        let mut x = vec![0.0f32; n];
        for block in x.chunks_exact_mut(QK) {
            let scale = 10f32.powf(rng.random_range(-3.0f32..3.0));
            let ones = rng.random_ratio(1, 5);
            for v in block.iter_mut() {
                let sign = if rng.random() { 1.0 } else { -1.0 };
                *v = if ones {
                    sign
                } else {
                    sign * rng.random_range(0.01f32..1.0) * scale
                };
            }
        }
        Q8Activation::quantize(&x)
    }

    /// Every several-token kernel this CPU runs (AVX2's, AVX-512's where
    /// there is one, and each kernel set's `dot_more_q8_multi`), on rows
    /// of 1 to 9 super-blocks with every byte random and f16 scales from
    /// subnormal to ±6·10⁴, against 1 to 4 random activations: result `t`
    /// has the bits of the scalar reference for activation `t`, and
    /// nothing past the activations' outputs is written.
    #[test]
    fn the_multi_token_kernels_give_the_reference_bits_for_every_token() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed_0513);
        let sets = crate::kernels::tests::simd_sets();
        let mut checked = 0;
        for f in FORMATS {
            for supers in 1..=9 {
                for rep in 0..6 {
                    let w = random_row(&mut rng, f, supers);
                    for m in 1..=crate::kernels::q8act::MULTI {
                        let acts: Vec<Q8Activation> =
                            (0..m).map(|_| nonzero_x(&mut rng, supers * QK_K)).collect();
                        let xs: Vec<&Q8Activation> = acts.iter().collect();
                        let want: Vec<u32> = xs
                            .iter()
                            .map(|x| (f.reference())(&w, x).to_bits())
                            .collect();
                        let at = format!("{f:?} {supers} super-blocks, row {rep}, {m} tokens");
                        let check = |level: &str, out: &[f32]| {
                            let got: Vec<u32> = out[..m].iter().map(|v| v.to_bits()).collect();
                            assert_eq!(got, want, "{level} {at}");
                            assert!(out[m].is_nan(), "{level} {at}: wrote past the outputs");
                        };
                        #[cfg(target_arch = "x86_64")]
                        {
                            let mut levels: Vec<(&str, UnsafeMulti)> = Vec::new();
                            if is_x86_feature_detected!("avx2")
                                && is_x86_feature_detected!("fma")
                                && is_x86_feature_detected!("f16c")
                            {
                                levels.push(("avx2", f.avx2_multi()));
                            } else if rep == 0 && supers == 1 && m == 1 {
                                eprintln!("SKIP avx2 multi: this CPU has no AVX2+FMA+F16C");
                            }
                            match f.avx512_multi() {
                                Some((kernel, true)) => levels.push(("avx512", kernel)),
                                Some((_, false)) if rep == 0 && supers == 1 && m == 1 => {
                                    eprintln!(
                                        "SKIP avx512 multi {f:?}: this CPU has no AVX-512 VNNI (or GFNI)"
                                    );
                                }
                                _ => {}
                            }
                            for (level, kernel) in levels {
                                let mut out = vec![f32::NAN; m + 1];
                                // SAFETY: the CPU has the level's features
                                // (checked above); `w` whole super-blocks,
                                // every activation of its length and an
                                // output for each.
                                unsafe { kernel(&w, &xs, &mut out) };
                                check(level, &out);
                                checked += 1;
                            }
                        }
                        for set in &sets {
                            let Some(multi) = set.dot_more_q8_multi else {
                                continue;
                            };
                            let mut out = vec![f32::NAN; m + 1];
                            multi(f.weight_format(), &w, &xs, &mut out);
                            check(set.name, &out);
                            checked += 1;
                        }
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            assert!(checked > 0, "no several-token kernel ran");
        }
        let _ = checked;
    }
}
