//! Activations quantized to 8-bit blocks, and the integer dot products of
//! Q8_0 weight rows with them (Q4_0's are in [`super::q4_0`]), the way the
//! fastest CPU engines run integer formats:
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
//! dequantize-then-multiply product, as in llama.cpp; it applies to every
//! block-quantized format (unless `--exact-quant`), identically in every
//! tier.

use crate::format::f16_to_f32;
use crate::quant::{Q8_0_BLOCK_BYTES, QK};

/// An activation vector quantized to blocks of 32: `x[i] ≈ scales[i/32] ·
/// quants[i]`.
#[derive(Clone, Debug, Default)]
pub struct Q8Activation {
    pub scales: Vec<f32>,
    pub quants: Vec<i8>,
    /// Per block, `8 · Σ q`: what Q4_0's zero point of 8 contributes,
    /// subtracted exactly by kernels that multiply unsigned weight codes.
    pub bsums8: Vec<i32>,
    /// Per 16 quants (each block's halves), their sum (|Σ| ≤ 2032): what
    /// Q2_K's per-sub-block mins meet, so its kernels take `Σ m·Σ q` from
    /// one 16-bit multiply-add instead of a product with every quant.
    pub bsums16: Vec<i16>,
    /// The quants again, in groups of 4 blocks laid out as Q4_0 packs its
    /// nibbles: 64 bytes of each block's first 16 quants (block after
    /// block), then 64 of their last 16; zeros past the last block.
    pub split: Vec<i8>,
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
            if quantize_avx512::available() {
                // SAFETY: AVX-512 F/BW/VL checked by `available`.
                unsafe { quantize_avx512::quantize(self, x) };
            } else {
                // SAFETY: `vector_quantize` is set only where AVX2 was
                // detected.
                unsafe { avx2::quantize(self, x) };
            }
            return;
        }
        self.quantize_scalar(x);
    }

    /// The reference quantizer.
    pub fn quantize_scalar(&mut self, x: &[f32]) {
        debug_assert!(x.len().is_multiple_of(QK));
        self.clear(x.len());
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

    /// Empties the buffers and gives them room for `len` quants, so that
    /// quantizing allocates each at most once.
    fn clear(&mut self, len: usize) {
        let blocks = len / QK;
        self.scales.clear();
        self.scales.reserve(blocks);
        self.quants.clear();
        self.quants.reserve(len);
        self.bsums8.clear();
        self.bsums8.reserve(blocks);
        self.bsums16.clear();
        self.bsums16.reserve(2 * blocks);
        self.split.clear();
        self.split.reserve(blocks.div_ceil(4) * 2 * 64);
    }

    /// Records block scale `d` and the sum of the block's quants, which
    /// start at `start`.
    fn finish_block(&mut self, d: f32, start: usize) {
        let q = &self.quants[start..start + QK];
        let sum = q.iter().map(|&v| v as i32).sum::<i32>();
        self.record_block(d, start, sum);
    }

    /// [`Self::finish_block`] with the sum of the block's quants given.
    #[inline(always)]
    fn record_block(&mut self, d: f32, start: usize, sum: i32) {
        let low: i32 = self.quants[start..start + 16]
            .iter()
            .map(|&q| q as i32)
            .sum();
        self.record_block_halves(d, start, sum, low);
    }

    /// [`Self::record_block`] with the sum of the block's first 16 quants
    /// given too.
    #[inline(always)]
    fn record_block_halves(&mut self, d: f32, start: usize, sum: i32, low: i32) {
        self.scales.push(d);
        self.bsums8.push(8 * sum);
        // Both within ±16·127: exact in i16.
        self.bsums16.push(low as i16);
        self.bsums16.push((sum - low) as i16);
        let b = self.scales.len() - 1;
        let (g, j) = (b / 4, b % 4);
        if j == 0 {
            self.split.resize((g + 1) * 2 * 64, 0);
        }
        let at = g * 128 + j * 16;
        self.split[at..at + 16].copy_from_slice(&self.quants[start..start + 16]);
        self.split[at + 64..at + 80].copy_from_slice(&self.quants[start + 16..start + 32]);
    }
}

