//! k-quant rows (Q2_K to Q6_K) packed 16 at a time ("panels") for
//! products with several tokens: prefill and batched decode.
//!
//! Row-major, a k-quant row's product with one activation reduces every
//! 32-element block's partial sums across vector lanes before it can scale
//! them, and it splits the nibbles again for every token. Called once per
//! token on a row held in L1 it ran at 36 GB/s × tokens on two Zen 4 cores
//! against 47 for Q4_0 (docs/benchmarks.md, "llama.cpp's k-quant layout").
//! A panel puts 16 rows side by side, 32-bit word by word: word `w` of row
//! `r` (bytes `4w..4w + 4` of its super-blocks) sits at `64w + 4r`. One
//! 64-byte load then carries the same 4 bytes of all 16 rows, and one
//! `vpdpbusd` against 4 broadcast activation bytes advances all 16 rows'
//! block sums (two `vpmaddubsw` for 8 rows each on AVX2): no realignment,
//! no horizontal reduction, and the nibbles are split once for all the
//! tokens of a pass. The scale words interleave the same way, so a block's
//! 16 scales and mins are one vector each. A super-block of a panel is 16
//! super-blocks' bytes (2304 for Q4_K, 2816 for Q5_K); the formats whose
//! super-blocks are not whole 16-byte groups (Q2_K, Q3_K, Q6_K) are packed
//! a super-block at a time ([`pack_supers`]; their kernels: [`low_k`],
//! [`avx512_q6_k`], [`avx2_q6_k`]), Q3_K's and Q6_K's last half word (`d`)
//! of the 16 rows side by side after their whole words. So a panel is
//! always exactly as long as its rows, and the RAM tier can lay a matrix
//! out in panels where it lies ([`panels_in_place`]).
//!
//! Panels are built on the fly, per task of a matrix product, in a scratch
//! buffer ([`pack`]): a transpose of 4-byte words, paid once for all the
//! tokens of the product. Weights stay row-major everywhere else.
//!
//! Bits: a panel kernel gives every row and token exactly what
//! [`super::q4_k::dot_q4_k_q8`] (or `dot_q5_k_q8`) gives: the same exact
//! integers per block (`sc · Σ q·a` and `m · Σ a` are products of integers
//! below 2²⁴, so exact in f32 as well), the same four roundings of its
//! term, added into lane `b mod 4` in block order, and the same final
//! reduction. [`dot_panel_ref`] is the reference; the tests compare every
//! kernel with it.

use super::Q8Activation;
use crate::format::WeightFormat;
use crate::quant::{
    IQ4_XS_BLOCK_BYTES, Q2_K_BLOCK_BYTES, Q3_K_BLOCK_BYTES, Q4_K_BLOCK_BYTES, Q5_K_BLOCK_BYTES,
    Q6_K_BLOCK_BYTES,
};

/// Rows per panel.
pub const PANEL_ROWS: usize = 16;

/// The most activations one call of a panel kernel takes.
pub const PANEL_TOKENS: usize = 8;

/// From how many tokens a product packs panels (below it the row kernel
/// runs once per token, with no packing to pay for).
pub const PANEL_MIN_TOKENS: usize = 2;

/// `(format, panel, supers, xs, out)`: the 16 rows of a panel of `supers`
/// super-blocks of `format` against up to
/// [`PANEL_TOKENS`] activations; `out[t][r]` is exactly the row kernel's
/// product of row `r` and `xs[t]`.
pub type PanelDot = fn(WeightFormat, &[u8], usize, &[&Q8Activation], &mut [[f32; PANEL_ROWS]]);

/// Bytes of one super-block of `format` in a row, where panels take it.
/// A panel of 16 rows is exactly as long as the rows: 16 × this per
/// super-block.
pub fn super_bytes(format: WeightFormat) -> Option<usize> {
    match format {
        WeightFormat::Q2K => Some(Q2_K_BLOCK_BYTES),
        WeightFormat::Q3K => Some(Q3_K_BLOCK_BYTES),
        WeightFormat::Q4K => Some(Q4_K_BLOCK_BYTES),
        WeightFormat::Q5K => Some(Q5_K_BLOCK_BYTES),
        WeightFormat::Q6K => Some(Q6_K_BLOCK_BYTES),
        WeightFormat::Iq4Xs => Some(IQ4_XS_BLOCK_BYTES),
        _ => None,
    }
}

/// Packs 16 consecutive rows of `format` (`rb` bytes each, whole
/// super-blocks) into `out`, as long as the rows: [`pack`] where a
/// super-block is whole 16-byte groups (Q4_K, Q5_K), else
/// [`pack_supers`] a super-block at a time.
pub fn pack_format(format: WeightFormat, rows: &[u8], rb: usize, out: &mut [u8]) {
    let size = super_bytes(format).expect("a panel format");
    if size.is_multiple_of(16) {
        pack(rows, rb, out)
    } else {
        pack_supers(rows, rb, size, out)
    }
}

/// Packs 16 consecutive rows of `rb` bytes, whole super-blocks of `size`
/// bytes (`W = ⌊size / 4⌋` whole words, and a half word more where `size`
/// is `4W + 2`: Q3_K's and Q6_K's `d`), one super-block at a time into
/// `16 size` bytes: word `w` (< W) of row `r`'s super-block `s` to
/// `16 size s + 64w + 4r`, and its half word to `16 size s + 64W + 2r`
/// (the 16 rows' `d` side by side, one f16 vector).
pub fn pack_supers(rows: &[u8], rb: usize, size: usize, out: &mut [u8]) {
    assert!(size > 0 && rb.is_multiple_of(size), "whole super-blocks");
    assert!(
        matches!(size % 4, 0 | 2),
        "super-blocks of whole words, or a half word more"
    );
    let words = size / 4;
    let chunk = PANEL_ROWS * size;
    assert_eq!(rows.len(), PANEL_ROWS * rb, "16 rows");
    assert_eq!(out.len(), rows.len(), "a panel is as long as its rows");
    // The words of whole groups of four by transposes; the rest (at most
    // three words) copied into a group of its own per row, transposed the
    // same way, and the words that exist kept.
    let body = words / 4 * 4;
    let rest = words - body;
    let mut tails = [0u8; PANEL_ROWS * 16];
    let mut group = [0u8; 64 * 4];
    for (s, dst) in out.chunks_exact_mut(chunk).enumerate() {
        let at = s * size;
        transpose_words(rows, rb, at, body, dst);
        if rest > 0 {
            for (r, tail) in tails.chunks_exact_mut(16).enumerate() {
                let from = r * rb + at + 4 * body;
                tail[..4 * rest].copy_from_slice(&rows[from..from + 4 * rest]);
            }
            transpose_words(&tails, 16, 0, 4, &mut group);
            dst[64 * body..64 * words].copy_from_slice(&group[..64 * rest]);
        }
        if size % 4 == 2 {
            for (r, half) in dst[64 * words..].chunks_exact_mut(2).enumerate() {
                let from = r * rb + at + 4 * words;
                half.copy_from_slice(&rows[from..from + 2]);
            }
        }
    }
}

