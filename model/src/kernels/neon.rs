//! NEON kernels for aarch64, chosen at run time (`super::select_simd`).
//!
//! NEON (Advanced SIMD) is part of every aarch64 target Rust builds for
//! (checked at compile time below); the integer kernels have a second
//! build with SDOT (the `dotprod` extension, ARMv8.2), installed only where
//! `is_aarch64_feature_detected!("dotprod")` finds it. Both builds run the
//! same arithmetic, so they give the same bits.
//!
//! Contracts, as the x86 kernels' (`super::x86`, `super::q8act`,
//! `super::q4_0`):
//! - `dot_f32`, `dot_bf16`, `dot_f16`: within rounding of the scalar
//!   reference, with the AVX2 kernels' arithmetic (their 8-lane
//!   accumulators as pairs of NEON registers, the same fused
//!   multiply-adds, horizontal sum and tail), so they give AVX2's bits
//!   (the tests check both against one emulation of that arithmetic).
//! - `dot_q8_0`, `dot_q4_0` (f32 activations): bit for bit what [`dot_f32`]
//!   gives on the dequantized row (as on AVX2).
//! - `dot_f32_rows` is [`dot_f32`] per row; `weighted_rows` is the scalar
//!   reference bit for bit (one fused multiply-add per element, row order).
//! - `dot_q8_0_q8`, `dot_q4_0_q8` and their multi-token forms: the scalar
//!   references' arithmetic exactly (exact integer lane sums, one fused
//!   multiply-add per block into the reference's lane, its reduction), so
//!   they equal [`super::q8act::dot_q8_0_q8`] and
//!   [`super::q4_0::dot_q4_0_q8`] bit for bit; likewise `dot_q6_k_q8`,
//!   `dot_q4_k_q8` and `dot_q5_k_q8` and their references in
//!   [`super::q6_k`] and [`super::q4_k`].
//! - `dot_more_q8` (Q4_1, Q5_0, Q5_1, IQ4_NL; Q2_K, Q3_K, IQ4_XS): the
//!   references of [`super::legacy_q8`] and [`super::low_k`] bit for bit
//!   (exact integer sums, each block's f32 steps in the reference's order
//!   into its lane `b mod 4`, blocks in order, the `tree4` reduction);
//!   `dot_more_q8_multi` is the same kernel over up to [`MULTI`] tokens
//!   (each block's codes decoded once, every token's arithmetic its own),
//!   so each token gets those bits too.
//!
//! The f16 scales are widened with FCVTL/FCVT (base AArch64 instructions,
//! exact, as `f16_to_f32`) through `asm!`, since Rust's f16 vector
//! intrinsics are unstable; SDOT goes through `asm!` for the same reason
//! (`vdotq_s32` is unstable).

#![cfg(target_arch = "aarch64")]

use std::arch::aarch64::*;
use std::arch::asm;

use super::q8act::{MULTI, Q8Activation};
use crate::format::{WeightFormat, bf16_to_f32, f16_to_f32};
use crate::quant::{
    IQ4_NL_BLOCK_BYTES, IQ4_NL_VALUES, IQ4_XS_BLOCK_BYTES, IQ4_XS_QS, IQ4_XS_SCALES_L, K_SCALES,
    Q2_K_BLOCK_BYTES, Q2_K_D, Q2_K_QS, Q3_K_BLOCK_BYTES, Q3_K_D, Q3_K_QS, Q3_K_SCALES,
    Q4_0_BLOCK_BYTES, Q4_1_BLOCK_BYTES, Q4_K_BLOCK_BYTES, Q4_K_QS, Q5_0_BLOCK_BYTES,
    Q5_1_BLOCK_BYTES, Q5_K_BLOCK_BYTES, Q5_K_QH, Q5_K_QS, Q6_K_BLOCK_BYTES, Q6_K_D, Q6_K_QH,
    Q6_K_SCALES, Q8_0_BLOCK_BYTES, QK, QK_K,
};

// Every `unsafe` call of a NEON intrinsic below relies on this.
const _: () = assert!(
    cfg!(target_feature = "neon"),
    "aarch64 targets without NEON are not supported"
);

/// Four f16 values (bits) widened to f32, exactly (FCVTL).
#[inline(always)]
fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let r: float32x4_t;
    // SAFETY: FCVTL (half to single) is a base AdvSIMD instruction; it only
    // reads and writes registers.
    unsafe {
        asm!("fcvtl {0:v}.4s, {1:v}.4h", out(vreg) r, in(vreg) h, options(pure, nomem, nostack));
    }
    r
}

/// One f16 value (bits) widened to f32, exactly (FCVT).
#[inline(always)]
fn f16_to_f32_hw(h: u16) -> f32 {
    let r: f32;
    // SAFETY: FCVT (half to single) is a base FP instruction; registers only.
    unsafe {
        asm!("fcvt {0:s}, {1:h}", out(vreg) r, in(vreg) h, options(pure, nomem, nostack));
    }
    r
}

/// `acc` lane k plus `Σ a_j · b_j` over bytes `j ∈ 4k..4k+4` (SDOT).
///
/// # Safety
/// Requires the `dotprod` extension.
#[target_feature(enable = "dotprod")]
#[inline]
unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: SDOT is available (caller); registers only.
    unsafe {
        asm!(
            "sdot {0:v}.4s, {1:v}.16b, {2:v}.16b",
            inout(vreg) acc,
            in(vreg) a,
            in(vreg) b,
            options(pure, nomem, nostack)
        );
    }
    acc
}

/// What [`sdot`] computes, with widening multiplies and pairwise adds
/// (base NEON): exact, as every product fits in i16 and every sum in i32.
///
/// # Safety
/// With `SDOT`, requires the `dotprod` extension.
#[inline(always)]
unsafe fn dot4<const SDOT: bool>(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: NEON is baseline (asserted above); SDOT only when the caller
    // has it.
    unsafe {
        if SDOT {
            sdot(acc, a, b)
        } else {
            let lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
            let hi = vpaddlq_s16(vmull_high_s8(a, b));
            vaddq_s32(acc, vpaddq_s32(lo, hi))
        }
    }
}

/// The 8 lanes `lo` (0..4) and `hi` (4..8) reduced as the AVX2 kernels
/// reduce a register (and as `q8act`'s `hsum8`):
/// `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`.
#[inline(always)]
fn hsum8(lo: float32x4_t, hi: float32x4_t) -> f32 {
    // SAFETY: register arithmetic; NEON is baseline.
    unsafe {
        let s = vaddq_f32(lo, hi);
        let u = vaddq_f32(s, vextq_f32::<2>(s, s));
        vgetq_lane_f32::<0>(u) + vgetq_lane_f32::<1>(u)
    }
}

/// The f32 dot products' shape, the AVX2 kernels' (`super::x86`): with
/// `WIDE`, element vectors `4j..4j+4` of each 16-element step go to
/// accumulator `j` (AVX2's two 8-lane accumulators are `acc[0..2]` and
/// `acc[2..4]`); then 8-element steps to `acc[0..2]`; the rest one by one
/// after the horizontal sum. AVX2's `dot_f16` takes 8-element steps only
/// (`WIDE` false).
///
/// # Safety
/// `w4(i)` must be sound for `i + 4 <= n`, `w1(i)` for `i < n`, and `x`
/// readable for `n` floats.
#[inline(always)]
unsafe fn dot_shape<const WIDE: bool>(
    n: usize,
    x: *const f32,
    w4: impl Fn(usize) -> float32x4_t,
    w1: impl Fn(usize) -> f32,
) -> f32 {
    // SAFETY: loads of x stay below n (caller); register arithmetic.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while WIDE && i + 16 <= n {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = vfmaq_f32(*a, w4(i + 4 * j), vld1q_f32(x.add(i + 4 * j)));
            }
            i += 16;
        }
        while i + 8 <= n {
            acc[0] = vfmaq_f32(acc[0], w4(i), vld1q_f32(x.add(i)));
            acc[1] = vfmaq_f32(acc[1], w4(i + 4), vld1q_f32(x.add(i + 4)));
            i += 8;
        }
        let mut s = if WIDE {
            hsum8(vaddq_f32(acc[0], acc[2]), vaddq_f32(acc[1], acc[3]))
        } else {
            hsum8(acc[0], acc[1])
        };
        while i < n {
            s += w1(i) * *x.add(i);
            i += 1;
        }
        s
    }
}

/// Any lengths: the common prefix is used (`w.len() == x.len()` in use).
///
/// # Safety
/// A target-feature function: callable where NEON is present, which every
/// aarch64 target guarantees. Lengths are checked inside.
#[target_feature(enable = "neon")]
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    let n = x.len().min(w.len());
    let wp = w.as_ptr();
    // SAFETY: dot_shape reads w and x below n.
    unsafe { dot_shape::<true>(n, x.as_ptr(), |i| vld1q_f32(wp.add(i)), |i| *wp.add(i)) }
}

/// `out[t] = dot_f32(q, k_t)` for rows `k_t = k[t·stride..t·stride +
/// q.len()]` (panics if a row is out of bounds).
///
/// # Safety
/// A target-feature function: callable where NEON is present, which every
/// aarch64 target guarantees. Lengths are checked inside.
#[target_feature(enable = "neon")]
pub fn dot_f32_rows(q: &[f32], k: &[f32], stride: usize, out: &mut [f32]) {
    for (t, o) in out.iter_mut().enumerate() {
        *o = dot_f32(q, &k[t * stride..t * stride + q.len()]);
    }
}

/// A bf16 row · `x` (bf16 widens exactly by a shift).
///
/// # Safety
/// A target-feature function: callable where NEON is present, which every
/// aarch64 target guarantees. Lengths are checked inside.
#[target_feature(enable = "neon")]
pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    let n = x.len().min(w.len());
    let wp = w.as_ptr();
    // SAFETY: dot_shape reads w and x below n; bf16 widens by a shift.
    unsafe {
        dot_shape::<true>(
            n,
            x.as_ptr(),
            |i| vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(wp.add(i)))),
            |i| bf16_to_f32(*wp.add(i)),
        )
    }
}

/// An f16 row · `x`.
///
/// # Safety
/// A target-feature function: callable where NEON is present, which every
/// aarch64 target guarantees. Lengths are checked inside.
#[target_feature(enable = "neon")]
pub fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
    let n = x.len().min(w.len());
    let wp = w.as_ptr();
    // SAFETY: dot_shape reads w and x below n.
    unsafe {
        dot_shape::<false>(
            n,
            x.as_ptr(),
            |i| f16x4_to_f32(vld1_u16(wp.add(i))),
            |i| f16_to_f32(*wp.add(i)),
        )
    }
}

/// A block's 32 dequantized weights (`d · q`, exact) into the wide
/// [`dot_shape`]'s accumulators as its two 16-element steps, so a row of blocks gives
/// what [`dot_f32`] gives on the dequantized row.
///
/// # Safety
/// `x` readable for 32 floats.
#[inline(always)]
unsafe fn block_into(acc: &mut [float32x4_t; 4], q: [int32x4_t; 8], d: f32, x: *const f32) {
    // SAFETY: 8 loads of 4 floats within the block (caller).
    unsafe {
        let d = vdupq_n_f32(d);
        for (j, qj) in q.into_iter().enumerate() {
            let w = vmulq_f32(vcvtq_f32_s32(qj), d);
            acc[j % 4] = vfmaq_f32(acc[j % 4], w, vld1q_f32(x.add(4 * j)));
        }
    }
}

/// 16 signed bytes widened to 4 vectors of i32.
#[inline(always)]
fn widen(v: int8x16_t) -> [int32x4_t; 4] {
    // SAFETY: register arithmetic; NEON is baseline.
    unsafe {
        let (lo, hi) = (vmovl_s8(vget_low_s8(v)), vmovl_high_s8(v));
        [
            vmovl_s16(vget_low_s16(lo)),
            vmovl_high_s16(lo),
            vmovl_s16(vget_low_s16(hi)),
            vmovl_high_s16(hi),
        ]
    }
}

/// Row of `blocks` blocks of `bytes` bytes each, `x` of `blocks · 32`
/// floats: `quants(block)` gives a block's 32 weights as two 16-byte
/// halves.
///
/// # Safety
/// `quants(b)` sound for `b < blocks`; `x` readable for `blocks · 32`.
#[inline(always)]
unsafe fn dot_blocks(
    w: &[u8],
    bytes: usize,
    x: *const f32,
    blocks: usize,
    quants: impl Fn(*const u8) -> (int8x16_t, int8x16_t),
) -> f32 {
    // SAFETY: block b's 32 floats are within x (caller); register
    // arithmetic.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 4];
        for (b, blk) in w.chunks_exact(bytes).take(blocks).enumerate() {
            let d = f16_to_f32_hw(u16::from_le_bytes([blk[0], blk[1]]));
            let (lo, hi) = quants(blk.as_ptr());
            let [q0, q1, q2, q3] = widen(lo);
            let [q4, q5, q6, q7] = widen(hi);
            block_into(&mut acc, [q0, q1, q2, q3, q4, q5, q6, q7], d, x.add(b * QK));
        }
        hsum8(vaddq_f32(acc[0], acc[2]), vaddq_f32(acc[1], acc[3]))
    }
}

/// A Q8_0 row (`x.len() / 32` blocks of 34 bytes) with f32 `x`; see the
/// module docs for the contract.
///
/// # Safety
/// A target-feature function: callable where NEON is present, which every
/// aarch64 target guarantees. Lengths are checked inside.
#[target_feature(enable = "neon")]
pub fn dot_q8_0(w: &[u8], x: &[f32]) -> f32 {
    let blocks = (x.len() / QK).min(w.len() / Q8_0_BLOCK_BYTES);
    // SAFETY: each block reads its own 32 quant bytes; x holds blocks · 32.
    unsafe {
        dot_blocks(w, Q8_0_BLOCK_BYTES, x.as_ptr(), blocks, |blk| {
            let q = blk.add(2) as *const i8;
            (vld1q_s8(q), vld1q_s8(q.add(16)))
        })
    }
}

/// The 32 codes `0..=15` of a Q4_0 block in activation order, as two
/// 16-byte halves (low nibbles, then high ones).
///
/// # Safety
/// `blk` readable for 18 bytes.
#[inline(always)]
unsafe fn q4_codes(blk: *const u8) -> (int8x16_t, int8x16_t) {
    // SAFETY: 16 bytes after the scale (caller); register arithmetic.
    unsafe {
        let raw = vld1q_u8(blk.add(2));
        let lo = vandq_u8(raw, vdupq_n_u8(0x0f));
        let hi = vshrq_n_u8::<4>(raw);
        (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi))
    }
}