/// A block's scale `d = amax / 127` and its inverse (0 for an all-zero
/// block). NaNs are skipped by the maximum, as `f32::max` does.
#[inline]
fn block_scale(block: &[f32]) -> (f32, f32) {
    scale_of(block.iter().fold(0.0f32, |m, v| m.max(v.abs())))
}

/// The scale and inverse scale of a block whose largest |value| is `amax`.
#[inline(always)]
fn scale_of(amax: f32) -> (f32, f32) {
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

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! # Safety
    //! Every function requires AVX2, FMA and F16C (checked by the caller with
    //! `is_x86_feature_detected!`), `w.len() == blocks × block bytes` and an
    //! activation of `blocks × 32` quants.

    use std::arch::x86_64::*;

    use super::Q8Activation;
    use crate::quant::{Q8_0_BLOCK_BYTES, QK};

    /// [`Q8Activation::quantize_scalar`] with 8 lanes: the same scale, and
    /// `round` (half away from zero) as `trunc(x) ± (|x − trunc(x)| ≥ ½)`,
    /// exact because `x − trunc(x)` is; NaN lanes become 0 as Rust's
    /// saturating `as i8` makes them.
    ///
    /// # Safety
    /// Requires AVX2 (checked by the caller).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize(a: &mut Q8Activation, x: &[f32]) {
        a.clear(x.len());
        let sign = _mm256_set1_ps(-0.0);
        let half = _mm256_set1_ps(0.5);
        let one = _mm256_set1_ps(1.0);
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        for block in x.chunks_exact(QK) {
            // SAFETY: k·8 + 8 <= 32 = block.len().
            let v: [__m256; 4] =
                std::array::from_fn(|k| unsafe { _mm256_loadu_ps(block.as_ptr().add(k * 8)) });
            // `block_scale`'s maximum of |v| in registers: `max_ps` gives
            // its second operand where either is NaN, and the running
            // maximum never is NaN, so NaNs are skipped as `f32::max`
            // skips them; a maximum is exact in any order.
            let mut m = _mm256_setzero_ps();
            for vk in v {
                m = _mm256_max_ps(_mm256_and_ps(vk, magnitude), m);
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
            let (d, id) = super::scale_of(amax);
            let vid = _mm256_set1_ps(id);
            let mut ints = [_mm256_setzero_si256(); 4];
            for (out, vk) in ints.iter_mut().zip(v) {
                let xv = _mm256_mul_ps(vk, vid);
                let t = _mm256_round_ps(xv, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(xv, t));
                let away = _mm256_or_ps(_mm256_and_ps(xv, sign), one);
                let up = _mm256_and_ps(_mm256_cmp_ps(frac, half, _CMP_GE_OQ), away);
                let r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, up), lo), hi);
                let ordered = _mm256_cmp_ps(xv, xv, _CMP_ORD_Q);
                *out = _mm256_cvttps_epi32(_mm256_and_ps(r, ordered));
            }
            // The quants' sum from the 32-bit lanes (exact).
            let s8 = _mm256_add_epi32(
                _mm256_add_epi32(ints[0], ints[1]),
                _mm256_add_epi32(ints[2], ints[3]),
            );
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
            let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
            let w16a = _mm256_packs_epi32(ints[0], ints[1]);
            let w16b = _mm256_packs_epi32(ints[2], ints[3]);
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), order);
            let start = a.quants.len();
            let mut q = [0i8; QK];
            // SAFETY: `q` has 32 bytes.
            unsafe { _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes) };
            a.quants.extend_from_slice(&q);
            a.record_block(d, start, sum);
        }
    }

    /// The 8 lanes' sum: `((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))`.
    #[inline(always)]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
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

    /// Up to [`super::MULTI`] activations against one Q8_0 row: the row's
    /// blocks are loaded once; each token runs exactly the arithmetic of
    /// the single-token kernel (same lanes, accumulators and order), so
    /// `out[t]` equals `dot_q8_0_q8(w, xs[t])` bit for bit.
    ///
    /// # Safety
    /// See the module docs; `xs.len() == out.len() <= MULTI`, each activation
    /// of `blocks × 32` quants.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
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

    /// The multi-token kernel for exactly `N` tokens (a compile-time count,
    /// so the accumulators stay in registers).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn multi<const N: usize>(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        let blocks = w.len() / Q8_0_BLOCK_BYTES;
        let wp = w.as_ptr();
        let qp: [*const i8; N] = std::array::from_fn(|t| xs[t].quants.as_ptr());
        let sp: [*const f32; N] = std::array::from_fn(|t| xs[t].scales.as_ptr());
        let ones = _mm256_set1_epi16(1);
        // SAFETY: block b reads w[34b..34b+34] and each activation's
        // quants[32b..32b+32] and scales[b], in bounds for b < blocks
        // (caller).
        unsafe {
            // One block into an accumulator set (even blocks or odd ones).
            let step = |b: usize, acc: &mut [__m256; N]| {
                let blk = wp.add(b * Q8_0_BLOCK_BYTES);
                let bits = (blk as *const u16).read_unaligned() as i32;
                let dw = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
                let wq = _mm256_loadu_si256(blk.add(2) as *const __m256i);
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
                out[t] = finish(even[t], odd[t]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod quantize_avx512 {
    //! [`super::Q8Activation::quantize_scalar`] with 16 lanes: a block is two
    //! registers, where AVX2 takes four, and its quants are narrowed to bytes
    //! by one conversion per register. The operations on each element are
    //! the AVX2 quantizer's (the same maximum, scale, and rounding half away
    //! from zero as `trunc(x) ± (|x − trunc(x)| ≥ ½)`), so are the results.

    use std::arch::x86_64::*;

    use super::Q8Activation;
    use crate::quant::QK;

    /// Whether this CPU runs [`quantize`]: AVX-512 F, BW and VL.
    pub fn available() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
    }

    /// See the module docs.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VL ([`available`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub unsafe fn quantize(a: &mut Q8Activation, x: &[f32]) {
        a.clear(x.len());
        let sign = _mm512_set1_ps(-0.0);
        let half = _mm512_set1_ps(0.5);
        let one = _mm512_set1_ps(1.0);
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        let magnitude = _mm512_set1_epi32(0x7fff_ffff);
        // Bitwise operations on floats go through the integer forms
        // (AVX-512 F alone; the float forms need DQ).
        let sign_bits = _mm512_castps_si512(sign);
        let (one_bits, not_sign) = (_mm512_castps_si512(one), magnitude);
        for block in x.chunks_exact(QK) {
            // SAFETY: k·16 + 16 <= 32 = block.len().
            let v: [__m512; 2] =
                std::array::from_fn(|k| unsafe { _mm512_loadu_ps(block.as_ptr().add(k * 16)) });
            // The maximum of |v| skipping NaNs, as in the AVX2 quantizer:
            // `max_ps` gives its second operand where either is NaN, and
            // the running maximum never is NaN; the lanes' maximum is exact
            // in any order.
            let mut m = _mm512_setzero_ps();
            for vk in v {
                let abs = _mm512_and_si512(_mm512_castps_si512(vk), magnitude);
                m = _mm512_max_ps(_mm512_castsi512_ps(abs), m);
            }
            let amax = _mm512_reduce_max_ps(m);
            let (d, id) = super::scale_of(amax);
            let vid = _mm512_set1_ps(id);
            let mut ints = [_mm512_setzero_si512(); 2];
            for (out, vk) in ints.iter_mut().zip(v) {
                let xv = _mm512_mul_ps(vk, vid);
                let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(xv);
                let d = _mm512_castps_si512(_mm512_sub_ps(xv, t));
                let frac = _mm512_castsi512_ps(_mm512_and_si512(d, not_sign));
                let away = _mm512_castsi512_ps(_mm512_or_si512(
                    _mm512_and_si512(_mm512_castps_si512(xv), sign_bits),
                    one_bits,
                ));
                let up = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half), away);
                let r = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(t, up), lo), hi);
                // NaN lanes to 0, as Rust's saturating `as i8` makes them.
                let r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(xv, xv), r);
                *out = _mm512_cvttps_epi32(r);
            }
            // Sums of the 32-bit lanes (exact: |q| ≤ 127).
            let low = _mm512_reduce_add_epi32(ints[0]);
            let sum = low + _mm512_reduce_add_epi32(ints[1]);
            let start = a.quants.len();
            let mut q = [0i8; QK];
            // SAFETY: `q` has 32 bytes; each conversion gives 16 (every
            // value within ±127, so truncating to bytes is exact).
            unsafe {
                _mm_storeu_si128(
                    q.as_mut_ptr() as *mut __m128i,
                    _mm512_cvtepi32_epi8(ints[0]),
                );
                _mm_storeu_si128(
                    q.as_mut_ptr().add(16) as *mut __m128i,
                    _mm512_cvtepi32_epi8(ints[1]),
                );
            }
            a.quants.extend_from_slice(&q);
            a.record_block_halves(d, start, sum, low);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    //! Two consecutive Q8_0 rows at once in 512-bit registers (AVX-512
    //! VNNI): row 0's 32 codes of a block in the low half, row 1's in the
    //! high half, each token's block broadcast to both. The 32-bit lane `k`
    //! of a half is exactly the AVX2 kernel's lane `k` (Σ of elements 4k ..
    //! 4k + 3), scaled and accumulated by the same fused multiply-add into
    //! the same even/odd accumulator, and each half is reduced in the AVX2
    //! kernel's order: every result is [`super::dot_q8_0_q8`]'s bit for bit.
    //!
    //! For several tokens (prefill, batched decode) the weights' work — the
    //! magnitudes, the sign mask, the two scales — is done once per block
    //! for up to [`PAIR_TOKENS`] tokens, and each token costs five vector
    //! operations per block and row pair, against eight per block and row
    //! with AVX2's `maddubs` (q8act.rs `avx2::multi`).
    //!
    //! # Safety
    //! Every function requires AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C
    //! (checked by the caller), two rows of `blocks × 34` bytes and
    //! activations of `blocks × 32` quants.

    use std::arch::x86_64::*;

    use super::Q8Activation;
    use crate::quant::{Q8_0_BLOCK_BYTES, QK};

    /// Most activations one call takes (two accumulators per token: 16 of
    /// the 32 vector registers at 8).
    pub const PAIR_TOKENS: usize = 8;

    /// Rows `w0` and `w1` (Q8_0, the same length) against `xs.len() ≤
    /// PAIR_TOKENS` activations: `out[t] = [row 0, row 1]` for `xs[t]`,
    /// each [`super::dot_q8_0_q8`]'s bits.
    ///
    /// # Safety
    /// See the module docs; `w0.len() == w1.len()`, a multiple of 34;
    /// `out.len() >= xs.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_q8_pair(
        w0: &[u8],
        w1: &[u8],
        xs: &[&Q8Activation],
        out: &mut [[f32; 2]],
    ) {
        // SAFETY: forwarded contract; N matches the slice lengths.
        unsafe {
            match xs.len().min(out.len()) {
                1 => pair::<1>(w0, w1, xs, out),
                2 => pair::<2>(w0, w1, xs, out),
                3 => pair::<3>(w0, w1, xs, out),
                4 => pair::<4>(w0, w1, xs, out),
                5 => pair::<5>(w0, w1, xs, out),
                6 => pair::<6>(w0, w1, xs, out),
                7 => pair::<7>(w0, w1, xs, out),
                8 => pair::<8>(w0, w1, xs, out),
                _ => {}
            }
        }
    }

    /// The pair kernel for exactly `N` tokens (a compile-time count, so
    /// the accumulators stay in registers).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn pair<const N: usize>(
        w0: &[u8],
        w1: &[u8],
        xs: &[&Q8Activation],
        out: &mut [[f32; 2]],
    ) {
        let blocks = w0.len() / Q8_0_BLOCK_BYTES;
        let (p0, p1) = (w0.as_ptr(), w1.as_ptr());
        let qp: [*const i8; N] = std::array::from_fn(|t| xs[t].quants.as_ptr());
        let sp: [*const f32; N] = std::array::from_fn(|t| xs[t].scales.as_ptr());
        let zero = _mm512_setzero_si512();
        // Lanes 0..8 take the first f32 of a vector, lanes 8..16 the second.
        let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        // SAFETY: block b reads w0/w1[34b..34b+34] and each activation's
        // quants[32b..32b+32] and scales[b], in bounds for b < blocks
        // (caller).
        unsafe {
            // One block into an accumulator set (even blocks or odd ones).
            let step = |b: usize, acc: &mut [__m512; N]| {
                let (b0, b1) = (p0.add(b * Q8_0_BLOCK_BYTES), p1.add(b * Q8_0_BLOCK_BYTES));
                let lo = _mm256_loadu_si256(b0.add(2) as *const __m256i);
                let hi = _mm256_loadu_si256(b1.add(2) as *const __m256i);
                let wq = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                // |w| as unsigned bytes (|−128| = 128) against x with w's
                // sign: the products w·x, exactly, in VNNI's u8 × i8 form.
                let aw = _mm512_abs_epi8(wq);
                let neg = _mm512_movepi8_mask(wq);
                // The two rows' f16 scales, converted exactly (F16C), row 0's
                // under lanes 0..8 and row 1's under 8..16.
                let bits = _mm_insert_epi16::<1>(
                    _mm_cvtsi32_si128((b0 as *const u16).read_unaligned() as i32),
                    (b1 as *const u16).read_unaligned() as i32,
                );
                let dw = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_cvtph_ps(bits)));
                for t in 0..N {
                    let xq = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        qp[t].add(b * QK) as *const __m256i
                    ));
                    let sx = _mm512_mask_sub_epi8(xq, neg, zero, xq);
                    let lanes = _mm512_dpbusd_epi32(zero, aw, sx);
                    // f16(d) · x.d rounded once, as the scalar `d * xs`.
                    let d = _mm512_mul_ps(dw, _mm512_set1_ps(*sp[t].add(b)));
                    acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lanes), acc[t]);
                }
            };
            let (mut even, mut odd) = ([_mm512_setzero_ps(); N], [_mm512_setzero_ps(); N]);
            let mut b = 0;
            while b + 2 <= blocks {
                // The next two rows (where the caller goes next: its
                // rows are consecutive) asked of L2, 4 × 34 bytes of them
                // per two blocks of these. A hint that never faults.
                let at = 2 * w0.len() + b * 2 * Q8_0_BLOCK_BYTES;
                _mm_prefetch::<_MM_HINT_T1>(p0.wrapping_add(at) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(p0.wrapping_add(at + 64) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(p0.wrapping_add(at + 128) as *const i8);
                step(b, &mut even);
                step(b + 1, &mut odd);
                b += 2;
            }
            if b < blocks {
                step(b, &mut even);
            }
            for t in 0..N {
                let s = _mm512_add_ps(even[t], odd[t]);
                let row0 = _mm512_castps512_ps256(s);
                let row1 = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s)));
                // The AVX2 kernel's reduction of each row's 8 lanes.
                out[t] = [super::avx2::hsum(row0), super::avx2::hsum(row1)];
            }
        }
    }
}