/// Packs 16 consecutive rows of `rb` bytes each (`rows`, row-major,
/// `16 × rb` bytes; `rb` a multiple of 16) into `out` (as long): word `w`
/// of row `r` goes to `64w + 4r`.
pub fn pack(rows: &[u8], rb: usize, out: &mut [u8]) {
    assert!(rb.is_multiple_of(16), "panel rows are whole 16-byte groups");
    assert_eq!(rows.len(), PANEL_ROWS * rb, "16 rows");
    assert_eq!(out.len(), rows.len(), "a panel is as long as its rows");
    transpose_words(rows, rb, 0, rb / 4, out);
}

/// Words `0..words` (a multiple of 4) from byte `at` of each of the 16
/// rows of `rb` bytes in `rows` to `out`: word `w` of row `r` at
/// `64w + 4r`.
fn transpose_words(rows: &[u8], rb: usize, at: usize, words: usize, out: &mut [u8]) {
    assert!(
        words.is_multiple_of(4) && at + 4 * words <= rb,
        "whole groups of 4 words"
    );
    assert!(rows.len() >= PANEL_ROWS * rb && out.len() >= 64 * words);
    #[cfg(target_arch = "x86_64")]
    {
        transpose_words_sse2(rows, rb, at, words, out);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        transpose_words_scalar(rows, rb, at, words, out);
    }
}

/// The word-by-word form of [`transpose_words`].
#[cfg(any(test, not(target_arch = "x86_64")))]
fn transpose_words_scalar(rows: &[u8], rb: usize, at: usize, words: usize, out: &mut [u8]) {
    for r in 0..PANEL_ROWS {
        let row = &rows[r * rb + at..][..4 * words];
        for (w, word) in row.chunks_exact(4).enumerate() {
            out[64 * w + 4 * r..][..4].copy_from_slice(word);
        }
    }
}

/// [`transpose_words`] by 4 × 4 transposes of words in SSE2 registers
/// (every x86-64 CPU has SSE2).
#[cfg(target_arch = "x86_64")]
fn transpose_words_sse2(rows: &[u8], rb: usize, at: usize, words: usize, out: &mut [u8]) {
    use std::arch::x86_64::*;
    let (src, dst) = (rows.as_ptr(), out.as_mut_ptr());
    for w in (0..words).step_by(4) {
        for q in 0..PANEL_ROWS / 4 {
            // SAFETY: SSE2 is part of x86-64. Each load reads bytes
            // `at + 4w..at + 4w + 16` of row `4q + i` (< 16), inside
            // `rows` as `w + 4 ≤ words` and `at + 4 words ≤ rb` (checked
            // by `transpose_words`); each store writes 16 bytes at
            // `64(w + k) + 16q` (k, q < 4), inside `out` of at least
            // `64 words` bytes. Unaligned forms.
            unsafe {
                let row = |i: usize| _mm_loadu_si128(src.add((4 * q + i) * rb + at + 4 * w).cast());
                let (a, b, c, d) = (row(0), row(1), row(2), row(3));
                let ab_lo = _mm_unpacklo_epi32(a, b);
                let cd_lo = _mm_unpacklo_epi32(c, d);
                let ab_hi = _mm_unpackhi_epi32(a, b);
                let cd_hi = _mm_unpackhi_epi32(c, d);
                let words = [
                    _mm_unpacklo_epi64(ab_lo, cd_lo),
                    _mm_unpackhi_epi64(ab_lo, cd_lo),
                    _mm_unpacklo_epi64(ab_hi, cd_hi),
                    _mm_unpackhi_epi64(ab_hi, cd_hi),
                ];
                for (k, v) in words.into_iter().enumerate() {
                    _mm_storeu_si128(dst.add(64 * (w + k) + 16 * q).cast(), v);
                }
            }
        }
    }
}

/// Whether matrices of `format` can be laid out in panels in place
/// ([`panels_in_place`]): every panel format, as a panel is exactly as
/// long as its rows.
pub fn in_place(format: WeightFormat) -> bool {
    super_bytes(format).is_some()
}

/// Rearranges a row-major matrix of a panel format (`rows` rows of `rb`
/// bytes) into panels in place: every full group of 16 rows becomes a
/// panel ([`pack_format`]), the remaining rows stay as they are;
/// `scratch` holds one group while it is rewritten. [`rows_in_place`]
/// undoes it.
pub fn panels_in_place(
    format: WeightFormat,
    bytes: &mut [u8],
    rows: usize,
    rb: usize,
    scratch: &mut Vec<u8>,
) {
    assert!(in_place(format), "{format:?} has no panels");
    assert_eq!(bytes.len(), rows * rb, "whole rows");
    scratch.resize(PANEL_ROWS * rb, 0);
    for group in bytes.chunks_exact_mut(PANEL_ROWS * rb) {
        scratch.copy_from_slice(group);
        pack_format(format, scratch, rb, group);
    }
}