/// A Q4_0 row with f32 `x`; same contract as [`dot_q8_0`].
///
/// # Safety
/// A target-feature function: callable where NEON is present, which every
/// aarch64 target guarantees. Lengths are checked inside.
#[target_feature(enable = "neon")]
pub fn dot_q4_0(w: &[u8], x: &[f32]) -> f32 {
    let blocks = (x.len() / QK).min(w.len() / Q4_0_BLOCK_BYTES);
    // SAFETY: each block reads its own 16 code bytes; x holds blocks · 32.
    unsafe {
        dot_blocks(w, Q4_0_BLOCK_BYTES, x.as_ptr(), blocks, |blk| {
            let eight = vdupq_n_s8(8);
            let (lo, hi) = q4_codes(blk);
            (vsubq_s8(lo, eight), vsubq_s8(hi, eight))
        })
    }
}

/// [`super::scalar::weighted_rows`] with 4 lanes: 64 outputs at a time
/// held in registers over every row (loaded from `o`, stored back), the
/// same fused multiply-add per
/// element, so the results are the reference's bits.
/// Panics if a row is out of bounds.
///
/// # Safety
/// A target-feature function: callable where NEON is present, which every
/// aarch64 target guarantees. Lengths are checked inside.
#[target_feature(enable = "neon")]
pub fn weighted_rows(o: &mut [f32], s: &[f32], v: &[f32], stride: usize) {
    let n = o.len();
    if let Some(last) = s.len().checked_sub(1) {
        assert!(v.len() >= last * stride + n, "value rows in bounds");
    }
    let (vp, op) = (v.as_ptr(), o.as_mut_ptr());
    let mut i = 0;
    // SAFETY: row t's elements i..i+64 (or i..i+4) are below t·stride + n
    // <= v.len() (checked above), and i + 64 <= n (or i + 4 <= n) for o.
    unsafe {
        while i + 64 <= n {
            let mut acc = [vdupq_n_f32(0.0); 16];
            for (k, a) in acc.iter_mut().enumerate() {
                *a = vld1q_f32(op.add(i + 4 * k));
            }
            for (t, &st) in s.iter().enumerate() {
                let row = vp.add(t * stride + i);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = vfmaq_n_f32(*a, vld1q_f32(row.add(4 * k)), st);
                }
            }
            for (k, a) in acc.iter().enumerate() {
                vst1q_f32(op.add(i + 4 * k), *a);
            }
            i += 64;
        }
        while i + 4 <= n {
            let mut a = vld1q_f32(op.add(i));
            for (t, &st) in s.iter().enumerate() {
                a = vfmaq_n_f32(a, vld1q_f32(vp.add(t * stride + i)), st);
            }
            vst1q_f32(op.add(i), a);
            i += 4;
        }
    }
    if i < n && !s.is_empty() {
        super::scalar::weighted_rows(&mut o[i..], s, &v[i..], stride);
    }
}

/// Checks what the integer kernels read: `blocks` blocks of every
/// activation.
fn check_acts(xs: &[&Q8Activation], blocks: usize) {
    for x in xs {
        assert!(
            x.quants.len() >= blocks * QK && x.scales.len() >= blocks && x.bsums8.len() >= blocks,
            "activation of the row's length"
        );
    }
}

/// Block `b` of a Q8_0 row into each token's accumulators (`qp`, `sp`:
/// the tokens' quants and scales).
///
/// # Safety
/// As [`q8_0_multi`], for block `b`.
#[inline(always)]
unsafe fn q8_0_block<const SDOT: bool, const N: usize>(
    wp: *const u8,
    b: usize,
    qp: &[*const i8; N],
    sp: &[*const f32; N],
    acc: &mut [[float32x4_t; 2]; N],
) {
    // SAFETY: block b of the row and of every activation is in bounds
    // (caller); SDOT only when the caller has it.
    unsafe {
        let blk = wp.add(b * Q8_0_BLOCK_BYTES);
        let dw = f16_to_f32_hw(u16::from_le((blk as *const u16).read_unaligned()));
        let w0 = vld1q_s8(blk.add(2) as *const i8);
        let w1 = vld1q_s8(blk.add(18) as *const i8);
        let z = vdupq_n_s32(0);
        for t in 0..N {
            let d = vdupq_n_f32(dw * *sp[t].add(b));
            let q = qp[t].add(b * QK);
            let lo = dot4::<SDOT>(z, w0, vld1q_s8(q));
            let hi = dot4::<SDOT>(z, w1, vld1q_s8(q.add(16)));
            acc[t][0] = vfmaq_f32(acc[t][0], d, vcvtq_f32_s32(lo));
            acc[t][1] = vfmaq_f32(acc[t][1], d, vcvtq_f32_s32(hi));
        }
    }
}

/// `N` activations against one Q8_0 row: the row's blocks are loaded once;
/// each token runs `q8act::dot_q8_0_q8`'s arithmetic (exact lane sums of 4
/// products, one fused multiply-add per block into the even or odd
/// accumulator, `hsum8` of their sum).
///
/// # Safety
/// With `SDOT`, requires `dotprod`; activations checked by [`check_acts`]
/// for `w.len() / 34` blocks; `out.len() >= N`, `xs.len() >= N`.
#[inline(always)]
unsafe fn q8_0_multi<const SDOT: bool, const N: usize>(
    w: &[u8],
    xs: &[&Q8Activation],
    out: &mut [f32],
) {
    let blocks = w.len() / Q8_0_BLOCK_BYTES;
    let wp = w.as_ptr();
    let qp: [*const i8; N] = std::array::from_fn(|t| xs[t].quants.as_ptr());
    let sp: [*const f32; N] = std::array::from_fn(|t| xs[t].scales.as_ptr());
    // SAFETY: block b reads w[34b..34b + 34] and each activation's
    // quants[32b..32b + 32] and scales[b], in bounds for b < blocks
    // (caller); SDOT only when the caller has it.
    unsafe {
        let zero = [[vdupq_n_f32(0.0); 2]; N];
        let (mut even, mut odd) = (zero, zero);
        let mut b = 0;
        while b + 2 <= blocks {
            q8_0_block::<SDOT, N>(wp, b, &qp, &sp, &mut even);
            q8_0_block::<SDOT, N>(wp, b + 1, &qp, &sp, &mut odd);
            b += 2;
        }
        if b < blocks {
            q8_0_block::<SDOT, N>(wp, b, &qp, &sp, &mut even);
        }
        for t in 0..N {
            out[t] = hsum8(
                vaddq_f32(even[t][0], odd[t][0]),
                vaddq_f32(even[t][1], odd[t][1]),
            );
        }
    }
}

/// Blocks `c..c + n` (`n <= 4`; 4 in the main loop, a constant once
/// inlined) of a Q4_0 row into each token's accumulator lanes.
///
/// # Safety
/// As [`q4_0_multi`], for these blocks.
#[inline(always)]
unsafe fn q4_0_group<const SDOT: bool, const N: usize>(
    wp: *const u8,
    xs: &[&Q8Activation],
    c: usize,
    n: usize,
    acc: &mut [float32x4_t; N],
) {
    // SAFETY: blocks c..c + n of the row and of every activation are in
    // bounds (caller); SDOT only when the caller has it.
    unsafe {
        let zero = vdupq_n_s32(0);
        let mut codes = [(vdupq_n_s8(0), vdupq_n_s8(0)); 4];
        let mut bits = [0u16; 4];
        for i in 0..n {
            let blk = wp.add((c + i) * Q4_0_BLOCK_BYTES);
            codes[i] = q4_codes(blk);
            bits[i] = u16::from_le((blk as *const u16).read_unaligned());
        }
        let dw = f16x4_to_f32(vld1_u16(bits.as_ptr()));
        // Lanes 0..n: the blocks present.
        let live = vcltq_u32(vld1q_u32([0u32, 1, 2, 3].as_ptr()), vdupq_n_u32(n as u32));
        for t in 0..N {
            let x = xs[t];
            let q = x.quants.as_ptr().add(c * QK);
            let mut v = [zero; 4];
            for i in 0..n {
                let (lo, hi) = codes[i];
                let p = dot4::<SDOT>(zero, lo, vld1q_s8(q.add(i * QK)));
                v[i] = dot4::<SDOT>(p, hi, vld1q_s8(q.add(i * QK + 16)));
            }
            let (zp, sp) = (x.bsums8.as_ptr().add(c), x.scales.as_ptr().add(c));
            let (zs, xsc) = if n == 4 {
                (vld1q_s32(zp), vld1q_f32(sp))
            } else {
                let (mut zs, mut xsc) = ([0i32; 4], [0.0f32; 4]);
                for i in 0..n {
                    (zs[i], xsc[i]) = (*zp.add(i), *sp.add(i));
                }
                (vld1q_s32(zs.as_ptr()), vld1q_f32(xsc.as_ptr()))
            };
            // Lane i: block c + i's sum of its 4 lanes.
            let sums = vpaddq_s32(vpaddq_s32(v[0], v[1]), vpaddq_s32(v[2], v[3]));
            let sums = vcvtq_f32_s32(vsubq_s32(sums, zs));
            let d = vmulq_f32(dw, xsc);
            acc[t] = vbslq_f32(live, vfmaq_f32(acc[t], d, sums), acc[t]);
        }
    }
}

/// `N` activations against one Q4_0 row, 4 blocks at a time: the blocks'
/// codes and scales are unpacked once; each token's 4 exact block sums
/// (`Σ code · q − 8 Σ q`) and scales `f16(w.d) · x.d` go through one fused
/// multiply-add into lanes 0..4 (block `b` into lane `b % 4`, lanes past
/// the last block untouched), reduced as `q4_0::tree4` — the reference's
/// arithmetic.
///
/// # Safety
/// As [`q8_0_multi`], with blocks of 18 bytes.
#[inline(always)]
unsafe fn q4_0_multi<const SDOT: bool, const N: usize>(
    w: &[u8],
    xs: &[&Q8Activation],
    out: &mut [f32],
) {
    let blocks = w.len() / Q4_0_BLOCK_BYTES;
    let wp = w.as_ptr();
    // SAFETY: blocks c..c + n < blocks are read from w and from every
    // activation's quants, scales and bsums8 (caller); SDOT only when the
    // caller has it.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); N];
        let mut c = 0;
        while c + 4 <= blocks {
            q4_0_group::<SDOT, N>(wp, xs, c, 4, &mut acc);
            c += 4;
        }
        if c < blocks {
            q4_0_group::<SDOT, N>(wp, xs, c, blocks - c, &mut acc);
        }
        for t in 0..N {
            let a = acc[t];
            let u = vaddq_f32(a, vextq_f32::<2>(a, a));
            out[t] = vgetq_lane_f32::<0>(u) + vgetq_lane_f32::<1>(u);
        }
    }
}

/// The 64 codes of one half (`n`) of a Q6_K super-block, blocks `4n..4n +
/// 4` of it, each as two 16-byte halves in activation order, signed
/// (`code − 32`, −32..=31): block `k`'s element `l` is the low (`k < 2`)
/// or high nibble of `ql[64n + 32(k mod 2) + l]` with bits `2k, 2k + 1` of
/// `qh[32n + l]` as bits 4–5 (`crate::quant::q6_k_code`).
///
/// # Safety
/// `blk` readable for a whole super-block (210 bytes), `n < 2`.
#[inline(always)]
unsafe fn q6_k_codes(blk: *const u8, n: usize) -> [(int8x16_t, int8x16_t); 4] {
    // SAFETY: ql[64n..64n + 64] and qh[32n..32n + 32] lie in the
    // super-block (caller); register arithmetic.
    unsafe {
        let ql = blk.add(64 * n);
        let qh = blk.add(Q6_K_QH + 32 * n);
        let (m4, m2, off) = (vdupq_n_u8(0x0f), vdupq_n_u8(0x30), vdupq_n_s8(32));
        // Byte halves h = 0, 1 (elements l = 16h .. 16h + 16).
        let one = |h: usize| -> [int8x16_t; 4] {
            let ql0 = vld1q_u8(ql.add(16 * h));
            let ql1 = vld1q_u8(ql.add(32 + 16 * h));
            let hb = vld1q_u8(qh.add(16 * h));
            let codes = [
                vorrq_u8(vandq_u8(ql0, m4), vandq_u8(vshlq_n_u8::<4>(hb), m2)),
                vorrq_u8(vandq_u8(ql1, m4), vandq_u8(vshlq_n_u8::<2>(hb), m2)),
                vorrq_u8(vshrq_n_u8::<4>(ql0), vandq_u8(hb, m2)),
                vorrq_u8(vshrq_n_u8::<4>(ql1), vandq_u8(vshrq_n_u8::<2>(hb), m2)),
            ];
            codes.map(|c| vsubq_s8(vreinterpretq_s8_u8(c), off))
        };
        let (a, b) = (one(0), one(1));
        [(a[0], b[0]), (a[1], b[1]), (a[2], b[2]), (a[3], b[3])]
    }
}

