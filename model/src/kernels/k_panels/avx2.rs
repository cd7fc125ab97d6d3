//! The panel kernel on AVX2: rows 0..8 of a panel in the 8 lanes of one
//! register, rows 8..16 in another (bytes `0..32` and `32..64` of each
//! 64-byte word). A super-block's nibbles come 32 bytes per row for two
//! blocks (`2c`: low nibbles, `2c + 1`: high ones), 8 words, split into
//! codes 0..15 (high nibbles shifted down: in place, 16×, they would
//! saturate `vpmaddubsw`), or 0..31 with Q5_K's fifth bits.
//!
//! Per token, block and word, `vpmaddubsw` multiplies the codes by the
//! word's 4 broadcast quants into 16-bit pair sums: at most
//! 2 · 15 · 127 = 3810 in magnitude for Q4_K, so a block's 8 words
//! (≤ 30480) add up exactly in 16 bits; Q5_K's reach 2 · 31 · 127 = 7874,
//! so they are widened after 4 words (≤ 31496). `vpmaddwd` by each row's
//! scale as a 16-bit pair `(sc, sc)` widens and scales at once, giving
//! `A = sc · Σ q·a` exactly (|A| < 2²⁴). The term then takes the row
//! kernel's f32 operations: `B = m · Σ a` (exact),
//! `fmsub(d·xd, A, (dmin·xd)·B)`, added into accumulator lane `b mod 4`;
//! the lanes are reduced as `(a0 + a2) + (a1 + a3)`.
//!
//! Tokens go 4 at a time (then 2, then 1; 3 when there are just 3): each
//! register of codes serves 4 tokens, each broadcast both halves of the
//! rows, and the group's 8 registers of sums stay in registers. From 3
//! tokens on, and for Q5_K whose fifth bits cost more to merge, each pair
//! of blocks is split once into a local array (which stays in L1) for
//! every group of tokens; 1 or 2 Q4_K tokens split the nibbles in
//! registers as they go.
//! The words of a block run in loops of 4 whose count the compiler cannot
//! see: unrolled, it hoisted the broadcasts of all 8 words and spilled
//! (52 against 42 ns per panel super-block and token, 8 Q4_K tokens on
//! one Zen 4 core; the AVX-512 kernel took 33, the AVX2 row kernel 116).
//!
//! # Safety
//! Requires AVX2, FMA and F16C (checked by the caller with
//! `is_x86_feature_detected!`), a panel of `supers` whole super-blocks of
//! `format` (Q4_K or Q5_K), at most [`super::PANEL_TOKENS`] activations
//! of `supers × 256` quants and an output for each.

use std::arch::x86_64::*;

use super::{PANEL_ROWS, Q8Activation, super_words};
use crate::format::WeightFormat;
use crate::kernels::q4_0::LANES;

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
    let five = match format {
        WeightFormat::Q4K => false,
        WeightFormat::Q5K => true,
        other => panic!("no panels of {other:?}"),
    };
    for_tokens!(xs.len(), T => if five {
        // SAFETY: forwarded contract, with `xs.len() == T`.
        unsafe { panel_n::<true, T>(panel, supers, xs, out) }
    } else {
        // SAFETY: as above.
        unsafe { panel_n::<false, T>(panel, supers, xs, out) }
    });
}

