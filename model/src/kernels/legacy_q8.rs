//! Q4_1, Q5_0, Q5_1 and IQ4_NL weights (ggml's legacy quants and its
//! non-linear 4-bit one; layouts and dequantizers in [`crate::quant`])
//! against activations quantized to 8-bit blocks of 32 ([`Q8Activation`]),
//! as llama.cpp's `ggml_vec_dot_{q4_1_q8_1, q5_0_q8_0, q5_1_q8_1,
//! iq4_nl_q8_0}` do. A weight block is an activation block: block `b` has
//! the f16 scale `d` (and, for Q4_1/Q5_1, the f16 min `m`), the
//! activation's scale `x.d_b` and quants `a` (−127..=127), and gives exact
//! integers:
//!
//! - Q4_1 / Q5_1 (element `q·d + m`, codes `q` in 0..=15 / 0..=31):
//!   `A_b = Σ q·a` (|A_b| ≤ 32 · 31 · 127 < 2²⁴: exact in f32 too) and
//!   `B_b = Σ a = bsums8_b / 8` (|B_b| ≤ 32 · 127). Its term is
//!   `t_b = fma(f16(d) · x.d_b, A_b, (f16(m) · x.d_b) · B_b)`: three f32
//!   roundings on the min's part (the two products and the fma), two on
//!   the codes' part (`d · x.d_b` and the fma). `t_b` is added into
//!   accumulator lane `b mod 4` (one more rounding, none for the first
//!   term of a lane).
//! - Q5_0 (element `(q − 16)·d`, q in 0..=31) and IQ4_NL (element
//!   `d · v[nibble]`, `v` the signed table [`IQ4_NL_VALUES`], |v| ≤ 127):
//!   one integer `S_b = Σ (q − 16)·a = Σ q·a − 16 · Σ a` or `S_b = Σ v·a`
//!   (|S_b| ≤ 32 · 127 · 127 < 2²⁴), and, as Q4_0's kernel does, lane
//!   `b mod 4` becomes `fma(f16(d) · x.d_b, S_b, lane)`: two roundings per
//!   block (the scale product and the fma).
//!
//! The 4 lanes are reduced as `(a0 + a2) + (a1 + a3)` ([`tree4`]), as the
//! Q4_0, Q4_K and Q6_K kernels do.
//!
//! The scalar `dot_*_q8` are the references; [`avx2`]'s kernels give their
//! bits (the tests check it). The vector kernels take 8 blocks at a time,
//! two per register: the two blocks' nibbles side by side (their low
//! nibbles, elements 0–15, in one register; high ones in another) meet the
//! activation's `split` copy of the quants, laid out the same way, in
//! `maddubs` (unsigned codes · signed quants, pairs ≤ 2 · 31 · 127) and
//! `madd` by ones; three `hadd` and one permutation give the 8 blocks'
//! sums in block order; then every term of the 8 blocks is computed in 8
//! f32 lanes at once and folded into the 4 accumulator lanes as blocks
//! 0–3, then 4–7 (the reference's order). IQ4_NL's values are signed, so
//! its products are taken as `|v| · (a · sign v)` (exact: `a`
//! is never −128), pairs ≤ 2 · 127 · 127 < 2¹⁵.

use super::q4_0::{LANES, tree4};
use super::q8act::Q8Activation;
use crate::format::f16_to_f32;
use crate::quant::{
    IQ4_NL_BLOCK_BYTES, IQ4_NL_VALUES, Q4_1_BLOCK_BYTES, Q5_0_BLOCK_BYTES, Q5_1_BLOCK_BYTES, QK,
};

/// The little-endian f16 at byte `at` of a block.
#[inline(always)]
fn f16_at(blk: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([blk[at], blk[at + 1]]))
}

/// Block `b`'s term of a format with a min, from its integers and
/// scales, in the reference's order of operations (the vector kernels
/// compute exactly this).
#[inline(always)]
fn min_term(d: f32, m: f32, xd: f32, a: i32, s: i32) -> f32 {
    (d * xd).mul_add(a as f32, (m * xd) * s as f32)
}

/// The 32 nibble codes of 16 bytes in element order: the low nibbles are
/// elements 0..16, the high ones 16..32.
#[inline(always)]
fn nibbles(qs: &[u8]) -> [u8; QK] {
    let mut c = [0; QK];
    for (i, &q) in qs[..QK / 2].iter().enumerate() {
        c[i] = q & 0x0f;
        c[i + QK / 2] = q >> 4;
    }
    c
}

/// The 5-bit codes of a Q5_0/Q5_1 block: nibble `e` under bit `e` of the
/// little-endian `qh` at `at` (bit `e % 8` of its byte `e / 8`), nibbles
/// at `at + 4`.
#[inline(always)]
fn five_bit_codes(blk: &[u8], at: usize) -> [u8; QK] {
    let qh = &blk[at..at + 4];
    let mut c = nibbles(&blk[at + 4..at + 4 + QK / 2]);
    for (e, c) in c.iter_mut().enumerate() {
        *c |= ((qh[e / 8] >> (e % 8)) & 1) << 4;
    }
    c
}

/// `Σ v·a` over a block, exactly: every product fits an i16
/// (|v·a| ≤ 127 · 127) and is summed into one of 8 i32 lanes, the shape of
/// the baseline SIMD's 16-bit multiplies (SSE2, NEON), which LLVM then
/// uses.
#[inline(always)]
fn block_dot<V: Copy + Into<i16>>(v: &[V; QK], a: &[i8; QK]) -> i32 {
    let mut lanes = [0i32; 8];
    for e in 0..QK {
        lanes[e % 8] += i32::from(v[e].into() * i16::from(a[e]));
    }
    lanes.iter().sum()
}