/// A Q6_K row (`supers` super-blocks) · activation, `q6_k::dot_q6_k_q8`'s
/// arithmetic: per half of a super-block (its blocks `4n..4n + 4`), the 8
/// sub-block sums `Σ (code − 32) · q` (exact: lanes of 4 products, each
/// |·| ≤ 32 · 128), times their i8 scales and paired into the 4 block sums
/// `s_b` (exact, |s_b| < 2²⁴, so exact as f32 too); `d_b = f16(d) · x.d_b`
/// (one rounding); one fused multiply-add of the 4 blocks into lanes
/// 0..4 (block `b` into lane `b % 4`, blocks in order), reduced as
/// `q4_0::tree4`.
///
/// # Safety
/// With `SDOT`, requires `dotprod`; `w` at least `supers` super-blocks,
/// `x.quants` at least `supers · 256` and `x.scales` `supers · 8` long.
#[inline(always)]
unsafe fn q6_k_row<const SDOT: bool>(w: &[u8], x: &Q8Activation, supers: usize) -> f32 {
    let (wp, qp, sp) = (w.as_ptr(), x.quants.as_ptr(), x.scales.as_ptr());
    // SAFETY: super-block i < supers of w, and the activation's quants
    // [256i..256i + 256] and scales [8i..8i + 8], are in bounds (caller);
    // SDOT only when the caller has it.
    unsafe {
        let zero = vdupq_n_s32(0);
        let mut acc = vdupq_n_f32(0.0);
        for i in 0..supers {
            let blk = wp.add(i * Q6_K_BLOCK_BYTES);
            let dw = vdupq_n_f32(f16_to_f32_hw(u16::from_le_bytes([
                *blk.add(Q6_K_D),
                *blk.add(Q6_K_D + 1),
            ])));
            let sc = vld1q_s8(blk.add(Q6_K_SCALES) as *const i8);
            let sc16 = [vmovl_s8(vget_low_s8(sc)), vmovl_high_s8(sc)];
            for (n, &s16) in sc16.iter().enumerate() {
                let codes = q6_k_codes(blk, n);
                let q = qp.add((8 * i + 4 * n) * QK);
                // p[2k + h]: sub-block 8n + 2k + h's 4 lane sums.
                let mut p = [zero; 8];
                for (k, &(lo, hi)) in codes.iter().enumerate() {
                    p[2 * k] = dot4::<SDOT>(zero, lo, vld1q_s8(q.add(k * QK)));
                    p[2 * k + 1] = dot4::<SDOT>(zero, hi, vld1q_s8(q.add(k * QK + 16)));
                }
                // Lane j: sub-block 8n + j (then 8n + 4 + j) summed, times
                // its scale.
                let subs_lo = vmulq_s32(
                    vpaddq_s32(vpaddq_s32(p[0], p[1]), vpaddq_s32(p[2], p[3])),
                    vmovl_s16(vget_low_s16(s16)),
                );
                let subs_hi = vmulq_s32(
                    vpaddq_s32(vpaddq_s32(p[4], p[5]), vpaddq_s32(p[6], p[7])),
                    vmovl_high_s16(s16),
                );
                // Lane k: block 8i + 4n + k's s_b.
                let sums = vcvtq_f32_s32(vpaddq_s32(subs_lo, subs_hi));
                let d = vmulq_f32(dw, vld1q_f32(sp.add(8 * i + 4 * n)));
                acc = vfmaq_f32(acc, d, sums);
            }
        }
        // (a0 + a2) + (a1 + a3), as `tree4`.
        let u = vaddq_f32(acc, vextq_f32::<2>(acc, acc));
        vgetq_lane_f32::<0>(u) + vgetq_lane_f32::<1>(u)
    }
}

/// A Q4_K/Q5_K super-block's 8 sub-block scales (bytes 0..8) and mins
/// (bytes 8..16) from its 12 packed bytes at `s`, as
/// `crate::quant::k4_scale_min` gives them one at a time (ggml's
/// `get_scale_min_k4`, four sub-blocks per 32-bit word): sub-block
/// `j < 4` takes the low 6 bits of `s[j]` (scale) and `s[j + 4]` (min);
/// `j ≥ 4` the low (scale) or high (min) nibble of `s[j + 4]` under the
/// top 2 bits of `s[j − 4]` (scale) or `s[j]` (min).
///
/// # Safety
/// `s` readable for 12 bytes.
#[inline(always)]
unsafe fn k4_scales_mins(s: *const u8) -> uint8x16_t {
    // SAFETY: 12 bytes at `s` (caller), read as three unaligned words;
    // the vector load reads the local array.
    unsafe {
        let word = |k: usize| u32::from_le_bytes((s.add(4 * k) as *const [u8; 4]).read_unaligned());
        let (w0, w1, w2) = (word(0), word(1), word(2));
        let (low6, low4, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
        let words = [
            w0 & low6,
            (w2 & low4) | (((w0 >> 6) & top2) << 4),
            w1 & low6,
            ((w2 >> 4) & low4) | (((w1 >> 6) & top2) << 4),
        ];
        let mut bytes = [0u8; 16];
        for (b, w) in bytes.chunks_exact_mut(4).zip(words) {
            b.copy_from_slice(&w.to_le_bytes());
        }
        vld1q_u8(bytes.as_ptr())
    }
}

/// Blocks `2g` and `2g + 1` of a Q4_K or (`Q5`) Q5_K super-block as their
/// codes, each block as two 16-byte halves in activation order, from the
/// 32 nibble bytes of their 64 elements at `qs`: element `l` of block
/// `2g` is the low nibble of `qs[l]`, of block `2g + 1` its high nibble
/// (`crate::quant::q4_k_code`); for Q5_K, bits 0 and 1 of `hb[l]` (the
/// super-block's `qh[l] >> 2g`, as two halves) go above them as bit 4
/// (`crate::quant::q5_k_code`). The codes (0..=15, 0..=31) are positive
/// as signed bytes.
///
/// # Safety
/// `qs` readable for 32 bytes.
#[inline(always)]
unsafe fn k4_pair<const Q5: bool>(
    qs: *const u8,
    hb: [uint8x16_t; 2],
) -> [(int8x16_t, int8x16_t); 2] {
    // SAFETY: 32 bytes at `qs` (caller); register arithmetic.
    unsafe {
        let (m4, bit4) = (vdupq_n_u8(0x0f), vdupq_n_u8(0x10));
        let raw = [vld1q_u8(qs), vld1q_u8(qs.add(16))];
        let code = |h: usize, high: bool| {
            let nibble = if high {
                vshrq_n_u8::<4>(raw[h])
            } else {
                vandq_u8(raw[h], m4)
            };
            let c = if Q5 {
                let fifth = if high {
                    vshlq_n_u8::<3>(hb[h])
                } else {
                    vshlq_n_u8::<4>(hb[h])
                };
                vorrq_u8(nibble, vandq_u8(fifth, bit4))
            } else {
                nibble
            };
            vreinterpretq_s8_u8(c)
        };
        [
            (code(0, false), code(1, false)),
            (code(0, true), code(1, true)),
        ]
    }
}

/// A Q4_K or (`Q5`) Q5_K row (`supers` super-blocks of `bytes` bytes) ·
/// activation, `q4_k::dot_q4_k_q8`'s (`dot_q5_k_q8`'s) arithmetic: per
/// half of a super-block (its blocks `4n..4n + 4`), the 4 block sums
/// `Σ code · q` (exact: lanes of 4 products, each |·| ≤ 31 · 128) and
/// `A_b = sc · Σ code · q`, `B_b = m · Σ q` (`Σ q = x.bsums8[b] / 8`, an
/// exact shift), exact as i32 and as f32 (|·| < 2²⁴); then, lane `k`
/// for block `b = 8i + 4n + k`, `t_b = fma(d · x.d_b, A_b, −((dmin ·
/// x.d_b) · B_b))` (`q4_k::term`: the same four roundings, the negation
/// exact) added (not fused) into lane `k = b % 4`, blocks in order;
/// reduced as `q4_0::tree4`.
///
/// # Safety
/// With `SDOT`, requires `dotprod`; `w` at least `supers · bytes` long,
/// `x.quants` at least `supers · 256` and `x.scales` and `x.bsums8`
/// `supers · 8`.
#[inline(always)]
unsafe fn k4_row<const SDOT: bool, const Q5: bool>(
    w: &[u8],
    x: &Q8Activation,
    supers: usize,
) -> f32 {
    let (bytes, qs_at) = if Q5 {
        (Q5_K_BLOCK_BYTES, Q5_K_QS)
    } else {
        (Q4_K_BLOCK_BYTES, Q4_K_QS)
    };
    let (wp, qp) = (w.as_ptr(), x.quants.as_ptr());
    let (sp, bp) = (x.scales.as_ptr(), x.bsums8.as_ptr());
    // SAFETY: super-block i < supers of w (its scales, qh and nibbles
    // within its `bytes`), and the activation's quants [256i..256i + 256],
    // scales and bsums8 [8i..8i + 8], are in bounds (caller); SDOT only
    // when the caller has it.
    unsafe {
        let zero = vdupq_n_s32(0);
        let mut acc = vdupq_n_f32(0.0);
        for i in 0..supers {
            let blk = wp.add(i * bytes);
            let d = vdupq_n_f32(f16_to_f32_hw(u16::from_le_bytes([*blk, *blk.add(1)])));
            let dmin = vdupq_n_f32(f16_to_f32_hw(u16::from_le_bytes([
                *blk.add(2),
                *blk.add(3),
            ])));
            let sm = k4_scales_mins(blk.add(K_SCALES));
            let (sc16, m16) = (vmovl_u8(vget_low_u8(sm)), vmovl_high_u8(sm));
            // The fifth bits of Q5_K, shifted right by 2 per pair of
            // blocks (unused for Q4_K).
            let mut hb = if Q5 {
                let qh = blk.add(Q5_K_QH);
                [vld1q_u8(qh), vld1q_u8(qh.add(16))]
            } else {
                [vdupq_n_u8(0); 2]
            };
            let qs = blk.add(qs_at);
            for n in 0..2 {
                // v[k]: block 8i + 4n + k's 4 lane sums.
                let mut v = [zero; 4];
                for h in 0..2 {
                    let g = 2 * n + h;
                    let pair = k4_pair::<Q5>(qs.add(32 * g), hb);
                    hb = hb.map(|b| vshrq_n_u8::<2>(b));
                    for (k, &(lo, hi)) in pair.iter().enumerate() {
                        let q = qp.add((8 * i + 2 * g + k) * QK);
                        let p = dot4::<SDOT>(zero, lo, vld1q_s8(q));
                        v[2 * h + k] = dot4::<SDOT>(p, hi, vld1q_s8(q.add(16)));
                    }
                }
                let (sc, m) = if n == 0 {
                    (vmovl_u16(vget_low_u16(sc16)), vmovl_u16(vget_low_u16(m16)))
                } else {
                    (vmovl_high_u16(sc16), vmovl_high_u16(m16))
                };
                let (sc, m) = (vreinterpretq_s32_u32(sc), vreinterpretq_s32_u32(m));
                // Lane k: block 8i + 4n + k's A_b and B_b.
                let dots = vpaddq_s32(vpaddq_s32(v[0], v[1]), vpaddq_s32(v[2], v[3]));
                let a = vcvtq_f32_s32(vmulq_s32(sc, dots));
                let sums = vshrq_n_s32::<3>(vld1q_s32(bp.add(8 * i + 4 * n)));
                let b = vcvtq_f32_s32(vmulq_s32(m, sums));
                let xd = vld1q_f32(sp.add(8 * i + 4 * n));
                let min_term = vmulq_f32(vmulq_f32(dmin, xd), b);
                let t = vfmaq_f32(vnegq_f32(min_term), vmulq_f32(d, xd), a);
                acc = vaddq_f32(acc, t);
            }
        }
        // (a0 + a2) + (a1 + a3), as `tree4`.
        let u = vaddq_f32(acc, vextq_f32::<2>(acc, acc));
        vgetq_lane_f32::<0>(u) + vgetq_lane_f32::<1>(u)
    }
}

/// Tokens a NEON panel pass multiplies at once (their 8 accumulator
/// registers each, with the 8 of a word's codes, fill the 32 registers).
const PANEL_GROUP: usize = 2;

/// `T` activations against a Q4_K or (`Q5`) Q5_K panel of `supers`
/// super-blocks ([`super::k_panels`]: word `w` of row `r` at `64w + 4r`),
/// `out[t][r]` equal to `dot_q4_k_q8` (`dot_q5_k_q8`) of row `r` and
/// `xs[t]` bit for bit: the arithmetic of [`k4_row`] with 4 rows in each
/// of 4 registers. Each 64-byte word of codes is 4 registers of 4 rows'
/// 4 bytes; [`dot4`] against the word's 4 activation bytes, broadcast,
/// advances all 16 rows' block sums (as one `vpdpbusd` does on AVX-512),
/// with no reduction across lanes.
///
/// # Safety
/// With `SDOT`, requires `dotprod`; `panel` at least `supers × words × 64`
/// bytes (36 words a super-block for Q4_K, 44 for Q5_K), each activation's
/// quants `supers · 256` long and its scales and bsums8 `supers · 8`,
/// `out.len() ≥ T`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // t and q index several arrays at once
unsafe fn k4_panel<const SDOT: bool, const Q5: bool, const T: usize>(
    panel: &[u8],
    supers: usize,
    xs: &[&Q8Activation],
    out: &mut [[f32; 16]],
) {
    let words = if Q5 { 44 } else { 36 };
    let codes_at = if Q5 { 12 } else { 4 };
    // SAFETY: super-block `s < supers` reads words `s · words..+words` of
    // the panel (64 bytes each) and, per token, quants `256 s..+256`,
    // scales and bsums8 `8 s..+8` (caller); SDOT only when the caller has
    // it; the rest is register arithmetic on local arrays.
    unsafe {
        let zero = vdupq_n_s32(0);
        let low = vdupq_n_u8(0x0f);
        let fifth = vdupq_n_u8(0x10);
        let mut acc = [[[vdupq_n_f32(0.0); 4]; 4]; T];
        for s in 0..supers {
            let base = panel.as_ptr().add(s * words * 64);
            // Word `k`, rows 4q..4q + 4.
            let word = |k: usize, q: usize| vld1q_u32(base.add(64 * k + 16 * q) as *const u32);
            let mut d = [vdupq_n_f32(0.0); 4];
            let mut dmin = [vdupq_n_f32(0.0); 4];
            // Each row's 8 scales and mins (ggml's get_scale_min_k4, lane
            // by lane), as f32: exact small integers.
            let mut sc = [[vdupq_n_f32(0.0); 4]; 8];
            let mut mn = [[vdupq_n_f32(0.0); 4]; 8];
            for q in 0..4 {
                let dd = word(0, q);
                d[q] = f16x4_to_f32(vmovn_u32(dd));
                dmin[q] = f16x4_to_f32(vshrn_n_u32::<16>(dd));
                let (w0, w1, w2) = (word(1, q), word(2, q), word(3, q));
                let shr = |v: uint32x4_t, n: usize| vshlq_u32(v, vdupq_n_s32(-(n as i32)));
                let (m6, m4, m2) = (vdupq_n_u32(0x3f), vdupq_n_u32(0x0f), vdupq_n_u32(0x03));
                for j in 0..4 {
                    sc[j][q] = vcvtq_f32_u32(vandq_u32(shr(w0, 8 * j), m6));
                    mn[j][q] = vcvtq_f32_u32(vandq_u32(shr(w1, 8 * j), m6));
                    let top = |w: uint32x4_t| vshlq_n_u32::<4>(vandq_u32(shr(w, 8 * j + 6), m2));
                    sc[j + 4][q] = vcvtq_f32_u32(vorrq_u32(vandq_u32(shr(w2, 8 * j), m4), top(w0)));
                    mn[j + 4][q] =
                        vcvtq_f32_u32(vorrq_u32(vandq_u32(shr(w2, 8 * j + 4), m4), top(w1)));
                }
            }
            for c in 0..4 {
                let b0 = 8 * s + 2 * c;
                let bits = (vdupq_n_u8(1 << (2 * c)), vdupq_n_u8(1 << (2 * c + 1)));
                let mut lo = [[zero; 4]; T];
                let mut hi = [[zero; 4]; T];
                for g in 0..8 {
                    for q in 0..4 {
                        let w = vreinterpretq_u8_u32(word(codes_at + 8 * c + g, q));
                        let (mut wl, mut wh) = (vandq_u8(w, low), vshrq_n_u8::<4>(w));
                        if Q5 {
                            // Fifth bits: bits 2c, 2c + 1 of qh word g.
                            let h = vreinterpretq_u8_u32(word(4 + g, q));
                            wl = vorrq_u8(wl, vandq_u8(vtstq_u8(h, bits.0), fifth));
                            wh = vorrq_u8(wh, vandq_u8(vtstq_u8(h, bits.1), fifth));
                        }
                        let (wl, wh) = (vreinterpretq_s8_u8(wl), vreinterpretq_s8_u8(wh));
                        for t in 0..T {
                            let a =
                                (xs.get_unchecked(t).quants.as_ptr() as *const i32).add(8 * b0 + g);
                            let al = vreinterpretq_s8_s32(vdupq_n_s32(a.read_unaligned()));
                            let ah = vreinterpretq_s8_s32(vdupq_n_s32(a.add(8).read_unaligned()));
                            lo[t][q] = dot4::<SDOT>(lo[t][q], wl, al);
                            hi[t][q] = dot4::<SDOT>(hi[t][q], wh, ah);
                        }
                    }
                }
                for t in 0..T {
                    let x = xs.get_unchecked(t);
                    for (k, dots) in [lo[t], hi[t]].into_iter().enumerate() {
                        let (b, j) = (b0 + k, 2 * c + k);
                        let sum = vdupq_n_f32((*x.bsums8.get_unchecked(b) >> 3) as f32);
                        let xd = vdupq_n_f32(*x.scales.get_unchecked(b));
                        for q in 0..4 {
                            // A = sc · Σ code·q and B = m · Σ q: integers
                            // below 2²⁴, so these products are exact.
                            let a = vmulq_f32(vcvtq_f32_s32(dots[q]), sc[j][q]);
                            let bm = vmulq_f32(mn[j][q], sum);
                            let min_term = vmulq_f32(vmulq_f32(dmin[q], xd), bm);
                            let term = vfmaq_f32(vnegq_f32(min_term), vmulq_f32(d[q], xd), a);
                            let lane = &mut acc[t][b % 4][q];
                            *lane = vaddq_f32(*lane, term);
                        }
                    }
                }
            }
        }
        for t in 0..T {
            let a = &acc[t];
            for q in 0..4 {
                // (a0 + a2) + (a1 + a3), as `tree4`.
                let v = vaddq_f32(vaddq_f32(a[0][q], a[2][q]), vaddq_f32(a[1][q], a[3][q]));
                vst1q_f32(out.get_unchecked_mut(t).as_mut_ptr().add(4 * q), v);
            }
        }
    }
}

/// [`k4_panel`] over any number of tokens, [`PANEL_GROUP`] at a time.
///
/// # Safety
/// As [`k4_panel`], for every token of `xs`.
#[inline(always)]
unsafe fn k4_panels<const SDOT: bool, const Q5: bool>(
    panel: &[u8],
    supers: usize,
    xs: &[&Q8Activation],
    out: &mut [[f32; 16]],
) {
    for (x, o) in xs.chunks(PANEL_GROUP).zip(out.chunks_mut(PANEL_GROUP)) {
        // SAFETY: forwarded contract, with `x.len()` tokens.
        unsafe {
            match x.len() {
                1 => k4_panel::<SDOT, Q5, 1>(panel, supers, x, o),
                _ => k4_panel::<SDOT, Q5, PANEL_GROUP>(panel, supers, x, o),
            }
        }
    }
}

/// `T` activations against a Q2_K or (`Q3`) Q3_K panel of `supers`
/// super-blocks ([`super::k_panels::low_k`]: 1344 or 1760 bytes a
/// super-block), `out[t][r]` equal to `dot_q2_k_q8` (`dot_q3_k_q8`) of row
/// `r` and `xs[t]` bit for bit. Each 64-byte word of codes is 4 registers
/// of 4 rows' 4 bytes; a block's codes (signed: Q3_K's less 4 unless their
/// hmask bit is set) are built once per word for the pass's tokens, and
/// [`dot4`] against the word's 4 activation bytes advances all 16 rows'
/// sub-block sums. The term is the row kernel's: `A = Σ sc·Σ code·a` and
/// (Q2_K) `B = Σ m·Σ a` exact, then `fma(d·xd, A, −(dmin·xd)·B)` added
/// into lane `b mod 4` (Q2_K) or `fma(d·xd, A, lane)` (Q3_K).
///
/// # Safety
/// With `SDOT`, requires `dotprod`; `panel` at least `supers × 16 × 84`
/// (Q3_K: `× 110`) bytes, each activation's quants `supers · 256` long, its scales
/// `supers · 8` and its bsums16 `supers · 16`, `out.len() ≥ T`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // t and q index several arrays at once
unsafe fn low_k_panel<const SDOT: bool, const Q3: bool, const T: usize>(
    panel: &[u8],
    supers: usize,
    xs: &[&Q8Activation],
    out: &mut [[f32; 16]],
) {
    // Bytes of a panel super-block: 16 rows' (Q3_K: 27 words of 64 bytes,
    // then the 16 rows' `d`; Q2_K: 21 words).
    let bytes = if Q3 { 16 * 110 } else { 16 * 84 };
    // SAFETY: super-block `s < supers` reads bytes `s · bytes..+bytes` of
    // the panel and, per token, quants `256 s..+256`,
    // scales `8 s..+8` and bsums16 `16 s..+16` (caller); SDOT only when the
    // caller has it; the rest is register arithmetic on local arrays.
    unsafe {
        let zero = vdupq_n_s32(0);
        let (m3, four) = (vdupq_n_u8(3), vdupq_n_u8(4));
        let shr = |v: uint32x4_t, n: usize| vshlq_u32(v, vdupq_n_s32(-(n as i32)));
        let (m4, m2) = (vdupq_n_u32(0x0f), vdupq_n_u32(0x03));
        let mut acc = [[[vdupq_n_f32(0.0); 4]; 4]; T];
        for s in 0..supers {
            let base = panel.as_ptr().add(s * bytes);
            // Word `k`, rows 4q..4q + 4.
            let word = |k: usize, q: usize| vld1q_u32(base.add(64 * k + 16 * q) as *const u32);
            let mut d = [vdupq_n_f32(0.0); 4];
            let mut dmin = [vdupq_n_f32(0.0); 4];
            for q in 0..4 {
                if Q3 {
                    // Rows 4q..4q + 4's `d`: 8 bytes after the 27 words.
                    d[q] = f16x4_to_f32(vld1_u16(base.add(64 * 27 + 8 * q) as *const u16));
                    continue;
                }
                let dd = word(20, q);
                d[q] = f16x4_to_f32(vmovn_u32(dd));
                dmin[q] = f16x4_to_f32(vshrn_n_u32::<16>(dd));
            }
            for k in 0..8 {
                let b = 8 * s + k;
                // Sub-block 2k + i's scale (and Q2_K's min) as f32, exact
                // small integers.
                let mut sc = [[vdupq_n_f32(0.0); 4]; 2];
                let mut mn = [[vdupq_n_f32(0.0); 4]; 2];
                for i in 0..2 {
                    let j = 2 * k + i;
                    for q in 0..4 {
                        if Q3 {
                            let lo = vandq_u32(
                                shr(word(24 + (j % 8) / 4, q), 8 * (j % 4) + 4 * (j / 8)),
                                m4,
                            );
                            let hi = vandq_u32(shr(word(26, q), 8 * (j % 4) + 2 * (j / 4)), m2);
                            let raw = vreinterpretq_s32_u32(vorrq_u32(lo, vshlq_n_u32::<4>(hi)));
                            sc[i][q] = vcvtq_f32_s32(vsubq_s32(raw, vdupq_n_s32(32)));
                        } else {
                            let w = word(j / 4, q);
                            sc[i][q] = vcvtq_f32_u32(vandq_u32(shr(w, 8 * (j % 4)), m4));
                            mn[i][q] = vcvtq_f32_u32(vandq_u32(shr(w, 8 * (j % 4) + 4), m4));
                        }
                    }
                }
                let codes_at = if Q3 { 8 } else { 4 } + 8 * (k / 4);
                let shift = vdupq_n_s8(-(2 * (k % 4) as i8));
                let bit = vdupq_n_u8(1 << k);
                let mut dots = [[[zero; 4]; 2]; T];
                for g in 0..8 {
                    for q in 0..4 {
                        let w = vreinterpretq_u8_u32(word(codes_at + g, q));
                        let c = vandq_u8(vshlq_u8(w, shift), m3);
                        let c = if Q3 {
                            // code − 4 unless bit k of the hmask byte is set.
                            let high =
                                vandq_u8(vtstq_u8(vreinterpretq_u8_u32(word(g, q)), bit), four);
                            vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(c, high)), vdupq_n_s8(4))
                        } else {
                            vreinterpretq_s8_u8(c)
                        };
                        for t in 0..T {
                            let a =
                                (xs.get_unchecked(t).quants.as_ptr() as *const i32).add(8 * b + g);
                            let a = vreinterpretq_s8_s32(vdupq_n_s32(a.read_unaligned()));
                            dots[t][g / 4][q] = dot4::<SDOT>(dots[t][g / 4][q], c, a);
                        }
                    }
                }
                for t in 0..T {
                    let x = xs.get_unchecked(t);
                    let xd = vdupq_n_f32(*x.scales.get_unchecked(b));
                    let sums = x.bsums16.as_ptr().add(2 * b);
                    let (s0, s1) = (
                        vdupq_n_f32(f32::from(*sums)),
                        vdupq_n_f32(f32::from(*sums.add(1))),
                    );
                    for q in 0..4 {
                        let dots = dots[t];
                        let a = vfmaq_f32(
                            vmulq_f32(sc[0][q], vcvtq_f32_s32(dots[0][q])),
                            sc[1][q],
                            vcvtq_f32_s32(dots[1][q]),
                        );
                        let lane = &mut acc[t][b % 4][q];
                        if Q3 {
                            *lane = vfmaq_f32(*lane, vmulq_f32(d[q], xd), a);
                        } else {
                            let bm = vfmaq_f32(vmulq_f32(mn[0][q], s0), mn[1][q], s1);
                            let min_term = vmulq_f32(vmulq_f32(dmin[q], xd), bm);
                            let term = vfmaq_f32(vnegq_f32(min_term), vmulq_f32(d[q], xd), a);
                            *lane = vaddq_f32(*lane, term);
                        }
                    }
                }
            }
        }
        for t in 0..T {
            let a = &acc[t];
            for q in 0..4 {
                // (a0 + a2) + (a1 + a3), as `tree4`.
                let v = vaddq_f32(vaddq_f32(a[0][q], a[2][q]), vaddq_f32(a[1][q], a[3][q]));
                vst1q_f32(out.get_unchecked_mut(t).as_mut_ptr().add(4 * q), v);
            }
        }
    }
}