/// Most activations one multi-token call takes.
pub const MULTI: usize = 4;

/// A row kernel written once for any number `N` of activations (its
/// single-token form is `N = 1`), so that [`by_count`] can pick `N` from
/// a slice's length. (The x86 kernels' for now; NEON's Q4_0 and Q8_0 ones
/// have a macro of their own.)
#[cfg(target_arch = "x86_64")]
pub(crate) trait Tokens {
    /// One row against `N` activations: result `t` for `xs[t]`.
    ///
    /// # Safety
    /// The implementing kernel's contract, for every activation.
    unsafe fn run<const N: usize>(w: &[u8], xs: &[&Q8Activation; N]) -> [f32; N];
}

/// `K`'s kernel for `xs.len()` activations (at most [`MULTI`]), into
/// `out[..xs.len()]`. Panics where `xs` is longer than [`MULTI`] or `out`
/// shorter than `xs`.
///
/// # Safety
/// `K::run`'s contract, for every activation of `xs`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn by_count<K: Tokens>(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
    const _: () = assert!(MULTI == 4, "by_count spells out 1..=4 activations");
    // SAFETY: the caller's contract, for every activation.
    unsafe {
        match *xs {
            [] => {}
            [a] => out[..1].copy_from_slice(&K::run::<1>(w, &[a])),
            [a, b] => out[..2].copy_from_slice(&K::run::<2>(w, &[a, b])),
            [a, b, c] => out[..3].copy_from_slice(&K::run::<3>(w, &[a, b, c])),
            [a, b, c, d] => out[..4].copy_from_slice(&K::run::<4>(w, &[a, b, c, d])),
            _ => panic!("at most {MULTI} activations, got {}", xs.len()),
        }
    }
}