/// The formats with a min (blocks of `SIZE` bytes): `codes` gives a
/// block's codes (0..=31).
#[inline(always)]
fn dot_with_min<const SIZE: usize>(
    w: &[u8],
    x: &Q8Activation,
    codes: impl Fn(&[u8; SIZE]) -> [u8; QK],
) -> f32 {
    let (blocks, _) = w.as_chunks::<SIZE>();
    let (quants, _) = x.quants[..blocks.len() * QK].as_chunks::<QK>();
    let mut acc = [0.0f32; LANES];
    for (b, (blk, q)) in blocks.iter().zip(quants).enumerate() {
        let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
        let a = block_dot(&codes(blk), q);
        let s = x.bsums8[b] / 8;
        acc[b % LANES] += min_term(d, m, x.scales[b], a, s);
    }
    tree4(acc)
}

/// The formats without a min (blocks of `SIZE` bytes): `values` gives a
/// block's signed values.
#[inline(always)]
fn dot_signed<const SIZE: usize>(
    w: &[u8],
    x: &Q8Activation,
    values: impl Fn(&[u8; SIZE]) -> [i8; QK],
) -> f32 {
    let (blocks, _) = w.as_chunks::<SIZE>();
    let (quants, _) = x.quants[..blocks.len() * QK].as_chunks::<QK>();
    let mut acc = [0.0f32; LANES];
    for (b, (blk, q)) in blocks.iter().zip(quants).enumerate() {
        let d = f16_at(blk, 0) * x.scales[b];
        let s = block_dot(&values(blk), q);
        acc[b % LANES] = d.mul_add(s as f32, acc[b % LANES]);
    }
    tree4(acc)
}

/// Scalar reference: a Q4_1 row (`n/32` blocks of 20 bytes: f16 `d`, f16
/// `m`, 16 bytes of nibbles) · activation.
pub fn dot_q4_1_q8(w: &[u8], x: &Q8Activation) -> f32 {
    dot_with_min::<Q4_1_BLOCK_BYTES>(w, x, |blk| nibbles(&blk[4..]))
}

/// Scalar reference: a Q5_1 row (`n/32` blocks of 24 bytes: f16 `d`, f16
/// `m`, `qh`, 16 bytes of nibbles) · activation.
pub fn dot_q5_1_q8(w: &[u8], x: &Q8Activation) -> f32 {
    dot_with_min::<Q5_1_BLOCK_BYTES>(w, x, |blk| five_bit_codes(blk, 4))
}

/// Scalar reference: a Q5_0 row (`n/32` blocks of 22 bytes: f16 `d`,
/// `qh`, 16 bytes of nibbles) · activation.
pub fn dot_q5_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
    dot_signed::<Q5_0_BLOCK_BYTES>(w, x, |blk| {
        let q = five_bit_codes(blk, 2);
        let mut v = [0; QK];
        for e in 0..QK {
            v[e] = q[e] as i8 - 16;
        }
        v
    })
}