/// [`low_k_panel`] over any number of tokens, [`PANEL_GROUP`] at a time.
///
/// # Safety
/// As [`low_k_panel`], for every token of `xs`.
#[inline(always)]
unsafe fn low_k_panels<const SDOT: bool, const Q3: bool>(
    panel: &[u8],
    supers: usize,
    xs: &[&Q8Activation],
    out: &mut [[f32; 16]],
) {
    for (x, o) in xs.chunks(PANEL_GROUP).zip(out.chunks_mut(PANEL_GROUP)) {
        // SAFETY: forwarded contract, with `x.len()` tokens.
        unsafe {
            match x.len() {
                1 => low_k_panel::<SDOT, Q3, 1>(panel, supers, x, o),
                _ => low_k_panel::<SDOT, Q3, PANEL_GROUP>(panel, supers, x, o),
            }
        }
    }
}

/// `(a0 + a2) + (a1 + a3)`: the accumulator lanes reduced as `q4_0::tree4`.
#[inline(always)]
fn tree4(acc: float32x4_t) -> f32 {
    // SAFETY: register arithmetic; NEON is baseline.
    unsafe {
        let u = vaddq_f32(acc, vextq_f32::<2>(acc, acc));
        vgetq_lane_f32::<0>(u) + vgetq_lane_f32::<1>(u)
    }
}

/// The little-endian f16 at `p` widened to f32 (exact).
///
/// # Safety
/// `p` readable for 2 bytes.
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: 2 bytes at `p` (caller).
    unsafe { f16_to_f32_hw(u16::from_le_bytes((p as *const [u8; 2]).read_unaligned())) }
}

/// Bit `l mod 8` in byte `l`: tests one bit of a broadcast byte per lane.
const BIT_OF_LANE: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];

/// A block format of [`legacy_row`] (layouts in `crate::quant`; the
/// arithmetic in `super::legacy_q8`). Trait constants, so that each
/// format's kernel is straight-line code.
trait Legacy {
    /// Bytes of a block.
    const SIZE: usize;
    /// Where its 16 bytes of nibbles lie: element `l < 16` the low nibble
    /// of byte `l`, element `l + 16` its high one.
    const QS: usize;
    /// Where a 5-bit format's fifth bits lie (a little-endian u32, bit `e`
    /// for element `e`).
    const QH: Option<usize>;
    /// Whether bytes 2..4 are an f16 min `m` (Q4_1, Q5_1): the term is
    /// `fma(d · x.d_b, A_b, (m · x.d_b) · B_b)`, added into its lane;
    /// otherwise the lane is `fma(d · x.d_b, S_b, lane)`.
    const MIN: bool;
    /// Subtracted from every code (Q5_0's 16, so that its `S_b = Σ (q −
    /// 16) · a` is one signed dot product).
    const OFFSET: i8;
    /// Whether the nibbles index [`IQ4_NL_VALUES`] (IQ4_NL).
    const TABLE: bool;
}

