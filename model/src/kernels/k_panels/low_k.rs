//! Q2_K, Q3_K and IQ4_XS panels: 16 rows side by side, word by word, as
//! the Q4_K panels ([`super::pack_supers`]). Their 84-, 110- and 136-byte
//! super-blocks take 21, 27½ and 34 words:
//!
//! - **Q2_K**: words 0–3 the 16 sub-block bytes (scale in the low nibble,
//!   min in the high one; sub-block `j` is byte `j mod 4` of word `j / 4`),
//!   words 4–19 the codes, word 20 `d` (low half) and `dmin` (high half).
//! - **Q3_K**: words 0–7 `hmask`, words 8–23 the codes, words 24–26 the
//!   12 bytes of 6-bit scales, then the 16 rows' `d` side by side (32
//!   bytes: a panel super-block is 1760 bytes, as long as its rows).
//! - **IQ4_XS**: word 0 `d` (low half) and `scales_h` (high half), word 1
//!   `scales_l`, words `2 + 4k..2 + 4k + 4` block `k`'s nibbles (see
//!   [`avx512`]'s `iq4_xs`).
//!
//! Codes word `g` (< 8) of half `n` (word `8n + g` of the codes) holds
//! elements `4g..4g + 4` of blocks `4n..4n + 4`, block `4n + i` in bits
//! `2i, 2i + 1` of each byte; Q3_K's `hmask` word `g` holds their high
//! bits, block `k`'s in bit `k`. So a block's 32 elements are 8 words:
//! words 0–3 its first sub-block of 16, words 4–7 its second.
//!
//! Per token and sub-block the kernels sum `u · a` over 4 words with the
//! codes unsigned (`u` = 0..3 for Q2_K, the code + 4 = 0..7 for Q3_K), the
//! same for all 16 rows. Q3_K's sum starts at `−4 · Σ a` (the activation's
//! `bsums16`), so it ends as the row kernel's exact `Σ (u − 4) · a`. The
//! block's term then follows with the row kernel's f32 operations: Q2_K
//! `fmsub(d·xd, A, (dmin·xd)·B)` added into lane `b mod 4`, Q3_K
//! `fma(d·xd, A, lane)`, with `A = Σ sc·Σ u·a` and `B = Σ m·Σ a` exact
//! integers (below 2²⁴, so exact as f32 products and sums too); the lanes
//! reduce as `(a0 + a2) + (a1 + a3)`. IQ4_XS takes its values from a
//! table (one scale a block, `fma(d·xd, A, lane)` as Q3_K). Every result
//! is the row kernel's, bit for bit.

use crate::quant::{IQ4_XS_BLOCK_BYTES, Q2_K_BLOCK_BYTES, Q3_K_BLOCK_BYTES};

/// Words of a super-block: Q2_K's (21), Q3_K's (27 whole ones, then
/// `d`).
const Q2_WORDS: usize = Q2_K_BLOCK_BYTES / 4;
const Q3_WORDS: usize = Q3_K_BLOCK_BYTES / 4;

/// Bytes of a panel super-block: 16 rows' (as long as the rows).
const Q2_PANEL: usize = 16 * Q2_K_BLOCK_BYTES;
const Q3_PANEL: usize = 16 * Q3_K_BLOCK_BYTES;
const IQ4_XS_PANEL: usize = 16 * IQ4_XS_BLOCK_BYTES;

/// A `vpshufb` control for one 128-bit lane: in each of its 32-bit lanes,
/// byte `i` takes that lane's byte `p[i]` (zero where `p[i]` < 0).
fn lane_bytes(p: [i8; 4]) -> [i8; 16] {
    let mut c = [0i8; 16];
    for (l, lane) in c.chunks_exact_mut(4).enumerate() {
        for (v, &i) in lane.iter_mut().zip(&p) {
            *v = if i < 0 { -1 } else { 4 * l as i8 + i };
        }
    }
    c
}

pub mod avx512 {
    //! The Q2_K, Q3_K and IQ4_XS panel kernels on AVX-512 VNNI: the 16 rows in the
    //! 16 lanes of a register, one `vpdpbusd` per word and token. A
    //! block's 8 code words are built once for every token of the pass
    //! (Q3_K's high bits added under a byte mask).
    //!
    //! # Safety
    //! Requires AVX-512 F, BW, VL and VNNI, FMA and F16C (checked by the
    //! caller with `is_x86_feature_detected!`), a panel of `supers` whole
    //! super-blocks of `format` (Q2_K or Q3_K), at most
    //! [`PANEL_TOKENS`](super::super::PANEL_TOKENS) activations of
    //! `supers × 256` quants (with their `bsums16`) and an output for
    //! each.

    use std::arch::x86_64::*;

    use super::super::{PANEL_ROWS, Q8Activation};
    use crate::format::WeightFormat;
    use crate::kernels::q4_0::LANES;

    use super::{IQ4_XS_PANEL, Q2_PANEL, Q2_WORDS, Q3_PANEL, Q3_WORDS};