/// `T` tokens through the panel (`FIVE`: Q5_K, else Q4_K): a function of
/// its own per token count (all inlined into [`dot_panel`], the 3-token
/// Q4_K pass ran at 75 against 53 ns per super-block and token).
///
/// # Safety
/// As [`dot_panel`], with `xs.len() == T`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline(never)]
#[allow(clippy::needless_range_loop)] // h, j, t index several arrays at once
unsafe fn panel_n<const FIVE: bool, const T: usize>(
    panel: &[u8],
    supers: usize,
    xs: &[&Q8Activation],
    out: &mut [[f32; PANEL_ROWS]],
) {
    let words = super_words(FIVE);
    let codes_at = if FIVE { 12 } else { 4 };
    // Whether the codes are split once into `split` (see the module docs).
    let stored = FIVE || T > 2;
    debug_assert_eq!(panel.len(), supers * words * 64);
    debug_assert!(xs.len() == T && out.len() >= T);
    let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
    // SAFETY: super-block `s < supers` reads words `s × words..+words` of
    // the panel (64 bytes each, as two 32-byte halves) and, for each
    // token, quants `256 s..+256`, scales and `bsums8` `8 s..+8`, all in
    // bounds by the module contract, which also gives the `T` outputs
    // written at the end; the rest is register arithmetic and local
    // arrays indexed below their lengths (`t < T`, `j < 8`, lanes < 4).
    unsafe {
        let low = _mm256_set1_epi8(0x0f);
        let fifth = _mm256_set1_epi8(0x10);
        let (m6, m4, m2) = (
            _mm256_set1_epi32(0x3f),
            _mm256_set1_epi32(0x0f),
            _mm256_set1_epi32(0x03),
        );
        // Bytes 0, 1, 4, 5, … (each row's d) to the low 8 of each 128-bit
        // lane, bytes 2, 3, 6, 7, … (dmin) to the high 8.
        let halves = _mm256_setr_epi8(
            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, //
            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
        );
        let shr = |v: __m256i, n: usize| _mm256_srl_epi32(v, _mm_cvtsi64_si128(n as i64));
        // acc[t][lane][h]: token t's rows 8h..8h + 8, lane b mod 4.
        let mut acc = [[[_mm256_setzero_ps(); 2]; LANES]; T];
        // The codes of a pair of blocks: split[k][g][h], block 2c + k,
        // word g, rows 8h..8h + 8.
        let mut split = [[[_mm256_setzero_si256(); 2]; 8]; 2];
        // Each token's Σ a of the super-block's 8 blocks, as f32, and their
        // scales.
        let mut sums = [[0.0f32; 8]; T];
        let mut xds = [[0.0f32; 8]; T];
        // 4, where the compiler cannot see it (the word loops).
        let four = std::hint::black_box(4usize);
        for s in 0..supers {
            let base = panel.as_ptr().add(s * words * 64);
            if T == 1 {
                super::ask_next_panel(base, panel.len(), words);
            }
            let half = |k: usize, h: usize| {
                _mm256_loadu_si256(base.add(64 * k + 32 * h) as *const __m256i)
            };
            for t in 0..T {
                let b8 = xs.get_unchecked(t).bsums8.as_ptr().add(8 * s);
                // bsums8 is 8 Σ a: the shift divides exactly.
                let v = _mm256_srai_epi32::<3>(_mm256_loadu_si256(b8 as *const __m256i));
                _mm256_storeu_ps(sums[t].as_mut_ptr(), _mm256_cvtepi32_ps(v));
                let xd = xs.get_unchecked(t).scales.as_ptr().add(8 * s);
                _mm256_storeu_ps(xds[t].as_mut_ptr(), _mm256_loadu_ps(xd));
            }
            let mut d = [_mm256_setzero_ps(); 2];
            let mut dmin = [_mm256_setzero_ps(); 2];
            // Each row's 8 scales and mins (ggml's get_scale_min_k4, lane
            // by lane): the scales as 16-bit pairs (sc, sc), for `vpmaddwd`
            // to scale and widen a block's 16-bit sums at once, the mins
            // as f32 (exact small integers).
            let mut sc = [[_mm256_setzero_si256(); 2]; 8];
            let mut mn = [[_mm256_setzero_ps(); 2]; 8];
            let pair = |v: __m256i| _mm256_or_si256(v, _mm256_slli_epi32::<16>(v));
            for h in 0..2 {
                let dd = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(
                    half(0, h),
                    halves,
                ));
                d[h] = _mm256_cvtph_ps(_mm256_castsi256_si128(dd));
                dmin[h] = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(dd));
                let (w0, w1, w2) = (half(1, h), half(2, h), half(3, h));
                for j in 0..4 {
                    sc[j][h] = pair(_mm256_and_si256(shr(w0, 8 * j), m6));
                    mn[j][h] = _mm256_cvtepi32_ps(_mm256_and_si256(shr(w1, 8 * j), m6));
                    let top = |w: __m256i| {
                        _mm256_slli_epi32::<4>(_mm256_and_si256(shr(w, 8 * j + 6), m2))
                    };
                    sc[j + 4][h] = pair(_mm256_or_si256(
                        _mm256_and_si256(shr(w2, 8 * j), m4),
                        top(w0),
                    ));
                    mn[j + 4][h] = _mm256_cvtepi32_ps(_mm256_or_si256(
                        _mm256_and_si256(shr(w2, 8 * j + 4), m4),
                        top(w1),
                    ));
                }
            }
            // Q4_K's codes of block 2c + k, word g, rows 8h..8h + 8: the
            // low (k = 0) or high (k = 1) nibbles of 32 code bytes.
            let nibbles = |c: usize, k: usize, g: usize, h: usize| {
                let w = half(codes_at + 8 * c + g, h);
                _mm256_and_si256(if k == 0 { w } else { _mm256_srli_epi16::<4>(w) }, low)
            };
            for c in 0..4 {
                if stored {
                    for g in 0..8 {
                        for h in 0..2 {
                            let (wl, wh) = (nibbles(c, 0, g, h), nibbles(c, 1, g, h));
                            if FIVE {
                                // Fifth bits: bit 2c (2c + 1) of each byte
                                // of qh's word g, moved to bit 4 (16-bit
                                // shifts by at most 4 keep every byte's
                                // bits in the byte the mask looks at).
                                let f = half(4 + g, h);
                                let (f0, f1) = match c {
                                    0 => (_mm256_slli_epi16::<4>(f), _mm256_slli_epi16::<3>(f)),
                                    1 => (_mm256_slli_epi16::<2>(f), _mm256_slli_epi16::<1>(f)),
                                    2 => (f, _mm256_srli_epi16::<1>(f)),
                                    _ => (_mm256_srli_epi16::<2>(f), _mm256_srli_epi16::<3>(f)),
                                };
                                split[0][g][h] = _mm256_or_si256(wl, _mm256_and_si256(f0, fifth));
                                split[1][g][h] = _mm256_or_si256(wh, _mm256_and_si256(f1, fifth));
                            } else {
                                split[0][g][h] = wl;
                                split[1][g][h] = wh;
                            }
                        }
                    }
                }
                for k in 0..2 {
                    let (b, j) = (8 * s + 2 * c + k, 2 * c + k);
                    // Tokens t..t + $p of block b into their lanes.
                    macro_rules! tokens {
                        ($p:literal, $t:expr) => {{
                            let t: usize = $t;
                            // s16[i][h]: token t + i's 16-bit pair sums of
                            // rows 8h..8h + 8.
                            let mut s16 = [[_mm256_setzero_si256(); 2]; $p];
                            // Q5_K: A of the first 4 words.
                            let mut part = [[_mm256_setzero_si256(); 2]; $p];
                            // Words `from..from + 4`, in a loop the compiler
                            // keeps.
                            let words4 = |from: usize, s16: &mut [[__m256i; 2]; $p]| {
                                let mut g = from;
                                while g < from + four {
                                    let w = if stored {
                                        split[k][g]
                                    } else {
                                        [nibbles(c, k, g, 0), nibbles(c, k, g, 1)]
                                    };
                                    for i in 0..$p {
                                        let a = _mm256_set1_epi32(
                                            q[t + i].add(8 * b + g).read_unaligned(),
                                        );
                                        for h in 0..2 {
                                            s16[i][h] = _mm256_add_epi16(
                                                s16[i][h],
                                                _mm256_maddubs_epi16(w[h], a),
                                            );
                                        }
                                    }
                                    g += 1;
                                }
                            };
                            words4(0, &mut s16);
                            if FIVE {
                                // 4 words of Q5_K pair sums are as many as
                                // 16 bits hold exactly.
                                for i in 0..$p {
                                    for h in 0..2 {
                                        part[i][h] = _mm256_madd_epi16(s16[i][h], sc[j][h]);
                                        s16[i][h] = _mm256_setzero_si256();
                                    }
                                }
                            }
                            words4(4, &mut s16);
                            for i in 0..$p {
                                let sum =
                                    _mm256_set1_ps(*sums.get_unchecked(t + i).get_unchecked(j));
                                let xd = _mm256_set1_ps(*xds.get_unchecked(t + i).get_unchecked(j));
                                for h in 0..2 {
                                    // A = sc · Σ q·a and B = m · Σ a:
                                    // integers below 2²⁴, exact in i32
                                    // and in f32.
                                    let mut a = _mm256_madd_epi16(s16[i][h], sc[j][h]);
                                    if FIVE {
                                        a = _mm256_add_epi32(part[i][h], a);
                                    }
                                    let bm = _mm256_mul_ps(mn[j][h], sum);
                                    let term = _mm256_fmsub_ps(
                                        _mm256_mul_ps(d[h], xd),
                                        _mm256_cvtepi32_ps(a),
                                        _mm256_mul_ps(_mm256_mul_ps(dmin[h], xd), bm),
                                    );
                                    let lane = &mut acc[t + i][b % LANES][h];
                                    *lane = _mm256_add_ps(*lane, term);
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
                        3 if T == 3 => tokens!(3, t),
                        // After a group of 4, 2 + 1 ran faster than 3.
                        3 => {
                            tokens!(2, t);
                            tokens!(1, t + 2);
                        }
                        2 => tokens!(2, t),
                        1 => tokens!(1, t),
                        _ => {}
                    }
                }
            }
        }
        store(&acc, out);
    }
}

/// Each token's four accumulator lanes (rows 0..8, 8..16) reduced as
/// `(a0 + a2) + (a1 + a3)`, the row kernels' `tree4`, into `out[t]`.
///
/// # Safety
/// AVX2 (caller); `out` has an entry for each of `acc`'s tokens.
#[inline(always)]
pub(super) unsafe fn store<const T: usize>(
    acc: &[[[__m256; 2]; LANES]; T],
    out: &mut [[f32; PANEL_ROWS]],
) {
    assert!(out.len() >= T);
    for ([a0, a1, a2, a3], o) in acc.iter().zip(out.iter_mut()) {
        for (h, half) in o.chunks_exact_mut(8).enumerate() {
            // SAFETY: register arithmetic (AVX2, caller) and an unaligned
            // store of 8 floats into `half`, 8 long.
            unsafe {
                let v = _mm256_add_ps(_mm256_add_ps(a0[h], a2[h]), _mm256_add_ps(a1[h], a3[h]));
                _mm256_storeu_ps(half.as_mut_ptr(), v);
            }
        }
    }
}