struct Q41;
struct Q50;
struct Q51;
struct Iq4Nl;

impl Legacy for Q41 {
    const SIZE: usize = Q4_1_BLOCK_BYTES;
    const QS: usize = 4;
    const QH: Option<usize> = None;
    const MIN: bool = true;
    const OFFSET: i8 = 0;
    const TABLE: bool = false;
}

impl Legacy for Q50 {
    const SIZE: usize = Q5_0_BLOCK_BYTES;
    const QS: usize = 6;
    const QH: Option<usize> = Some(2);
    const MIN: bool = false;
    const OFFSET: i8 = 16;
    const TABLE: bool = false;
}

impl Legacy for Q51 {
    const SIZE: usize = Q5_1_BLOCK_BYTES;
    const QS: usize = 8;
    const QH: Option<usize> = Some(4);
    const MIN: bool = true;
    const OFFSET: i8 = 0;
    const TABLE: bool = false;
}

impl Legacy for Iq4Nl {
    const SIZE: usize = IQ4_NL_BLOCK_BYTES;
    const QS: usize = 2;
    const QH: Option<usize> = None;
    const MIN: bool = false;
    const OFFSET: i8 = 0;
    const TABLE: bool = true;
}

/// A legacy block's 32 weights as signed bytes in element order, two
/// 16-byte halves (elements 0..16: the low nibbles, 16..32: the high
/// ones): the codes (0..=15; with the fifth bit `e` of `qh` as bit 4,
/// 0..=31), less [`Legacy::OFFSET`], or their [`IQ4_NL_VALUES`] —
/// what `legacy_q8`'s `nibbles`, `five_bit_codes` and the IQ4_NL table
/// give, all within −127..=113 (so signed bytes).
///
/// # Safety
/// `blk` readable for one block (`F::SIZE` bytes).
#[inline(always)]
unsafe fn legacy_values<F: Legacy>(blk: *const u8) -> (int8x16_t, int8x16_t) {
    // SAFETY: the nibbles and `qh` lie within the block (caller); the
    // table and bit loads read constants; register arithmetic.
    unsafe {
        let raw = vld1q_u8(blk.add(F::QS));
        let (mut lo, mut hi) = (vandq_u8(raw, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(raw));
        if let Some(at) = F::QH {
            let qh = (blk.add(at) as *const [u8; 4]).read_unaligned();
            let bit = vld1q_u8(BIT_OF_LANE.as_ptr());
            // Lane l of the half: bit l of (qh byte a, then qh byte b) as
            // 0x10.
            let fifth = |a: u8, b: u8| {
                let spread = vcombine_u8(vdup_n_u8(a), vdup_n_u8(b));
                vandq_u8(vtstq_u8(spread, bit), vdupq_n_u8(0x10))
            };
            lo = vorrq_u8(lo, fifth(qh[0], qh[1]));
            hi = vorrq_u8(hi, fifth(qh[2], qh[3]));
        }
        if F::TABLE {
            let table = vld1q_s8(IQ4_NL_VALUES.as_ptr());
            (vqtbl1q_s8(table, lo), vqtbl1q_s8(table, hi))
        } else {
            let off = vdupq_n_s8(F::OFFSET);
            (
                vsubq_s8(vreinterpretq_s8_u8(lo), off),
                vsubq_s8(vreinterpretq_s8_u8(hi), off),
            )
        }
    }
}

/// The quants, scales and `bsums8` of `N` activations, as pointers (what
/// the several-token kernels read per token).
struct Acts<const N: usize> {
    quants: [*const i8; N],
    scales: [*const f32; N],
    bsums8: [*const i32; N],
    bsums16: [*const i16; N],
}

impl<const N: usize> Acts<N> {
    /// The first `N` of `xs` (panics if there are fewer).
    #[inline(always)]
    fn of(xs: &[&Q8Activation]) -> Self {
        Acts {
            quants: std::array::from_fn(|t| xs[t].quants.as_ptr()),
            scales: std::array::from_fn(|t| xs[t].scales.as_ptr()),
            bsums8: std::array::from_fn(|t| xs[t].bsums8.as_ptr()),
            bsums16: std::array::from_fn(|t| xs[t].bsums16.as_ptr()),
        }
    }
}

/// Blocks `c..c + n` (`c` a multiple of 4, `1 <= n <= 4`) of a legacy row
/// at `wp` into each token's `acc[t]`: the blocks' values and f16 heads
/// decoded once; per token, block `c + i` into lane `i` (= `(c + i) mod
/// 4`), lanes `n..4` left as they are. Per block the exact integer `Σ v ·
/// a` (lanes of 4 products, |·| ≤ 127 · 127, then summed: exact whatever
/// the order), then the reference's f32 steps (see [`Legacy::MIN`]).
///
/// # Safety
/// With `SDOT`, requires `dotprod`; blocks `c..c + n` of the row and of
/// every activation of `a` (quants, scales, bsums8) in bounds.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // t indexes the accumulators and the activations
unsafe fn legacy_group<const SDOT: bool, F: Legacy, const N: usize>(
    wp: *const u8,
    a: &Acts<N>,
    c: usize,
    n: usize,
    acc: &mut [float32x4_t; N],
) {
    // SAFETY: blocks c..c + n of the row and of the activations are in
    // bounds (caller), the local arrays are 4 long and n <= 4; SDOT only
    // when the caller has it.
    unsafe {
        let zero = vdupq_n_s32(0);
        let mut values = [(vdupq_n_s8(0), vdupq_n_s8(0)); 4];
        let mut heads = [0u32; 4];
        for i in 0..n {
            let blk = wp.add((c + i) * F::SIZE);
            values[i] = legacy_values::<F>(blk);
            heads[i] = u32::from_le_bytes((blk as *const [u8; 4]).read_unaligned());
        }
        let heads = vld1q_u32(heads.as_ptr());
        let dw = f16x4_to_f32(vmovn_u32(heads));
        let m = f16x4_to_f32(vshrn_n_u32::<16>(heads));
        // Lanes 0..n: the blocks present.
        let live = vcltq_u32(vld1q_u32([0u32, 1, 2, 3].as_ptr()), vdupq_n_u32(n as u32));
        for t in 0..N {
            let q = a.quants[t].add(c * QK);
            let mut v = [zero; 4];
            let (mut xd, mut bsums8) = ([0.0f32; 4], [0i32; 4]);
            for i in 0..n {
                let (lo, hi) = values[i];
                let p = dot4::<SDOT>(zero, lo, vld1q_s8(q.add(i * QK)));
                v[i] = dot4::<SDOT>(p, hi, vld1q_s8(q.add(i * QK + 16)));
                xd[i] = *a.scales[t].add(c + i);
                bsums8[i] = *a.bsums8[t].add(c + i);
            }
            // Lane i: block c + i's integer (|·| < 2²⁴, so exact as f32).
            let sums = vpaddq_s32(vpaddq_s32(v[0], v[1]), vpaddq_s32(v[2], v[3]));
            let sums = vcvtq_f32_s32(sums);
            let xd = vld1q_f32(xd.as_ptr());
            // f16(d) · x.d_b: one rounding.
            let d = vmulq_f32(dw, xd);
            let new = if F::MIN {
                // B_b = Σ a = bsums8 / 8 (an exact shift); (m · x.d_b) ·
                // B_b (two roundings), fused into d · A_b, added into the
                // lane.
                let b = vcvtq_f32_s32(vshrq_n_s32::<3>(vld1q_s32(bsums8.as_ptr())));
                vaddq_f32(acc[t], vfmaq_f32(vmulq_f32(vmulq_f32(m, xd), b), d, sums))
            } else {
                vfmaq_f32(acc[t], d, sums)
            };
            acc[t] = if n == 4 {
                new
            } else {
                vbslq_f32(live, new, acc[t])
            };
        }
    }
}

/// A Q4_1, Q5_0, Q5_1 or IQ4_NL row (whole blocks of `F::SIZE` bytes) ·
/// `N` activations, `legacy_q8`'s reference arithmetic for each: 4
/// blocks at a time, decoded once for every token; each token's block
/// `b` term into its lane `b mod 4`, blocks in order ([`legacy_group`]),
/// reduced as [`tree4`] into `out[t]`.
///
/// # Safety
/// With `SDOT`, requires `dotprod`; every activation of `a` at least
/// `w.len() / F::SIZE` blocks long (quants, scales, bsums8); `out.len() >=
/// N`.
#[inline(always)]
unsafe fn legacy_row<const SDOT: bool, F: Legacy, const N: usize>(
    w: &[u8],
    a: &Acts<N>,
    out: &mut [f32],
) {
    let blocks = w.len() / F::SIZE;
    let wp = w.as_ptr();
    // SAFETY: groups cover blocks 0..blocks of the row, in bounds of every
    // activation (caller); SDOT only when the caller has it.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); N];
        let mut c = 0;
        while c + 4 <= blocks {
            legacy_group::<SDOT, F, N>(wp, a, c, 4, &mut acc);
            c += 4;
        }
        if c < blocks {
            legacy_group::<SDOT, F, N>(wp, a, c, blocks - c, &mut acc);
        }
        for (o, &acc) in out.iter_mut().zip(&acc) {
            *o = tree4(acc);
        }
    }
}

/// Each block's sum of its two sub-blocks' `scale · Σ`, for the 4 blocks
/// of a half super-block: `p[j]` holds sub-block `j`'s 4 lane sums (of
/// the half's 8), `sc` their scales (i16). Lane `k`: block `k`'s
/// `sc_{2k} · Σ_{2k} + sc_{2k+1} · Σ_{2k+1}`, exact in i32 (|·| < 2²⁰
/// here).
#[inline(always)]
fn scaled_pairs(p: &[int32x4_t; 8], sc: int16x8_t) -> int32x4_t {
    // SAFETY: register arithmetic; NEON is baseline.
    unsafe {
        // Lane j: sub-block j's sum (then 4 + j's), times its scale.
        let lo = vmulq_s32(
            vpaddq_s32(vpaddq_s32(p[0], p[1]), vpaddq_s32(p[2], p[3])),
            vmovl_s16(vget_low_s16(sc)),
        );
        let hi = vmulq_s32(
            vpaddq_s32(vpaddq_s32(p[4], p[5]), vpaddq_s32(p[6], p[7])),
            vmovl_high_s16(sc),
        );
        vpaddq_s32(lo, hi)
    }
}

/// A Q2_K row (`supers` super-blocks of 84 bytes) · `N` activations,
/// `low_k::dot_q2_k_q8`'s arithmetic for each: per half super-block (its
/// blocks `4n..4n + 4`, codes `(qs[32n + l] >> 2k) & 3` for its block
/// `k`, decoded once for every token), each sub-block's `Σ q · a` (exact
/// lane sums) scaled by its 4-bit scale and paired into `A_b`
/// ([`scaled_pairs`]), and its min times the activation's `Σ a` of the
/// sub-block (`bsums16`) paired into `B_b`; lane `k` for block `b = 8i + 4n
/// + k`: `t_b = fma(d · x.d_b, A_b, −((dmin · x.d_b) · B_b))`
/// (`q4_k::term`) added into the token's lane `b mod 4`, blocks in order;
/// reduced as [`tree4`] into `out[t]`.
///
/// # Safety
/// With `SDOT`, requires `dotprod`; `w` at least `supers` super-blocks,
/// every activation's quants at least `supers · 256`, scales `supers · 8`
/// and `bsums16` `supers · 16` long; `out.len() >= N`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // t indexes the accumulators and the activations
unsafe fn q2_k_row<const SDOT: bool, const N: usize>(
    w: &[u8],
    a: &Acts<N>,
    supers: usize,
    out: &mut [f32],
) {
    let wp = w.as_ptr();
    // SAFETY: super-block i < supers of w (scales at 0, codes at Q2_K_QS,
    // d and dmin at Q2_K_D), and every activation's quants [256i..256i +
    // 256], scales [8i..8i + 8] and bsums16 [16i..16i + 16], are in bounds
    // (caller); SDOT only when the caller has it.
    unsafe {
        let zero = vdupq_n_s32(0);
        let (m3, m4) = (vdupq_n_u8(3), vdupq_n_u8(0x0f));
        let mut acc = [vdupq_n_f32(0.0); N];
        for i in 0..supers {
            let blk = wp.add(i * Q2_K_BLOCK_BYTES);
            let d = vdupq_n_f32(f16_at(blk.add(Q2_K_D)));
            let dmin = vdupq_n_f32(f16_at(blk.add(Q2_K_D + 2)));
            // Sub-block j's scale (low nibble) and min (high) in byte j.
            let bytes = vld1q_u8(blk);
            let (sc, mn) = (vandq_u8(bytes, m4), vshrq_n_u8::<4>(bytes));
            for n in 0..2 {
                let qs = blk.add(Q2_K_QS + 32 * n);
                let mut raw = [vld1q_u8(qs), vld1q_u8(qs.add(16))];
                // codes[2k + h]: sub-block 2k + h of the half (its block
                // k's half h), elements 16(2k + h).. of the half's quants.
                let mut codes = [vdupq_n_s8(0); 8];
                for k in 0..4 {
                    for h in 0..2 {
                        codes[2 * k + h] = vreinterpretq_s8_u8(vandq_u8(raw[h], m3));
                        raw[h] = vshrq_n_u8::<2>(raw[h]);
                    }
                }
                let (sc16, mn16) = if n == 0 {
                    (vmovl_u8(vget_low_u8(sc)), vmovl_u8(vget_low_u8(mn)))
                } else {
                    (vmovl_high_u8(sc), vmovl_high_u8(mn))
                };
                let (sc16, mn16) = (vreinterpretq_s16_u16(sc16), vreinterpretq_s16_u16(mn16));
                for t in 0..N {
                    let q = a.quants[t].add((8 * i + 4 * n) * QK);
                    // p[j]: sub-block j's Σ q · a as 4 lane sums.
                    let mut p = [zero; 8];
                    for j in 0..8 {
                        p[j] = dot4::<SDOT>(zero, codes[j], vld1q_s8(q.add(16 * j)));
                    }
                    let av = vcvtq_f32_s32(scaled_pairs(&p, sc16));
                    // Sub-block j's min times its Σ a, paired: B_b.
                    let sums = vld1q_s16(a.bsums16[t].add(16 * i + 8 * n));
                    let bv = vcvtq_f32_s32(vpaddq_s32(
                        vmull_s16(vget_low_s16(mn16), vget_low_s16(sums)),
                        vmull_high_s16(mn16, sums),
                    ));
                    let xd = vld1q_f32(a.scales[t].add(8 * i + 4 * n));
                    let min_term = vmulq_f32(vmulq_f32(dmin, xd), bv);
                    let term = vfmaq_f32(vnegq_f32(min_term), vmulq_f32(d, xd), av);
                    acc[t] = vaddq_f32(acc[t], term);
                }
            }
        }
        for (o, &acc) in out.iter_mut().zip(&acc) {
            *o = tree4(acc);
        }
    }
}