/// Scalar reference: an IQ4_NL row (`n/32` blocks of 18 bytes: f16 `d`,
/// 16 bytes of nibbles indexing [`IQ4_NL_VALUES`]) · activation.
pub fn dot_iq4_nl_q8(w: &[u8], x: &Q8Activation) -> f32 {
    dot_signed::<IQ4_NL_BLOCK_BYTES>(w, x, |blk| {
        let mut v = [0; QK];
        for (i, &q) in blk[2..2 + QK / 2].iter().enumerate() {
            v[i] = IQ4_NL_VALUES[usize::from(q & 0x0f)];
            v[i + QK / 2] = IQ4_NL_VALUES[usize::from(q >> 4)];
        }
        v
    })
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! # Safety
    //! Every function needs AVX2, FMA and F16C (the caller checked them at
    //! run time), `w` whole blocks of its format and every activation of
    //! `w`'s length in elements (`w.len() / block bytes × 32` quants, one
    //! scale and one sum per block, and `split` filled as
    //! [`Q8Activation::quantize`] does: the kernels read the quants
    //! there); the several-token kernels at most
    //! [`MULTI`](crate::kernels::q8act::MULTI) activations and an output
    //! for each.
    //!
    //! Blocks are taken 8 at a time (the last group masked: its missing
    //! blocks give sums, scales and so terms of +0, which leave a lane's
    //! bits as they are, a lane never being −0).
    //!
    //! One walk serves `N` activations (the single-token kernels are
    //! `N = 1`): each pair of blocks is decoded once and its codes meet
    //! every activation's quants, and a group's f16 scales are converted
    //! once; every activation's sums, terms and lanes are its own, the
    //! same operations in the same order as for one activation, so result
    //! `t` is the single-token kernel's for `xs[t]`.

    use std::arch::x86_64::*;

    use super::Q8Activation;
    use crate::kernels::q8act::{Tokens, by_count};
    use crate::quant::{
        IQ4_NL_BLOCK_BYTES, IQ4_NL_VALUES, Q4_1_BLOCK_BYTES, Q5_0_BLOCK_BYTES, Q5_1_BLOCK_BYTES,
    };

    /// Byte offsets of 8 consecutive blocks of `size` bytes.
    const fn offsets(size: usize) -> [i32; 8] {
        let mut o = [0i32; 8];
        let mut i = 0;
        while i < 8 {
            o[i] = (i * size) as i32;
            i += 1;
        }
        o
    }

    /// A format's layout and fold (trait constants and methods rather
    /// than closures: `#[inline(always)]` puts them into the
    /// `target_feature` kernels, where a closure left out of line would
    /// call every intrinsic).
    trait Format {
        /// Bytes of a block.
        const SIZE: usize;
        /// Where a block's 16 bytes of nibbles lie.
        const QS: usize;
        /// Where a Q5 block's fifth bits (a little-endian u32) lie.
        const QH: Option<usize>;
        /// Whether codes index [`IQ4_NL_VALUES`] (signed values).
        const TABLE: bool;
        /// Whether bytes 2–3 of a block are an f16 min.
        const MIN: bool;
        /// A group's terms for one activation added into its 4
        /// accumulator lanes.
        unsafe fn fold(acc: __m128, g: Group) -> __m128;
    }

    /// Two blocks' codes, decoded once for every activation: `lo` the
    /// bytes `maddubs` takes unsigned for elements 0–15 of each block
    /// (block `a`'s in the low 128 bits, `b`'s in the high), `hi` for
    /// elements 16–31; the codes themselves, or for the table |v|, with
    /// the signed values `v` in `lo_v`, `hi_v` (unused otherwise).
    #[derive(Clone, Copy)]
    struct Pair {
        lo: __m256i,
        hi: __m256i,
        lo_v: __m256i,
        hi_v: __m256i,
    }

    /// The codes of blocks `a` and `b` (zero where `b` is `None`).
    ///
    /// The nibbles of both blocks are one register (low nibbles: elements
    /// 0–15 of each, high: 16–31), so the activation's split layout pairs
    /// with them without a shuffle.
    #[inline(always)]
    unsafe fn decode<F: Format>(a: *const u8, b: Option<*const u8>) -> Pair {
        // SAFETY: whole blocks at `a` and `b` (caller); register
        // arithmetic under the module's guarantee.
        unsafe {
            let la = _mm_loadu_si128(a.add(F::QS) as *const __m128i);
            let lb = match b {
                Some(b) => _mm_loadu_si128(b.add(F::QS) as *const __m128i),
                None => _mm_setzero_si128(),
            };
            let raw = _mm256_set_m128i(lb, la);
            let m4 = _mm256_set1_epi8(0x0f);
            let mut lo = _mm256_and_si256(raw, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
            if let Some(at) = F::QH {
                let bits = |p: *const u8| {
                    i32::from_le_bytes(std::ptr::read_unaligned(p.add(at) as *const [u8; 4]))
                };
                let hb = b.map_or(0, bits);
                // Each 128-bit half: its block's qh in its low 32 bits.
                let qh = _mm256_setr_epi32(bits(a), 0, 0, 0, hb, 0, 0, 0);
                // Byte e of a half takes byte e / 8 of its qh (0, 1 for the
                // low nibbles' elements 0–15, 2, 3 for 16–31), keeps bit
                // e mod 8 and becomes 0x10 where it is set.
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                let sixteen = _mm256_set1_epi8(0x10);
                let fifth = |sel: __m256i| {
                    let spread = _mm256_shuffle_epi8(qh, sel);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
                    _mm256_and_si256(set, sixteen)
                };
                lo = _mm256_or_si256(
                    lo,
                    fifth(_mm256_setr_epi8(
                        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1,
                        1, 1, 1, 1, 1, 1, 1,
                    )),
                );
                hi = _mm256_or_si256(
                    hi,
                    fifth(_mm256_setr_epi8(
                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                        3, 3, 3, 3, 3, 3, 3,
                    )),
                );
            }
            if F::TABLE {
                let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                    IQ4_NL_VALUES.as_ptr() as *const __m128i
                ));
                // Codes < 16: the shuffle looks each up in the table.
                let (lo_v, hi_v) = (
                    _mm256_shuffle_epi8(table, lo),
                    _mm256_shuffle_epi8(table, hi),
                );
                Pair {
                    lo: _mm256_abs_epi8(lo_v),
                    hi: _mm256_abs_epi8(hi_v),
                    lo_v,
                    hi_v,
                }
            } else {
                Pair {
                    lo,
                    hi,
                    lo_v: lo,
                    hi_v: hi,
                }
            }
        }
    }

    /// A pair's integer sums of `code · a` (or `v · a`) against one
    /// activation, 4 partial sums per block: lanes 0–3 block `a`'s, lanes
    /// 4–7 block `b`'s. `xlo` and `xhi`: the 32 bytes of `split` holding
    /// the two blocks' first 16 quants, and their last 16.
    ///
    /// `maddubs` pairs are ≤ 2 · 31 · 127, two of them added in 16 bits
    /// ≤ 15748; the table's, taken as |v| · (a · sign v) (exact: `a` is
    /// never −128), are ≤ 2 · 127 · 127 and widened first.
    #[inline(always)]
    unsafe fn products<F: Format>(p: &Pair, xlo: *const i8, xhi: *const i8) -> __m256i {
        // SAFETY: 32 bytes at `xlo` and `xhi` (caller); register
        // arithmetic under the module's guarantee.
        unsafe {
            let xl = _mm256_loadu_si256(xlo as *const __m256i);
            let xh = _mm256_loadu_si256(xhi as *const __m256i);
            let ones = _mm256_set1_epi16(1);
            if F::TABLE {
                let prod = |mag: __m256i, v: __m256i, x: __m256i| {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, v)), ones)
                };
                _mm256_add_epi32(prod(p.lo, p.lo_v, xl), prod(p.hi, p.hi_v, xh))
            } else {
                let s = _mm256_add_epi16(
                    _mm256_maddubs_epi16(p.lo, xl),
                    _mm256_maddubs_epi16(p.hi, xh),
                );
                _mm256_madd_epi16(s, ones)
            }
        }
    }

    /// The accumulator lanes reduced as [`super::tree4`] does.
    #[inline(always)]
    unsafe fn finish(acc: __m128) -> f32 {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let h2 = _mm_add_ps(acc, _mm_movehl_ps(acc, acc));
            _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)))
        }
    }

    /// What a group of (up to) 8 blocks hands the format's fold for one
    /// activation.
    struct Group {
        /// Per block, the integer sum of its products.
        sums: __m256i,
        /// The blocks' f16 `d`, 0 past the last block.
        d: __m256,
        /// Their f16 `m` where the format has one (else unused).
        m: __m256,
        /// `x.d_b`, 0 past the last block.
        xd: __m256,
        /// `x.bsums8_b`, 0 past the last block.
        bsums8: __m256i,
    }

    /// Blocks `c..c + n` (`c` a multiple of 8, n ≤ 8, `mask` set in
    /// lanes `< n`) of a row at `wp` into every activation's lanes.
    #[inline(always)]
    unsafe fn group<F: Format, const N: usize>(
        wp: *const u8,
        xs: &[&Q8Activation; N],
        c: usize,
        n: usize,
        (mask, offsets): (__m256i, __m256i),
        acc: &mut [__m128; N],
    ) {
        // SAFETY: blocks c..c + n are in the row and every activation
        // (caller), and `split` holds their groups of 4 (module docs);
        // the masked loads and the gather touch only those.
        unsafe {
            let zero = _mm256_setzero_si256();
            // Per activation, the first `hadd` round of pairs (0, 1) and of
            // pairs (2, 3).
            let mut h = [[zero; 2]; N];
            for half in 0..2 {
                let mut v = [[zero; 2]; N];
                for r in 0..2 {
                    let p = 2 * half + r;
                    if 2 * p >= n {
                        break;
                    }
                    let b = c + 2 * p;
                    let second = (2 * p + 1 < n).then(|| wp.add((b + 1) * F::SIZE));
                    let codes = decode::<F>(wp.add(b * F::SIZE), second);
                    // Split group b / 4: pairs at 0 and 32, last halves 64 on.
                    let at = b / 4 * 128 + 32 * (p % 2);
                    for (x, v) in xs.iter().zip(v.iter_mut()) {
                        let sp = x.split.as_ptr().add(at);
                        v[r] = products::<F>(&codes, sp, sp.add(64));
                    }
                }
                for (h, v) in h.iter_mut().zip(&v) {
                    h[half] = _mm256_hadd_epi32(v[0], v[1]);
                }
            }
            let heads = if n == 8 {
                // Plain loads (cheaper than a gather here).
                let h = |i: usize| {
                    i32::from_le_bytes(std::ptr::read_unaligned(
                        wp.add((c + i) * F::SIZE) as *const [u8; 4]
                    ))
                };
                _mm256_setr_epi32(h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7))
            } else {
                _mm256_mask_i32gather_epi32::<1>(
                    _mm256_setzero_si256(),
                    wp.add(c * F::SIZE) as *const i32,
                    offsets,
                    mask,
                )
            };
            let (d, m) = if F::MIN {
                halves(heads)
            } else {
                (low_halves(heads), _mm256_setzero_ps())
            };
            // Halves (0, 2, 4, 6) and (1, 3, 5, 7) back to block order.
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            for ((x, h), acc) in xs.iter().zip(&h).zip(acc.iter_mut()) {
                let sums = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h[0], h[1]), order);
                let g = Group {
                    sums,
                    d,
                    m,
                    xd: _mm256_maskload_ps(x.scales.as_ptr().add(c), mask),
                    bsums8: _mm256_maskload_epi32(x.bsums8.as_ptr().add(c), mask),
                };
                *acc = F::fold(*acc, g);
            }
        }
    }

    /// The shared walk over a row of `F`'s blocks, for `N` activations.
    struct Walk<F>(std::marker::PhantomData<F>);

    impl<F: Format> Tokens for Walk<F> {
        #[inline(always)]
        unsafe fn run<const N: usize>(w: &[u8], xs: &[&Q8Activation; N]) -> [f32; N] {
            let blocks = w.len() / F::SIZE;
            let wp = w.as_ptr();
            let offs = offsets(F::SIZE);
            // SAFETY: blocks c..c + n < blocks are read, with every
            // activation's quants, scales and sums (module docs).
            unsafe {
                let offsets = _mm256_loadu_si256(offs.as_ptr() as *const __m256i);
                let mut acc = [_mm_setzero_ps(); N];
                let all = _mm256_set1_epi32(-1);
                let mut c = 0;
                while c + 8 <= blocks {
                    group::<F, N>(wp, xs, c, 8, (all, offsets), &mut acc);
                    c += 8;
                }
                if c < blocks {
                    let n = blocks - c;
                    let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), iota);
                    group::<F, N>(wp, xs, c, n, (mask, offsets), &mut acc);
                }
                let mut out = [0.0f32; N];
                for (o, a) in out.iter_mut().zip(acc) {
                    *o = finish(a);
                }
                out
            }
        }
    }

    /// The 8 blocks' f16 at bytes 0–1 of their heads, and at bytes 2–3.
    #[inline(always)]
    unsafe fn halves(heads: __m256i) -> (__m256, __m256) {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            // Per 128-bit half: the 4 low f16, then the 4 high ones.
            let split = _mm256_shuffle_epi8(
                heads,
                _mm256_setr_epi8(
                    0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13,
                    2, 3, 6, 7, 10, 11, 14, 15,
                ),
            );
            // 64-bit quarters (lo0, hi0, lo1, hi1) → (lo0, lo1, hi0, hi1).
            let both = _mm256_permute4x64_epi64::<0b11_01_10_00>(split);
            (
                _mm256_cvtph_ps(_mm256_castsi256_si128(both)),
                _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(both)),
            )
        }
    }

    /// The 8 blocks' f16 `d` at bytes 0–1 of their heads.
    #[inline(always)]
    unsafe fn low_halves(heads: __m256i) -> __m256 {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            // 16-bit lanes: zero the high half of each 32-bit lane and pack
            // (packus keeps the values below 2¹⁶ as they are).
            let lo = _mm256_and_si256(heads, _mm256_set1_epi32(0xffff));
            let packed = _mm256_packus_epi32(lo, lo);
            let both = _mm256_permute4x64_epi64::<0b10_00_10_00>(packed);
            _mm256_cvtph_ps(_mm256_castsi256_si128(both))
        }
    }

    /// Lanes `acc + t` for blocks 0–3, then 4–7 of `t`.
    #[inline(always)]
    unsafe fn add8(acc: __m128, t: __m256) -> __m128 {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let acc = _mm_add_ps(acc, _mm256_castps256_ps128(t));
            _mm_add_ps(acc, _mm256_extractf128_ps::<1>(t))
        }
    }

    /// Lanes `fma(d, s, acc)` for blocks 0–3, then 4–7.
    #[inline(always)]
    unsafe fn fma8(acc: __m128, d: __m256, s: __m256) -> __m128 {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let acc = _mm_fmadd_ps(_mm256_castps256_ps128(d), _mm256_castps256_ps128(s), acc);
            _mm_fmadd_ps(
                _mm256_extractf128_ps::<1>(d),
                _mm256_extractf128_ps::<1>(s),
                acc,
            )
        }
    }

    /// A min format's fold: `t = fma(d·xd, A, (m·xd)·B)`, `B = bsums8 / 8`.
    #[inline(always)]
    unsafe fn fold_min(acc: __m128, g: Group) -> __m128 {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let a = _mm256_cvtepi32_ps(g.sums);
            let b = _mm256_cvtepi32_ps(_mm256_srai_epi32::<3>(g.bsums8));
            let t = _mm256_fmadd_ps(
                _mm256_mul_ps(g.d, g.xd),
                a,
                _mm256_mul_ps(_mm256_mul_ps(g.m, g.xd), b),
            );
            add8(acc, t)
        }
    }

    struct Q41;
    struct Q51;
    struct Q50;
    struct Iq4Nl;

    impl Format for Q41 {
        const SIZE: usize = Q4_1_BLOCK_BYTES;
        const QS: usize = 4;
        const QH: Option<usize> = None;
        const TABLE: bool = false;
        const MIN: bool = true;
        #[inline(always)]
        unsafe fn fold(acc: __m128, g: Group) -> __m128 {
            // SAFETY: register arithmetic under the module's guarantee.
            unsafe { fold_min(acc, g) }
        }
    }

    impl Format for Q51 {
        const SIZE: usize = Q5_1_BLOCK_BYTES;
        const QS: usize = 8;
        const QH: Option<usize> = Some(4);
        const TABLE: bool = false;
        const MIN: bool = true;
        #[inline(always)]
        unsafe fn fold(acc: __m128, g: Group) -> __m128 {
            // SAFETY: register arithmetic under the module's guarantee.
            unsafe { fold_min(acc, g) }
        }
    }

    impl Format for Q50 {
        const SIZE: usize = Q5_0_BLOCK_BYTES;
        const QS: usize = 6;
        const QH: Option<usize> = Some(2);
        const TABLE: bool = false;
        const MIN: bool = false;
        #[inline(always)]
        unsafe fn fold(acc: __m128, g: Group) -> __m128 {
            // SAFETY: register arithmetic under the module's guarantee.
            unsafe {
                // S = Σ q·a − 16 · Σ a = Σ q·a − 2 · bsums8, exactly.
                let s = _mm256_sub_epi32(g.sums, _mm256_slli_epi32::<1>(g.bsums8));
                fma8(acc, _mm256_mul_ps(g.d, g.xd), _mm256_cvtepi32_ps(s))
            }
        }
    }

    impl Format for Iq4Nl {
        const SIZE: usize = IQ4_NL_BLOCK_BYTES;
        const QS: usize = 2;
        const QH: Option<usize> = None;
        const TABLE: bool = true;
        const MIN: bool = false;
        #[inline(always)]
        unsafe fn fold(acc: __m128, g: Group) -> __m128 {
            // SAFETY: register arithmetic under the module's guarantee.
            unsafe { fma8(acc, _mm256_mul_ps(g.d, g.xd), _mm256_cvtepi32_ps(g.sums)) }
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract.
        unsafe { Walk::<Q41>::run::<1>(w, &[x])[0] }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_1_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract.
        unsafe { Walk::<Q51>::run::<1>(w, &[x])[0] }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract.
        unsafe { Walk::<Q50>::run::<1>(w, &[x])[0] }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq4_nl_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: the module contract.
        unsafe { Walk::<Iq4Nl>::run::<1>(w, &[x])[0] }
    }

    /// Up to [`MULTI`](crate::kernels::q8act::MULTI) activations against one Q4_1 row: `out[t]` is
    /// [`dot_q4_1_q8`]`(w, xs[t])`, bit for bit.
    ///
    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: the module contract.
        unsafe { by_count::<Walk<Q41>>(w, xs, out) }
    }

    /// Up to [`MULTI`](crate::kernels::q8act::MULTI) activations against one Q5_1 row: `out[t]` is
    /// [`dot_q5_1_q8`]`(w, xs[t])`, bit for bit.
    ///
    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_1_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: the module contract.
        unsafe { by_count::<Walk<Q51>>(w, xs, out) }
    }

    /// Up to [`MULTI`](crate::kernels::q8act::MULTI) activations against one Q5_0 row: `out[t]` is
    /// [`dot_q5_0_q8`]`(w, xs[t])`, bit for bit.
    ///
    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: the module contract.
        unsafe { by_count::<Walk<Q50>>(w, xs, out) }
    }

    /// Up to [`MULTI`](crate::kernels::q8act::MULTI) activations against one IQ4_NL row: `out[t]` is
    /// [`dot_iq4_nl_q8`]`(w, xs[t])`, bit for bit.
    ///
    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_iq4_nl_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: the module contract.
        unsafe { by_count::<Walk<Iq4Nl>>(w, xs, out) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_iq4_nl, dequantize_q4_1, dequantize_q5_0, dequantize_q5_1};
    use rand::{Rng, SeedableRng};

    type Dot = fn(&[u8], &Q8Activation) -> f32;
    type Deq = fn(&[u8], &mut [f32]);
    /// A several-token vector kernel (its CPU features checked by the
    /// caller).
    #[cfg(target_arch = "x86_64")]
    type UnsafeMulti = unsafe fn(&[u8], &[&Q8Activation], &mut [f32]);

    /// f32's unit roundoff.
    const U: f64 = f32::EPSILON as f64 / 2.0;

    /// `γₖ = k·u / (1 − k·u)`: the bound on `|Π (1 + δᵢ) − 1|` over `k`
    /// roundings.
    fn gamma(k: usize) -> f64 {
        k as f64 * U / (1.0 - k as f64 * U)
    }

    struct Format {
        name: &'static str,
        format: crate::format::WeightFormat,
        size: usize,
        /// Whether bytes 2–3 are an f16 min.
        min: bool,
        dot: Dot,
        deq: Deq,
        /// `(|codes' part|, |min|)` of element `e` of a block, as exact
        /// reals: `|q·d|` (or `|(q − 16)·d|`, `|v·d|`) and `|m|` (or 0).
        parts: fn(&[u8], usize) -> (f64, f64),
        #[cfg(target_arch = "x86_64")]
        avx2: unsafe fn(&[u8], &Q8Activation) -> f32,
        #[cfg(target_arch = "x86_64")]
        avx2_multi: UnsafeMulti,
    }

    fn d(blk: &[u8]) -> f64 {
        f16_at(blk, 0) as f64
    }

    fn m(blk: &[u8]) -> f64 {
        f16_at(blk, 2) as f64
    }

    fn formats() -> [Format; 4] {
        [
            Format {
                name: "q4_1",
                format: crate::format::WeightFormat::Q4_1,
                size: Q4_1_BLOCK_BYTES,
                min: true,
                dot: dot_q4_1_q8,
                deq: dequantize_q4_1,
                parts: |blk, e| {
                    let q = nibbles(&blk[4..])[e] as f64;
                    ((q * d(blk)).abs(), m(blk).abs())
                },
                #[cfg(target_arch = "x86_64")]
                avx2: avx2::dot_q4_1_q8,
                #[cfg(target_arch = "x86_64")]
                avx2_multi: avx2::dot_q4_1_q8_multi,
            },
            Format {
                name: "q5_1",
                format: crate::format::WeightFormat::Q5_1,
                size: Q5_1_BLOCK_BYTES,
                min: true,
                dot: dot_q5_1_q8,
                deq: dequantize_q5_1,
                parts: |blk, e| {
                    let q = five_bit_codes(blk, 4)[e] as f64;
                    ((q * d(blk)).abs(), m(blk).abs())
                },
                #[cfg(target_arch = "x86_64")]
                avx2: avx2::dot_q5_1_q8,
                #[cfg(target_arch = "x86_64")]
                avx2_multi: avx2::dot_q5_1_q8_multi,
            },
            Format {
                name: "q5_0",
                format: crate::format::WeightFormat::Q5_0,
                size: Q5_0_BLOCK_BYTES,
                min: false,
                dot: dot_q5_0_q8,
                deq: dequantize_q5_0,
                parts: |blk, e| {
                    let q = five_bit_codes(blk, 2)[e] as f64 - 16.0;
                    ((q * d(blk)).abs(), 0.0)
                },
                #[cfg(target_arch = "x86_64")]
                avx2: avx2::dot_q5_0_q8,
                #[cfg(target_arch = "x86_64")]
                avx2_multi: avx2::dot_q5_0_q8_multi,
            },
            Format {
                name: "iq4_nl",
                format: crate::format::WeightFormat::Iq4Nl,
                size: IQ4_NL_BLOCK_BYTES,
                min: false,
                dot: dot_iq4_nl_q8,
                deq: dequantize_iq4_nl,
                parts: |blk, e| {
                    let v = IQ4_NL_VALUES[usize::from(nibbles(&blk[2..])[e])] as f64;
                    ((v * d(blk)).abs(), 0.0)
                },
                #[cfg(target_arch = "x86_64")]
                avx2: avx2::dot_iq4_nl_q8,
                #[cfg(target_arch = "x86_64")]
                avx2_multi: avx2::dot_iq4_nl_q8_multi,
            },
        ]
    }

    /// Row lengths in blocks: below, at and around the 4 lanes and the 8
    /// blocks of a vector group, and a 2048-wide row.
    const BLOCKS: [usize; 14] = [1, 2, 3, 4, 5, 7, 8, 9, 13, 15, 16, 17, 31, 64];

    /// A random f16 scale: ordinary, negative, tiny (subnormal f16) or
    /// large, of either sign.
    fn scale(rng: &mut impl Rng) -> half::f16 {
        let v = match rng.random_range(0..6) {
            0 => rng.random_range(1e-7f32..5e-5),
            1 => rng.random_range(100.0f32..60000.0),
            _ => rng.random_range(1e-4f32..0.05),
        };
        half::f16::from_f32(if rng.random() { v } else { -v })
    }

    /// Random blocks: every code and bit random, then finite random
    /// scales (and mins) written over the f16 fields; no block all-zero.
    fn random_row(rng: &mut impl Rng, f: &Format, blocks: usize) -> Vec<u8> {
        let mut w: Vec<u8> = (0..blocks * f.size).map(|_| rng.random()).collect();
        for blk in w.chunks_exact_mut(f.size) {
            let fields: &[usize] = if f.min { &[0, 2] } else { &[0] };
            for &at in fields {
                blk[at..at + 2].copy_from_slice(&scale(rng).to_bits().to_le_bytes());
            }
        }
        w
    }

    /// Activations of `blocks` blocks with differing block scales: block 0
    /// all ±1 (quants ±127), block 1 (where there is one) all zero, the
    /// others random at scales from 1e-3 to 1e3.
    fn activations(rng: &mut impl Rng, blocks: usize) -> Vec<Q8Activation> {
        let mut out = Vec::new();
        for _ in 0..3 {
            let mut x = Vec::with_capacity(blocks * QK);
            for b in 0..blocks {
                let spread = 10f32.powi(rng.random_range(-3..=3));
                for _ in 0..QK {
                    x.push(match b {
                        0 => {
                            if rng.random() {
                                1.0
                            } else {
                                -1.0
                            }
                        }
                        1 => 0.0,
                        _ => rng.random_range(-1.0f32..1.0) * spread,
                    });
                }
            }
            out.push(Q8Activation::quantize(&x));
        }
        // And one plain random activation without special blocks.
        let x: Vec<f32> = (0..blocks * QK)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        out.push(Q8Activation::quantize(&x));
        out
    }

    /// The scalar reference against the f64 product of the dequantized row
    /// (`crate::quant`'s, ggml's) with the activation's values `x.d_b · a`.
    ///
    /// The bound. Let `P = Σₑ (|c_e| + |m_e|) · |x.d_b · a_e|`, `c_e` the
    /// codes' part of element `e` (`q·d`, `(q − 16)·d` or `v·d`: exact
    /// in f32, ≤ 16 significant bits) and `m_e` its block's min (0 without
    /// one). With `k = ⌈blocks / 4⌉` terms in the fullest lane:
    ///
    /// - Q4_1/Q5_1: a term `t_b` is its exact value with each of its two
    ///   parts off by at most γ₃ (three roundings on the min's part, two
    ///   on the codes'); a lane adds its terms with `k − 1` roundings (the
    ///   first add, to 0, is exact) and the tree with 2 more: γ_{k+4}·P.
    ///   The dequantizer rounds each element's `q·d + m` once: u·P more.
    ///   So `|got − exact| ≤ γ_{k+5}·P`.
    /// - Q5_0/IQ4_NL: `d·x.d_b` (1) and `k` fused multiply-adds in the
    ///   lane (the first, onto 0, rounds too), then the tree (2): γ_{k+3}·P;
    ///   the dequantized elements are exact.
    ///
    /// The f64 sums add at most `n · 2⁻⁵² · P`. (No f32 term underflows
    /// here: the smallest scale product is ~1e-7 · 1e-5.)
    #[test]
    fn the_reference_is_within_its_rounding_bound_of_the_exact_product() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(71);
        for f in formats() {
            let mut worst = 0.0f64;
            for &blocks in &BLOCKS {
                let n = blocks * QK;
                for _ in 0..4 {
                    let w = random_row(&mut rng, &f, blocks);
                    let mut deq = vec![0.0f32; n];
                    (f.deq)(&w, &mut deq);
                    for a in activations(&mut rng, blocks) {
                        let xv = |e: usize| a.scales[e / QK] as f64 * a.quants[e] as f64;
                        let terms = || (0..n).map(|e| deq[e] as f64 * xv(e));
                        let exact: f64 = terms().sum();
                        let p: f64 = (0..n)
                            .map(|e| {
                                let blk = &w[e / QK * f.size..][..f.size];
                                let (c, m) = (f.parts)(blk, e % QK);
                                (c + m) * xv(e).abs()
                            })
                            .sum();
                        assert!(
                            terms().any(|v| v != 0.0),
                            "{} {blocks} blocks: an all-zero product proves nothing",
                            f.name
                        );
                        let k = blocks.div_ceil(LANES);
                        let g = if f.min { gamma(k + 5) } else { gamma(k + 3) };
                        let bound = g * p + n as f64 * f64::EPSILON * p;
                        let got = (f.dot)(&w, &a) as f64;
                        let off = (got - exact).abs();
                        assert!(
                            off <= bound,
                            "{} {blocks} blocks: {got:e} vs {exact:e} (P {p:e}, off by {:.2}u·P, \
                             bound {:.2}u·P)",
                            f.name,
                            off / (U * p),
                            bound / (U * p)
                        );
                        worst = worst.max(off / bound);
                    }
                }
            }
            eprintln!("{}: worst error {worst:.3} of the bound", f.name);
        }
    }

    /// A row whose codes are all 0 is its min (or `−16·d` for Q5_0)
    /// everywhere: the product is that times `Σ x`, which checks the min
    /// and zero-point terms on their own.
    #[test]
    fn a_constant_row_gives_its_constant_times_the_activation_sum() {
        let x: Vec<f32> = (0..5 * QK).map(|i| (i % 7) as f32 * 0.25 - 0.5).collect();
        let a = Q8Activation::quantize(&x);
        let sum: f64 = (0..x.len())
            .map(|e| a.scales[e / QK] as f64 * a.quants[e] as f64)
            .sum();
        for f in formats() {
            let mut w = vec![0u8; 5 * f.size];
            for blk in w.chunks_exact_mut(f.size) {
                blk[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
                if f.min {
                    blk[2..4].copy_from_slice(&half::f16::from_f32(-1.5).to_bits().to_le_bytes());
                }
            }
            let value = match f.name {
                "q4_1" | "q5_1" => -1.5,
                "q5_0" => -8.0,
                _ => -63.5, // iq4_nl: nibble 0 is −127
            };
            let got = (f.dot)(&w, &a) as f64;
            let want = value * sum;
            assert!(
                (got - want).abs() <= 1e-5 * want.abs(),
                "{}: {got} vs {want}",
                f.name
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_kernels_equal_the_reference_bit_for_bit() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("SKIP avx2: this CPU has no AVX2+FMA+F16C (probe: is_x86_feature_detected)");
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(72);
        for f in formats() {
            for &blocks in &BLOCKS {
                for _ in 0..4 {
                    let w = random_row(&mut rng, &f, blocks);
                    for a in activations(&mut rng, blocks) {
                        let want = (f.dot)(&w, &a);
                        // SAFETY: features checked above; `w` whole blocks
                        // and `a` of its length.
                        let got = unsafe { (f.avx2)(&w, &a) };
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{} {blocks} blocks: {got:e} vs {want:e}",
                            f.name
                        );
                    }
                }
            }
            // The extremes: every code at its largest against quants of
            // −127 (the largest integers a block can have), and all-zero
            // weights.
            for fill in [0xffu8, 0x00] {
                let blocks = 11;
                let mut w = vec![fill; blocks * f.size];
                for blk in w.chunks_exact_mut(f.size) {
                    blk[..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
                    if f.min {
                        blk[2..4]
                            .copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
                    }
                }
                let a = Q8Activation::quantize(&vec![-1.0f32; blocks * QK]);
                let want = (f.dot)(&w, &a);
                assert!(want != 0.0, "{}", f.name);
                // SAFETY: as above.
                let got = unsafe { (f.avx2)(&w, &a) };
                assert_eq!(got.to_bits(), want.to_bits(), "{} fill {fill:#x}", f.name);
            }
        }
    }

    /// A random activation of `blocks` blocks, none of them zero: block
    /// scales from 1e-3 to 1e3, and now and then a block of ±1 (quants
    /// ±127, the largest).
    fn nonzero_activation(rng: &mut impl Rng, blocks: usize) -> Q8Activation {
        let mut x = Vec::with_capacity(blocks * QK);
        for _ in 0..blocks {
            let spread = 10f32.powi(rng.random_range(-3..=3));
            let ones = rng.random_ratio(1, 5);
            for _ in 0..QK {
                let sign = if rng.random() { 1.0 } else { -1.0 };
                x.push(if ones {
                    sign
                } else {
                    sign * rng.random_range(0.01f32..1.0) * spread
                });
            }
        }
        Q8Activation::quantize(&x)
    }

    /// Every several-token kernel this CPU runs (AVX2's, and each kernel
    /// set's `dot_more_q8_multi`), on rows of 1 to 13 blocks (around the
    /// 4 lanes and the 8-block groups) with random codes and f16 scales
    /// and mins (ordinary, negative, subnormal, large), against 1 to 4
    /// random activations: result `t` has the bits of the scalar
    /// reference for activation `t`, and nothing past the activations'
    /// outputs is written.
    #[test]
    fn the_multi_token_kernels_give_the_reference_bits_for_every_token() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(73);
        let sets = crate::kernels::tests::simd_sets();
        let mut checked = 0;
        for f in formats() {
            for blocks in 1..=13 {
                for rep in 0..6 {
                    let w = random_row(&mut rng, &f, blocks);
                    for m in 1..=crate::kernels::q8act::MULTI {
                        let acts: Vec<Q8Activation> = (0..m)
                            .map(|_| nonzero_activation(&mut rng, blocks))
                            .collect();
                        let xs: Vec<&Q8Activation> = acts.iter().collect();
                        let want: Vec<u32> = xs.iter().map(|x| (f.dot)(&w, x).to_bits()).collect();
                        let at = format!("{} {blocks} blocks, row {rep}, {m} tokens", f.name);
                        let check = |level: &str, out: &[f32]| {
                            let got: Vec<u32> = out[..m].iter().map(|v| v.to_bits()).collect();
                            assert_eq!(got, want, "{level} {at}");
                            assert!(out[m].is_nan(), "{level} {at}: wrote past the outputs");
                        };
                        #[cfg(target_arch = "x86_64")]
                        if is_x86_feature_detected!("avx2")
                            && is_x86_feature_detected!("fma")
                            && is_x86_feature_detected!("f16c")
                        {
                            let mut out = vec![f32::NAN; m + 1];
                            // SAFETY: features checked above; `w` whole
                            // blocks, every activation of its length and
                            // an output for each.
                            unsafe { (f.avx2_multi)(&w, &xs, &mut out) };
                            check("avx2", &out);
                            checked += 1;
                        } else if rep == 0 && blocks == 1 && m == 1 {
                            eprintln!("SKIP avx2 multi: this CPU has no AVX2+FMA+F16C");
                        }
                        for set in &sets {
                            let Some(multi) = set.dot_more_q8_multi else {
                                continue;
                            };
                            let mut out = vec![f32::NAN; m + 1];
                            multi(f.format, &w, &xs, &mut out);
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
