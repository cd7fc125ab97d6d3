//! Integer dot products of Q8_0/Q4_0 weight rows with activations quantized
//! to 8-bit blocks, the way the fastest CPU engines run integer formats:
//! the activation is quantized once per matrix product, and each 32-element
//! block becomes one exact integer sum times two scales.
//!
//! The result is deterministic and the same on every CPU: the scalar
//! reference here reproduces the vector kernels' arithmetic step by step —
//! each block's products are summed exactly as integers into 8 lanes of 4
//! elements (what `maddubs` + `madd` produce), each lane is accumulated
//! with one fused multiply-add per block (`f32::mul_add`, as
//! `_mm256_fmadd_ps`) into one of two accumulators (even and odd blocks, so
//! consecutive blocks do not wait on each other), the two are added lane by
//! lane and the 8 lanes reduced in the vector kernels' order. So scalar and
//! AVX2 agree bit for bit, which the tests check.
//!
//! Quantizing the activation is a (small) approximation of the exact
//! dequantize-then-multiply product, as in llama.cpp; it applies only to
//! Q8_0/Q4_0 weights, identically in every tier.

use crate::format::f16_to_f32;
use crate::quant::{Q4_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK};

/// An activation vector quantized to blocks of 32: `x[i] ≈ scales[i/32] ·
/// quants[i]`.
#[derive(Clone, Debug, Default)]
pub struct Q8Activation {
    pub scales: Vec<f32>,
    pub quants: Vec<i8>,
    /// Per block, 8 lanes of `8 · Σ q` over 4 consecutive quants (the
    /// vector kernels' lanes): what Q4_0's zero point of 8 contributes,
    /// subtracted exactly by kernels that multiply unsigned weight codes.
    pub sums8: Vec<i32>,
    /// Per block, the scale repeated over the 8 lanes.
    pub scales8: Vec<f32>,
}

impl Q8Activation {
    /// Quantizes `x` (`len % 32 == 0`): per block `d = amax / 127`,
    /// `q = round(x / d)` (half away from zero); `d` stays f32.
    pub fn quantize(x: &[f32]) -> Q8Activation {
        let mut a = Q8Activation::default();
        a.quantize_from(x);
        a
    }

    /// As [`Q8Activation::quantize`], reusing this value's buffers. Uses
    /// the AVX2 quantizer where the AVX2 (or AVX-512) kernels run; it
    /// gives the scalar one's results exactly.
    pub fn quantize_from(&mut self, x: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::kernels().vector_quantize {
            // SAFETY: `vector_quantize` is set only where AVX2 was detected.
            unsafe { avx2::quantize(self, x) };
            return;
        }
        self.quantize_scalar(x);
    }

    /// The reference quantizer.
    pub fn quantize_scalar(&mut self, x: &[f32]) {
        debug_assert!(x.len().is_multiple_of(QK));
        self.clear();
        for block in x.chunks_exact(QK) {
            let (d, id) = block_scale(block);
            let start = self.quants.len();
            self.quants.extend(
                block
                    .iter()
                    .map(|v| (v * id).round().clamp(-127.0, 127.0) as i8),
            );
            self.finish_block(d, start);
        }
    }

    fn clear(&mut self) {
        self.scales.clear();
        self.quants.clear();
        self.sums8.clear();
        self.scales8.clear();
    }

    /// Records block scale `d` and the lane sums of the block's quants,
    /// which start at `start`.
    fn finish_block(&mut self, d: f32, start: usize) {
        self.scales.push(d);
        let q = &self.quants[start..start + QK];
        self.sums8.extend(
            q.chunks_exact(4)
                .map(|c| 8 * c.iter().map(|&v| v as i32).sum::<i32>()),
        );
        self.scales8.extend([d; 8]);
    }
}

/// A block's scale `d = amax / 127` and its inverse (0 for an all-zero
/// block). NaNs are skipped by the maximum, as `f32::max` does.
#[inline]
fn block_scale(block: &[f32]) -> (f32, f32) {
    let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
}

/// The reduction order of the vector kernels' horizontal sum.
#[inline(always)]
fn hsum8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

#[inline(always)]
fn accumulate(acc: &mut [f32; 8], d: f32, w: &[i8; QK], q: &[i8]) {
    for (k, lane) in acc.iter_mut().enumerate() {
        let s: i32 = (4 * k..4 * k + 4).map(|j| w[j] as i32 * q[j] as i32).sum();
        *lane = d.mul_add(s as f32, *lane);
    }
}