/// A Q3_K super-block's 16 sub-block scales (−32..=31) in sub-block
/// order, from its 12 packed bytes at `s`, as `crate::quant::q3_k_scale`
/// gives them one at a time: the low nibbles of bytes 0–7 are sub-blocks
/// 0–7's low 4 bits, their high nibbles 8–15's; bits `2·(j / 4)`,
/// `2·(j / 4) + 1` of byte `8 + j mod 4` sub-block `j`'s top 2.
///
/// # Safety
/// `s` readable for 12 bytes.
#[inline(always)]
unsafe fn q3_k_scales(s: *const u8) -> int8x16_t {
    // SAFETY: 12 bytes at `s` (caller), read as three unaligned words;
    // the vector load reads the local array.
    unsafe {
        let word = |k: usize| u32::from_le_bytes((s.add(4 * k) as *const [u8; 4]).read_unaligned());
        let (w0, w1, w2) = (word(0), word(1), word(2));
        let part = |low: u32, high: u32| (low & 0x0f0f_0f0f) | ((high & 0x0303_0303) << 4);
        let words = [
            part(w0, w2),
            part(w1, w2 >> 2),
            part(w0 >> 4, w2 >> 4),
            part(w1 >> 4, w2 >> 6),
        ];
        let mut bytes = [0u8; 16];
        for (b, w) in bytes.chunks_exact_mut(4).zip(words) {
            b.copy_from_slice(&w.to_le_bytes());
        }
        vsubq_s8(
            vreinterpretq_s8_u8(vld1q_u8(bytes.as_ptr())),
            vdupq_n_s8(32),
        )
    }
}

/// A Q3_K row (`supers` super-blocks of 110 bytes) · `N` activations,
/// `low_k::dot_q3_k_q8`'s arithmetic for each: per half super-block (its
/// blocks `4n..4n + 4`), block `k`'s codes `((qs[32n + l] >> 2k) & 3) +
/// 4·hbit − 4` (`hbit`: bit `4n + k` of `hmask[l]`; −4..=3), decoded once
/// for every token, against each token's quants, each sub-block's exact
/// sum times its signed scale and paired into `A_b` ([`scaled_pairs`]);
/// the token's lane `k` for block `b = 8i + 4n + k` becomes `fma(d ·
/// x.d_b, A_b, lane)` (blocks in order), reduced as [`tree4`] into
/// `out[t]`.
///
/// # Safety
/// With `SDOT`, requires `dotprod`; `w` at least `supers` super-blocks,
/// every activation's quants at least `supers · 256` and scales `supers
/// · 8` long; `out.len() >= N`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // t indexes the accumulators and the activations
unsafe fn q3_k_row<const SDOT: bool, const N: usize>(
    w: &[u8],
    a: &Acts<N>,
    supers: usize,
    out: &mut [f32],
) {
    let wp = w.as_ptr();
    // SAFETY: super-block i < supers of w (hmask at 0, codes at Q3_K_QS,
    // scales at Q3_K_SCALES, d at Q3_K_D), and every activation's quants
    // [256i..256i + 256] and scales [8i..8i + 8], are in bounds (caller);
    // SDOT only when the caller has it.
    unsafe {
        let zero = vdupq_n_s32(0);
        let (m3, four) = (vdupq_n_u8(3), vdupq_n_u8(4));
        let mut acc = [vdupq_n_f32(0.0); N];
        for i in 0..supers {
            let blk = wp.add(i * Q3_K_BLOCK_BYTES);
            let d = vdupq_n_f32(f16_at(blk.add(Q3_K_D)));
            let sc = q3_k_scales(blk.add(Q3_K_SCALES));
            let hm = [vld1q_u8(blk), vld1q_u8(blk.add(16))];
            for n in 0..2 {
                let qs = blk.add(Q3_K_QS + 32 * n);
                let mut raw = [vld1q_u8(qs), vld1q_u8(qs.add(16))];
                // codes[2k + h]: sub-block 2k + h of the half (its block
                // k's half h), elements 16(2k + h).. of the half's quants.
                let mut codes = [vdupq_n_s8(0); 8];
                for k in 0..4 {
                    let bit = vdupq_n_u8(1 << (4 * n + k));
                    for h in 0..2 {
                        let high = vandq_u8(vtstq_u8(hm[h], bit), four);
                        let u = vorrq_u8(vandq_u8(raw[h], m3), high);
                        codes[2 * k + h] = vsubq_s8(vreinterpretq_s8_u8(u), vdupq_n_s8(4));
                        raw[h] = vshrq_n_u8::<2>(raw[h]);
                    }
                }
                let sc16 = if n == 0 {
                    vmovl_s8(vget_low_s8(sc))
                } else {
                    vmovl_high_s8(sc)
                };
                for t in 0..N {
                    let q = a.quants[t].add((8 * i + 4 * n) * QK);
                    // p[j]: sub-block j of the half, 4 lane sums.
                    let mut p = [zero; 8];
                    for j in 0..8 {
                        p[j] = dot4::<SDOT>(zero, codes[j], vld1q_s8(q.add(16 * j)));
                    }
                    let av = vcvtq_f32_s32(scaled_pairs(&p, sc16));
                    let xd = vld1q_f32(a.scales[t].add(8 * i + 4 * n));
                    acc[t] = vfmaq_f32(acc[t], vmulq_f32(d, xd), av);
                }
            }
        }
        for (o, &acc) in out.iter_mut().zip(&acc) {
            *o = tree4(acc);
        }
    }
}

/// An IQ4_XS super-block's 8 block scales (−32..=31), as
/// `crate::quant::iq4_xs_scale` gives them: nibble `k mod 2` of
/// `scales_l[k / 2]` under bits `2k`, `2k + 1` of `scales_h`, less 32.
///
/// # Safety
/// `blk` readable for the super-block's first 8 bytes.
#[inline(always)]
unsafe fn iq4_xs_scales(blk: *const u8) -> [int32x4_t; 2] {
    // SAFETY: bytes 2..8 of the super-block (caller); the vector loads
    // read the local array.
    unsafe {
        let h = u16::from_le_bytes((blk.add(2) as *const [u8; 2]).read_unaligned());
        let l = (blk.add(IQ4_XS_SCALES_L) as *const [u8; 4]).read_unaligned();
        let ls: [i32; 8] = std::array::from_fn(|k| {
            let low = (l[k / 2] >> (4 * (k % 2))) & 0x0f;
            let high = (h >> (2 * k)) & 3;
            (i32::from(low) | (i32::from(high) << 4)) - 32
        });
        [vld1q_s32(ls.as_ptr()), vld1q_s32(ls.as_ptr().add(4))]
    }
}

/// An IQ4_XS row (`supers` super-blocks of 136 bytes) · `N` activations,
/// `low_k::dot_iq4_xs_q8`'s arithmetic for each: block `k`'s 16 bytes of
/// nibbles (element `l` the low nibble of byte `l`, `l + 16` its high
/// one) looked up in [`IQ4_NL_VALUES`] (TBL) once for every token; per
/// token the exact `Σ v · a` times the block's scale (`A_b`, |·| < 2²⁴);
/// per half super-block, the token's lane `k` for block `b = 8i + 4n + k`
/// becomes `fma(d · x.d_b, A_b, lane)` (blocks in order), reduced as
/// [`tree4`] into `out[t]`.
///
/// # Safety
/// With `SDOT`, requires `dotprod`; `w` at least `supers` super-blocks,
/// every activation's quants at least `supers · 256` and scales `supers
/// · 8` long; `out.len() >= N`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // t indexes the accumulators and the activations
unsafe fn iq4_xs_row<const SDOT: bool, const N: usize>(
    w: &[u8],
    a: &Acts<N>,
    supers: usize,
    out: &mut [f32],
) {
    let wp = w.as_ptr();
    // SAFETY: super-block i < supers of w (d at 0, scales at 2..8, nibbles
    // at IQ4_XS_QS), and every activation's quants [256i..256i + 256] and
    // scales [8i..8i + 8], are in bounds (caller); the table load reads a
    // constant; SDOT only when the caller has it.
    unsafe {
        let zero = vdupq_n_s32(0);
        let m4 = vdupq_n_u8(0x0f);
        let table = vld1q_s8(IQ4_NL_VALUES.as_ptr());
        let mut acc = [vdupq_n_f32(0.0); N];
        for i in 0..supers {
            let blk = wp.add(i * IQ4_XS_BLOCK_BYTES);
            let d = vdupq_n_f32(f16_at(blk));
            let ls = iq4_xs_scales(blk);
            for (n, &ls) in ls.iter().enumerate() {
                // values[k]: block 4n + k's values, two 16-byte halves.
                let mut values = [(vdupq_n_s8(0), vdupq_n_s8(0)); 4];
                for (k, v) in values.iter_mut().enumerate() {
                    let raw = vld1q_u8(blk.add(IQ4_XS_QS + 16 * (4 * n + k)));
                    let lo = vqtbl1q_s8(table, vandq_u8(raw, m4));
                    let hi = vqtbl1q_s8(table, vshrq_n_u8::<4>(raw));
                    *v = (lo, hi);
                }
                for t in 0..N {
                    let q = a.quants[t].add((8 * i + 4 * n) * QK);
                    // v[k]: block 4n + k's 4 lane sums.
                    let mut v = [zero; 4];
                    for k in 0..4 {
                        let (lo, hi) = values[k];
                        let p = dot4::<SDOT>(zero, lo, vld1q_s8(q.add(k * QK)));
                        v[k] = dot4::<SDOT>(p, hi, vld1q_s8(q.add(k * QK + 16)));
                    }
                    let sums = vpaddq_s32(vpaddq_s32(v[0], v[1]), vpaddq_s32(v[2], v[3]));
                    let av = vcvtq_f32_s32(vmulq_s32(sums, ls));
                    let xd = vld1q_f32(a.scales[t].add(8 * i + 4 * n));
                    acc[t] = vfmaq_f32(acc[t], vmulq_f32(d, xd), av);
                }
            }
        }
        for (o, &acc) in out.iter_mut().zip(&acc) {
            *o = tree4(acc);
        }
    }
}

/// Elements and bytes of one block of a format `dot_more_q8` takes;
/// panics on another format (one with a kernel of its own).
fn more_q8_block(format: WeightFormat) -> (usize, usize) {
    match format {
        WeightFormat::Q4_1 => (QK, Q4_1_BLOCK_BYTES),
        WeightFormat::Q5_0 => (QK, Q5_0_BLOCK_BYTES),
        WeightFormat::Q5_1 => (QK, Q5_1_BLOCK_BYTES),
        WeightFormat::Iq4Nl => (QK, IQ4_NL_BLOCK_BYTES),
        WeightFormat::Q2K => (QK_K, Q2_K_BLOCK_BYTES),
        WeightFormat::Q3K => (QK_K, Q3_K_BLOCK_BYTES),
        WeightFormat::Iq4Xs => (QK_K, IQ4_XS_BLOCK_BYTES),
        other => panic!("{other:?} has a kernel of its own"),
    }
}

/// What `dot_more_q8` and `dot_more_q8_multi` ask of their arguments,
/// checked as the x86 sets check them (`avx2_wrappers::more_q8_lengths`
/// and `more_q8_multi_lengths` in `super`): `w` whole blocks of `format`,
/// every activation of `xs` at least the row's length — its quants,
/// scales, bsums8, bsums16 and `split` copy (not all read here, but every
/// kernel set accepts the same arguments). Panics otherwise. Returns the
/// row's blocks (of 32 or of 256 elements).
fn more_q8_lengths(format: WeightFormat, w: &[u8], xs: &[&Q8Activation]) -> usize {
    let (elements, bytes) = more_q8_block(format);
    assert!(w.len().is_multiple_of(bytes), "whole blocks");
    let blocks = w.len() / bytes * elements / QK;
    for x in xs {
        assert!(
            x.quants.len() >= blocks * QK
                && x.scales.len() >= blocks
                && x.bsums8.len() >= blocks
                && x.bsums16.len() >= 2 * blocks
                && x.split.len() >= blocks.div_ceil(4) * 128,
            "an activation of the row's length"
        );
    }
    w.len() / bytes
}

/// The kernel of `format` (one of the seven [`more_q8_block`] knows) on
/// a row of `blocks` blocks of it and the first `N` activations of `xs`,
/// `out[t]` for `xs[t]`: each block's codes decoded once, each token's
/// arithmetic that of the one-token kernel (`N = 1`).
///
/// # Safety
/// With `SDOT`, requires `dotprod`; the arguments checked by
/// [`more_q8_lengths`], which returned `blocks`; `xs.len() >= N` and
/// `out.len() >= N`.
#[inline(always)]
unsafe fn more_q8<const SDOT: bool, const N: usize>(
    format: WeightFormat,
    w: &[u8],
    xs: &[&Q8Activation],
    out: &mut [f32],
    blocks: usize,
) {
    let a = Acts::<N>::of(xs);
    // SAFETY: `w` is `blocks` whole blocks of `format` and each of the
    // `N` activations at least as long (caller), which is what each
    // kernel reads; `out` holds `N` results; SDOT only when the caller has
    // it.
    unsafe {
        match format {
            WeightFormat::Q4_1 => legacy_row::<SDOT, Q41, N>(w, &a, out),
            WeightFormat::Q5_0 => legacy_row::<SDOT, Q50, N>(w, &a, out),
            WeightFormat::Q5_1 => legacy_row::<SDOT, Q51, N>(w, &a, out),
            WeightFormat::Iq4Nl => legacy_row::<SDOT, Iq4Nl, N>(w, &a, out),
            WeightFormat::Q2K => q2_k_row::<SDOT, N>(w, &a, blocks, out),
            WeightFormat::Q3K => q3_k_row::<SDOT, N>(w, &a, blocks, out),
            WeightFormat::Iq4Xs => iq4_xs_row::<SDOT, N>(w, &a, blocks, out),
            other => panic!("{other:?} has a kernel of its own"),
        }
    }
}