    /// # Safety
    /// See the module docs (IQ4_XS as Q2_K and Q3_K).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    pub unsafe fn dot_panel(
        format: WeightFormat,
        panel: &[u8],
        supers: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; PANEL_ROWS]],
    ) {
        match format {
            // SAFETY: forwarded contract, with `xs.len() == T`.
            WeightFormat::Q2K => {
                for_tokens!(xs.len(), T => unsafe { q2_k::<T>(panel, supers, xs, out) })
            }
            // SAFETY: as above.
            WeightFormat::Q3K => {
                for_tokens!(xs.len(), T => unsafe { q3_k::<T>(panel, supers, xs, out) })
            }
            // SAFETY: as above.
            WeightFormat::Iq4Xs => {
                for_tokens!(xs.len(), T => unsafe { iq4_xs::<T>(panel, supers, xs, out) })
            }
            other => panic!("no low-bit panels of {other:?}"),
        }
    }

    /// `v >> n` in each 32-bit lane.
    #[inline(always)]
    fn shr(v: __m512i, n: usize) -> __m512i {
        // SAFETY: register arithmetic; AVX-512 F per the module contract
        // (the callers are `target_feature` functions, and this is
        // inlined).
        unsafe { _mm512_srl_epi32(v, _mm_cvtsi64_si128(n as i64)) }
    }

    /// Block `k`'s codes of one word (`w`, codes word `g` of its half):
    /// bits `2 (k mod 4)`, `2 (k mod 4) + 1` of every byte as 0..3.
    #[inline(always)]
    fn two_bits(w: __m512i, k: usize) -> __m512i {
        // SAFETY: as `shr`. A 16-bit shift by at most 6 moves a byte's
        // bits within it before the mask keeps bits 0 and 1.
        unsafe {
            let v = _mm512_srl_epi16(w, _mm_cvtsi64_si128(2 * (k % 4) as i64));
            _mm512_and_si512(v, _mm512_set1_epi8(3))
        }
    }

    /// Each lane's accumulators reduced as `(a0 + a2) + (a1 + a3)` into
    /// `out[t]`.
    ///
    /// # Safety
    /// AVX-512 F (caller); `out` has an entry for each token of `acc`.
    #[inline(always)]
    unsafe fn store<const T: usize>(acc: &[[__m512; LANES]; T], out: &mut [[f32; PANEL_ROWS]]) {
        assert!(out.len() >= T);
        for (a, o) in acc.iter().zip(out.iter_mut()) {
            // SAFETY: register arithmetic and an unaligned store of 16
            // floats into `o`, 16 long.
            unsafe {
                let v = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
                _mm512_storeu_ps(o.as_mut_ptr(), v);
            }
        }
    }

    /// `T` Q2_K tokens through the panel.
    ///
    /// # Safety
    /// As [`dot_panel`], with `xs.len() == T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes xs, the sums and acc
    unsafe fn q2_k<const T: usize>(
        panel: &[u8],
        supers: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; PANEL_ROWS]],
    ) {
        debug_assert_eq!(panel.len(), supers * Q2_PANEL);
        debug_assert!(xs.len() == T && out.len() >= T);
        let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
        // SAFETY: super-block `s < supers` reads words `21 s..21 s + 21` of
        // the panel (64 bytes each) and, for each token, quants
        // `256 s..+256`, scales `8 s..+8` and `bsums16` `16 s..+16`, all
        // in bounds by the module contract; the rest is register
        // arithmetic and local arrays indexed below their lengths.
        unsafe {
            let m4b = _mm512_set1_epi8(0x0f);
            // [`super::lane_bytes`] in every 128-bit lane.
            let ctl = |p: [i8; 4]| {
                let c = super::lane_bytes(p);
                _mm512_broadcast_i32x4(_mm_loadu_si128(c.as_ptr() as *const __m128i))
            };
            // Byte i of a lane, zero-extended; bytes 2p and 2p + 1 as a
            // pair of 16-bit values.
            let byte: [__m512i; 4] = std::array::from_fn(|i| ctl([i as i8, -1, -1, -1]));
            let pair: [__m512i; 2] =
                std::array::from_fn(|p| ctl([2 * p as i8, -1, 2 * p as i8 + 1, -1]));
            let mut acc = [[_mm512_setzero_ps(); LANES]; T];
            for s in 0..supers {
                let base = panel.as_ptr().add(s * Q2_PANEL);
                if T == 1 {
                    super::super::ask_next_panel(base, panel.len(), Q2_WORDS);
                }
                let word = |k: usize| _mm512_loadu_si512(base.add(64 * k) as *const __m512i);
                let dd = word(20);
                let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
                let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
                // Sub-block j's scale and min: the low and high nibbles of
                // byte j mod 4 of word j / 4, split once a super-block
                // (byte i of each lane of `scales[q]` and `mins4[q]`: sub-block
                // 4q + i).
                let scales: [__m512i; 4] = std::array::from_fn(|q| _mm512_and_si512(word(q), m4b));
                let mins4: [__m512i; 4] =
                    std::array::from_fn(|q| _mm512_and_si512(_mm512_srli_epi32::<4>(word(q)), m4b));
                for k in 0..8 {
                    let b = 8 * s + k;
                    // Sub-blocks 2k and 2k + 1: bytes 2 (k mod 2) and
                    // 2 (k mod 2) + 1 of word k / 2; scale as f32 (exact
                    // small integers).
                    let p = k % 2;
                    let sc = [2 * p, 2 * p + 1]
                        .map(|i| _mm512_cvtepi32_ps(_mm512_shuffle_epi8(scales[k / 2], byte[i])));
                    // The two mins as a 16-bit pair (m0, m1), for
                    // `vpmaddwd` against the pair of the token's sums.
                    let mins = _mm512_shuffle_epi8(mins4[k / 2], pair[p]);
                    let codes_at = 4 + 8 * (k / 4);
                    // Sub-block h's Σ u·a (words 4h..4h + 4) for every
                    // token.
                    let sub = |h: usize| {
                        let mut dots = [_mm512_setzero_si512(); T];
                        for g in 4 * h..4 * h + 4 {
                            let u = two_bits(word(codes_at + g), k);
                            for t in 0..T {
                                let a = _mm512_set1_epi32(q[t].add(8 * b + g).read_unaligned());
                                dots[t] = _mm512_dpbusd_epi32(dots[t], u, a);
                            }
                        }
                        dots
                    };
                    let dots = [sub(0), sub(1)];
                    for t in 0..T {
                        let x = xs.get_unchecked(t);
                        let cvt = _mm512_cvtepi32_ps;
                        let a = _mm512_fmadd_ps(
                            sc[1],
                            cvt(dots[1][t]),
                            _mm512_mul_ps(sc[0], cvt(dots[0][t])),
                        );
                        // B = m0 · Σ a + m1 · Σ a over the sub-blocks' sums
                        // (adjacent i16s): exact.
                        let sums = x.bsums16.as_ptr().add(2 * b) as *const i32;
                        let bm = _mm512_cvtepi32_ps(_mm512_madd_epi16(
                            mins,
                            _mm512_set1_epi32(sums.read_unaligned()),
                        ));
                        let xd = _mm512_set1_ps(*x.scales.get_unchecked(b));
                        let term = _mm512_fmsub_ps(
                            _mm512_mul_ps(d, xd),
                            a,
                            _mm512_mul_ps(_mm512_mul_ps(dmin, xd), bm),
                        );
                        let lane = &mut acc[t][b % LANES];
                        *lane = _mm512_add_ps(*lane, term);
                    }
                }
            }
            store(&acc, out);
        }
    }

    /// `T` Q3_K tokens through the panel.
    ///
    /// # Safety
    /// As [`dot_panel`], with `xs.len() == T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes xs, the sums and acc
    unsafe fn q3_k<const T: usize>(
        panel: &[u8],
        supers: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; PANEL_ROWS]],
    ) {
        debug_assert_eq!(panel.len(), supers * Q3_PANEL);
        debug_assert!(xs.len() == T && out.len() >= T);
        let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
        // SAFETY: as in `q2_k`, with 1760 bytes per super-block: 27 words
        // of 64 bytes, then 32 of `d`.
        unsafe {
            let (m4b, m2b) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x03));
            let off8 = _mm512_set1_epi8(32);
            let four = _mm512_set1_epi8(4);
            let mut acc = [[_mm512_setzero_ps(); LANES]; T];
            for s in 0..supers {
                let base = panel.as_ptr().add(s * Q3_PANEL);
                if T == 1 {
                    super::super::ask_next_panel(base, panel.len(), Q3_PANEL.div_ceil(64));
                }
                let word = |k: usize| _mm512_loadu_si512(base.add(64 * k) as *const __m512i);
                let d =
                    _mm512_cvtph_ps(_mm256_loadu_si256(base.add(64 * Q3_WORDS) as *const __m256i));
                let (w0, w1, w2) = (word(24), word(25), word(26));
                // The 16 sub-block scales of each row, unpacked once a
                // super-block: byte i of each lane of `six[q]` is scale
                // j = 4q + i less 32 (−32..=31). Its low 4 bits are nibble
                // j / 8 of byte j mod 8 (words 24, 25), its high 2 bits
                // 2q of byte 8 + i (word 26). (32-bit shifts by at most 6,
                // then byte masks: every bit stays in its byte.)
                let six: [__m512i; 4] = std::array::from_fn(|q| {
                    let low = shr(if q % 2 == 0 { w0 } else { w1 }, 4 * (q / 2));
                    let high = _mm512_and_si512(shr(w2, 2 * q), m2b);
                    let v =
                        _mm512_or_si512(_mm512_and_si512(low, m4b), _mm512_slli_epi32::<4>(high));
                    _mm512_sub_epi8(v, off8)
                });
                // Sub-block j's scale as f32: byte j mod 4 of `six[j / 4]`,
                // sign-extended.
                let scale = |j: usize| {
                    let up =
                        _mm512_sll_epi32(six[j / 4], _mm_cvtsi64_si128(24 - 8 * (j % 4) as i64));
                    _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(up))
                };
                for k in 0..8 {
                    let b = 8 * s + k;
                    let sc = [scale(2 * k), scale(2 * k + 1)];
                    let bit = _mm512_set1_epi8(1 << k);
                    let codes_at = 8 + 8 * (k / 4);
                    // Sub-block h's Σ (u − 4)·a (words 4h..4h + 4) for
                    // every token: each sum starts at −4 · Σ a, the 4 that
                    // the unsigned codes carry.
                    // The block's 8 code words, built once (from L1 where
                    // they do not stay in registers: `vpdpbusd` takes them
                    // as a memory operand).
                    let u: [__m512i; 8] = std::array::from_fn(|g| {
                        let c = two_bits(word(codes_at + g), k);
                        let high = _mm512_test_epi8_mask(word(g), bit);
                        _mm512_mask_add_epi8(c, high, c, four)
                    });
                    let sub = |h: usize| {
                        let mut dots: [__m512i; T] = std::array::from_fn(|t| {
                            let sums = xs.get_unchecked(t).bsums16.as_ptr().add(2 * b + h);
                            _mm512_set1_epi32(-4 * i32::from(*sums))
                        });
                        for g in 4 * h..4 * h + 4 {
                            for t in 0..T {
                                let a = _mm512_set1_epi32(q[t].add(8 * b + g).read_unaligned());
                                dots[t] = _mm512_dpbusd_epi32(dots[t], u[g], a);
                            }
                        }
                        dots
                    };
                    let dots = [sub(0), sub(1)];
                    for t in 0..T {
                        let x = xs.get_unchecked(t);
                        let cvt = _mm512_cvtepi32_ps;
                        let a = _mm512_fmadd_ps(
                            sc[1],
                            cvt(dots[1][t]),
                            _mm512_mul_ps(sc[0], cvt(dots[0][t])),
                        );
                        let xd = _mm512_set1_ps(*x.scales.get_unchecked(b));
                        let lane = &mut acc[t][b % LANES];
                        *lane = _mm512_fmadd_ps(_mm512_mul_ps(d, xd), a, *lane);
                    }
                }
            }
            store(&acc, out);
        }
    }

    /// [`IQ4_NL_VALUES`](crate::quant::IQ4_NL_VALUES) + 128, as the
    /// unsigned bytes `vpdpbusd` takes (1..=241).
    const VALUES_U8: [u8; 16] = {
        let mut t = [0u8; 16];
        let mut i = 0;
        while i < 16 {
            t[i] = (crate::quant::IQ4_NL_VALUES[i] as i16 + 128) as u8;
            i += 1;
        }
        t
    };

    /// `T` IQ4_XS tokens through the panel. A super-block's words: word 0
    /// `d` (low half) and `scales_h` (high half), word 1 `scales_l`, words
    /// `2 + 4k..2 + 4k + 4` block `k`'s 16 nibble bytes (word `i`'s low
    /// nibbles its elements `4i..4i + 4`, its high ones `16 + 4i..`). The
    /// values are looked up + 128 (unsigned), and each block's sum starts
    /// at −128 · Σ a (the activation's `bsums8`), so it ends as the row
    /// kernel's exact `Σ value · a`.
    ///
    /// # Safety
    /// As [`dot_panel`], with `xs.len() == T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes xs, the sums and acc
    unsafe fn iq4_xs<const T: usize>(
        panel: &[u8],
        supers: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; PANEL_ROWS]],
    ) {
        debug_assert_eq!(panel.len(), supers * IQ4_XS_PANEL);
        debug_assert!(xs.len() == T && out.len() >= T);
        let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
        // SAFETY: super-block `s < supers` reads words `34 s..34 s + 34` of
        // the panel (64 bytes each) and, for each token, quants
        // `256 s..+256`, scales and `bsums8` `8 s..+8`, all in bounds by
        // the module contract; `VALUES_U8` is 16 bytes; the rest is
        // register arithmetic and local arrays indexed below their
        // lengths.
        unsafe {
            let table =
                _mm512_broadcast_i32x4(_mm_loadu_si128(VALUES_U8.as_ptr() as *const __m128i));
            let nibble = _mm512_set1_epi8(0x0f);
            let (m4, m2) = (_mm512_set1_epi32(0x0f), _mm512_set1_epi32(0x03));
            let off = _mm512_set1_epi32(32);
            let mut acc = [[_mm512_setzero_ps(); LANES]; T];
            for s in 0..supers {
                let base = panel.as_ptr().add(s * IQ4_XS_PANEL);
                let word = |k: usize| _mm512_loadu_si512(base.add(64 * k) as *const __m512i);
                let (w0, w1) = (word(0), word(1));
                let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w0));
                for k in 0..8 {
                    let b = 8 * s + k;
                    // Block k's scale (−32..=31): its low 4 bits nibble k
                    // of scales_l, its high 2 bits 2k of scales_h.
                    let raw = _mm512_or_si512(
                        _mm512_and_si512(shr(w1, 4 * k), m4),
                        _mm512_slli_epi32::<4>(_mm512_and_si512(shr(w0, 16 + 2 * k), m2)),
                    );
                    let sc = _mm512_cvtepi32_ps(_mm512_sub_epi32(raw, off));
                    // The block's values: v[i] for i < 4 word i's low
                    // nibbles, v[4 + i] its high ones; either way the
                    // quants of word i of the block.
                    let v: [__m512i; 8] = std::array::from_fn(|i| {
                        let w = word(2 + 4 * k + i % 4);
                        let n = if i < 4 { w } else { _mm512_srli_epi16::<4>(w) };
                        _mm512_shuffle_epi8(table, _mm512_and_si512(n, nibble))
                    });
                    let mut dots: [__m512i; T] = std::array::from_fn(|t| {
                        // bsums8 is 8 Σ a.
                        _mm512_set1_epi32(-16 * *xs.get_unchecked(t).bsums8.get_unchecked(b))
                    });
                    for i in 0..8 {
                        for t in 0..T {
                            let a = _mm512_set1_epi32(q[t].add(8 * b + i).read_unaligned());
                            dots[t] = _mm512_dpbusd_epi32(dots[t], v[i], a);
                        }
                    }
                    for t in 0..T {
                        let x = xs.get_unchecked(t);
                        // A = scale · Σ value·a: below 2²⁴, exact.
                        let a = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(dots[t]));
                        let xd = _mm512_set1_ps(*x.scales.get_unchecked(b));
                        let lane = &mut acc[t][b % LANES];
                        *lane = _mm512_fmadd_ps(_mm512_mul_ps(d, xd), a, *lane);
                    }
                }
            }
            store(&acc, out);
        }
    }
}

