//! The Q6_K panel kernel on AVX2: rows 0..8 of a panel in the 8 lanes of
//! one register, rows 8..16 in another (bytes `0..32` and `32..64` of each
//! 64-byte word), with [`super::avx512_q6_k`]'s arithmetic. A
//! super-block's half `n` (128 elements) is 16 words of `ql` and 8 of
//! `qh`: ql word `16n + 8c + i` (c < 2, i < 8) holds elements
//! `4i..4i + 4` of block `4n + c` in its low nibbles and of block
//! `4n + c + 2` in its high ones, qh word `32 + 8n + i` their fifth and
//! sixth bits. The unsigned codes (0..63) of such a pair of blocks are
//! built once into a local array (it stays in L1) for every token of the
//! pass.
//!
//! Per token, 16-element sub-block (4 words) and half of the rows,
//! `vpmaddubsw` multiplies the codes by each word's 4 broadcast quants
//! into 16-bit pair sums of `code · q`, at most 2 · 63 · 127 = 16002 in
//! magnitude: 4 of them (up to 64008) do not fit 16 bits, but the codes'
//! offset does not need to wait for a wider sum. The sub-block's
//! `32 · Σ q`, in the same pairs (the same for every row; computed once
//! per token and super-block with `vpmaddubsw` of 32 and the quants), is
//! the 16-bit sums' starting value, negated: the wrapping 16-bit adds
//! (`vpaddw`, never saturating) give the sums modulo 2¹⁶, and the true
//! pair sums `Σ (code − 32) · q`, 8 products of at most 32 · 127, lie in
//! ±32512, so the result modulo 2¹⁶ is exactly them. `vpmaddwd` by each
//! row's sub-block scale as a 16-bit pair `(sc, sc)` widens and scales at
//! once: `sc · Σ (code − 32) · q`, exact in i32. The block's two add up to
//! the row kernel's `s_b` (|s_b| < 2²⁴, so its conversion is exact), and
//! the term takes the row kernel's f32 operations:
//! `fma(d · xd, s_b, acc)` into accumulator lane `b mod 4`, in block
//! order per lane; the lanes are reduced as `(a0 + a2) + (a1 + a3)`.
//!
//! Tokens go 3 at a time (then 2 or 1): each register of codes serves 3
//! tokens, each broadcast both halves of the rows. A group's 16-bit sums
//! and its `s_b` so far, for both halves, take `4p` registers for `p`
//! tokens, the codes and a broadcast 3 more: 4 tokens (19) spilled, and
//! ran 8 tokens at 55 against 49 ns per panel super-block and token with
//! 3 (one Zen 4 core, `cargo bench --bench kernels -- --panel-tokens`);
//! taking the halves of the rows one after the other instead (10
//! registers for 4 tokens, each broadcast loaded twice) took 67. The 4
//! words of a sub-block run in a loop whose count the compiler cannot see
//! (see [`super::avx2`]).
//!
//! # Safety
//! Requires AVX2, FMA and F16C (checked by the caller with
//! `is_x86_feature_detected!`), a Q6_K panel of `supers` whole
//! super-blocks ([`super::pack_supers`]), at most [`super::PANEL_TOKENS`]
//! activations of `supers × 256` quants (in −127..=127, as
//! [`Q8Activation::quantize`] makes them) and an output for each.

use std::arch::x86_64::*;

use super::{PANEL_ROWS, Q8Activation};
use crate::format::WeightFormat;
use crate::kernels::q4_0::LANES;
use crate::quant::Q6_K_BLOCK_BYTES;

/// Tokens multiplied at once (see the module docs).
const GROUP: usize = 3;

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
    assert_eq!(format, WeightFormat::Q6K, "a Q6_K panel");
    // SAFETY: forwarded contract, with `xs.len() == T`.
    for_tokens!(xs.len(), T => unsafe { panel_n::<T>(panel, supers, xs, out) });
}

/// A `vpshufb` control that puts byte `m` of each 32-bit lane in bytes 1
/// and 3 of the lane and zeros in bytes 0 and 2: after an arithmetic shift
/// of 16-bit lanes by 8, the lane's signed byte `m` as the pair `(v, v)`.
fn pair_of_byte(m: usize) -> [i8; 32] {
    let mut c = [-1i8; 32];
    for r in 0..8 {
        // Indices are within each 128-bit half: rows r mod 4.
        let at = (4 * (r % 4) + m) as i8;
        c[4 * r + 1] = at;
        c[4 * r + 3] = at;
    }
    c
}