/// Runs `kernel::<N>` for `N = xs.len()` (at most [`MULTI`]).
macro_rules! by_count {
    ($kernel:ident, $sdot:expr, $w:expr, $xs:expr, $out:expr) => {{
        let (w, xs, out) = ($w, $xs, $out);
        let n = xs.len().min(out.len());
        assert!(n <= MULTI, "at most MULTI tokens");
        match n {
            1 => $kernel::<{ $sdot }, 1>(w, xs, out),
            2 => $kernel::<{ $sdot }, 2>(w, xs, out),
            3 => $kernel::<{ $sdot }, 3>(w, xs, out),
            4 => $kernel::<{ $sdot }, 4>(w, xs, out),
            _ => {}
        }
    }};
}

/// The integer kernels for one instruction set: `$sdot` selects SDOT and
/// `$feature` the target features it needs.
macro_rules! integer_kernels {
    ($module:ident, $sdot:expr, $feature:literal) => {
        pub mod $module {
            use super::*;

            /// A Q8_0 row (blocks of 34 bytes) · activation; equals
            /// `q8act::dot_q8_0_q8` bit for bit.
            ///
            /// # Safety
            /// Needs the target features of this build (`dotprod` for
            /// [`super::dotprod`], checked by the caller); lengths are
            /// checked inside.
            #[target_feature(enable = $feature)]
            pub fn dot_q8_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
                let mut out = [0.0f32];
                dot_q8_0_q8_multi(w, &[x], &mut out);
                out[0]
            }

            /// Up to [`MULTI`] activations against one Q8_0 row, `out[t]`
            /// equal to `dot_q8_0_q8(w, xs[t])` bit for bit.
            ///
            /// # Safety
            /// Needs the target features of this build (`dotprod` for
            /// [`super::dotprod`], checked by the caller); lengths are
            /// checked inside.
            #[target_feature(enable = $feature)]
            pub fn dot_q8_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
                check_acts(xs, w.len() / Q8_0_BLOCK_BYTES);
                // SAFETY: activations checked; this function has the
                // features the kernel's build needs.
                unsafe { by_count!(q8_0_multi, $sdot, w, xs, out) }
            }

            /// A Q4_0 row (blocks of 18 bytes) · activation; equals
            /// `q4_0::dot_q4_0_q8` bit for bit.
            ///
            /// # Safety
            /// Needs the target features of this build (`dotprod` for
            /// [`super::dotprod`], checked by the caller); lengths are
            /// checked inside.
            #[target_feature(enable = $feature)]
            pub fn dot_q4_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
                let mut out = [0.0f32];
                dot_q4_0_q8_multi(w, &[x], &mut out);
                out[0]
            }

            /// Up to [`MULTI`] activations against one Q4_0 row, `out[t]`
            /// equal to `dot_q4_0_q8(w, xs[t])` bit for bit.
            ///
            /// # Safety
            /// Needs the target features of this build (`dotprod` for
            /// [`super::dotprod`], checked by the caller); lengths are
            /// checked inside.
            #[target_feature(enable = $feature)]
            pub fn dot_q4_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
                check_acts(xs, w.len() / Q4_0_BLOCK_BYTES);
                // SAFETY: as in dot_q8_0_q8_multi.
                unsafe { by_count!(q4_0_multi, $sdot, w, xs, out) }
            }

            /// A Q6_K row (whole super-blocks of 210 bytes; a partial one
            /// at the end is ignored, as by the reference) · activation;
            /// equals `q6_k::dot_q6_k_q8` bit for bit. Panics if `x` is
            /// shorter than the row.
            ///
            /// # Safety
            /// Needs the target features of this build (`dotprod` for
            /// [`super::dotprod`], checked by the caller); lengths are
            /// checked inside.
            #[target_feature(enable = $feature)]
            pub fn dot_q6_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
                let supers = w.len() / Q6_K_BLOCK_BYTES;
                assert!(
                    x.quants.len() >= supers * QK_K && x.scales.len() >= supers * (QK_K / QK),
                    "activation of the row's length"
                );
                // SAFETY: the row's super-blocks and the activation's
                // quants and scales they meet are in bounds (checked);
                // this function has the features the kernel's build needs.
                unsafe { q6_k_row::<$sdot>(w, x, supers) }
            }

            /// A Q4_K row (whole super-blocks of 144 bytes; a partial one
            /// at the end is ignored, as by the reference) · activation;
            /// equals `q4_k::dot_q4_k_q8` bit for bit. Panics if `x` is
            /// shorter than the row.
            ///
            /// # Safety
            /// Needs the target features of this build (`dotprod` for
            /// [`super::dotprod`], checked by the caller); lengths are
            /// checked inside.
            #[target_feature(enable = $feature)]
            pub fn dot_q4_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
                let supers = w.len() / Q4_K_BLOCK_BYTES;
                check_acts(&[x], supers * (QK_K / QK));
                // SAFETY: the row's super-blocks and the activation's
                // quants, scales and bsums8 they meet are in bounds
                // (checked); this function has the features the kernel's
                // build needs.
                unsafe { k4_row::<$sdot, false>(w, x, supers) }
            }

            /// A Q5_K row (whole super-blocks of 176 bytes; a partial one
            /// at the end is ignored, as by the reference) · activation;
            /// equals `q4_k::dot_q5_k_q8` bit for bit. Panics if `x` is
            /// shorter than the row.
            ///
            /// # Safety
            /// Needs the target features of this build (`dotprod` for
            /// [`super::dotprod`], checked by the caller); lengths are
            /// checked inside.
            #[target_feature(enable = $feature)]
            pub fn dot_q5_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
                let supers = w.len() / Q5_K_BLOCK_BYTES;
                check_acts(&[x], supers * (QK_K / QK));
                // SAFETY: as in dot_q4_k_q8.
                unsafe { k4_row::<$sdot, true>(w, x, supers) }
            }
            /// Q2_K, Q3_K, Q4_K or Q5_K panel ([`super::super::k_panels`]) · up to
            /// [`super::super::k_panels::PANEL_TOKENS`] activations;
            /// `out[t][r]` equals the row kernel's product of row `r` and
            /// `xs[t]` bit for bit. Panics on a panel or activations of
            /// the wrong length, or another format.
            ///
            /// # Safety
            /// Needs the target features of this build (`dotprod` for
            /// [`super::dotprod`], checked by the caller); lengths are
            /// checked inside.
            #[target_feature(enable = $feature)]
            pub fn dot_k_panels(
                format: crate::format::WeightFormat,
                panel: &[u8],
                supers: usize,
                xs: &[&Q8Activation],
                out: &mut [[f32; 16]],
            ) {
                use crate::format::WeightFormat;
                let size = match format {
                    WeightFormat::Q2K
                    | WeightFormat::Q3K
                    | WeightFormat::Q4K
                    | WeightFormat::Q5K => super::super::k_panels::super_bytes(format).unwrap_or(0),
                    other => panic!("no NEON panels of {other:?}"),
                };
                assert_eq!(panel.len(), supers * 16 * size, "whole super-blocks");
                assert!(
                    xs.len() <= super::super::k_panels::PANEL_TOKENS && out.len() >= xs.len(),
                    "tokens"
                );
                check_acts(xs, supers * (QK_K / QK));
                assert!(
                    xs.iter().all(|x| x.bsums16.len() >= supers * QK_K / 16),
                    "activation sums of the row's length"
                );
                // SAFETY: the panel, the activations and the outputs are
                // as long as the kernel reads (checked); this function has
                // the features the kernel's build needs.
                unsafe {
                    match format {
                        WeightFormat::Q2K => low_k_panels::<$sdot, false>(panel, supers, xs, out),
                        WeightFormat::Q3K => low_k_panels::<$sdot, true>(panel, supers, xs, out),
                        WeightFormat::Q4K => k4_panels::<$sdot, false>(panel, supers, xs, out),
                        _ => k4_panels::<$sdot, true>(panel, supers, xs, out),
                    }
                }
            }

            /// A row of Q4_1, Q5_0, Q5_1 or IQ4_NL (blocks of 32) or of
            /// Q2_K, Q3_K or IQ4_XS (super-blocks of 256) · activation;
            /// equals the scalar reference (`legacy_q8::dot_*_q8`,
            /// `low_k::dot_*_q8`; `super::super::dot_more_q8` by format)
            /// bit for bit. Panics if `w` is not whole blocks of `format`
            /// or `x` is shorter than the row (as the x86 kernel sets
            /// check), or on another format.
            ///
            /// # Safety
            /// Needs the target features of this build (`dotprod` for
            /// [`super::dotprod`], checked by the caller); lengths are
            /// checked inside.
            #[target_feature(enable = $feature)]
            pub fn dot_more_q8(format: WeightFormat, w: &[u8], x: &Q8Activation) -> f32 {
                let blocks = more_q8_lengths(format, w, &[x]);
                let mut out = [0.0f32];
                // SAFETY: `w` is whole blocks of `format` and `x` of its
                // length (checked), one activation and one output; this
                // function has the features the kernel's build needs.
                unsafe { more_q8::<$sdot, 1>(format, w, &[x], &mut out, blocks) };
                out[0]
            }

            /// A row of one of [`dot_more_q8`]'s formats · up to
            /// [`MULTI`] activations: each block's codes decoded once for
            /// every token, `out[t]` equal to `dot_more_q8(format, w,
            /// xs[t])` bit for bit; `out[xs.len()..]` untouched. Panics
            /// where `dot_more_q8` would for any activation, on more than
            /// [`MULTI`] activations or fewer outputs than activations
            /// (as the x86 kernel sets check).
            ///
            /// # Safety
            /// Needs the target features of this build (`dotprod` for
            /// [`super::dotprod`], checked by the caller); lengths are
            /// checked inside.
            #[target_feature(enable = $feature)]
            pub fn dot_more_q8_multi(
                format: WeightFormat,
                w: &[u8],
                xs: &[&Q8Activation],
                out: &mut [f32],
            ) {
                assert!(
                    xs.len() <= MULTI && out.len() >= xs.len(),
                    "at most MULTI activations, an output for each"
                );
                let blocks = more_q8_lengths(format, w, xs);
                // SAFETY: `w` is whole blocks of `format`, every activation
                // of its length and `out` as long as `xs` (checked), and
                // each arm's `N` is `xs.len()`; this function has the
                // features the kernel's build needs.
                unsafe {
                    match xs.len() {
                        0 => {}
                        1 => more_q8::<$sdot, 1>(format, w, xs, out, blocks),
                        2 => more_q8::<$sdot, 2>(format, w, xs, out, blocks),
                        3 => more_q8::<$sdot, 3>(format, w, xs, out, blocks),
                        4 => more_q8::<$sdot, 4>(format, w, xs, out, blocks),
                        n => panic!("{n} activations: more than this kernel takes"),
                    }
                }
            }
        }
    };
}