/// Scalar reference of the multi-token kernel: the single-token reference
/// per token.
pub fn dot_q8_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(xs) {
        *o = dot_q8_0_q8(w, x);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::q4_0::dot_q4_0_q8;
    use crate::quant::{dequantize_q4_0, dequantize_q8_0, quantize_q4_0, quantize_q8_0};
    use rand::{Rng, SeedableRng};

    /// `n` uniform values in `(−spread, spread)`.
    pub(crate) fn data(rng: &mut impl Rng, n: usize, spread: f32) -> Vec<f32> {
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
        // The split copy: 5 blocks make two groups of 4, the second padded.
        let a = Q8Activation::quantize(&data(&mut rng, 5 * QK, 1.0));
        assert_eq!(a.split.len(), 2 * 128);
        for (i, &q) in a.quants.iter().enumerate() {
            let (b, e) = (i / QK, i % QK);
            let at = b / 4 * 128 + (e / 16) * 64 + (b % 4) * 16 + e % 16;
            assert_eq!(a.split[at], q, "quant {i}");
        }
        assert!(a.split[128 + 16..128 + 64].iter().all(|&q| q == 0));
        assert!(a.split[128 + 80..].iter().all(|&q| q == 0));
        assert_eq!(
            a.bsums8[4],
            8 * a.quants[4 * QK..].iter().map(|&q| q as i32).sum::<i32>()
        );
        assert_eq!(a.bsums16.len(), 10);
        for (h, &s) in a.bsums16.iter().enumerate() {
            let want: i32 = a.quants[16 * h..16 * h + 16]
                .iter()
                .map(|&q| q as i32)
                .sum();
            assert_eq!(s as i32, want, "half {h}");
        }
        // Extremes: 16 × ±127 fit.
        let mut x = vec![1.0f32; 2 * QK];
        x[QK..].fill(-1.0);
        let e = Q8Activation::quantize(&x);
        assert_eq!(e.bsums16, vec![2032, 2032, -2032, -2032]);
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

    /// Every kernel set this CPU runs (NEON on aarch64) equals the scalar
    /// reference bit for bit through its installed single- and few-token
    /// Q8_0 kernels, with zero and negative scales and every byte value.
    #[test]
    fn kernel_sets_equal_the_scalar_reference_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
        for k in crate::kernels::tests::simd_sets() {
            for &blocks in &[1usize, 2, 3, 7, 8, 9, 16, 17, 65] {
                let n = blocks * QK;
                for spread in [0.01f32, 1.0, 300.0] {
                    let mut w = quantize_q8_0(&data(&mut rng, n, spread)).unwrap();
                    for (b, blk) in w.chunks_exact_mut(Q8_0_BLOCK_BYTES).enumerate() {
                        match b % 4 {
                            1 => blk[..2].fill(0),
                            2 => blk[1] |= 0x80,
                            3 => {
                                for (j, q) in blk[2..].iter_mut().enumerate() {
                                    *q = (b * QK + j) as u8;
                                }
                            }
                            _ => {}
                        }
                    }
                    // Enough tokens for the pair kernel's largest pass.
                    let mut xs: Vec<Vec<f32>> = (0..8).map(|_| data(&mut rng, n, spread)).collect();
                    xs[1][..QK].fill(0.0);
                    let acts: Vec<Q8Activation> =
                        xs.iter().map(|x| Q8Activation::quantize(x)).collect();
                    let want: Vec<f32> = acts.iter().map(|a| dot_q8_0_q8(&w, a)).collect();
                    for (a, want) in acts.iter().zip(&want) {
                        let got = (k.dot_q8_0_q8)(&w, a);
                        assert_eq!(got.to_bits(), want.to_bits(), "{} {blocks} blocks", k.name);
                    }
                    let refs: Vec<&Q8Activation> = acts.iter().collect();
                    for m in 1..=MULTI {
                        let mut out = vec![f32::NAN; m];
                        (k.dot_q8_0_q8_multi)(&w, &refs[..m], &mut out);
                        for (t, o) in out.iter().enumerate() {
                            assert_eq!(
                                o.to_bits(),
                                want[t].to_bits(),
                                "{} multi, {blocks} blocks, {m} tokens",
                                k.name
                            );
                        }
                    }
                    // Two rows at a time: the second row another of this
                    // test's rows (its bytes reversed block by block keep
                    // the extreme bytes and scales), so each half of the
                    // kernel sees different weights.
                    if let Some(pair) = k.dot_q8_0_q8_pair {
                        let w1: Vec<u8> = w
                            .chunks_exact(Q8_0_BLOCK_BYTES)
                            .rev()
                            .flatten()
                            .copied()
                            .collect();
                        let want1: Vec<f32> = acts.iter().map(|a| dot_q8_0_q8(&w1, a)).collect();
                        for m in 1..=refs.len() {
                            let mut out = vec![[f32::NAN; 2]; m];
                            pair(&w, &w1, &refs[..m], &mut out);
                            for (t, o) in out.iter().enumerate() {
                                assert_eq!(
                                    [o[0].to_bits(), o[1].to_bits()],
                                    [want[t].to_bits(), want1[t].to_bits()],
                                    "{} pair, {blocks} blocks, {m} tokens, token {t}",
                                    k.name
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_and_avx512_quantizers_equal_the_scalar_one() {
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
        inputs.push(vec![-0.0; QK]);
        let mut nans = vec![f32::NAN; QK];
        nans[17] = -3.0;
        inputs.push(nans);
        inputs.push(vec![f32::NAN; QK]);
        let mut avx512_checked = 0;
        for x in &inputs {
            let mut want = Q8Activation::default();
            want.quantize_scalar(x);
            let mut got = Q8Activation::default();
            // SAFETY: features checked above.
            unsafe { avx2::quantize(&mut got, x) };
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let same = |got: &Q8Activation, name: &str| {
                assert_eq!(got.quants, want.quants, "{name}");
                assert_eq!(got.bsums8, want.bsums8, "{name}");
                assert_eq!(got.bsums16, want.bsums16, "{name}");
                assert_eq!(got.split, want.split, "{name}");
                assert_eq!(bits(&got.scales), bits(&want.scales), "{name}");
            };
            same(&got, "AVX2");
            if quantize_avx512::available() {
                // Into the AVX2 result's buffers: reused, as the
                // per-thread scratch reuses them.
                // SAFETY: AVX-512 F/BW/VL checked by `available`.
                unsafe { quantize_avx512::quantize(&mut got, x) };
                same(&got, "AVX-512");
                avx512_checked += 1;
            }
        }
        if quantize_avx512::available() {
            assert_eq!(avx512_checked, inputs.len());
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
                // SAFETY: features checked above; lengths come from the quantizers.
                let v8 = unsafe { avx2::dot_q8_0_q8(&q8, &a) };
                assert_eq!(
                    v8.to_bits(),
                    dot_q8_0_q8(&q8, &a).to_bits(),
                    "q8_0 {blocks} blocks"
                );
            }
        }
        // Multi-token: each token's result equals its single-token call.
        for &blocks in &[1usize, 5, 64] {
            let n = blocks * QK;
            let bytes = quantize_q8_0(&data(&mut rng, n, 1.0)).unwrap();
            let acts: Vec<Q8Activation> = (0..MULTI)
                .map(|_| Q8Activation::quantize(&data(&mut rng, n, 2.0)))
                .collect();
            let refs: Vec<&Q8Activation> = acts.iter().collect();
            for m in 1..=MULTI {
                let mut out = vec![f32::NAN; m];
                // SAFETY: features checked above; lengths from the quantizers.
                unsafe { avx2::dot_q8_0_q8_multi(&bytes, &refs[..m], &mut out) };
                for (t, o) in out.iter().enumerate() {
                    let single = dot_q8_0_q8(&bytes, refs[t]);
                    assert_eq!(o.to_bits(), single.to_bits(), "m={m} t={t}");
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
}