/// `T` tokens through the panel: a function of its own per token count.
///
/// # Safety
/// As [`dot_panel`], with `xs.len() == T`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline(never)]
#[allow(clippy::needless_range_loop)] // g, h, j, t index several arrays at once
unsafe fn panel_n<const T: usize>(
    panel: &[u8],
    supers: usize,
    xs: &[&Q8Activation],
    out: &mut [[f32; PANEL_ROWS]],
) {
    // Bytes of a panel super-block: 52 words, then the 16 rows' `d`.
    const B: usize = 16 * Q6_K_BLOCK_BYTES;
    debug_assert_eq!(panel.len(), supers * B);
    debug_assert!(xs.len() == T && out.len() >= T);
    let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
    let picks = [0, 1, 2, 3].map(pair_of_byte);
    // SAFETY: super-block `s < supers` reads bytes `s B..(s + 1) B` of the
    // panel (52 words of 64 bytes, as two 32-byte halves, then 32 of `d`
    // as two 16-byte halves) and, for each token,
    // quants `256 s..+256` and scales `8 s..+8`, all in bounds by the
    // module contract, which also gives the `T` outputs written at the
    // end; the rest is register arithmetic and local arrays indexed below
    // their lengths (`t < T`, `g < 8`, `j < 16`, `i < 8`, lanes < 4).
    unsafe {
        let low = _mm256_set1_epi8(0x0f);
        let top = _mm256_set1_epi8(0x30);
        let thirty_two = _mm256_set1_epi8(32);
        let pick: [__m256i; 4] =
            std::array::from_fn(|m| _mm256_loadu_si256(picks[m].as_ptr() as *const __m256i));
        // acc[t][lane][h]: token t's rows 8h..8h + 8, lane b mod 4.
        let mut acc = [[[_mm256_setzero_ps(); 2]; LANES]; T];
        // The codes of a pair of blocks: split[k][i][h], block 4n + c + 2k,
        // word i, rows 8h..8h + 8.
        let mut split = [[[_mm256_setzero_si256(); 2]; 8]; 2];
        // Each row's 16 sub-block scales as 16-bit pairs: sc[j][h].
        let mut sc = [[_mm256_setzero_si256(); 2]; 16];
        // neg[t][g]: −32 Σ q of token t's block g as 16-bit pairs (bytes
        // 4p, 4p + 1 and 4p + 2, 4p + 3 of each word), sub-block 2g in
        // element 0, 2g + 1 in element 4.
        let mut neg = [[[0i32; 8]; 8]; T];
        // Each token's block scales of the super-block.
        let mut xds = [[0.0f32; 8]; T];
        // 4, where the compiler cannot see it (the word loops).
        let four = std::hint::black_box(4usize);
        for s in 0..supers {
            let base = panel.as_ptr().add(s * B);
            let half = |k: usize, h: usize| {
                _mm256_loadu_si256(base.add(64 * k + 32 * h) as *const __m256i)
            };
            for t in 0..T {
                let x = xs.get_unchecked(t);
                let qs = x.quants.as_ptr().add(256 * s);
                for g in 0..8 {
                    // 32 (q₀ + q₁) and 32 (q₂ + q₃) of each word (at most
                    // 8128 in magnitude), added over the 4 words of each
                    // 128-bit half (a sub-block; at most 32512): every
                    // element then holds its half's pair.
                    let v = _mm256_loadu_si256(qs.add(32 * g) as *const __m256i);
                    let m = _mm256_maddubs_epi16(thirty_two, v);
                    let m = _mm256_add_epi16(m, _mm256_shuffle_epi32::<0b01_00_11_10>(m));
                    let m = _mm256_add_epi16(m, _mm256_shuffle_epi32::<0b10_11_00_01>(m));
                    let m = _mm256_sub_epi16(_mm256_setzero_si256(), m);
                    _mm256_storeu_si256(neg[t][g].as_mut_ptr() as *mut __m256i, m);
                }
                let xd = x.scales.as_ptr().add(8 * s);
                _mm256_storeu_ps(xds[t].as_mut_ptr(), _mm256_loadu_ps(xd));
            }
            // `d` of rows 8h..8h + 8: 16 bytes after the 52 words.
            let mut d = [_mm256_setzero_ps(); 2];
            for h in 0..2 {
                let at = base.add(64 * 52 + 16 * h);
                d[h] = _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
            }
            // Scale j: byte j mod 4 of scale word 48 + j / 4, sign-extended.
            for j in 0..16 {
                for h in 0..2 {
                    let w = _mm256_shuffle_epi8(half(48 + j / 4, h), pick[j % 4]);
                    sc[j][h] = _mm256_srai_epi16::<8>(w);
                }
            }
            for n in 0..2 {
                for c in 0..2 {
                    for i in 0..8 {
                        for h in 0..2 {
                            let (ql, qh) = (half(16 * n + 8 * c + i, h), half(32 + 8 * n + i, h));
                            // qh's bit pairs 2c and 2c + 4 moved to bits
                            // 4–5 (16-bit shifts: the masks drop what
                            // crosses a byte).
                            let (ha, hb) = if c == 0 {
                                (_mm256_slli_epi16::<4>(qh), qh)
                            } else {
                                (_mm256_slli_epi16::<2>(qh), _mm256_srli_epi16::<2>(qh))
                            };
                            split[0][i][h] = _mm256_or_si256(
                                _mm256_and_si256(ql, low),
                                _mm256_and_si256(ha, top),
                            );
                            split[1][i][h] = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(ql), low),
                                _mm256_and_si256(hb, top),
                            );
                        }
                    }
                    for k in 0..2 {
                        // Block g of the super-block: lanes get their
                        // blocks in order (g = 0, 2, 1, 3, 4, 6, 5, 7).
                        let g = 4 * n + c + 2 * k;
                        let b = 8 * s + g;
                        // Tokens t..t + $p of block b into their lanes.
                        macro_rules! tokens {
                            ($p:literal, $t:expr) => {{
                                let t: usize = $t;
                                // s_b of token t + i, rows 8h..8h + 8.
                                let mut sb = [[_mm256_setzero_si256(); 2]; $p];
                                for sub in 0..2 {
                                    // 16-bit pair sums, from −32 Σ q.
                                    let mut s16: [[__m256i; 2]; $p] = std::array::from_fn(|i| {
                                        let o = _mm256_set1_epi32(neg[t + i][g][4 * sub]);
                                        [o, o]
                                    });
                                    let mut w = 4 * sub;
                                    while w < 4 * sub + four {
                                        let codes = split[k][w];
                                        for i in 0..$p {
                                            let a = _mm256_set1_epi32(
                                                q[t + i].add(8 * b + w).read_unaligned(),
                                            );
                                            for h in 0..2 {
                                                s16[i][h] = _mm256_add_epi16(
                                                    s16[i][h],
                                                    _mm256_maddubs_epi16(codes[h], a),
                                                );
                                            }
                                        }
                                        w += 1;
                                    }
                                    let j = 2 * g + sub;
                                    for i in 0..$p {
                                        for h in 0..2 {
                                            // sc · Σ (code − 32) · q, exact.
                                            let v = _mm256_madd_epi16(s16[i][h], sc[j][h]);
                                            sb[i][h] = _mm256_add_epi32(sb[i][h], v);
                                        }
                                    }
                                }
                                for i in 0..$p {
                                    let xd =
                                        _mm256_set1_ps(*xds.get_unchecked(t + i).get_unchecked(g));
                                    for h in 0..2 {
                                        let lane = &mut acc[t + i][b % LANES][h];
                                        *lane = _mm256_fmadd_ps(
                                            _mm256_mul_ps(d[h], xd),
                                            _mm256_cvtepi32_ps(sb[i][h]),
                                            *lane,
                                        );
                                    }
                                }
                            }};
                        }
                        let mut t = 0;
                        while t + GROUP <= T {
                            tokens!(3, t);
                            t += GROUP;
                        }
                        match T - t {
                            2 => tokens!(2, t),
                            1 => tokens!(1, t),
                            _ => {}
                        }
                    }
                }
            }
        }
        super::avx2::store(&acc, out);
    }
}