integer_kernels!(base, false, "neon");
integer_kernels!(dotprod, true, "neon,dotprod");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{NEON, NEON_DOTPROD, has_neon_dotprod};
    use rand::{Rng, SeedableRng};

    /// A build's `dot_more_q8` (the `base` or `dotprod` one).
    type MoreQ8 = unsafe fn(WeightFormat, &[u8], &Q8Activation) -> f32;

    /// The seven formats: where a block's f16 scales lie, and the row
    /// lengths tested, in blocks (of 32 or 256): 1..=13 blocks for the
    /// legacy formats (around the 4 lanes of a group), 1..=9 super-blocks
    /// for the K formats.
    const FORMATS: [(WeightFormat, &[usize], usize); 7] = [
        (WeightFormat::Q4_1, &[0, 2], 13),
        (WeightFormat::Q5_0, &[0], 13),
        (WeightFormat::Q5_1, &[0, 2], 13),
        (WeightFormat::Iq4Nl, &[0], 13),
        (WeightFormat::Q2K, &[Q2_K_D, Q2_K_D + 2], 9),
        (WeightFormat::Q3K, &[Q3_K_D], 9),
        (WeightFormat::Iq4Xs, &[0], 9),
    ];

    /// The scalar reference of `f` (`legacy_q8`, `low_k`).
    fn reference(f: WeightFormat, w: &[u8], x: &Q8Activation) -> f32 {
        crate::kernels::dot_more_q8(f, w, x)
    }

    /// The builds this CPU runs: `base`, and `dotprod` where it has SDOT.
    fn builds() -> Vec<(&'static str, MoreQ8)> {
        let mut b: Vec<(&'static str, MoreQ8)> = vec![("base", base::dot_more_q8)];
        if has_neon_dotprod() {
            b.push(("dotprod", dotprod::dot_more_q8));
        } else {
            eprintln!("SKIP dotprod: this CPU has no dotprod (probe: is_aarch64_feature_detected)");
        }
        b
    }

    /// A random f16 scale (bits): ordinary, subnormal, large or zero, of
    /// either sign.
    fn random_f16(rng: &mut impl Rng) -> u16 {
        let sign = if rng.random() { 0x8000 } else { 0 };
        sign | match rng.random_range(0..8) {
            0 | 1 => rng.random_range(1u16..0x0400),
            2 | 3 => half::f16::from_f32(rng.random_range(1000.0f32..65504.0)).to_bits(),
            4 => 0,
            _ => half::f16::from_f32(rng.random_range(1e-4f32..0.05)).to_bits(),
        }
    }

    /// `blocks` blocks of `f`: every byte random (so every code, fifth
    /// bit, hmask bit, sub-block scale and min), then random f16 scales
    /// written over the f16 fields.
    fn random_row(rng: &mut impl Rng, f: WeightFormat, fields: &[usize], blocks: usize) -> Vec<u8> {
        let size = more_q8_block(f).1;
        let mut w: Vec<u8> = (0..blocks * size).map(|_| rng.random()).collect();
        for blk in w.chunks_exact_mut(size) {
            for &at in fields {
                blk[at..at + 2].copy_from_slice(&random_f16(rng).to_le_bytes());
            }
        }
        w
    }

    /// Activations of `n` elements: one with differing block scales
    /// (magnitudes 10⁻³..10³), block 0 all ±1 (quants ±127) and, in rows
    /// of 3 blocks or more, block 1 all zero; one plain random.
    fn activations(rng: &mut impl Rng, n: usize) -> [Q8Activation; 2] {
        let blocks = n / QK;
        let mut x = vec![0.0f32; n];
        for (b, block) in x.chunks_exact_mut(QK).enumerate() {
            let spread = 10f32.powf(rng.random_range(-3.0f32..3.0));
            for v in block.iter_mut() {
                *v = match b {
                    0 => {
                        if rng.random() {
                            1.0
                        } else {
                            -1.0
                        }
                    }
                    1 if blocks >= 3 => 0.0,
                    _ => rng.random_range(-1.0f32..1.0) * spread,
                };
            }
        }
        let plain: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        [Q8Activation::quantize(&x), Q8Activation::quantize(&plain)]
    }

    /// `got` has the bits of `want`.
    fn same(got: f32, want: f32, at: &str) {
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "{at}: {got:e} vs reference {want:e}"
        );
    }

    /// Random rows of 1..=13 blocks (legacy formats) or 1..=9 super-blocks
    /// (K formats) with scales of both signs from subnormal to 6.5·10⁴,
    /// against random activations; then rows of one byte everywhere (0x00:
    /// the smallest codes and, for Q3_K and IQ4_XS, scales; 0xff: the
    /// largest) or of every byte value in turn, against quants of ±127:
    /// both builds give the scalar reference's bits.
    #[test]
    fn more_q8_kernels_give_the_reference_bits_in_both_builds() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x4e_e0_4e);
        let builds = builds();
        for (f, fields, most) in FORMATS {
            let elements = more_q8_block(f).0;
            for blocks in 1..=most {
                let n = blocks * elements;
                let mut nonzero = false;
                for r in 0..6 {
                    let w = random_row(&mut rng, f, fields, blocks);
                    for (k, x) in activations(&mut rng, n).iter().enumerate() {
                        let want = reference(f, &w, x);
                        nonzero |= want != 0.0;
                        for &(name, kernel) in &builds {
                            // SAFETY: `base` needs NEON (baseline), `dotprod`
                            // is listed only where the CPU has it.
                            let got = unsafe { kernel(f, &w, x) };
                            same(
                                got,
                                want,
                                &format!("{f:?} {name} {blocks} blocks, row {r} x{k}"),
                            );
                        }
                    }
                }
                assert!(
                    nonzero,
                    "{f:?} {blocks} blocks: all-zero products prove nothing"
                );
            }
            let blocks = most;
            let size = more_q8_block(f).1;
            let counter: Vec<u8> = (0..blocks * size).map(|i| i as u8).collect();
            for (fill, mut w) in [
                ("0x00", vec![0u8; blocks * size]),
                ("0xff", vec![0xffu8; blocks * size]),
                ("counter", counter),
            ] {
                for blk in w.chunks_exact_mut(size) {
                    for (&at, v) in fields.iter().zip([-3.5f32, 0.75]) {
                        let bits = half::f16::from_f32(v).to_bits().to_le_bytes();
                        blk[at..at + 2].copy_from_slice(&bits);
                    }
                }
                for sign in [1.0f32, -1.0] {
                    let x = Q8Activation::quantize(&vec![sign; blocks * elements]);
                    let want = reference(f, &w, &x);
                    assert!(want != 0.0 || fill == "0x00", "{f:?} {fill}");
                    for &(name, kernel) in &builds {
                        // SAFETY: as above.
                        let got = unsafe { kernel(f, &w, &x) };
                        same(got, want, &format!("{f:?} {name} fill {fill}, x {sign}"));
                    }
                }
            }
        }
    }

    /// The NEON kernel sets take the seven formats to these kernels: each
    /// gives the reference's bits, and (unlike the scalar reference, which
    /// ignores a partial last block) rejects a row of partial blocks, an
    /// activation shorter than the row and a format of its own field.
    #[test]
    fn the_neon_sets_dispatch_each_more_q8_format_to_its_kernel() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0xd15_7a7c);
        let mut sets = vec![NEON];
        if has_neon_dotprod() {
            sets.push(NEON_DOTPROD);
        } else {
            eprintln!(
                "SKIP neon+dotprod: this CPU has no dotprod (probe: is_aarch64_feature_detected)"
            );
        }
        for set in sets {
            for (f, fields, _) in FORMATS {
                let (elements, _) = more_q8_block(f);
                let blocks = if elements == QK { 7 } else { 3 };
                let w = random_row(&mut rng, f, fields, blocks);
                for x in activations(&mut rng, blocks * elements) {
                    let want = reference(f, &w, &x);
                    same(
                        (set.dot_more_q8)(f, &w, &x),
                        want,
                        &format!("{} {f:?}", set.name),
                    );
                    let partial = &w[..w.len() - 1];
                    let _ = reference(f, partial, &x);
                    let dot = set.dot_more_q8;
                    let rejects = |w: &[u8], x: &Q8Activation| {
                        std::panic::catch_unwind(|| dot(f, w, x)).is_err()
                    };
                    assert!(rejects(partial, &x), "{} {f:?}: partial block", set.name);
                    let short = Q8Activation::quantize(&vec![1.0; (blocks * elements) - QK]);
                    assert!(rejects(&w, &short), "{} {f:?}: short activation", set.name);
                }
            }
            let x = Q8Activation::quantize(&[1.0; QK]);
            let q4_0 = vec![0u8; Q4_0_BLOCK_BYTES];
            let dot = set.dot_more_q8;
            assert!(
                std::panic::catch_unwind(|| dot(WeightFormat::Q4_0, &q4_0, &x)).is_err(),
                "{}: Q4_0 has a kernel of its own",
                set.name
            );
        }
    }

    /// A build's `dot_more_q8_multi` (the `base` or `dotprod` one).
    type MoreQ8Multi = unsafe fn(WeightFormat, &[u8], &[&Q8Activation], &mut [f32]);

    /// The several-token builds this CPU runs: `base`, and `dotprod` where
    /// it has SDOT.
    fn multi_builds() -> Vec<(&'static str, MoreQ8Multi)> {
        let mut b: Vec<(&'static str, MoreQ8Multi)> = vec![("base", base::dot_more_q8_multi)];
        if has_neon_dotprod() {
            b.push(("dotprod", dotprod::dot_more_q8_multi));
        } else {
            eprintln!("SKIP dotprod: this CPU has no dotprod (probe: is_aarch64_feature_detected)");
        }
        b
    }

    /// A NaN the kernels never produce: outputs past the tokens keep it.
    const UNTOUCHED: u32 = 0x7fc0_dead;

    /// `kernel` on `w` and the first 1..=4 of `acts`: every token's bits
    /// are the reference's for it alone, and nothing past them is
    /// written.
    fn check_tokens(
        name: &str,
        kernel: MoreQ8Multi,
        f: WeightFormat,
        w: &[u8],
        acts: &[Q8Activation],
        want: &[f32],
        at: &str,
    ) {
        for count in 1..=MULTI.min(acts.len()) {
            let xs: Vec<&Q8Activation> = acts[..count].iter().collect();
            let mut out = [f32::from_bits(UNTOUCHED); MULTI + 2];
            // SAFETY: `base` needs NEON (baseline), `dotprod` is listed
            // only where the CPU has it.
            unsafe { kernel(f, w, &xs, &mut out) };
            for t in 0..count {
                same(
                    out[t],
                    want[t],
                    &format!("{f:?} {name} {at}, {count} tokens, token {t}"),
                );
            }
            for (t, o) in out.iter().enumerate().skip(count) {
                assert_eq!(
                    o.to_bits(),
                    UNTOUCHED,
                    "{f:?} {name} {at}, {count} tokens: out[{t}] written"
                );
            }
        }
    }

    /// Random rows of 1..=13 blocks (legacy formats) or 1..=9 super-blocks
    /// (K formats) with scales of both signs from subnormal to 6.5·10⁴,
    /// against 1..=4 different random activations (in rotating order);
    /// then rows of 0x00, 0xff or every byte value in turn against ±1 and
    /// random activations: in both builds, each token of the several-token
    /// kernel gives the scalar reference's bits for that token alone, and
    /// outputs past the tokens are untouched.
    #[test]
    fn more_q8_multi_kernels_give_each_token_the_reference_bits_in_both_builds() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x6d_75_1f);
        let builds = multi_builds();
        for (f, fields, most) in FORMATS {
            let elements = more_q8_block(f).0;
            for blocks in 1..=most {
                let n = blocks * elements;
                let mut later_nonzero = false;
                for r in 0..4 {
                    let w = random_row(&mut rng, f, fields, blocks);
                    let [a, b] = activations(&mut rng, n);
                    let [c, d] = activations(&mut rng, n);
                    let mut acts = [a, c, b, d];
                    acts.rotate_left(r);
                    let want: Vec<f32> = acts.iter().map(|x| reference(f, &w, x)).collect();
                    later_nonzero |= want[1..].iter().any(|&v| v != 0.0);
                    for &(name, kernel) in &builds {
                        let at = format!("{blocks} blocks, row {r}");
                        check_tokens(name, kernel, f, &w, &acts, &want, &at);
                    }
                }
                assert!(
                    later_nonzero,
                    "{f:?} {blocks} blocks: all-zero later tokens prove nothing"
                );
            }
            let blocks = most;
            let size = more_q8_block(f).1;
            let counter: Vec<u8> = (0..blocks * size).map(|i| i as u8).collect();
            for (fill, mut w) in [
                ("0x00", vec![0u8; blocks * size]),
                ("0xff", vec![0xffu8; blocks * size]),
                ("counter", counter),
            ] {
                for blk in w.chunks_exact_mut(size) {
                    for (&at, v) in fields.iter().zip([-3.5f32, 0.75]) {
                        let bits = half::f16::from_f32(v).to_bits().to_le_bytes();
                        blk[at..at + 2].copy_from_slice(&bits);
                    }
                }
                let [a, b] = activations(&mut rng, blocks * elements);
                let acts = [
                    Q8Activation::quantize(&vec![1.0; blocks * elements]),
                    a,
                    Q8Activation::quantize(&vec![-1.0; blocks * elements]),
                    b,
                ];
                let want: Vec<f32> = acts.iter().map(|x| reference(f, &w, x)).collect();
                for &(name, kernel) in &builds {
                    check_tokens(name, kernel, f, &w, &acts, &want, &format!("fill {fill}"));
                }
            }
        }
    }

    /// The NEON kernel sets' `dot_more_q8_multi` is their own build's
    /// several-token kernel (NEON's the base build, NEON_DOTPROD's the
    /// dotprod one) for all seven formats: each token gives the
    /// reference's bits, and (unlike a scalar fallback, which ignores a
    /// partial last block) it rejects a row of partial blocks, a later
    /// activation shorter than the row, more than `MULTI` activations,
    /// fewer outputs than activations and a format of its own field.
    #[test]
    fn the_neon_sets_dispatch_each_more_q8_format_to_their_multi_kernels() {
        use crate::kernels::MoreMultiDot;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5e_75_4a);
        let mut sets: Vec<(crate::kernels::KernelSet, MoreMultiDot)> =
            vec![(NEON, crate::kernels::neon_wrappers::dot_more_q8_multi)];
        if has_neon_dotprod() {
            sets.push((
                NEON_DOTPROD,
                crate::kernels::dotprod_wrappers::dot_more_q8_multi,
            ));
        } else {
            eprintln!(
                "SKIP neon+dotprod: this CPU has no dotprod (probe: is_aarch64_feature_detected)"
            );
        }
        for (set, own) in sets {
            let Some(multi) = set.dot_more_q8_multi else {
                panic!("{}: no dot_more_q8_multi", set.name)
            };
            assert_eq!(
                multi as usize, own as usize,
                "{}: dot_more_q8_multi is not this set's build",
                set.name
            );
            for (f, fields, _) in FORMATS {
                let (elements, _) = more_q8_block(f);
                let blocks = if elements == QK { 7 } else { 3 };
                let n = blocks * elements;
                let w = random_row(&mut rng, f, fields, blocks);
                let [a, b] = activations(&mut rng, n);
                let [c, d] = activations(&mut rng, n);
                let acts = [a, b, c, d];
                let xs: Vec<&Q8Activation> = acts.iter().collect();
                let mut out = [f32::from_bits(UNTOUCHED); MULTI + 1];
                multi(f, &w, &xs, &mut out);
                for (t, x) in acts.iter().enumerate() {
                    same(
                        out[t],
                        reference(f, &w, x),
                        &format!("{} {f:?} token {t}", set.name),
                    );
                }
                assert_eq!(out[MULTI].to_bits(), UNTOUCHED, "{} {f:?}", set.name);
                let rejects = |w: &[u8], xs: &[&Q8Activation], outs: usize| {
                    std::panic::catch_unwind(|| multi(f, w, xs, &mut vec![0.0; outs])).is_err()
                };
                let partial = &w[..w.len() - 1];
                let _ = reference(f, partial, &acts[0]);
                assert!(!rejects(&w, &xs, MULTI), "{} {f:?}: whole", set.name);
                assert!(
                    rejects(partial, &xs, MULTI),
                    "{} {f:?}: partial block",
                    set.name
                );
                let short = Q8Activation::quantize(&vec![1.0; n - QK]);
                let with_short = [xs[0], xs[1], &short];
                assert!(
                    rejects(&w, &with_short, 3),
                    "{} {f:?}: short activation",
                    set.name
                );
                let five = [xs[0], xs[1], xs[2], xs[3], xs[0]];
                assert!(rejects(&w, &five, 5), "{} {f:?}: more than MULTI", set.name);
                assert!(rejects(&w, &xs, 3), "{} {f:?}: too few outputs", set.name);
            }
            let x = Q8Activation::quantize(&[1.0; QK]);
            let q4_0 = vec![0u8; Q4_0_BLOCK_BYTES];
            assert!(
                std::panic::catch_unwind(|| multi(WeightFormat::Q4_0, &q4_0, &[&x], &mut [0.0]))
                    .is_err(),
                "{}: Q4_0 has a kernel of its own",
                set.name
            );
        }
    }
}