/// The final reduction of the even- and odd-block accumulators.
#[inline(always)]
fn finish(acc: [[f32; 8]; 2]) -> f32 {
    let mut s = [0.0f32; 8];
    for (k, v) in s.iter_mut().enumerate() {
        *v = acc[0][k] + acc[1][k];
    }
    hsum8(s)
}

/// Scalar reference: a Q8_0 row (`n/32` blocks of 34 bytes) · activation.
pub fn dot_q8_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
    let mut acc = [[0.0f32; 8]; 2];
    for (b, blk) in w.chunks_exact(Q8_0_BLOCK_BYTES).enumerate() {
        let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) * x.scales[b];
        let mut wq = [0i8; QK];
        for (o, &v) in wq.iter_mut().zip(&blk[2..]) {
            *o = v as i8;
        }
        accumulate(&mut acc[b % 2], d, &wq, &x.quants[b * QK..(b + 1) * QK]);
    }
    finish(acc)
}

/// Scalar reference: a Q4_0 row (`n/32` blocks of 18 bytes) · activation.
pub fn dot_q4_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
    let mut acc = [[0.0f32; 8]; 2];
    for (b, blk) in w.chunks_exact(Q4_0_BLOCK_BYTES).enumerate() {
        let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) * x.scales[b];
        let mut wq = [0i8; QK];
        for (j, &v) in blk[2..].iter().enumerate() {
            wq[j] = (v & 0x0f) as i8 - 8;
            wq[j + QK / 2] = (v >> 4) as i8 - 8;
        }
        accumulate(&mut acc[b % 2], d, &wq, &x.quants[b * QK..(b + 1) * QK]);
    }
    finish(acc)
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! # Safety
    //! Every function requires AVX2, FMA and F16C (checked by the caller with
    //! `is_x86_feature_detected!`), `w.len() == blocks × block bytes` and an
    //! activation of `blocks × 32` quants.

    use std::arch::x86_64::*;

    use super::Q8Activation;
    use crate::quant::{Q4_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK};

    /// [`Q8Activation::quantize_scalar`] with 8 lanes: the same scale, and
    /// `round` (half away from zero) as `trunc(x) ± (|x − trunc(x)| ≥ ½)`,
    /// exact because `x − trunc(x)` is; NaN lanes become 0 as Rust's
    /// saturating `as i8` makes them.
    ///
    /// # Safety
    /// Requires AVX2 (checked by the caller).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize(a: &mut Q8Activation, x: &[f32]) {
        a.clear();
        a.quants.reserve(x.len());
        let sign = _mm256_set1_ps(-0.0);
        let half = _mm256_set1_ps(0.5);
        let one = _mm256_set1_ps(1.0);
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for block in x.chunks_exact(QK) {
            let (d, id) = super::block_scale(block);
            let vid = _mm256_set1_ps(id);
            let mut ints = [_mm256_setzero_si256(); 4];
            for (k, out) in ints.iter_mut().enumerate() {
                // SAFETY: k·8 + 8 <= 32 = block.len().
                let v = unsafe { _mm256_loadu_ps(block.as_ptr().add(k * 8)) };
                let xv = _mm256_mul_ps(v, vid);
                let t = _mm256_round_ps(xv, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(xv, t));
                let away = _mm256_or_ps(_mm256_and_ps(xv, sign), one);
                let up = _mm256_and_ps(_mm256_cmp_ps(frac, half, _CMP_GE_OQ), away);
                let r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, up), lo), hi);
                let ordered = _mm256_cmp_ps(xv, xv, _CMP_ORD_Q);
                *out = _mm256_cvttps_epi32(_mm256_and_ps(r, ordered));
            }
            let w16a = _mm256_packs_epi32(ints[0], ints[1]);
            let w16b = _mm256_packs_epi32(ints[2], ints[3]);
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), order);
            let start = a.quants.len();
            let mut q = [0i8; QK];
            // SAFETY: `q` has 32 bytes.
            unsafe { _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes) };
            a.quants.extend_from_slice(&q);
            a.finish_block(d, start);
        }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: register arithmetic under the caller's avx guarantee.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            _mm_cvtss_f32(s)
        }
    }

    /// 8 exact i32 lane sums of 4 products each: `Σ w_j · q_j` for
    /// `j ∈ 4k..4k+4`. |w|,|q| ≤ 128 keeps `maddubs` pairs below i16 limits.
    #[inline(always)]
    unsafe fn lane_sums(w: __m256i, q: __m256i) -> __m256i {
        // SAFETY: register arithmetic under the caller's avx2 guarantee.
        unsafe {
            let aw = _mm256_sign_epi8(w, w);
            let sq = _mm256_sign_epi8(q, w);
            let pairs = _mm256_maddubs_epi16(aw, sq);
            _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
        }
    }

    /// The block's f16 scale times the activation's, broadcast. F16C
    /// converts exactly, as `f16_to_f32` does.
    #[inline(always)]
    unsafe fn scale(blk: *const u8, xs: f32) -> __m256 {
        // SAFETY: the block's first two bytes are in bounds (caller);
        // register arithmetic under the caller's avx2/f16c guarantee.
        unsafe {
            let bits = (blk as *const u16).read_unaligned() as i32;
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
            _mm256_set1_ps(d * xs)
        }
    }

    #[inline(always)]
    unsafe fn finish(a0: __m256, a1: __m256) -> f32 {
        // SAFETY: register arithmetic under the caller's avx guarantee.
        unsafe { hsum(_mm256_add_ps(a0, a1)) }
    }

    /// The even- and odd-block accumulators reduced in the order every
    /// vector kernel uses (for the AVX-512 kernels).
    ///
    /// # Safety
    /// Requires AVX.
    #[inline(always)]
    pub(super) unsafe fn finish_pub(a0: __m256, a1: __m256) -> f32 {
        // SAFETY: forwarded guarantee.
        unsafe { finish(a0, a1) }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
        let blocks = w.len() / Q8_0_BLOCK_BYTES;
        let (wp, qp) = (w.as_ptr(), x.quants.as_ptr());
        // SAFETY: block b reads w[34b..34b+34] and quants[32b..32b+32],
        // in bounds for b < blocks (module docs).
        unsafe {
            let step = |b: usize, acc: __m256| {
                let blk = wp.add(b * Q8_0_BLOCK_BYTES);
                let d = scale(blk, *x.scales.get_unchecked(b));
                let wq = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                let xq = _mm256_loadu_si256(qp.add(b * QK) as *const __m256i);
                _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lane_sums(wq, xq)), acc)
            };
            let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut b = 0;
            while b + 2 <= blocks {
                even = step(b, even);
                odd = step(b + 1, odd);
                b += 2;
            }
            if b < blocks {
                even = step(b, even);
            }
            finish(even, odd)
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
        let blocks = w.len() / Q4_0_BLOCK_BYTES;
        let (wp, qp) = (w.as_ptr(), x.quants.as_ptr());
        let low = _mm_set1_epi8(0x0f);
        let eight = _mm256_set1_epi8(8);
        // SAFETY: block b reads w[18b..18b+18] and quants[32b..32b+32],
        // in bounds for b < blocks (module docs).
        unsafe {
            let step = |b: usize, acc: __m256| {
                let blk = wp.add(b * Q4_0_BLOCK_BYTES);
                let d = scale(blk, *x.scales.get_unchecked(b));
                let raw = _mm_loadu_si128(blk.add(2) as *const __m128i);
                // Elements 0..16 are the low nibbles, 16..32 the high ones.
                let lo = _mm_and_si128(raw, low);
                let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
                let wq = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), eight);
                let xq = _mm256_loadu_si256(qp.add(b * QK) as *const __m256i);
                _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lane_sums(wq, xq)), acc)
            };
            let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut b = 0;
            while b + 2 <= blocks {
                even = step(b, even);
                odd = step(b + 1, odd);
                b += 2;
            }
            if b < blocks {
                even = step(b, even);
            }
            finish(even, odd)
        }
    }

    /// Up to [`super::MULTI`] activations against one row: the row's blocks
    /// are loaded and unpacked once; each token runs exactly the arithmetic
    /// of the single-token kernel (same lanes, accumulators and order), so
    /// `out[t]` equals `dot_*_q8(w, xs[t])` bit for bit.
    ///
    /// # Safety
    /// See the module docs; `xs.len() == out.len() <= MULTI`, each activation
    /// of `blocks × 32` quants.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q_q8_multi(w: &[u8], q4: bool, xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: forwarded contract; N matches the slice lengths.
        unsafe {
            match (xs.len().min(out.len()), q4) {
                (1, true) => multi::<1, true>(w, xs, out),
                (2, true) => multi::<2, true>(w, xs, out),
                (3, true) => multi::<3, true>(w, xs, out),
                (4, true) => multi::<4, true>(w, xs, out),
                (1, false) => multi::<1, false>(w, xs, out),
                (2, false) => multi::<2, false>(w, xs, out),
                (3, false) => multi::<3, false>(w, xs, out),
                (4, false) => multi::<4, false>(w, xs, out),
                _ => {}
            }
        }
    }

    /// The multi-token kernel for exactly `N` tokens (a compile-time count,
    /// so the accumulators stay in registers).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn multi<const N: usize, const Q4: bool>(
        w: &[u8],
        xs: &[&Q8Activation],
        out: &mut [f32],
    ) {
        let bb = if Q4 {
            Q4_0_BLOCK_BYTES
        } else {
            Q8_0_BLOCK_BYTES
        };
        let blocks = w.len() / bb;
        let wp = w.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        let qp: [*const i8; N] = std::array::from_fn(|t| xs[t].quants.as_ptr());
        let sp: [*const f32; N] = std::array::from_fn(|t| xs[t].scales.as_ptr());
        let low = _mm_set1_epi8(0x0f);
        let eight = _mm256_set1_epi8(8);
        let ones = _mm256_set1_epi16(1);
        // SAFETY: block b reads w[bb·b..bb·b+bb] and each activation's
        // quants[32b..32b+32] and scales[b], in bounds for b < blocks
        // (caller).
        unsafe {
            // One block into accumulator set P (even blocks 0, odd 1): the
            // parity is a constant in each call, so nothing is indexed at
            // run time and the accumulators stay in registers.
            let step = |b: usize, acc: &mut [__m256; N]| {
                let blk = wp.add(b * bb);
                let bits = (blk as *const u16).read_unaligned() as i32;
                let dw = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
                let wq = if Q4 {
                    let raw = _mm_loadu_si128(blk.add(2) as *const __m128i);
                    let lo = _mm_and_si128(raw, low);
                    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
                    _mm256_sub_epi8(_mm256_set_m128i(hi, lo), eight)
                } else {
                    _mm256_loadu_si256(blk.add(2) as *const __m256i)
                };
                let aw = _mm256_sign_epi8(wq, wq);
                for t in 0..N {
                    let d = _mm256_set1_ps(dw * *sp[t].add(b));
                    let xq = _mm256_loadu_si256(qp[t].add(b * QK) as *const __m256i);
                    let pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xq, wq));
                    let lanes = _mm256_madd_epi16(pairs, ones);
                    acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lanes), acc[t]);
                }
            };
            let (mut even, mut odd) = ([_mm256_setzero_ps(); N], [_mm256_setzero_ps(); N]);
            let mut b = 0;
            while b + 2 <= blocks {
                step(b, &mut even);
                step(b + 1, &mut odd);
                b += 2;
            }
            if b < blocks {
                step(b, &mut even);
            }
            for t in 0..N {
                acc[t] = [even[t], odd[t]];
            }
            for t in 0..N {
                out[t] = finish(acc[t][0], acc[t][1]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    //! Q4_0 kernels with AVX-512 VNNI (`vpdpbusd`: 4 unsigned × signed byte
    //! products summed into each i32 lane in one instruction), two blocks
    //! per 512-bit register. The weight codes enter unsigned (0..15) and
    //! the zero point is applied exactly afterwards, `Σ(w−8)q = Σwq −
    //! 8Σq`, with the activation's precomputed lane sums. Lane `k` of a
    //! block holds exactly the integer the AVX2 kernel's lane `k` holds,
    //! the low 256 bits accumulate the even blocks and the high 256 bits
    //! the odd ones, so the results equal the scalar reference bit for bit.
    //!
    //! # Safety
    //! Every function requires AVX-512 F, BW, VL, VNNI and VBMI, FMA and
    //! F16C (checked by the caller with `is_x86_feature_detected!`),
    //! `w.len() == blocks × 18` and activations of `blocks × 32` quants.

    use std::arch::x86_64::*;

    use super::Q8Activation;
    use crate::quant::{Q4_0_BLOCK_BYTES, QK};

    /// `vpermb` indices placing a block pair's packed nibbles (bytes 2..18
    /// and 20..36 of the 36 loaded) twice each: 128-bit lanes 0 and 2 keep
    /// the low nibbles, lanes 1 and 3 (shifted) the high ones.
    const PAIR: [u8; 64] = {
        let mut idx = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            let block = i / 32;
            idx[i] = (2 + block * Q4_0_BLOCK_BYTES + i % 16) as u8;
            i += 1;
        }
        idx
    };

    /// The 36 bytes of blocks `p` and `p + 18`.
    #[inline(always)]
    unsafe fn load_pair(p: *const u8) -> __m512i {
        // SAFETY: the masked load touches only the pair's 36 bytes, in
        // bounds (caller).
        unsafe { _mm512_maskz_loadu_epi8((1u64 << 36) - 1, p as *const i8) }
    }

    /// The pair's unsigned codes, in activation order.
    #[inline(always)]
    unsafe fn unpack_pair(raw: __m512i, idx: __m512i) -> __m512i {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let dup = _mm512_permutexvar_epi8(idx, raw);
            let high = _mm512_mask_blend_epi64(0b1100_1100, dup, _mm512_srli_epi16(dup, 4));
            _mm512_and_si512(high, _mm512_set1_epi8(0x0f))
        }
    }

    /// `vpermw` indices broadcasting the pair's two f16 scales (words 0
    /// and 9 of the 36 loaded bytes) over 8 lanes each.
    const SCALES: [u16; 32] = {
        let mut idx = [0u16; 32];
        let mut i = 8;
        while i < 16 {
            idx[i] = (Q4_0_BLOCK_BYTES / 2) as u16;
            i += 1;
        }
        idx
    };

    /// The pair's two weight scales (f16, converted exactly), each over its
    /// block's 8 lanes.
    #[inline(always)]
    unsafe fn pair_dw(raw: __m512i, sidx: __m512i) -> __m512 {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let words = _mm512_permutexvar_epi16(sidx, raw);
            _mm512_cvtph_ps(_mm512_castsi512_si256(words))
        }
    }

    /// Weight scales times the activation's (blocks `b`, `b + 1`): the same
    /// f32 products as the scalar reference's `f16_to_f32(d) · x.scales[b]`.
    #[inline(always)]
    unsafe fn pair_scale(dw: __m512, x: &Q8Activation, b: usize) -> __m512 {
        // SAFETY: scales8[8b..8b+16] is in bounds for b + 1 < blocks.
        unsafe { _mm512_mul_ps(dw, _mm512_loadu_ps(x.scales8.as_ptr().add(b * 8))) }
    }

    /// The lanes of one block pair against one activation (blocks `b`,
    /// `b + 1`).
    #[inline(always)]
    unsafe fn pair_lanes(wq: __m512i, x: &Q8Activation, b: usize) -> __m512i {
        // SAFETY: quants[32b..32b+64] and sums8[8b..8b+16] are in bounds
        // for b + 1 < blocks (caller).
        unsafe {
            let xq = _mm512_loadu_si512(x.quants.as_ptr().add(b * QK) as *const __m512i);
            let zero = _mm512_loadu_si512(x.sums8.as_ptr().add(b * 8) as *const __m512i);
            let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xq);
            _mm512_sub_epi32(dot, zero)
        }
    }

    /// The last block of an odd count (an even block: the low half).
    #[inline(always)]
    unsafe fn tail(p: *const u8, x: &Q8Activation, b: usize, acc: __m512) -> __m512 {
        // SAFETY: block b's 18 bytes, quants[32b..32b+32] and
        // sums8[8b..8b+8] are in bounds (caller).
        unsafe {
            let raw = _mm_loadu_si128(p.add(2) as *const __m128i);
            let low = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(raw, low);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
            let wq = _mm256_set_m128i(hi, lo);
            let xq = _mm256_loadu_si256(x.quants.as_ptr().add(b * QK) as *const __m256i);
            let zero = _mm256_loadu_si256(x.sums8.as_ptr().add(b * 8) as *const __m256i);
            let dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq);
            let lanes = _mm256_sub_epi32(dot, zero);
            let bits = (p as *const u16).read_unaligned() as i32;
            let dw = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
            let d = _mm256_set1_ps(dw * *x.scales.get_unchecked(b));
            let even = _mm512_castps512_ps256(acc);
            let even = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lanes), even);
            // The low 256 bits replaced (insertf64x4 is AVX-512 F; the f32x8
            // form would need DQ).
            _mm512_castpd_ps(_mm512_insertf64x4(
                _mm512_castps_pd(acc),
                _mm256_castps_pd(even),
                0,
            ))
        }
    }

    #[inline(always)]
    unsafe fn finish(acc: __m512) -> f32 {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let even = _mm512_castps512_ps256(acc);
            let odd = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
            super::avx2::finish_pub(even, odd)
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
    pub unsafe fn dot_q4_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
        let blocks = w.len() / Q4_0_BLOCK_BYTES;
        let wp = w.as_ptr();
        // SAFETY: pairs b, b+1 < blocks and the tail block are in bounds
        // (module docs); PAIR is 64 bytes.
        unsafe {
            let idx = _mm512_loadu_si512(PAIR.as_ptr() as *const __m512i);
            let sidx = _mm512_loadu_si512(SCALES.as_ptr() as *const __m512i);
            let mut acc = _mm512_setzero_ps();
            let mut b = 0;
            while b + 2 <= blocks {
                let raw = load_pair(wp.add(b * Q4_0_BLOCK_BYTES));
                let wq = unpack_pair(raw, idx);
                let d = pair_scale(pair_dw(raw, sidx), x, b);
                acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(pair_lanes(wq, x, b)), acc);
                b += 2;
            }
            if b < blocks {
                acc = tail(wp.add(b * Q4_0_BLOCK_BYTES), x, b, acc);
            }
            finish(acc)
        }
    }

    /// One Q4_0 row against up to [`super::MULTI`] activations; `out[t]`
    /// equals `dot_q4_0_q8(w, xs[t])` bit for bit.
    ///
    /// # Safety
    /// See the module docs; `xs.len() == out.len() <= MULTI`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
    pub unsafe fn dot_q4_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: forwarded contract; N matches the slice lengths.
        unsafe {
            match xs.len().min(out.len()) {
                1 => multi::<1>(w, xs, out),
                2 => multi::<2>(w, xs, out),
                3 => multi::<3>(w, xs, out),
                4 => multi::<4>(w, xs, out),
                _ => {}
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
    unsafe fn multi<const N: usize>(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        let blocks = w.len() / Q4_0_BLOCK_BYTES;
        let wp = w.as_ptr();
        // SAFETY: as in `dot_q4_0_q8`, for each of the N activations.
        unsafe {
            let idx = _mm512_loadu_si512(PAIR.as_ptr() as *const __m512i);
            let sidx = _mm512_loadu_si512(SCALES.as_ptr() as *const __m512i);
            let mut acc = [_mm512_setzero_ps(); N];
            let mut b = 0;
            while b + 2 <= blocks {
                let raw = load_pair(wp.add(b * Q4_0_BLOCK_BYTES));
                let wq = unpack_pair(raw, idx);
                let dw = pair_dw(raw, sidx);
                for t in 0..N {
                    let d = pair_scale(dw, xs[t], b);
                    let lanes = pair_lanes(wq, xs[t], b);
                    acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lanes), acc[t]);
                }
                b += 2;
            }
            for t in 0..N {
                if b < blocks {
                    acc[t] = tail(wp.add(b * Q4_0_BLOCK_BYTES), xs[t], b, acc[t]);
                }
                out[t] = finish(acc[t]);
            }
        }
    }
}