/// Undoes [`panels_in_place`].
pub fn rows_in_place(
    format: WeightFormat,
    bytes: &mut [u8],
    rows: usize,
    rb: usize,
    scratch: &mut Vec<u8>,
) {
    assert_eq!(bytes.len(), rows * rb, "whole rows");
    scratch.resize(PANEL_ROWS * rb, 0);
    for group in bytes.chunks_exact_mut(PANEL_ROWS * rb) {
        scratch.copy_from_slice(group);
        for (r, row) in group.chunks_exact_mut(rb).enumerate() {
            row_of_format(format, scratch, r, row);
        }
    }
}

/// Row `r` of a matrix of `format` of `rows_total` rows of `rb` bytes laid
/// out by [`panels_in_place`], row-major into `out`.
pub fn row_of_in_place(
    format: WeightFormat,
    bytes: &[u8],
    rows_total: usize,
    rb: usize,
    r: usize,
    out: &mut [u8],
) {
    let full = rows_total / PANEL_ROWS * PANEL_ROWS;
    if r >= full {
        out.copy_from_slice(&bytes[r * rb..(r + 1) * rb]);
    } else {
        let p = r / PANEL_ROWS * PANEL_ROWS;
        row_of_format(format, &bytes[p * rb..(p + PANEL_ROWS) * rb], r - p, out);
    }
}

/// For a one-token pass over a panel in place (a decode's product over the
/// RAM tier's experts, whose panels lie back to back): asks L2 for the
/// `words` 64-byte words of the super-block at `base` in the *next*
/// panel, `ahead` bytes on (the panel's length). The panel kernel runs a
/// token at about twice the row kernel's rate, so DRAM must deliver ahead
/// of it: without this the decode's panel products stalled on their first
/// loads of each super-block and ran no faster than the row kernel; asked
/// of L1 instead, Q4_K's 18 KiB panels ran slower than rows
/// (docs/benchmarks.md). A hint only: a prefetch never faults, whatever
/// the address (past the matrix's end it fetches a neighbour's bytes or
/// nothing), and changes no result.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn ask_next_panel(base: *const u8, ahead: usize, words: usize) {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    for w in 0..words {
        // SAFETY: a prefetch is a hint that never faults; `wrapping_add`
        // keeps the pointer arithmetic defined.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(ahead + 64 * w) as *const i8) };
    }
}