pub mod avx2 {
    //! The Q2_K, Q3_K and IQ4_XS panel kernels on AVX2 (IQ4_XS: see
    //! [`iq4_xs`]): rows 0..8 of a panel in
    //! the 8 lanes of one register, rows 8..16 in another (bytes `0..32`
    //! and `32..64` of each 64-byte word), as [`super::super::avx2`]'s. A
    //! block's 8 code words are built once per pass into a local array (L1)
    //! and met by every token, 4 at a time: `vpmaddubsw` of the codes and
    //! the word's 4 broadcast quants gives 16-bit pair sums, at most
    //! 2 · 7 · 127 = 1778 in magnitude, so a sub-block's 4 words add up
    //! exactly in 16 bits (Q3_K's sum starts at `−4 · Σ a` in the low half
    //! of each lane, within ±15,240 in all). `vpmaddwd` by the sub-block's
    //! scale as a 16-bit pair `(sc, sc)` widens and scales at once.
    //!
    //! # Safety
    //! Requires AVX2, FMA and F16C (checked by the caller with
    //! `is_x86_feature_detected!`), a panel of `supers` whole super-blocks
    //! of `format` (Q2_K or Q3_K), at most
    //! [`PANEL_TOKENS`](super::super::PANEL_TOKENS) activations of
    //! `supers × 256` quants (with their `bsums16`) and an output for
    //! each.