/// Most activations one multi-token call takes.
pub const MULTI: usize = 4;

/// Scalar reference of the multi-token kernels: the single-token reference
/// per token.
pub fn dot_q_q8_multi(w: &[u8], q4: bool, xs: &[&Q8Activation], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(xs) {
        *o = if q4 {
            dot_q4_0_q8(w, x)
        } else {
            dot_q8_0_q8(w, x)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_q4_0, dequantize_q8_0, quantize_q4_0, quantize_q8_0};
    use rand::{Rng, SeedableRng};

    fn data(rng: &mut impl Rng, n: usize, spread: f32) -> Vec<f32> {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0) * spread)
            .collect()
    }

    #[test]
    fn activation_quantization_round_trips_within_half_a_step() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let x = data(&mut rng, 256, 3.0);
        let a = Q8Activation::quantize(&x);
        for (i, v) in x.iter().enumerate() {
            let d = a.scales[i / QK];
            assert!((a.quants[i] as f32 * d - v).abs() <= d * 0.5 + 1e-6);
        }
        let z = Q8Activation::quantize(&[0.0; 32]);
        assert_eq!(z.scales, vec![0.0]);
        assert!(z.quants.iter().all(|&q| q == 0));
    }

    #[test]
    fn integer_dots_match_the_exact_product_within_the_activation_step() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        for &blocks in &[1usize, 2, 7, 64] {
            let n = blocks * QK;
            let w = data(&mut rng, n, 1.0);
            let x = data(&mut rng, n, 2.0);
            let a = Q8Activation::quantize(&x);
            for (bytes, deq) in [
                (quantize_q8_0(&w).unwrap(), {
                    let mut d = vec![0.0; n];
                    dequantize_q8_0(&quantize_q8_0(&w).unwrap(), &mut d);
                    d
                }),
                (quantize_q4_0(&w).unwrap(), {
                    let mut d = vec![0.0; n];
                    dequantize_q4_0(&quantize_q4_0(&w).unwrap(), &mut d);
                    d
                }),
            ] {
                let got = if bytes.len() == blocks * Q8_0_BLOCK_BYTES {
                    dot_q8_0_q8(&bytes, &a)
                } else {
                    dot_q4_0_q8(&bytes, &a)
                };
                // Against the exact product with the quantized activation
                // (f64): only float rounding separates them.
                let xq: Vec<f64> = a
                    .quants
                    .iter()
                    .enumerate()
                    .map(|(i, &q)| q as f64 * a.scales[i / QK] as f64)
                    .collect();
                let exact_q: f64 = deq.iter().zip(&xq).map(|(w, x)| *w as f64 * x).sum();
                let scale: f64 = deq
                    .iter()
                    .zip(&xq)
                    .map(|(w, x)| (*w as f64 * x).abs())
                    .sum();
                assert!(
                    (got as f64 - exact_q).abs() <= 1e-5 * scale.max(1e-9),
                    "{got} vs {exact_q}"
                );
                // Against the unquantized activation: within half a step per element.
                let exact: f64 = deq.iter().zip(&x).map(|(w, x)| *w as f64 * *x as f64).sum();
                let bound: f64 = deq
                    .iter()
                    .enumerate()
                    .map(|(i, w)| w.abs() as f64 * a.scales[i / QK] as f64 * 0.5)
                    .sum();
                assert!(
                    (got as f64 - exact).abs() <= bound * 1.01 + 1e-6,
                    "{got} vs {exact} (bound {bound})"
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_quantizer_equals_the_scalar_one() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("SKIP: this CPU has no AVX2+FMA+F16C (probe: is_x86_feature_detected)");
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(15);
        let mut inputs: Vec<Vec<f32>> = (0..40)
            .map(|i| data(&mut rng, QK * (1 + i % 5), [0.001f32, 1.0, 1e4][i % 3]))
            .collect();
        // Products that land on and next to .5 (ties round away from zero):
        // with amax 127 the inverse scale is 1, so x·id = x.
        let mut ties = vec![127.0f32];
        for k in 0..31 {
            let v = (k as f32 - 15.0) + 0.5;
            ties.push(match k % 3 {
                0 => v,
                1 => f32::from_bits(v.to_bits() - 1),
                _ => f32::from_bits(v.to_bits() + 1),
            });
        }
        inputs.push(ties);
        let mut odd = data(&mut rng, 2 * QK, 1.0);
        odd[3] = f32::NAN;
        odd[40] = f32::INFINITY;
        odd[41] = f32::NEG_INFINITY;
        odd[50..].fill(0.0);
        inputs.push(odd);
        inputs.push(vec![0.0; QK]);
        for x in &inputs {
            let mut want = Q8Activation::default();
            want.quantize_scalar(x);
            let mut got = Q8Activation::default();
            // SAFETY: features checked above.
            unsafe { avx2::quantize(&mut got, x) };
            assert_eq!(got.quants, want.quants);
            assert_eq!(got.sums8, want.sums8);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.scales), bits(&want.scales));
            assert_eq!(bits(&got.scales8), bits(&want.scales8));
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_equals_the_scalar_reference_bit_for_bit() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("SKIP: this CPU has no AVX2+FMA+F16C (probe: is_x86_feature_detected)");
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
        for &blocks in &[1usize, 3, 16, 65] {
            let n = blocks * QK;
            for spread in [0.01f32, 1.0, 300.0] {
                let w = data(&mut rng, n, spread);
                let x = data(&mut rng, n, spread);
                let a = Q8Activation::quantize(&x);
                let q8 = quantize_q8_0(&w).unwrap();
                let q4 = quantize_q4_0(&w).unwrap();
                // SAFETY: features checked above; lengths come from the quantizers.
                let (v8, v4) = unsafe { (avx2::dot_q8_0_q8(&q8, &a), avx2::dot_q4_0_q8(&q4, &a)) };
                assert_eq!(
                    v8.to_bits(),
                    dot_q8_0_q8(&q8, &a).to_bits(),
                    "q8_0 {blocks} blocks"
                );
                assert_eq!(
                    v4.to_bits(),
                    dot_q4_0_q8(&q4, &a).to_bits(),
                    "q4_0 {blocks} blocks"
                );
            }
        }
        // Multi-token: each token's result equals its single-token call.
        for &blocks in &[1usize, 5, 64] {
            let n = blocks * QK;
            let w = data(&mut rng, n, 1.0);
            let acts: Vec<Q8Activation> = (0..MULTI)
                .map(|_| Q8Activation::quantize(&data(&mut rng, n, 2.0)))
                .collect();
            let refs: Vec<&Q8Activation> = acts.iter().collect();
            for (bytes, q4) in [
                (quantize_q8_0(&w).unwrap(), false),
                (quantize_q4_0(&w).unwrap(), true),
            ] {
                for m in 1..=MULTI {
                    let mut out = vec![f32::NAN; m];
                    // SAFETY: features checked above; lengths from the quantizers.
                    unsafe { avx2::dot_q_q8_multi(&bytes, q4, &refs[..m], &mut out) };
                    for (t, o) in out.iter().enumerate() {
                        let single = if q4 {
                            dot_q4_0_q8(&bytes, refs[t])
                        } else {
                            dot_q8_0_q8(&bytes, refs[t])
                        };
                        assert_eq!(o.to_bits(), single.to_bits(), "q4={q4} m={m} t={t}");
                    }
                }
            }
        }
        // Extreme bytes (-128 in a Q8_0 row) stay exact.
        let mut q8 = quantize_q8_0(&data(&mut rng, 64, 1.0)).unwrap();
        q8[2] = 0x80;
        let a = Q8Activation::quantize(&data(&mut rng, 64, 1.0));
        // SAFETY: as above.
        let v = unsafe { avx2::dot_q8_0_q8(&q8, &a) };
        assert_eq!(v.to_bits(), dot_q8_0_q8(&q8, &a).to_bits());
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_vnni_equals_the_scalar_reference_bit_for_bit() {
        if !crate::kernels::has_avx512_vnni() {
            eprintln!(
                "SKIP: this CPU has no AVX-512 F/BW/VL/VNNI/VBMI (probe: is_x86_feature_detected)"
            );
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(14);
        for &blocks in &[1usize, 2, 3, 16, 65, 96] {
            let n = blocks * QK;
            for spread in [0.01f32, 1.0, 300.0] {
                let w = data(&mut rng, n, spread);
                let acts: Vec<Q8Activation> = (0..MULTI)
                    .map(|_| Q8Activation::quantize(&data(&mut rng, n, spread)))
                    .collect();
                let q4 = quantize_q4_0(&w).unwrap();
                for a in &acts {
                    // SAFETY: features checked above; lengths from the quantizers.
                    let v = unsafe { avx512::dot_q4_0_q8(&q4, a) };
                    assert_eq!(
                        v.to_bits(),
                        dot_q4_0_q8(&q4, a).to_bits(),
                        "{blocks} blocks"
                    );
                }
                let refs: Vec<&Q8Activation> = acts.iter().collect();
                for m in 1..=MULTI {
                    let mut out = vec![f32::NAN; m];
                    // SAFETY: as above.
                    unsafe { avx512::dot_q4_0_q8_multi(&q4, &refs[..m], &mut out) };
                    for (t, o) in out.iter().enumerate() {
                        let want = dot_q4_0_q8(&q4, refs[t]);
                        assert_eq!(o.to_bits(), want.to_bits(), "{blocks} blocks m={m} t={t}");
                    }
                }
            }
        }
        // Every nibble value, including the extremes 0 and 15, in a row
        // whose slice ends exactly at the last block (the masked loads must
        // not read past it).
        let mut row = quantize_q4_0(&data(&mut rng, 3 * QK, 1.0)).unwrap();
        for (i, b) in row.iter_mut().enumerate() {
            if i % Q4_0_BLOCK_BYTES >= 2 {
                *b = (i as u8).wrapping_mul(37);
            }
        }
        let a = Q8Activation::quantize(&data(&mut rng, 3 * QK, 1.0));
        // SAFETY: as above.
        let v = unsafe { avx512::dot_q4_0_q8(&row[..], &a) };
        assert_eq!(v.to_bits(), dot_q4_0_q8(&row, &a).to_bits());
    }
}