/// Asks L2 for `bytes` (the rows the next panel will be packed from,
/// while this one is multiplied: packing reads 16 rows side by side, which
/// the hardware prefetchers do not follow). A hint only: it never faults
/// and changes no result.
pub fn ask_l2(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        // From the start of the cache line that holds the first byte.
        let lead = bytes.as_ptr() as usize % 64;
        let first = bytes.as_ptr().wrapping_sub(lead);
        for at in (0..lead + bytes.len()).step_by(64) {
            // SAFETY: a prefetch is a hint that never faults, whatever the
            // address; `wrapping_*` keeps the pointer arithmetic defined.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(first.wrapping_add(at) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Row `r` of a panel of 16 rows of `rb` bytes, back in its row-major
/// form: word `w` from `64w + 4r`, the inverse of [`pack`] (and of
/// [`pack_supers`] for super-blocks of whole words).
pub fn row_of(panel: &[u8], rb: usize, r: usize, out: &mut [u8]) {
    assert!(r < PANEL_ROWS && panel.len() == PANEL_ROWS * rb && out.len() == rb);
    for (w, word) in out.chunks_exact_mut(4).enumerate() {
        word.copy_from_slice(&panel[64 * w + 4 * r..][..4]);
    }
}

/// Row `r` of a panel of `format` (16 rows of `out.len()` bytes, whole
/// super-blocks), back in its row-major form: the inverse of
/// [`pack_format`].
pub fn row_of_format(format: WeightFormat, panel: &[u8], r: usize, out: &mut [u8]) {
    let size = super_bytes(format).expect("a panel format");
    if size.is_multiple_of(4) {
        return row_of(panel, out.len(), r, out);
    }
    assert!(r < PANEL_ROWS && panel.len() == PANEL_ROWS * out.len());
    assert!(out.len().is_multiple_of(size), "whole super-blocks");
    let words = size / 4;
    for (blk, chunk) in out
        .chunks_exact_mut(size)
        .zip(panel.chunks_exact(PANEL_ROWS * size))
    {
        let (whole, half) = blk.split_at_mut(4 * words);
        for (w, bytes) in whole.chunks_exact_mut(4).enumerate() {
            bytes.copy_from_slice(&chunk[64 * w + 4 * r..][..4]);
        }
        half.copy_from_slice(&chunk[64 * words + 2 * r..][..half.len()]);
    }
}

/// Scalar reference of the panel kernels: each row of the panel through
/// the row kernel's reference, for each activation.
pub fn dot_panel_ref(
    format: WeightFormat,
    panel: &[u8],
    supers: usize,
    xs: &[&Q8Activation],
    out: &mut [[f32; PANEL_ROWS]],
) {
    let size = super_bytes(format).expect("a panel format");
    let dot = match format {
        WeightFormat::Q2K => super::low_k::dot_q2_k_q8,
        WeightFormat::Q3K => super::low_k::dot_q3_k_q8,
        WeightFormat::Iq4Xs => super::low_k::dot_iq4_xs_q8,
        WeightFormat::Q4K => super::q4_k::dot_q4_k_q8,
        WeightFormat::Q5K => super::q4_k::dot_q5_k_q8,
        _ => super::q6_k::dot_q6_k_q8,
    };
    let mut row = vec![0u8; supers * size];
    for r in 0..PANEL_ROWS {
        row_of_format(format, panel, r, &mut row);
        for (x, o) in xs.iter().zip(out.iter_mut()) {
            o[r] = dot(&row, x);
        }
    }
}

/// Words of one row's super-block of a panel format: `d`/`dmin`, three of
/// packed scales, (Q5_K) eight of fifth bits, then 32 of nibbles.
#[cfg(target_arch = "x86_64")]
const fn super_words(five: bool) -> usize {
    if five { 44 } else { 36 }
}

/// Runs `$call` with `$t` a constant equal to `$n` (1..=8: the kernels'
/// passes are generic over their token count); nothing for 0.
#[cfg(target_arch = "x86_64")]
macro_rules! for_tokens {
    ($n:expr, $t:ident => $call:expr) => {
        for_tokens!(@ $n, $t => $call; 1 2 3 4 5 6 7 8)
    };
    (@ $n:expr, $t:ident => $call:expr; $($k:literal)*) => {
        match $n {
            0 => {}
            $(
                $k => {
                    const $t: usize = $k;
                    $call
                }
            )*
            n => panic!("a panel pass takes at most {} tokens, not {n}", $crate::kernels::k_panels::PANEL_TOKENS),
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub mod avx2;

#[cfg(target_arch = "x86_64")]
pub mod avx2_q6_k;

#[cfg(target_arch = "x86_64")]
pub mod low_k;

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    //! The panel kernel on AVX-512 VNNI: the 16 rows in the 16 lanes of a
    //! register. A super-block's nibbles come 32 bytes per row for two
    //! blocks (`2c`: low nibbles, `2c + 1`: high ones), 8 words, so a pair
    //! of blocks is 8 loads, each split once for every token of the pass:
    //! low nibbles as 0..15, Q4_K's high ones in place as 16 × (0..15)
    //! (their exact sum comes out 16×; one arithmetic shift takes the
    //! factor off), Q5_K's with their fifth bit as 0..31. Per token and
    //! block: one `vpdpbusd` per word, then the term in f32 with the row
    //! kernel's roundings.
    //!
    //! # Safety
    //! Requires AVX-512 F, BW, VL and VNNI, FMA and F16C (checked by the
    //! caller with `is_x86_feature_detected!`), a panel of `supers` whole
    //! super-blocks of `format` (Q4_K or Q5_K), at most
    //! [`super::PANEL_TOKENS`] activations of `supers × 256` quants and an
    //! output for each.

    use std::arch::x86_64::*;

    use super::{PANEL_ROWS, Q8Activation, ask_next_panel, super_words};
    use crate::format::WeightFormat;
    use crate::kernels::q4_0::LANES;

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
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

    /// `T` tokens through the panel (`FIVE`: Q5_K, else Q4_K).
    ///
    /// # Safety
    /// As [`dot_panel`], with `xs.len() == T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes xs, the sums and acc
    unsafe fn panel_n<const FIVE: bool, const T: usize>(
        panel: &[u8],
        supers: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; PANEL_ROWS]],
    ) {
        let words = super_words(FIVE);
        let codes_at = if FIVE { 12 } else { 4 };
        debug_assert_eq!(panel.len(), supers * words * 64);
        debug_assert!(xs.len() == T && out.len() >= T);
        let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
        // SAFETY: super-block `s < supers` reads words `s × words..+words`
        // of the panel (64 bytes each) and, for each token, quants
        // `256 s..+256`, scales and `bsums8` `8 s..+8`, all in bounds by
        // the module contract; the rest is register arithmetic and local
        // arrays.
        unsafe {
            let low = _mm512_set1_epi8(0x0f);
            let high = _mm512_set1_epi8(0xf0u8 as i8);
            let fifth = _mm512_set1_epi8(0x10);
            let (m6, m4, m2) = (
                _mm512_set1_epi32(0x3f),
                _mm512_set1_epi32(0x0f),
                _mm512_set1_epi32(0x03),
            );
            let shr = |v: __m512i, n: usize| _mm512_srl_epi32(v, _mm_cvtsi64_si128(n as i64));
            let mut acc = [[_mm512_setzero_ps(); LANES]; T];
            for s in 0..supers {
                let base = panel.as_ptr().add(s * words * 64);
                if T == 1 {
                    ask_next_panel(base, panel.len(), words);
                }
                let word = |k: usize| _mm512_loadu_si512(base.add(64 * k) as *const __m512i);
                let dd = word(0);
                let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
                let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
                // Each row's 8 scales and mins (ggml's get_scale_min_k4,
                // lane by lane), as f32: exact small integers.
                let (w0, w1, w2) = (word(1), word(2), word(3));
                let mut sc = [_mm512_setzero_ps(); 8];
                let mut mn = [_mm512_setzero_ps(); 8];
                for j in 0..4 {
                    sc[j] = _mm512_cvtepi32_ps(_mm512_and_si512(shr(w0, 8 * j), m6));
                    mn[j] = _mm512_cvtepi32_ps(_mm512_and_si512(shr(w1, 8 * j), m6));
                    let top = |w: __m512i| {
                        _mm512_slli_epi32::<4>(_mm512_and_si512(shr(w, 8 * j + 6), m2))
                    };
                    sc[j + 4] = _mm512_cvtepi32_ps(_mm512_or_si512(
                        _mm512_and_si512(shr(w2, 8 * j), m4),
                        top(w0),
                    ));
                    mn[j + 4] = _mm512_cvtepi32_ps(_mm512_or_si512(
                        _mm512_and_si512(shr(w2, 8 * j + 4), m4),
                        top(w1),
                    ));
                }
                for c in 0..4 {
                    let b0 = 8 * s + 2 * c;
                    let bits = (
                        _mm512_set1_epi8(1 << (2 * c)),
                        _mm512_set1_epi8(1 << (2 * c + 1)),
                    );
                    let mut lo = [_mm512_setzero_si512(); T];
                    let mut hi = [_mm512_setzero_si512(); T];
                    for g in 0..8 {
                        let w = word(codes_at + 8 * c + g);
                        let (wl, wh) = if FIVE {
                            // Fifth bits: bit 2c (2c + 1) of each byte of
                            // qh's word g, as 16 added to the nibble (byte
                            // masks; shifts chosen per pair by a `match`
                            // ran Q5_K's passes of 1–3 tokens 2–3× slower,
                            // `cargo bench --bench kernels --
                            // --panel-tokens`).
                            let h = word(4 + g);
                            let (k0, k1) = (
                                _mm512_test_epi8_mask(h, bits.0),
                                _mm512_test_epi8_mask(h, bits.1),
                            );
                            let wl = _mm512_and_si512(w, low);
                            let wh = _mm512_and_si512(_mm512_srli_epi16::<4>(w), low);
                            (
                                _mm512_mask_add_epi8(wl, k0, wl, fifth),
                                _mm512_mask_add_epi8(wh, k1, wh, fifth),
                            )
                        } else {
                            (_mm512_and_si512(w, low), _mm512_and_si512(w, high))
                        };
                        for t in 0..T {
                            let a = q[t].add(8 * b0 + g);
                            lo[t] = _mm512_dpbusd_epi32(
                                lo[t],
                                wl,
                                _mm512_set1_epi32(a.read_unaligned()),
                            );
                            hi[t] = _mm512_dpbusd_epi32(
                                hi[t],
                                wh,
                                _mm512_set1_epi32(a.add(8).read_unaligned()),
                            );
                        }
                    }
                    for t in 0..T {
                        let x = xs.get_unchecked(t);
                        let dots = [
                            lo[t],
                            if FIVE {
                                hi[t]
                            } else {
                                _mm512_srai_epi32::<4>(hi[t])
                            },
                        ];
                        for (k, dot) in dots.into_iter().enumerate() {
                            let (b, j) = (b0 + k, 2 * c + k);
                            // A = sc · Σ q·a and B = m · Σ a: integers below
                            // 2²⁴, so these products are exact.
                            let a = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), sc[j]);
                            let sum = (*x.bsums8.get_unchecked(b) / 8) as f32;
                            let bm = _mm512_mul_ps(mn[j], _mm512_set1_ps(sum));
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
            }
            for t in 0..T {
                let a = &acc[t];
                let v = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
                _mm512_storeu_ps(out.get_unchecked_mut(t).as_mut_ptr(), v);
            }
        }
    }
}

/// The Q6_K panel kernel on AVX-512 VNNI: the 16 rows in the 16 lanes of a
/// register, as [`avx512`]'s. A super-block's half `n` (128 elements) is
/// 16 words of `ql` and 8 of `qh`; ql word `8c + i` (c < 2, i < 8) holds
/// elements `4i..4i + 4` of block `4n + c` in its low nibbles and of block
/// `4n + c + 2` in its high ones, qh word `i` their fifth and sixth bits.
/// The codes of such a pair of blocks (unsigned, 0..63) are built once for
/// every token of the pass; per token, one `vpdpbusd` per word gives each
/// 16-element sub-block's `Σ code · q`, less `32 · Σ q` (the codes' offset,
/// the same for all rows) it is the row kernel's exact `Σ (code − 32) · q`,
/// and the block's term follows with the row kernel's roundings.
///
/// # Safety
/// Requires AVX-512 F, BW, VL and VNNI, FMA and F16C (checked by the
/// caller with `is_x86_feature_detected!`), a Q6_K panel of `supers`
/// whole super-blocks, at most [`PANEL_TOKENS`] activations of
/// `supers × 256` quants and an output for each.
#[cfg(target_arch = "x86_64")]
pub mod avx512_q6_k {
    use std::arch::x86_64::*;

    use super::{PANEL_ROWS, Q8Activation};
    use crate::format::WeightFormat;
    use crate::kernels::q4_0::LANES;
    use crate::quant::Q6_K_BLOCK_BYTES;

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
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

    /// 32 × the sums of each 16 quants of super-block `s` of an activation
    /// (`q` its quants), the codes' offset times the quants.
    ///
    /// # Safety
    /// AVX-512 F/BW (caller) and 256 quants at `q + 256 s`.
    #[inline(always)]
    unsafe fn offsets(q: *const i8, s: usize) -> [i32; 16] {
        let mut o = [0i32; 16];
        // SAFETY: 4 loads of 64 quants inside super-block `s` (contract);
        // two 32-byte stores into `o`.
        unsafe {
            let bias = _mm512_set1_epi8(0x80u8 as i8);
            // |q| + 128 as bytes, summed 8 at a time: Σ q + 1024 per lane.
            let sums: [__m512i; 4] = std::array::from_fn(|v| {
                let x = _mm512_loadu_si512(q.add(256 * s + 64 * v) as *const __m512i);
                _mm512_sad_epu8(_mm512_xor_si512(x, bias), _mm512_setzero_si512())
            });
            let even = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
            let odd = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
            for p in 0..2 {
                let (a, b) = (sums[2 * p], sums[2 * p + 1]);
                let pair = _mm512_add_epi64(
                    _mm512_permutex2var_epi64(a, even, b),
                    _mm512_permutex2var_epi64(a, odd, b),
                );
                let x32 = _mm512_slli_epi64::<5>(_mm512_sub_epi64(pair, _mm512_set1_epi64(2048)));
                _mm256_storeu_si256(
                    o.as_mut_ptr().add(8 * p) as *mut __m256i,
                    _mm512_cvtepi64_epi32(x32),
                );
            }
        }
        o
    }

    /// The unsigned codes of blocks `4n + C` (low nibbles) and `4n + C + 2`
    /// (high nibbles) of the panel super-block at `base`, word by word.
    ///
    /// # Safety
    /// AVX-512 F/BW (caller), a whole panel super-block at `base`.
    #[inline(always)]
    unsafe fn codes<const C: usize>(base: *const u8, n: usize) -> ([__m512i; 8], [__m512i; 8]) {
        // SAFETY: words `16n + 8C + i` and `32 + 8n + i` (< 48) of the
        // super-block, 64 bytes each.
        unsafe {
            let (low, top) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
            let word = |k: usize| _mm512_loadu_si512(base.add(64 * k) as *const __m512i);
            let mut a = [_mm512_setzero_si512(); 8];
            let mut b = [_mm512_setzero_si512(); 8];
            for i in 0..8 {
                let (ql, qh) = (word(16 * n + 8 * C + i), word(32 + 8 * n + i));
                // qh's bit pairs 2C and 2C + 4 moved to bits 4–5 (16-bit
                // shifts: the mask drops what crosses a byte).
                let (ha, hb) = if C == 0 {
                    (_mm512_slli_epi16::<4>(qh), qh)
                } else {
                    (_mm512_slli_epi16::<2>(qh), _mm512_srli_epi16::<2>(qh))
                };
                a[i] = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_and_si512(ha, top));
                b[i] = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql), low),
                    _mm512_and_si512(hb, top),
                );
            }
            (a, b)
        }
    }

    /// Sub-block `j`'s scale of each row (`w`: scale word `j / 4`),
    /// sign-extended.
    #[inline(always)]
    unsafe fn scale(w: __m512i, j: usize) -> __m512i {
        // SAFETY: register arithmetic (AVX-512 F, caller).
        unsafe {
            let up = _mm_cvtsi32_si128(24 - 8 * (j % 4) as i32);
            _mm512_srai_epi32::<24>(_mm512_sll_epi32(w, up))
        }
    }

    /// `T` tokens through the panel.
    ///
    /// # Safety
    /// As [`dot_panel`], with `xs.len() == T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes xs, q, the offsets and acc
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
        let q: [*const i8; T] = std::array::from_fn(|t| xs[t].quants.as_ptr());
        // SAFETY: super-block `s < supers` reads bytes `s B..(s + 1) B` of
        // the panel (52 words of 64 bytes, then 32 of `d`) and, for each
        // token, quants `256 s..+256` and scales `8 s..+8`, all in bounds
        // by the module contract; the rest is register arithmetic and
        // local arrays.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); LANES]; T];
            for s in 0..supers {
                let base = panel.as_ptr().add(s * B);
                let word = |k: usize| _mm512_loadu_si512(base.add(64 * k) as *const __m512i);
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(64 * 52) as *const __m256i));
                let off: [[i32; 16]; T] = std::array::from_fn(|t| offsets(q[t], s));
                for n in 0..2 {
                    for c in 0..2 {
                        let (ca, cb) = if c == 0 {
                            codes::<0>(base, n)
                        } else {
                            codes::<1>(base, n)
                        };
                        // Blocks ga and ga + 2 of the super-block, their
                        // sub-blocks 2ga, 2ga + 1 and 2ga + 4, 2ga + 5.
                        let ga = 4 * n + c;
                        let sc: [__m512i; 4] = std::array::from_fn(|k| {
                            let j = 2 * ga + 4 * (k / 2) + k % 2;
                            scale(word(48 + j / 4), j)
                        });
                        for t in 0..T {
                            let x = xs.get_unchecked(t);
                            let mut sums = [_mm512_setzero_si512(); 4];
                            for i in 0..8 {
                                let a = q[t].add(32 * (8 * s + ga) + 4 * i) as *const i32;
                                let sub = i / 4;
                                sums[sub] = _mm512_dpbusd_epi32(
                                    sums[sub],
                                    ca[i],
                                    _mm512_set1_epi32(a.read_unaligned()),
                                );
                                sums[2 + sub] = _mm512_dpbusd_epi32(
                                    sums[2 + sub],
                                    cb[i],
                                    _mm512_set1_epi32(a.add(16).read_unaligned()),
                                );
                            }
                            for k in 0..2 {
                                let g = ga + 2 * k;
                                // s_b = sc₀ Σ₀ + sc₁ Σ₁ with Σ = Σ code·q −
                                // 32 Σ q: exact integers below 2²⁴.
                                let part = |h: usize| {
                                    let j = 2 * g + h;
                                    _mm512_mullo_epi32(
                                        _mm512_sub_epi32(
                                            sums[2 * k + h],
                                            _mm512_set1_epi32(off[t][j]),
                                        ),
                                        sc[2 * k + h],
                                    )
                                };
                                let sb = _mm512_cvtepi32_ps(_mm512_add_epi32(part(0), part(1)));
                                let b = 8 * s + g;
                                let db =
                                    _mm512_mul_ps(d, _mm512_set1_ps(*x.scales.get_unchecked(b)));
                                let lane = &mut acc[t][b % LANES];
                                *lane = _mm512_fmadd_ps(db, sb, *lane);
                            }
                        }
                    }
                }
            }
            for t in 0..T {
                let a = &acc[t];
                let v = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
                _mm512_storeu_ps(out.get_unchecked_mut(t).as_mut_ptr(), v);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::q4_k::tests::random_row;
    use crate::quant::QK_K;
    use rand::{Rng, SeedableRng};

    /// Every format with panels.
    const PANEL_FORMATS: [WeightFormat; 6] = [
        WeightFormat::Iq4Xs,
        WeightFormat::Q2K,
        WeightFormat::Q3K,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
    ];

    #[test]
    fn packing_gives_each_word_and_half_word_its_place_and_row_of_format_undoes_it() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(63);
        for format in PANEL_FORMATS {
            let size = super_bytes(format).unwrap();
            let words = size / 4;
            for supers in [1, 3] {
                let rb = supers * size;
                let rows: Vec<u8> = (0..PANEL_ROWS * rb).map(|_| rng.random()).collect();
                let mut panel = vec![0xaau8; PANEL_ROWS * rb];
                pack_format(format, &rows, rb, &mut panel);
                for r in 0..PANEL_ROWS {
                    for s in 0..supers {
                        let chunk = &panel[PANEL_ROWS * size * s..][..PANEL_ROWS * size];
                        let row = &rows[r * rb + s * size..][..size];
                        for w in 0..words {
                            let got = &chunk[64 * w + 4 * r..][..4];
                            assert_eq!(
                                got,
                                &row[4 * w..4 * w + 4],
                                "{format:?} row {r} super {s} word {w}"
                            );
                        }
                        // Q3_K's and Q6_K's `d`: the 16 rows' side by side
                        // after the words.
                        if size % 4 == 2 {
                            assert_eq!(
                                chunk[64 * words + 2 * r..][..2],
                                row[4 * words..],
                                "{format:?} row {r} d"
                            );
                        }
                    }
                    let mut back = vec![0u8; rb];
                    row_of_format(format, &panel, r, &mut back);
                    assert_eq!(back, rows[r * rb..(r + 1) * rb], "{format:?} row {r}");
                }
            }
        }
    }

    #[test]
    fn packing_is_a_transpose_of_words_and_row_of_undoes_it() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(60);
        for rb in [16, 144, 176 * 3, 144 * 8] {
            let rows: Vec<u8> = (0..PANEL_ROWS * rb).map(|_| rng.random()).collect();
            let mut fast = vec![0u8; rows.len()];
            let mut slow = vec![0u8; rows.len()];
            pack(&rows, rb, &mut fast);
            transpose_words_scalar(&rows, rb, 0, rb / 4, &mut slow);
            assert_eq!(fast, slow, "rb {rb}");
            // Word 1 of row 3 is the panel's bytes 64 + 12..64 + 16.
            assert_eq!(fast[76..80], rows[3 * rb + 4..3 * rb + 8]);
            let mut back = vec![0u8; rb];
            for r in 0..PANEL_ROWS {
                row_of(&fast, rb, r, &mut back);
                assert_eq!(back, rows[r * rb..(r + 1) * rb]);
            }
        }
    }

    /// A panel of 16 random rows of `supers` super-blocks of `format`
    /// (finite scales of both signs), with its rows.
    pub(crate) fn random_panel(
        rng: &mut impl Rng,
        format: WeightFormat,
        supers: usize,
    ) -> (Vec<u8>, Vec<u8>) {
        let size = super_bytes(format).unwrap();
        let rows: Vec<u8> = (0..PANEL_ROWS)
            .flat_map(|_| match format {
                WeightFormat::Q6K => crate::kernels::q6_k::tests::random_row(rng, supers),
                WeightFormat::Q2K | WeightFormat::Q3K | WeightFormat::Iq4Xs => {
                    low_k_row(rng, format, supers)
                }
                _ => random_row(rng, supers, size),
            })
            .collect();
        let mut panel = vec![0u8; PANEL_ROWS * supers * size];
        pack_format(format, &rows, supers * size, &mut panel);
        (panel, rows)
    }

    /// A Q2_K, Q3_K or IQ4_XS row of `supers` super-blocks: every byte
    /// random, then random f16 scales of both signs: ordinary, subnormal
    /// and large.
    pub(crate) fn low_k_row(rng: &mut impl Rng, format: WeightFormat, supers: usize) -> Vec<u8> {
        crate::kernels::tests::more_q8_bytes(rng, format, supers * QK_K)
    }

    /// Activations of `supers` super-blocks with the extremes a block can
    /// have: one block all ±127, one all zero.
    pub(crate) fn activations(rng: &mut impl Rng, supers: usize, n: usize) -> Vec<Q8Activation> {
        (0..n)
            .map(|t| {
                let len = supers * QK_K;
                let mut x: Vec<f32> = (0..len).map(|_| rng.random_range(-3.0f32..3.0)).collect();
                let at = (t * 32) % len;
                for v in &mut x[at..at + 32] {
                    *v = if rng.random() { 1.0 } else { -1.0 };
                }
                let z = (at + 64) % len;
                x[z..z + 32].fill(0.0);
                Q8Activation::quantize(&x)
            })
            .collect()
    }

    #[test]
    fn the_reference_is_the_row_kernel_on_each_row() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(61);
        for format in PANEL_FORMATS {
            let (panel, rows) = random_panel(&mut rng, format, 3);
            let xs = activations(&mut rng, 3, 3);
            let refs: Vec<&Q8Activation> = xs.iter().collect();
            let mut out = vec![[0.0f32; PANEL_ROWS]; 3];
            dot_panel_ref(format, &panel, 3, &refs, &mut out);
            let rb = rows.len() / PANEL_ROWS;
            for (t, x) in xs.iter().enumerate() {
                for r in 0..PANEL_ROWS {
                    let row = &rows[r * rb..(r + 1) * rb];
                    let want = match format {
                        WeightFormat::Q2K => crate::kernels::low_k::dot_q2_k_q8(row, x),
                        WeightFormat::Q3K => crate::kernels::low_k::dot_q3_k_q8(row, x),
                        WeightFormat::Iq4Xs => crate::kernels::low_k::dot_iq4_xs_q8(row, x),
                        WeightFormat::Q4K => crate::kernels::q4_k::dot_q4_k_q8(row, x),
                        WeightFormat::Q5K => crate::kernels::q4_k::dot_q5_k_q8(row, x),
                        _ => crate::kernels::q6_k::dot_q6_k_q8(row, x),
                    };
                    assert_eq!(out[t][r].to_bits(), want.to_bits());
                    assert!(want != 0.0);
                }
            }
        }
    }

    #[test]
    fn every_panel_kernel_gives_the_reference_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(62);
        let sets: Vec<_> = crate::kernels::tests::simd_sets()
            .into_iter()
            .flat_map(|k| {
                let k4 = k.dot_k_panels.into_iter().flat_map(move |p| {
                    [WeightFormat::Q4K, WeightFormat::Q5K].map(|f| (k.name, f, p))
                });
                let low = k.dot_low_k_panels.into_iter().flat_map(move |p| {
                    [WeightFormat::Q2K, WeightFormat::Q3K].map(|f| (k.name, f, p))
                });
                k4.chain(k.dot_q6_k_panels.map(|p| (k.name, WeightFormat::Q6K, p)))
                    .chain(low)
                    .chain(
                        k.dot_iq4_xs_panels
                            .map(|p| (k.name, WeightFormat::Iq4Xs, p)),
                    )
            })
            .collect();
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512bw") {
            for format in [WeightFormat::Q3K, WeightFormat::Iq4Xs] {
                assert!(
                    sets.iter().any(|(_, f, _)| *f == format),
                    "this CPU runs the {format:?} panels"
                );
            }
        }
        for (name, format, kernel) in sets {
            {
                for supers in [1, 2, 3, 8] {
                    let (panel, _) = random_panel(&mut rng, format, supers);
                    for n in 1..=PANEL_TOKENS {
                        let xs = activations(&mut rng, supers, n);
                        let refs: Vec<&Q8Activation> = xs.iter().collect();
                        let mut want = vec![[0.0f32; PANEL_ROWS]; n];
                        let mut got = vec![[f32::NAN; PANEL_ROWS]; n + 1];
                        dot_panel_ref(format, &panel, supers, &refs, &mut want);
                        kernel(format, &panel, supers, &refs, &mut got);
                        for t in 0..n {
                            for r in 0..PANEL_ROWS {
                                assert_eq!(
                                    got[t][r].to_bits(),
                                    want[t][r].to_bits(),
                                    "{name} {format:?} supers {supers} tokens {n}: token {t} row {r}"
                                );
                            }
                        }
                        // Nothing past the tokens is written.
                        assert!(got[n].iter().all(|v| v.is_nan()));
                    }
                }
            }
        }
    }

    #[test]
    fn extreme_codes_scales_and_mins_stay_exact_in_every_panel_kernel() {
        // Every code at its largest, every scale and min 63, quants −127:
        // the largest integers a block can hold.
        for format in [WeightFormat::Q4K, WeightFormat::Q5K] {
            let size = super_bytes(format).unwrap();
            let mut blk = vec![0xffu8; size];
            blk[..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
            blk[2..4].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
            let rows: Vec<u8> = (0..PANEL_ROWS).flat_map(|_| blk.clone()).collect();
            let mut panel = vec![0u8; rows.len()];
            pack(&rows, size, &mut panel);
            let x = Q8Activation::quantize(&vec![-1.0f32; QK_K]);
            let mut want = [[0.0f32; PANEL_ROWS]; 1];
            dot_panel_ref(format, &panel, 1, &[&x], &mut want);
            for k in crate::kernels::tests::simd_sets() {
                if let Some(kernel) = k.dot_k_panels {
                    let mut got = [[0.0f32; PANEL_ROWS]; 1];
                    kernel(format, &panel, 1, &[&x], &mut got);
                    assert_eq!(got, want, "{} {format:?}", k.name);
                }
            }
        }
    }

    #[test]
    fn extreme_q2_k_q3_k_and_iq4_xs_blocks_stay_exact_in_every_panel_kernel() {
        // All codes 3 (Q3_K: with the high bit clear, −1; set, 3 more), all
        // scales and mins at their largest or smallest, quants −127: the
        // largest sums a block holds, of both signs.
        use crate::quant::{Q2_K_D, Q3_K_D, Q3_K_SCALES};
        let one = half::f16::from_f32(1.0).to_bits().to_le_bytes();
        let mut blocks = Vec::new();
        let mut q2 = vec![0xffu8; Q2_K_BLOCK_BYTES];
        q2[Q2_K_D..Q2_K_D + 2].copy_from_slice(&one);
        q2[Q2_K_D + 2..].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        blocks.push((WeightFormat::Q2K, q2));
        for (hmask, scales) in [(0xffu8, 0xffu8), (0x00, 0x00), (0x00, 0xff)] {
            let mut q3 = vec![0xffu8; Q3_K_BLOCK_BYTES];
            q3[..32].fill(hmask);
            q3[Q3_K_SCALES..Q3_K_D].fill(scales);
            q3[Q3_K_D..].copy_from_slice(&one);
            blocks.push((WeightFormat::Q3K, q3));
        }
        // IQ4_XS: every nibble 0 (−127), the scales at 31 or −32.
        for (scales_h, scales_l) in [(0xffu8, 0xffu8), (0x00, 0x00)] {
            let mut iq = vec![0u8; IQ4_XS_BLOCK_BYTES];
            iq[..2].copy_from_slice(&one);
            iq[2..4].fill(scales_h);
            iq[4..8].fill(scales_l);
            blocks.push((WeightFormat::Iq4Xs, iq));
        }
        for (format, blk) in blocks {
            let rows: Vec<u8> = (0..PANEL_ROWS).flat_map(|_| blk.clone()).collect();
            let mut panel = vec![0u8; PANEL_ROWS * blk.len()];
            pack_format(format, &rows, blk.len(), &mut panel);
            let x = Q8Activation::quantize(&vec![-1.0f32; QK_K]);
            let mut want = [[0.0f32; PANEL_ROWS]; 1];
            dot_panel_ref(format, &panel, 1, &[&x], &mut want);
            assert!(want[0][0] != 0.0);
            for k in crate::kernels::tests::simd_sets() {
                let kernel = match format {
                    WeightFormat::Iq4Xs => k.dot_iq4_xs_panels,
                    _ => k.dot_low_k_panels,
                };
                if let Some(kernel) = kernel {
                    let mut got = [[0.0f32; PANEL_ROWS]; 1];
                    kernel(format, &panel, 1, &[&x], &mut got);
                    assert_eq!(got, want, "{} {format:?}", k.name);
                }
            }
        }
    }

    #[test]
    fn extreme_q6_k_codes_and_scales_stay_exact_in_every_panel_kernel() {
        // Codes −32 with scales −128, and codes 31 with scales −1, against
        // quants −127: the largest block sums of both signs.
        use crate::quant::{Q6_K_D, Q6_K_SCALES};
        for (code_byte, scale) in [(0x00u8, 0x80u8), (0xff, 0xff)] {
            let mut blk = vec![code_byte; Q6_K_BLOCK_BYTES];
            blk[Q6_K_SCALES..Q6_K_D].fill(scale);
            blk[Q6_K_D..].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
            let rows: Vec<u8> = (0..PANEL_ROWS).flat_map(|_| blk.clone()).collect();
            let mut panel = vec![0u8; PANEL_ROWS * Q6_K_BLOCK_BYTES];
            pack_format(WeightFormat::Q6K, &rows, Q6_K_BLOCK_BYTES, &mut panel);
            let x = Q8Activation::quantize(&vec![-1.0f32; QK_K]);
            let mut want = [[0.0f32; PANEL_ROWS]; 1];
            dot_panel_ref(WeightFormat::Q6K, &panel, 1, &[&x], &mut want);
            // 16 sub-blocks of 16 · code · scale · (−127) each.
            let code = if code_byte == 0 { -32.0 } else { 31.0 };
            let sc = scale as i8 as f32;
            assert_eq!(want[0][0], 16.0 * 16.0 * code * sc * -127.0 * x.scales[0]);
            for k in crate::kernels::tests::simd_sets() {
                if let Some(kernel) = k.dot_q6_k_panels {
                    let mut got = [[0.0f32; PANEL_ROWS]; 1];
                    kernel(WeightFormat::Q6K, &panel, 1, &[&x], &mut got);
                    assert_eq!(got, want, "{}", k.name);
                }
            }
        }
    }
}