    use std::arch::x86_64::*;

    use super::super::{PANEL_ROWS, Q8Activation};
    use crate::format::WeightFormat;
    use crate::kernels::q4_0::LANES;

    use super::{IQ4_XS_PANEL, Q2_PANEL, Q2_WORDS, Q3_PANEL, Q3_WORDS};

    /// Tokens multiplied at once.
    const GROUP: usize = 4;

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_panel(
        format: WeightFormat,
        panel: &[u8],
        supers: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; PANEL_ROWS]],
    ) {
        let q3 = match format {
            WeightFormat::Q2K => false,
            WeightFormat::Q3K => true,
            WeightFormat::Iq4Xs => {
                // SAFETY: forwarded contract, with `xs.len() == T`.
                for_tokens!(xs.len(), T => unsafe { iq4_xs::<T>(panel, supers, xs, out) });
                return;
            }
            other => panic!("no low-bit panels of {other:?}"),
        };
        for_tokens!(xs.len(), T => if q3 {
            // SAFETY: forwarded contract, with `xs.len() == T`.
            unsafe { panel_n::<true, T>(panel, supers, xs, out) }
        } else {
            // SAFETY: as above.
            unsafe { panel_n::<false, T>(panel, supers, xs, out) }
        });
    }

    /// `v >> n` (`left`: `<<`) in each 16-bit lane.
    #[inline(always)]
    fn shift16(v: __m256i, n: usize, left: bool) -> __m256i {
        // SAFETY: register arithmetic; AVX2 per the module contract (the
        // callers are `target_feature` functions, and this is inlined).
        unsafe {
            let n = _mm_cvtsi64_si128(n as i64);
            if left {
                _mm256_sll_epi16(v, n)
            } else {
                _mm256_srl_epi16(v, n)
            }
        }
    }

    /// `T` tokens through the panel (`Q3`: Q3_K, else Q2_K).
    ///
    /// # Safety
    /// As [`dot_panel`], with `xs.len() == T`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline(never)]
    #[allow(clippy::needless_range_loop)] // h, i, t index several arrays at once
    unsafe fn panel_n<const Q3: bool, const T: usize>(
        panel: &[u8],
        supers: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; PANEL_ROWS]],
    ) {
        let bytes = if Q3 { Q3_PANEL } else { Q2_PANEL };
        debug_assert_eq!(panel.len(), supers * bytes);
        debug_assert!(xs.len() == T && out.len() >= T);
        let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
        // SAFETY: super-block `s < supers` reads bytes `bytes × s..+bytes`
        // of the panel (words of 64 bytes each, as two 32-byte halves, and
        // Q3_K's 32 bytes of `d` as two 16-byte halves) and, for
        // each token, quants `256 s..+256`, scales `8 s..+8` and `bsums16`
        // `16 s..+16`, all in bounds by the module contract, which also
        // gives the `T` outputs written at the end; the rest is register
        // arithmetic and local arrays indexed below their lengths.
        unsafe {
            let (m3, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
            let low16 = _mm256_set1_epi32(0xffff);
            let (m4b, m2b) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x03));
            let off8 = _mm256_set1_epi8(32);
            // [`super::lane_bytes`] in both 128-bit lanes.
            let ctl = |p: [i8; 4]| {
                let c = super::lane_bytes(p);
                _mm256_broadcastsi128_si256(_mm_loadu_si128(c.as_ptr() as *const __m128i))
            };
            // Byte i of a lane into all four of its bytes; zero-extended
            // into both 16-bit halves; bytes 2p and 2p + 1 zero-extended
            // as a pair of 16-bit values.
            let pick: [__m256i; 4] = std::array::from_fn(|i| ctl([i as i8; 4]));
            let zpair: [__m256i; 4] = std::array::from_fn(|i| ctl([i as i8, -1, i as i8, -1]));
            let mpair: [__m256i; 2] =
                std::array::from_fn(|p| ctl([2 * p as i8, -1, 2 * p as i8 + 1, -1]));
            // Bytes 0, 1, 4, 5, … (each row's low f16) to the low 8 of each
            // 128-bit lane, bytes 2, 3, 6, 7, … (the high one) to the high 8.
            let halves = _mm256_setr_epi8(
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, //
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
            );
            let shr = |v: __m256i, n: usize| _mm256_srl_epi32(v, _mm_cvtsi64_si128(n as i64));
            // acc[t][lane][h]: token t's rows 8h..8h + 8, lane b mod 4.
            let mut acc = [[[_mm256_setzero_ps(); 2]; LANES]; T];
            // A block's codes: u[g][h], word g, rows 8h..8h + 8.
            let mut u = [[_mm256_setzero_si256(); 2]; 8];
            for s in 0..supers {
                let base = panel.as_ptr().add(s * bytes);
                if T == 1 {
                    super::super::ask_next_panel(base, panel.len(), bytes.div_ceil(64));
                }
                let half = |k: usize, h: usize| {
                    _mm256_loadu_si256(base.add(64 * k + 32 * h) as *const __m256i)
                };
                // d (and Q2_K's dmin) of rows 8h..8h + 8: Q3_K's 16 bytes
                // after the words, Q2_K's the halves of word 20.
                let mut d = [_mm256_setzero_ps(); 2];
                let mut dmin = [_mm256_setzero_ps(); 2];
                for h in 0..2 {
                    if Q3 {
                        let at = base.add(64 * Q3_WORDS + 16 * h);
                        d[h] = _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
                        continue;
                    }
                    let dd = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(
                        half(Q2_WORDS - 1, h),
                        halves,
                    ));
                    d[h] = _mm256_cvtph_ps(_mm256_castsi256_si128(dd));
                    dmin[h] = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(dd));
                }
                // (Q3_K) The 16 sub-block scales of each row, unpacked once
                // a super-block: byte i of each lane of `six[q][h]` (rows
                // 8h..8h + 8) is scale j = 4q + i less 32 (−32..=31). Its
                // low 4 bits are nibble j / 8 of byte j mod 8 (words 24,
                // 25), its high 2 bits 2q of byte 8 + i (word 26). (32-bit
                // shifts by at most 6, then byte masks: every bit stays in
                // its byte.)
                // (Q2_K) Byte i of each lane of `six[q][h]` is the scale
                // of sub-block 4q + i (the low nibble of byte i of word
                // q), of `mins4[q][h]` its min (the high nibble).
                let mut six = [[_mm256_setzero_si256(); 2]; 4];
                let mut mins4 = [[_mm256_setzero_si256(); 2]; 4];
                for q in 0..4 {
                    for h in 0..2 {
                        if Q3 {
                            let low = _mm256_and_si256(shr(half(24 + q % 2, h), 4 * (q / 2)), m4b);
                            let high = _mm256_and_si256(shr(half(26, h), 2 * q), m2b);
                            let v = _mm256_or_si256(low, _mm256_slli_epi32::<4>(high));
                            six[q][h] = _mm256_sub_epi8(v, off8);
                        } else {
                            let w = half(q, h);
                            six[q][h] = _mm256_and_si256(w, m4b);
                            mins4[q][h] = _mm256_and_si256(_mm256_srli_epi32::<4>(w), m4b);
                        }
                    }
                }
                for k in 0..8 {
                    let b = 8 * s + k;
                    // Sub-block j = 2k + i's scale as a 16-bit pair, and
                    // (Q2_K) its min as f32, rows 8h..8h + 8.
                    let mut sc = [[_mm256_setzero_si256(); 2]; 2];
                    // (Q2_K) The two mins as a 16-bit pair (m0, m1), for
                    // `vpmaddwd` against the pair of the token's sums.
                    let mut mins = [_mm256_setzero_si256(); 2];
                    for i in 0..2 {
                        let j = 2 * k + i;
                        for h in 0..2 {
                            if Q3 {
                                // Byte j mod 4 of each lane of `six[j / 4]`
                                // into both of its 16-bit halves (as the
                                // high byte), then sign-extended.
                                let dup = _mm256_shuffle_epi8(six[j / 4][h], pick[j % 4]);
                                sc[i][h] = _mm256_srai_epi16::<8>(dup);
                            } else {
                                // Byte j mod 4 of each lane of `six[j / 4]`,
                                // zero-extended into both 16-bit halves.
                                sc[i][h] = _mm256_shuffle_epi8(six[j / 4][h], zpair[j % 4]);
                            }
                        }
                    }
                    if !Q3 {
                        // Bytes 2 (k mod 2) and 2 (k mod 2) + 1 of each
                        // lane of `mins4[k / 2]`: sub-blocks 2k, 2k + 1.
                        for h in 0..2 {
                            mins[h] = _mm256_shuffle_epi8(mins4[k / 2][h], mpair[k % 2]);
                        }
                    }
                    let codes_at = if Q3 { 8 } else { 4 } + 8 * (k / 4);
                    for g in 0..8 {
                        for h in 0..2 {
                            let c = _mm256_and_si256(
                                shift16(half(codes_at + g, h), 2 * (k % 4), false),
                                m3,
                            );
                            u[g][h] = if Q3 {
                                // Bit k of the hmask byte, moved to bit 2
                                // (16-bit shifts by at most 5 keep every
                                // byte's bit k in the byte the mask looks
                                // at).
                                let hm = half(g, h);
                                let at2 = if k >= 2 {
                                    shift16(hm, k - 2, false)
                                } else {
                                    shift16(hm, 2 - k, true)
                                };
                                _mm256_or_si256(c, _mm256_and_si256(at2, four))
                            } else {
                                c
                            };
                        }
                    }
                    // Tokens t..t + $p of block b into their lanes.
                    macro_rules! tokens {
                        ($p:literal, $t:expr) => {{
                            let t: usize = $t;
                            for h in 0..2 {
                                // Sub-block i's sums; a[i]: Σ sc·Σ u·a.
                                let mut a = [_mm256_setzero_si256(); $p];
                                for i in 0..2 {
                                    let mut s16: [__m256i; $p] = std::array::from_fn(|n| {
                                        if Q3 {
                                            let sums = xs.get_unchecked(t + n).bsums16.as_ptr();
                                            let v = -4 * i32::from(*sums.add(2 * b + i));
                                            _mm256_and_si256(_mm256_set1_epi32(v), low16)
                                        } else {
                                            _mm256_setzero_si256()
                                        }
                                    });
                                    for g in 4 * i..4 * i + 4 {
                                        for n in 0..$p {
                                            let x = _mm256_set1_epi32(
                                                q[t + n].add(8 * b + g).read_unaligned(),
                                            );
                                            s16[n] = _mm256_add_epi16(
                                                s16[n],
                                                _mm256_maddubs_epi16(u[g][h], x),
                                            );
                                        }
                                    }
                                    for n in 0..$p {
                                        a[n] = _mm256_add_epi32(
                                            a[n],
                                            _mm256_madd_epi16(s16[n], sc[i][h]),
                                        );
                                    }
                                }
                                for n in 0..$p {
                                    let x = xs.get_unchecked(t + n);
                                    let xd = _mm256_set1_ps(*x.scales.get_unchecked(b));
                                    let lane = &mut acc[t + n][b % LANES][h];
                                    if Q3 {
                                        *lane = _mm256_fmadd_ps(
                                            _mm256_mul_ps(d[h], xd),
                                            _mm256_cvtepi32_ps(a[n]),
                                            *lane,
                                        );
                                    } else {
                                        // B = m0 · Σ a + m1 · Σ a over the
                                        // sub-blocks' sums (adjacent i16s).
                                        let sums = x.bsums16.as_ptr().add(2 * b) as *const i32;
                                        let bm = _mm256_cvtepi32_ps(_mm256_madd_epi16(
                                            mins[h],
                                            _mm256_set1_epi32(sums.read_unaligned()),
                                        ));
                                        let term = _mm256_fmsub_ps(
                                            _mm256_mul_ps(d[h], xd),
                                            _mm256_cvtepi32_ps(a[n]),
                                            _mm256_mul_ps(_mm256_mul_ps(dmin[h], xd), bm),
                                        );
                                        *lane = _mm256_add_ps(*lane, term);
                                    }
                                }
                            }
                        }};
                    }
                    let mut t = 0;
                    while t + GROUP <= T {
                        tokens!(4, t);
                        t += GROUP;
                    }
                    match T - t {
                        3 => tokens!(3, t),
                        2 => tokens!(2, t),
                        1 => tokens!(1, t),
                        _ => {}
                    }
                }
            }
            super::super::avx2::store(&acc, out);
        }
    }

    /// `T` IQ4_XS tokens through the panel (the words as the AVX-512
    /// kernel's). `vpmaddubsw` takes unsigned bytes on one side, so the
    /// values go in as their magnitudes and each token's quants take their
    /// signs (`vpsignb`): a pair sum is then at most 2 · 127 · 127 = 32,258,
    /// exact in 16 bits, and `vpmaddwd` by the block's scale as a pair
    /// `(sc, sc)` widens each at once (the block's `sc · Σ value·a` below
    /// 2²⁴, exact in i32 and in f32).
    ///
    /// # Safety
    /// As [`dot_panel`], with `xs.len() == T`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline(never)]
    #[allow(clippy::needless_range_loop)] // h, i, t index several arrays at once
    unsafe fn iq4_xs<const T: usize>(
        panel: &[u8],
        supers: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; PANEL_ROWS]],
    ) {
        debug_assert_eq!(panel.len(), supers * IQ4_XS_PANEL);
        debug_assert!(xs.len() == T && out.len() >= T);
        let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
        // SAFETY: super-block `s < supers` reads words `34 s..34 s + 34` of
        // the panel (64 bytes each, as two 32-byte halves) and, for each
        // token, quants `256 s..+256` and scales `8 s..+8`, all in bounds
        // by the module contract, which also gives the `T` outputs written
        // at the end; `IQ4_NL_VALUES` is 16 bytes; the rest is register
        // arithmetic and local arrays indexed below their lengths.
        unsafe {
            let values = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                crate::quant::IQ4_NL_VALUES.as_ptr() as *const __m128i,
            ));
            let nibble = _mm256_set1_epi8(0x0f);
            let (m4, m2) = (_mm256_set1_epi32(0x0f), _mm256_set1_epi32(0x03));
            let off = _mm256_set1_epi16(32);
            let shr = |v: __m256i, n: usize| _mm256_srl_epi32(v, _mm_cvtsi64_si128(n as i64));
            let halves = _mm256_setr_epi8(
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, //
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
            );
            let mut acc = [[[_mm256_setzero_ps(); 2]; LANES]; T];
            // A block's values: v[i][h] (signed) and their magnitudes
            // m[i][h]; i < 4 word i's low nibbles, 4 + i its high ones.
            let mut v = [[_mm256_setzero_si256(); 2]; 8];
            let mut m = [[_mm256_setzero_si256(); 2]; 8];
            for s in 0..supers {
                let base = panel.as_ptr().add(s * IQ4_XS_PANEL);
                let half = |k: usize, h: usize| {
                    _mm256_loadu_si256(base.add(64 * k + 32 * h) as *const __m256i)
                };
                let mut d = [_mm256_setzero_ps(); 2];
                for h in 0..2 {
                    let dd = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(
                        half(0, h),
                        halves,
                    ));
                    d[h] = _mm256_cvtph_ps(_mm256_castsi256_si128(dd));
                }
                for k in 0..8 {
                    let b = 8 * s + k;
                    // Block k's scale (−32..=31) as a 16-bit pair, rows
                    // 8h..8h + 8: its low 4 bits nibble k of scales_l
                    // (word 1), its high 2 bits 2k of scales_h (the high
                    // half of word 0).
                    let sc: [__m256i; 2] = std::array::from_fn(|h| {
                        let raw = _mm256_or_si256(
                            _mm256_and_si256(shr(half(1, h), 4 * k), m4),
                            _mm256_slli_epi32::<4>(_mm256_and_si256(
                                shr(half(0, h), 16 + 2 * k),
                                m2,
                            )),
                        );
                        _mm256_sub_epi16(_mm256_or_si256(raw, _mm256_slli_epi32::<16>(raw)), off)
                    });
                    for i in 0..8 {
                        for h in 0..2 {
                            let w = half(2 + 4 * k + i % 4, h);
                            let n = if i < 4 { w } else { _mm256_srli_epi16::<4>(w) };
                            v[i][h] = _mm256_shuffle_epi8(values, _mm256_and_si256(n, nibble));
                            m[i][h] = _mm256_abs_epi8(v[i][h]);
                        }
                    }
                    // Tokens t..t + $p of block b into their lanes.
                    macro_rules! tokens {
                        ($p:literal, $t:expr) => {{
                            let t: usize = $t;
                            for h in 0..2 {
                                let mut a = [_mm256_setzero_si256(); $p];
                                for i in 0..8 {
                                    for n in 0..$p {
                                        let x = _mm256_set1_epi32(
                                            q[t + n].add(8 * b + i).read_unaligned(),
                                        );
                                        let pairs = _mm256_maddubs_epi16(
                                            m[i][h],
                                            _mm256_sign_epi8(x, v[i][h]),
                                        );
                                        a[n] =
                                            _mm256_add_epi32(a[n], _mm256_madd_epi16(pairs, sc[h]));
                                    }
                                }
                                for n in 0..$p {
                                    let x = xs.get_unchecked(t + n);
                                    let xd = _mm256_set1_ps(*x.scales.get_unchecked(b));
                                    let lane = &mut acc[t + n][b % LANES][h];
                                    *lane = _mm256_fmadd_ps(
                                        _mm256_mul_ps(d[h], xd),
                                        _mm256_cvtepi32_ps(a[n]),
                                        *lane,
                                    );
                                }
                            }
                        }};
                    }
                    let mut t = 0;
                    while t + GROUP <= T {
                        tokens!(4, t);
                        t += GROUP;
                    }
                    match T - t {
                        3 => tokens!(3, t),
                        2 => tokens!(2, t),
                        1 => tokens!(1, t),
                        _ => {}
                    }
                }
            }
            super::super::avx2::store(&acc, out);
        }
    }
}
