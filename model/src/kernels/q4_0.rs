//! Q4_0 weights against activations quantized to 8-bit blocks: the
//! matrix–vector kernel of decode and the matrix–matrix kernel of prefill
//! and batched decode, which give the same bits for the same (row, token).
//!
//! The arithmetic, defined by the scalar reference [`dot_q4_0_q8`]: block
//! `b`'s 32 products are summed exactly as an integer `s_b`, its scale is
//! `d_b = f16(w.d_b) · x.d_b` (one f32 rounding), and `d_b · s_b` is added
//! with one fused multiply-add into accumulator lane `b mod 4`; the 4 lanes
//! are reduced at the end as `(a0 + a2) + (a1 + a3)` ([`tree4`]).
//!
//! Why this shape: it costs one conversion and one fused multiply-add per
//! (row, token, block), and both products vectorize it without changing a
//! bit. The matrix–vector kernel sums 16 consecutive blocks of one row into
//! the 16 lanes of a register and folds them into the 4 lanes in block
//! order; the matrix–matrix kernel puts 16 tokens in the lanes of a
//! register and keeps 4 accumulators for each of 4 rows, so one load of 4
//! activation bytes of 16 tokens feeds 4 rows' `vpdpbusd`. Every token
//! gets exactly the arithmetic of its single-token product, whatever the
//! batch (the engine's batch invariance) and whatever the CPU.

#[cfg(target_arch = "x86_64")]
use super::q8act::MULTI;
use super::q8act::Q8Activation;
use crate::format::f16_to_f32;
use crate::quant::{Q4_0_BLOCK_BYTES, QK};

/// Accumulator lanes: block `b` accumulates into lane `b % LANES`.
pub const LANES: usize = 4;

/// The fixed reduction of the accumulator lanes.
#[inline(always)]
pub fn tree4(a: [f32; LANES]) -> f32 {
    (a[0] + a[2]) + (a[1] + a[3])
}

/// Block `b`'s exact integer sum `Σ (code − 8) · q`.
#[inline(always)]
fn block_sum(blk: &[u8], q: &[i8]) -> i32 {
    let mut s = 0i32;
    for (j, &v) in blk[2..Q4_0_BLOCK_BYTES].iter().enumerate() {
        s += ((v & 0x0f) as i32 - 8) * q[j] as i32;
        s += ((v >> 4) as i32 - 8) * q[j + QK / 2] as i32;
    }
    s
}

/// Scalar reference: a Q4_0 row (`n/32` blocks of 18 bytes) · activation.
pub fn dot_q4_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (b, blk) in w.chunks_exact(Q4_0_BLOCK_BYTES).enumerate() {
        let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) * x.scales[b];
        let s = block_sum(blk, &x.quants[b * QK..(b + 1) * QK]);
        acc[b % LANES] = d.mul_add(s as f32, acc[b % LANES]);
    }
    tree4(acc)
}

/// Activations of several tokens interleaved for the matrix–matrix
/// kernels: tokens in groups of `width` (the kernel's lanes), and within a
/// group, for each block and each 4-byte group of it, the `width` tokens'
/// 4 quants side by side. Lanes past the last token hold zeros (their
/// results are discarded).
#[derive(Clone, Debug, Default)]
pub struct Q8Tiles {
    pub width: usize,
    pub tokens: usize,
    pub blocks: usize,
    /// `[group][block][4-byte group 0..8][lane][4]`.
    pub quants: Vec<i8>,
    /// `[group][block][lane]`: `8 · Σ q` of the token's block (Q4_0's zero
    /// point times the activation's block sum).
    pub zeros: Vec<i32>,
    /// `[group][block][lane]`: the token's block scale.
    pub scales: Vec<f32>,
}

impl Q8Tiles {
    /// Interleaves `xs` (each of `blocks × 32` quants) in groups of `width`.
    pub fn build(xs: &[&Q8Activation], width: usize) -> Q8Tiles {
        let blocks = xs.first().map_or(0, |x| x.scales.len());
        let groups = xs.len().div_ceil(width);
        let mut t = Q8Tiles {
            width,
            tokens: xs.len(),
            blocks,
            quants: vec![0; groups * blocks * QK * width],
            zeros: vec![0; groups * blocks * width],
            scales: vec![0.0; groups * blocks * width],
        };
        for (i, x) in xs.iter().enumerate() {
            assert_eq!(x.scales.len(), blocks, "activations of one length");
            let (g, lane) = (i / width, i % width);
            for b in 0..blocks {
                let q = &x.quants[b * QK..(b + 1) * QK];
                let base = (g * blocks + b) * QK * width;
                for (k, four) in q.chunks_exact(4).enumerate() {
                    let at = base + (k * width + lane) * 4;
                    t.quants[at..at + 4].copy_from_slice(four);
                }
                let at = (g * blocks + b) * width + lane;
                t.zeros[at] = x.bsums8[b];
                t.scales[at] = x.scales[b];
            }
        }
        t
    }

    /// Token groups.
    pub fn groups(&self) -> usize {
        self.tokens.div_ceil(self.width)
    }

    /// Floats a kernel writes per row (every lane of every group).
    pub fn row_stride(&self) -> usize {
        self.groups() * self.width
    }
}

/// Scalar reference of the matrix–matrix kernels: `out[t]` for every
/// lane of every group of `tiles`, one row.
pub fn gemm_q4_0_q8_ref(w: &[u8], tiles: &Q8Tiles, out: &mut [f32]) {
    let width = tiles.width;
    for (t, o) in out[..tiles.row_stride()].iter_mut().enumerate() {
        let (g, lane) = (t / width, t % width);
        let mut acc = [0.0f32; LANES];
        for (b, blk) in w.chunks_exact(Q4_0_BLOCK_BYTES).enumerate() {
            let at = (g * tiles.blocks + b) * width + lane;
            let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) * tiles.scales[at];
            let base = (g * tiles.blocks + b) * QK * width;
            let q: Vec<i8> = (0..QK)
                .map(|j| tiles.quants[base + (j / 4 * width + lane) * 4 + j % 4])
                .collect();
            acc[b % LANES] = d.mul_add(block_sum(blk, &q) as f32, acc[b % LANES]);
        }
        *o = tree4(acc);
    }
}

/// Rows' codes (`0..=15`, in activation order) and block scales, unpacked
/// once per row for the matrix–matrix kernels (x86 only so far).
#[derive(Default)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct RowScratch {
    codes: Vec<u8>,
    scales: Vec<f32>,
}

/// The matrix–matrix kernels' walk over whole rows (`rows.len()` a
/// multiple of `tiles.blocks × 18`), at most `max` at a time: each group is
/// unpacked into `scratch` and handed to `pass` with its row count and its
/// output (row `r` of the group at `out[r · tiles.row_stride()..]`).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn by_row_groups(
    rows: &[u8],
    tiles: &Q8Tiles,
    scratch: &mut RowScratch,
    out: &mut [f32],
    max: usize,
    mut pass: impl FnMut(usize, &RowScratch, &mut [f32]),
) {
    let rb = tiles.blocks * Q4_0_BLOCK_BYTES;
    let n = rows.len() / rb.max(1);
    let stride = tiles.row_stride();
    let mut r = 0;
    while r < n {
        let take = (n - r).min(max);
        scratch.unpack(&rows[r * rb..(r + take) * rb], tiles.blocks);
        pass(take, scratch, &mut out[r * stride..]);
        r += take;
    }
}

/// Runs `step(block, &mut acc[block % LANES])` over `blocks` blocks in
/// order, with constant lane indices (so the accumulators stay in
/// registers).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_macros))]
macro_rules! blocks_into_lanes {
    ($blocks:expr, $acc:ident, $step:ident) => {{
        let blocks = $blocks;
        let mut c = 0;
        while c + LANES <= blocks {
            $step(c, &mut $acc[0]);
            $step(c + 1, &mut $acc[1]);
            $step(c + 2, &mut $acc[2]);
            $step(c + 3, &mut $acc[3]);
            c += LANES;
        }
        if c < blocks {
            $step(c, &mut $acc[0]);
        }
        if c + 1 < blocks {
            $step(c + 1, &mut $acc[1]);
        }
        if c + 2 < blocks {
            $step(c + 2, &mut $acc[2]);
        }
    }};
}
#[cfg(target_arch = "x86_64")]
pub(crate) use blocks_into_lanes;

/// [`blocks_into_lanes`] for a step macro that takes its lane as a
/// constant, `$step!(b, lane)`: arrays of accumulators indexed by it stay
/// in registers (a closure here was left out of line, its accumulators in
/// memory).
#[cfg(target_arch = "x86_64")]
macro_rules! blocks_into_const_lanes {
    ($blocks:expr, $step:ident) => {{
        let blocks = $blocks;
        let mut c = 0;
        while c + LANES <= blocks {
            $step!(c, 0);
            $step!(c + 1, 1);
            $step!(c + 2, 2);
            $step!(c + 3, 3);
            c += LANES;
        }
        if c < blocks {
            $step!(c, 0);
        }
        if c + 1 < blocks {
            $step!(c + 1, 1);
        }
        if c + 2 < blocks {
            $step!(c + 2, 2);
        }
    }};
}
#[cfg(target_arch = "x86_64")]
pub(crate) use blocks_into_const_lanes;

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl RowScratch {
    /// Unpacks `rows` (whole rows of `blocks` blocks each).
    fn unpack(&mut self, rows: &[u8], blocks: usize) {
        let n = rows.len() / Q4_0_BLOCK_BYTES;
        debug_assert_eq!(n % blocks.max(1), 0);
        self.codes.resize(n * QK, 0);
        self.scales.clear();
        for (blk, out) in rows
            .chunks_exact(Q4_0_BLOCK_BYTES)
            .zip(self.codes.chunks_exact_mut(QK))
        {
            self.scales
                .push(f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])));
            let packed: &[u8; 16] = blk[2..].try_into().expect("18-byte block");
            let (lo, hi) = out.split_at_mut(QK / 2);
            for j in 0..QK / 2 {
                lo[j] = packed[j] & 0x0f;
                hi[j] = packed[j] >> 4;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! # Safety
    //! Every function requires AVX2, FMA and F16C (checked by the caller
    //! with `is_x86_feature_detected!`), `w.len() == blocks × 18` and
    //! activations of `blocks × 32` quants.

    use std::arch::x86_64::*;

    use super::{LANES, Q8Activation, Q8Tiles, RowScratch};
    use crate::quant::{Q4_0_BLOCK_BYTES, QK};

    /// Byte offsets of 8 consecutive blocks' scales.
    const OFFSETS: [i32; 8] = {
        let mut o = [0i32; 8];
        let mut i = 0;
        while i < 8 {
            o[i] = (i * Q4_0_BLOCK_BYTES) as i32;
            i += 1;
        }
        o
    };

    /// One block's 8 lane sums of `code · q` (4 products each; codes are
    /// 0..=15, so `maddubs` pairs stay far below the i16 limit).
    #[inline(always)]
    unsafe fn block_lanes(blk: *const u8, q: *const i8) -> __m256i {
        // SAFETY: the block's 16 code bytes and 32 quants are in bounds
        // (caller); register arithmetic under the module's guarantee.
        unsafe {
            let raw = _mm_loadu_si128(blk.add(2) as *const __m128i);
            let low = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(raw, low);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
            let codes = _mm256_set_m128i(hi, lo);
            let xq = _mm256_loadu_si256(q as *const __m256i);
            _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq), _mm256_set1_epi16(1))
        }
    }

    /// Lane `i` of the result: the sum of `v[i]`'s 8 lanes.
    #[inline(always)]
    unsafe fn reduce8(v: [__m256i; 8]) -> __m256i {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let h = [
                _mm256_hadd_epi32(v[0], v[1]),
                _mm256_hadd_epi32(v[2], v[3]),
                _mm256_hadd_epi32(v[4], v[5]),
                _mm256_hadd_epi32(v[6], v[7]),
            ];
            // Each 128-bit half: the half-sums of 4 consecutive vectors.
            let a = _mm256_hadd_epi32(h[0], h[1]);
            let b = _mm256_hadd_epi32(h[2], h[3]);
            let lows = _mm256_permute2x128_si256(a, b, 0x20);
            let highs = _mm256_permute2x128_si256(a, b, 0x31);
            _mm256_add_epi32(lows, highs)
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

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
        let blocks = w.len() / Q4_0_BLOCK_BYTES;
        let (wp, qp) = (w.as_ptr(), x.quants.as_ptr());
        // SAFETY: blocks c..c+n < blocks are read (module docs); the masked
        // loads and the gather touch only those.
        unsafe {
            let offsets = _mm256_loadu_si256(OFFSETS.as_ptr() as *const __m256i);
            let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let mut acc = _mm_setzero_ps();
            let mut c = 0;
            while c < blocks {
                let n = (blocks - c).min(8);
                let mut v = [_mm256_setzero_si256(); 8];
                for (i, vi) in v.iter_mut().enumerate().take(n) {
                    let b = c + i;
                    *vi = block_lanes(wp.add(b * Q4_0_BLOCK_BYTES), qp.add(b * QK));
                }
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), iota);
                let zeros = _mm256_maskload_epi32(x.bsums8.as_ptr().add(c), mask);
                let sums = _mm256_cvtepi32_ps(_mm256_sub_epi32(reduce8(v), zeros));
                let bits = _mm256_mask_i32gather_epi32::<1>(
                    _mm256_setzero_si256(),
                    wp.add(c * Q4_0_BLOCK_BYTES) as *const i32,
                    offsets,
                    mask,
                );
                // The low 16 bits of each lane: the blocks' f16 scales.
                let halves = _mm256_shuffle_epi8(
                    bits,
                    _mm256_setr_epi8(
                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9,
                        12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                    ),
                );
                let halves = _mm256_permute4x64_epi64(halves, 0b1000);
                let dw = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
                let d = _mm256_mul_ps(dw, _mm256_maskload_ps(x.scales.as_ptr().add(c), mask));
                acc = fold8(acc, d, sums, _mm256_castsi256_ps(mask));
                c += 8;
            }
            finish(acc)
        }
    }

    /// Up to [`super::MULTI`] tokens against one row (batched decode of a
    /// few sequences): each block is unpacked once and every token runs
    /// exactly [`dot_q4_0_q8`]'s arithmetic, so `out[t]` equals
    /// `dot_q4_0_q8(w, xs[t])` bit for bit.
    ///
    /// # Safety
    /// See the module docs; `xs.len() <= out.len()`, `xs.len() <=
    /// MULTI`, each activation of `blocks × 32` quants.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        let blocks = w.len() / Q4_0_BLOCK_BYTES;
        let wp = w.as_ptr();
        let n_tok = xs.len().min(out.len()).min(super::MULTI);
        // SAFETY: blocks c..c+n < blocks are read (module docs); the masked
        // loads and the gather touch only those.
        unsafe {
            let offsets = _mm256_loadu_si256(OFFSETS.as_ptr() as *const __m256i);
            let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let low = _mm_set1_epi8(0x0f);
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm_setzero_ps(); super::MULTI];
            let mut codes = [_mm256_setzero_si256(); 8];
            let mut c = 0;
            while c < blocks {
                let n = (blocks - c).min(8);
                for (i, code) in codes.iter_mut().enumerate().take(n) {
                    let raw =
                        _mm_loadu_si128(wp.add((c + i) * Q4_0_BLOCK_BYTES + 2) as *const __m128i);
                    let lo = _mm_and_si128(raw, low);
                    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
                    *code = _mm256_set_m128i(hi, lo);
                }
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), iota);
                let bits = _mm256_mask_i32gather_epi32::<1>(
                    _mm256_setzero_si256(),
                    wp.add(c * Q4_0_BLOCK_BYTES) as *const i32,
                    offsets,
                    mask,
                );
                let halves = _mm256_shuffle_epi8(
                    bits,
                    _mm256_setr_epi8(
                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9,
                        12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                    ),
                );
                let halves = _mm256_permute4x64_epi64(halves, 0b1000);
                let dw = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
                let m = _mm256_castsi256_ps(mask);
                for (x, a) in xs[..n_tok].iter().zip(acc.iter_mut()) {
                    let qp = x.quants.as_ptr();
                    let mut v = [_mm256_setzero_si256(); 8];
                    for (i, vi) in v.iter_mut().enumerate().take(n) {
                        let xq = _mm256_loadu_si256(qp.add((c + i) * QK) as *const __m256i);
                        *vi = _mm256_madd_epi16(_mm256_maddubs_epi16(codes[i], xq), ones);
                    }
                    let zeros = _mm256_maskload_epi32(x.bsums8.as_ptr().add(c), mask);
                    let sums = _mm256_cvtepi32_ps(_mm256_sub_epi32(reduce8(v), zeros));
                    let d = _mm256_mul_ps(dw, _mm256_maskload_ps(x.scales.as_ptr().add(c), mask));
                    *a = fold8(*a, d, sums, m);
                }
                c += 8;
            }
            for (o, a) in out.iter_mut().zip(&acc[..n_tok]) {
                *o = finish(*a);
            }
        }
    }

    /// Blocks c..c+4, then c+4..c+8 (products `d · sums`), into the 4
    /// accumulator lanes: block order within each lane. Lanes past the
    /// last block (`m` clear) are left as they are.
    #[inline(always)]
    unsafe fn fold8(acc: __m128, d: __m256, sums: __m256, m: __m256) -> __m128 {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let mut acc = acc;
            for half in [0, 1] {
                let (dh, sh, mh) = if half == 0 {
                    (
                        _mm256_castps256_ps128(d),
                        _mm256_castps256_ps128(sums),
                        _mm256_castps256_ps128(m),
                    )
                } else {
                    (
                        _mm256_extractf128_ps(d, 1),
                        _mm256_extractf128_ps(sums, 1),
                        _mm256_extractf128_ps(m, 1),
                    )
                };
                acc = _mm_blendv_ps(acc, _mm_fmadd_ps(dh, sh, acc), mh);
            }
            acc
        }
    }

    /// Token-group width of [`gemm_q4_0_q8`].
    pub const WIDTH: usize = 8;
    /// Rows multiplied together (sharing each load of the tokens' quants).
    const ROWS: usize = 2;

    /// Whole Q4_0 rows (`rows.len()` a multiple of `tiles.blocks × 18`)
    /// against every token of `tiles` (built with [`WIDTH`]): row `r`'s
    /// results at `out[r · tiles.row_stride()..]`, each equal to
    /// `dot_q4_0_q8(row, x_t)` bit for bit.
    ///
    /// # Safety
    /// See the module docs; `tiles.width == WIDTH`, `out.len() >= rows ·
    /// tiles.row_stride()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn gemm_q4_0_q8(
        rows: &[u8],
        tiles: &Q8Tiles,
        scratch: &mut RowScratch,
        out: &mut [f32],
    ) {
        super::by_row_groups(rows, tiles, scratch, out, ROWS, |take, unpacked, o| {
            // SAFETY: forwarded contract; `take` rows were unpacked.
            unsafe {
                if take == ROWS {
                    pass::<ROWS>(tiles, unpacked, o);
                } else {
                    pass::<1>(tiles, unpacked, o);
                }
            }
        });
    }

    /// `R` unpacked rows against every group of tokens (its closure
    /// inherits the target features, so the intrinsics inline).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // r indexes several arrays
    unsafe fn pass<const R: usize>(tiles: &Q8Tiles, scratch: &RowScratch, out: &mut [f32]) {
        let blocks = tiles.blocks;
        let stride = tiles.row_stride();
        let codes: [*const i32; R] =
            std::array::from_fn(|r| scratch.codes[r * blocks * QK..].as_ptr() as *const i32);
        let scales: [*const f32; R] =
            std::array::from_fn(|r| scratch.scales[r * blocks..].as_ptr());
        // SAFETY: group g's blocks are in bounds of the tiles, the rows'
        // codes and scales cover `blocks`, out covers R rows (caller).
        unsafe {
            let ones = _mm256_set1_epi16(1);
            for g in 0..tiles.groups() {
                let qbase = tiles.quants.as_ptr().add(g * blocks * QK * WIDTH);
                let zbase = tiles.zeros.as_ptr().add(g * blocks * WIDTH);
                let sbase = tiles.scales.as_ptr().add(g * blocks * WIDTH);
                let step = |b: usize, acc: &mut [__m256; R]| {
                    let q = qbase.add(b * QK * WIDTH) as *const __m256i;
                    // 16 products per i16 lane: |Σ| <= 16·15·127 < 2^15.
                    let mut p = [_mm256_setzero_si256(); R];
                    for k in 0..8 {
                        let t = _mm256_loadu_si256(q.add(k));
                        for r in 0..R {
                            let wk = _mm256_set1_epi32(codes[r].add(b * 8 + k).read_unaligned());
                            p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(wk, t));
                        }
                    }
                    let z = _mm256_loadu_si256(zbase.add(b * WIDTH) as *const __m256i);
                    let sc = _mm256_loadu_ps(sbase.add(b * WIDTH));
                    for r in 0..R {
                        let s = _mm256_sub_epi32(_mm256_madd_epi16(p[r], ones), z);
                        let d = _mm256_mul_ps(_mm256_set1_ps(*scales[r].add(b)), sc);
                        acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[r]);
                    }
                };
                let mut acc = [[_mm256_setzero_ps(); R]; LANES];
                blocks_into_lanes!(blocks, acc, step);
                for r in 0..R {
                    let v = _mm256_add_ps(
                        _mm256_add_ps(acc[0][r], acc[2][r]),
                        _mm256_add_ps(acc[1][r], acc[3][r]),
                    );
                    _mm256_storeu_ps(out.as_mut_ptr().add(r * stride + g * WIDTH), v);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    //! The same products with AVX-512 VNNI (`vpdpbusd`: 4 unsigned ×
    //! signed byte products summed into each i32 lane in one instruction).
    //! Weight codes enter unsigned (0..15) and the zero point is taken off
    //! exactly afterwards, `Σ(w−8)q = Σwq − 8Σq`.
    //!
    //! # Safety
    //! Every function requires AVX-512 F, BW, VL, VNNI and VBMI, FMA and
    //! F16C (checked by the caller with `is_x86_feature_detected!`),
    //! `w.len() == blocks × 18` and activations of `blocks × 32` quants.

    use std::arch::x86_64::*;

    use super::{LANES, Q8Activation, Q8Tiles, RowScratch};
    use crate::quant::{Q4_0_BLOCK_BYTES, QK};

    /// `vpermt2b` indices gathering 4 consecutive blocks' 16 packed bytes
    /// (block `j` at bytes `18j + 2..18j + 18` of the 72 from the group's
    /// start; the first 64 in one register, the last 8 in another).
    const PAYLOAD: [u8; 64] = {
        let mut idx = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            idx[i] = (Q4_0_BLOCK_BYTES * (i / 16) + 2 + i % 16) as u8;
            i += 1;
        }
        idx
    };

    /// `vpermw` indices for group `j` of a 16-block chunk: word lane
    /// `4j + m` takes block `m`'s f16 scale (word `9m` of the group's
    /// first 64 bytes).
    const SCALE_WORDS: [[u16; 32]; 4] = {
        let mut idx = [[0u16; 32]; 4];
        let mut j = 0;
        while j < 4 {
            let mut m = 0;
            while m < 4 {
                idx[j][4 * j + m] = (m * Q4_0_BLOCK_BYTES / 2) as u16;
                m += 1;
            }
            j += 1;
        }
        idx
    };

    /// `vpermd` indices taking lane `4k + j` (block `4j + k`, as the
    /// reduction leaves it) to lane `4j + k`.
    const TRANSPOSE: [i32; 16] = {
        let mut idx = [0i32; 16];
        let mut l = 0;
        while l < 16 {
            idx[l] = (4 * (l % 4) + l / 4) as i32;
            l += 1;
        }
        idx
    };

    /// `[x0+x1, x2+x3, y0+y1, y2+y3]` in every 128-bit lane.
    #[inline(always)]
    unsafe fn hadd(x: __m512i, y: __m512i) -> __m512i {
        // SAFETY: register arithmetic under the module's guarantee.
        unsafe {
            let (xf, yf) = (_mm512_castsi512_ps(x), _mm512_castsi512_ps(y));
            let even = _mm512_castps_si512(_mm512_shuffle_ps::<0b10_00_10_00>(xf, yf));
            let odd = _mm512_castps_si512(_mm512_shuffle_ps::<0b11_01_11_01>(xf, yf));
            _mm512_add_epi32(even, odd)
        }
    }

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
    pub unsafe fn dot_q4_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
        let blocks = w.len() / Q4_0_BLOCK_BYTES;
        let wp = w.as_ptr();
        let sp = x.split.as_ptr();
        // SAFETY: the masked loads touch only bytes of blocks < blocks and
        // of the activation's split copy (ceil(blocks / 4) groups); the
        // rest is register arithmetic (module docs).
        unsafe {
            let payload = _mm512_loadu_si512(PAYLOAD.as_ptr() as *const __m512i);
            let words: [__m512i; 4] = std::array::from_fn(|j| {
                _mm512_loadu_si512(SCALE_WORDS[j].as_ptr() as *const __m512i)
            });
            let transpose = _mm512_loadu_si512(TRANSPOSE.as_ptr() as *const __m512i);
            let nibble = _mm512_set1_epi8(0x0f);
            let mut acc = _mm_setzero_ps();
            let mut c = 0;
            while c < blocks {
                let n = (blocks - c).min(16);
                let mut v = [_mm512_setzero_si512(); 4];
                let mut scale_bits = _mm512_setzero_si512();
                for (j, vj) in v.iter_mut().enumerate() {
                    let b = c + 4 * j;
                    if b >= blocks {
                        break;
                    }
                    let bytes = (blocks - b).min(4) * Q4_0_BLOCK_BYTES;
                    let p = wp.add(b * Q4_0_BLOCK_BYTES) as *const i8;
                    let (m0, m1) = if bytes == 72 {
                        (u64::MAX, 0xff)
                    } else {
                        ((1u64 << bytes) - 1, 0)
                    };
                    let lo = _mm512_maskz_loadu_epi8(m0, p);
                    let hi = _mm512_maskz_loadu_epi8(m1, p.add(64));
                    let packed = _mm512_permutex2var_epi8(lo, payload, hi);
                    let low = _mm512_and_si512(packed, nibble);
                    let high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
                    let q = sp.add(b / 4 * 128) as *const __m512i;
                    let dot =
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(q));
                    *vj = _mm512_dpbusd_epi32(dot, high, _mm512_loadu_si512(q.add(1)));
                    scale_bits =
                        _mm512_mask_permutexvar_epi16(scale_bits, 0xf << (4 * j), words[j], lo);
                }
                // 128-bit lane k of v[j]: block 4j + k's 4 lane sums.
                let h = hadd(hadd(v[0], v[1]), hadd(v[2], v[3]));
                let sums = _mm512_permutexvar_epi32(transpose, h);
                let mask: __mmask16 = if n == 16 { u16::MAX } else { (1u16 << n) - 1 };
                let zeros = _mm512_maskz_loadu_epi32(mask, x.bsums8.as_ptr().add(c));
                let sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, zeros));
                let dw = _mm512_cvtph_ps(_mm512_castsi512_si256(scale_bits));
                let dd = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(mask, x.scales.as_ptr().add(c)));
                // Blocks c..c+4, c+4..c+8, … into lanes 0..4: block order
                // within each lane. Lanes past the last block are left as
                // they are.
                acc = _mm_mask3_fmadd_ps(
                    _mm512_extractf32x4_ps::<0>(dd),
                    _mm512_extractf32x4_ps::<0>(sums),
                    acc,
                    mask as u8 & 0xf,
                );
                acc = _mm_mask3_fmadd_ps(
                    _mm512_extractf32x4_ps::<1>(dd),
                    _mm512_extractf32x4_ps::<1>(sums),
                    acc,
                    (mask >> 4) as u8 & 0xf,
                );
                acc = _mm_mask3_fmadd_ps(
                    _mm512_extractf32x4_ps::<2>(dd),
                    _mm512_extractf32x4_ps::<2>(sums),
                    acc,
                    (mask >> 8) as u8 & 0xf,
                );
                acc = _mm_mask3_fmadd_ps(
                    _mm512_extractf32x4_ps::<3>(dd),
                    _mm512_extractf32x4_ps::<3>(sums),
                    acc,
                    (mask >> 12) as u8 & 0xf,
                );
                c += 16;
            }
            let h2 = _mm_add_ps(acc, _mm_movehl_ps(acc, acc));
            _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)))
        }
    }

    /// Token-group width of [`gemm_q4_0_q8`].
    pub const WIDTH: usize = 16;
    /// Rows multiplied together (sharing each load of the tokens' quants).
    const ROWS: usize = 4;

    /// Whole Q4_0 rows (`rows.len()` a multiple of `tiles.blocks × 18`)
    /// against every token of `tiles` (built with [`WIDTH`]): row `r`'s
    /// results at `out[r · tiles.row_stride()..]`, each equal to
    /// `dot_q4_0_q8(row, x_t)` bit for bit.
    ///
    /// # Safety
    /// See the module docs; `tiles.width == WIDTH`, `out.len() >= rows ·
    /// tiles.row_stride()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
    pub unsafe fn gemm_q4_0_q8(
        rows: &[u8],
        tiles: &Q8Tiles,
        scratch: &mut RowScratch,
        out: &mut [f32],
    ) {
        super::by_row_groups(rows, tiles, scratch, out, ROWS, |take, unpacked, o| {
            // SAFETY: forwarded contract; `take` rows were unpacked.
            unsafe {
                match take {
                    ROWS => pass::<ROWS>(tiles, unpacked, o),
                    3 => pass::<3>(tiles, unpacked, o),
                    2 => pass::<2>(tiles, unpacked, o),
                    _ => pass::<1>(tiles, unpacked, o),
                }
            }
        });
    }

    /// `R` unpacked rows against every group of tokens (its closure
    /// inherits the target features, so the intrinsics inline).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // r indexes several arrays
    unsafe fn pass<const R: usize>(tiles: &Q8Tiles, scratch: &RowScratch, out: &mut [f32]) {
        let blocks = tiles.blocks;
        let stride = tiles.row_stride();
        let codes: [*const i32; R] =
            std::array::from_fn(|r| scratch.codes[r * blocks * QK..].as_ptr() as *const i32);
        let scales: [*const f32; R] =
            std::array::from_fn(|r| scratch.scales[r * blocks..].as_ptr());
        // SAFETY: group g's blocks are in bounds of the tiles, the rows'
        // codes and scales cover `blocks`, out covers R rows (caller).
        unsafe {
            for g in 0..tiles.groups() {
                let qbase = tiles.quants.as_ptr().add(g * blocks * QK * WIDTH);
                let zbase = tiles.zeros.as_ptr().add(g * blocks * WIDTH);
                let sbase = tiles.scales.as_ptr().add(g * blocks * WIDTH);
                let step = |b: usize, acc: &mut [__m512; R]| {
                    let q = qbase.add(b * QK * WIDTH) as *const __m512i;
                    // The sums start at −8Σq (the zero point), exactly.
                    let z = _mm512_loadu_si512(zbase.add(b * WIDTH) as *const __m512i);
                    let mut s = [_mm512_sub_epi32(_mm512_setzero_si512(), z); R];
                    for k in 0..8 {
                        let t = _mm512_loadu_si512(q.add(k));
                        for r in 0..R {
                            let wk = _mm512_set1_epi32(codes[r].add(b * 8 + k).read_unaligned());
                            s[r] = _mm512_dpbusd_epi32(s[r], wk, t);
                        }
                    }
                    let sc = _mm512_loadu_ps(sbase.add(b * WIDTH));
                    for r in 0..R {
                        let d = _mm512_mul_ps(_mm512_set1_ps(*scales[r].add(b)), sc);
                        acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s[r]), acc[r]);
                    }
                };
                let mut acc = [[_mm512_setzero_ps(); R]; LANES];
                blocks_into_lanes!(blocks, acc, step);
                for r in 0..R {
                    let v = _mm512_add_ps(
                        _mm512_add_ps(acc[0][r], acc[2][r]),
                        _mm512_add_ps(acc[1][r], acc[3][r]),
                    );
                    _mm512_storeu_ps(out.as_mut_ptr().add(r * stride + g * WIDTH), v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::q8act::tests::data;
    use crate::quant::{dequantize_q4_0, quantize_q4_0};
    use rand::{Rng, SeedableRng};

    /// Block counts around the vector widths (8, 16) and the model sizes
    /// (24 for a 768-wide input, 64 for 2048).
    const BLOCKS: [usize; 14] = [1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 33, 64, 65];

    /// Rows with every nibble value, zero and negative scales, and an
    /// activation with zero, huge and infinite blocks.
    fn awkward(rng: &mut impl Rng, blocks: usize) -> (Vec<u8>, Q8Activation) {
        let mut w = quantize_q4_0(&data(rng, blocks * QK, 1.0)).unwrap();
        for (i, b) in w.iter_mut().enumerate() {
            let blk = i / Q4_0_BLOCK_BYTES;
            match (i % Q4_0_BLOCK_BYTES, blk % 5) {
                (0 | 1, 3) => *b = 0,
                (1, 4) => *b |= 0x80,
                (j, 2) if j >= 2 => *b = (i as u8).wrapping_mul(37),
                _ => {}
            }
        }
        let mut x = data(rng, blocks * QK, 2.0);
        for (b, blk) in x.chunks_mut(QK).enumerate() {
            match b % 7 {
                1 => blk.fill(0.0),
                4 => blk[5] = 1e30,
                6 if b > 6 => blk[9] = f32::INFINITY,
                _ => {}
            }
        }
        (w, Q8Activation::quantize(&x))
    }

    #[test]
    fn the_reference_is_the_sum_of_block_products() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(31);
        for &blocks in &BLOCKS {
            let n = blocks * QK;
            let w = quantize_q4_0(&data(&mut rng, n, 1.0)).unwrap();
            let a = Q8Activation::quantize(&data(&mut rng, n, 3.0));
            let mut deq = vec![0.0; n];
            dequantize_q4_0(&w, &mut deq);
            // The exact product of the dequantized row and the quantized
            // activation, in f64; only f32 rounding separates them.
            let (mut exact, mut scale) = (0.0f64, 0.0f64);
            for (i, &v) in deq.iter().enumerate() {
                let p = v as f64 * a.quants[i] as f64 * a.scales[i / QK] as f64;
                exact += p;
                scale += p.abs();
            }
            let got = dot_q4_0_q8(&w, &a) as f64;
            assert!((got - exact).abs() <= 1e-5 * scale, "{got} vs {exact}");
        }
    }

    #[test]
    fn tiles_hold_each_token_where_the_reference_gemm_finds_it() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(32);
        for &blocks in &[1usize, 9, 24] {
            let (w, _) = awkward(&mut rng, blocks);
            for tokens in [1usize, 3, 8, 17] {
                let acts: Vec<Q8Activation> = (0..tokens)
                    .map(|_| Q8Activation::quantize(&data(&mut rng, blocks * QK, 1.0)))
                    .collect();
                let refs: Vec<&Q8Activation> = acts.iter().collect();
                for width in [8usize, 16] {
                    let tiles = Q8Tiles::build(&refs, width);
                    let mut out = vec![f32::NAN; tiles.row_stride()];
                    gemm_q4_0_q8_ref(&w, &tiles, &mut out);
                    for (t, a) in acts.iter().enumerate() {
                        assert_eq!(out[t].to_bits(), dot_q4_0_q8(&w, a).to_bits());
                    }
                    // Lanes past the last token see zero activations.
                    assert!(out[tokens..].iter().all(|v| *v == 0.0));
                }
            }
        }
    }

    /// Every kernel set this CPU runs (NEON on aarch64) equals the scalar
    /// reference bit for bit through its installed single- and few-token
    /// kernels, on awkward rows and activations.
    #[test]
    fn kernel_sets_equal_the_scalar_reference_bit_for_bit() {
        use crate::kernels::q8act::MULTI;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(34);
        for k in crate::kernels::tests::simd_sets() {
            for &blocks in &BLOCKS {
                for spread in [0.01f32, 1.0, 300.0] {
                    let n = blocks * QK;
                    let (odd_row, odd_act) = awkward(&mut rng, blocks);
                    let rows = [quantize_q4_0(&data(&mut rng, n, spread)).unwrap(), odd_row];
                    let mut acts: Vec<Q8Activation> = (0..5)
                        .map(|_| Q8Activation::quantize(&data(&mut rng, n, spread)))
                        .collect();
                    acts.push(odd_act);
                    for w in &rows {
                        let want: Vec<f32> = acts.iter().map(|a| dot_q4_0_q8(w, a)).collect();
                        for (a, want) in acts.iter().zip(&want) {
                            let got = (k.dot_q4_0_q8)(w, a);
                            assert_eq!(got.to_bits(), want.to_bits(), "{} {blocks} blocks", k.name);
                        }
                        let Some(multi) = k.dot_q4_0_q8_multi else {
                            continue;
                        };
                        for m in 1..=MULTI {
                            let refs: Vec<&Q8Activation> = acts[acts.len() - m..].iter().collect();
                            let mut out = vec![f32::NAN; m];
                            multi(w, &refs, &mut out);
                            for (t, o) in out.iter().enumerate() {
                                assert_eq!(
                                    o.to_bits(),
                                    want[acts.len() - m + t].to_bits(),
                                    "{} multi, {blocks} blocks, {m} tokens",
                                    k.name
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every SIMD kernel this CPU runs equals the scalar reference bit for
    /// bit, token by token and in every batch.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_kernels_equal_the_scalar_reference_bit_for_bit() {
        type Dot = unsafe fn(&[u8], &Q8Activation) -> f32;
        type Gemm = unsafe fn(&[u8], &Q8Tiles, &mut RowScratch, &mut [f32]);
        let mut levels: Vec<(&str, Dot, Gemm, usize)> = Vec::new();
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            levels.push(("avx2", avx2::dot_q4_0_q8, avx2::gemm_q4_0_q8, avx2::WIDTH));
        } else {
            eprintln!("SKIP avx2: this CPU has no AVX2+FMA+F16C (probe: is_x86_feature_detected)");
        }
        if crate::kernels::has_avx512_vnni() {
            levels.push((
                "avx512",
                avx512::dot_q4_0_q8,
                avx512::gemm_q4_0_q8,
                avx512::WIDTH,
            ));
        } else {
            eprintln!("SKIP avx512: this CPU has no AVX-512 VNNI (probe: is_x86_feature_detected)");
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(33);
        let mut scratch = RowScratch::default();
        for &blocks in &BLOCKS {
            for spread in [0.01f32, 1.0, 300.0] {
                let n = blocks * QK;
                let mut rows = vec![quantize_q4_0(&data(&mut rng, n, spread)).unwrap()];
                let (odd_row, odd_act) = awkward(&mut rng, blocks);
                rows.push(odd_row);
                let mut acts: Vec<Q8Activation> = (0..18)
                    .map(|_| Q8Activation::quantize(&data(&mut rng, n, spread)))
                    .collect();
                acts.push(odd_act);
                for w in &rows {
                    let want: Vec<f32> = acts.iter().map(|a| dot_q4_0_q8(w, a)).collect();
                    if is_x86_feature_detected!("avx2")
                        && is_x86_feature_detected!("fma")
                        && is_x86_feature_detected!("f16c")
                    {
                        for m in 1..=MULTI {
                            let refs: Vec<&Q8Activation> = acts[acts.len() - m..].iter().collect();
                            let mut out = vec![f32::NAN; m];
                            // SAFETY: features checked above; lengths from
                            // the quantizers.
                            unsafe { avx2::dot_q4_0_q8_multi(w, &refs, &mut out) };
                            for (t, o) in out.iter().enumerate() {
                                let want = want[acts.len() - m + t];
                                assert_eq!(
                                    o.to_bits(),
                                    want.to_bits(),
                                    "avx2 multi, {blocks} blocks, {m} tokens"
                                );
                            }
                        }
                    }
                    for &(name, dot, gemm, width) in &levels {
                        for (a, want) in acts.iter().zip(&want) {
                            // SAFETY: features checked above; lengths from
                            // the quantizers.
                            let got = unsafe { dot(w, a) };
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{name} dot, {blocks} blocks"
                            );
                        }
                        for tokens in [1usize, 2, 7, 16, 17, acts.len()] {
                            let refs: Vec<&Q8Activation> = acts[..tokens].iter().collect();
                            let tiles = Q8Tiles::build(&refs, width);
                            let mut out = vec![f32::NAN; tiles.row_stride()];
                            // SAFETY: as above; tiles built with the kernel's width.
                            unsafe { gemm(w, &tiles, &mut scratch, &mut out) };
                            for t in 0..tokens {
                                assert_eq!(
                                    out[t].to_bits(),
                                    want[t].to_bits(),
                                    "{name} gemm, {blocks} blocks, {tokens} tokens, token {t}"
                                );
                            }
                        }
                    }
                }
                // Several rows per call (the kernels take 2 or 4 at once;
                // 1 to 7 cover every remainder).
                let refs: Vec<&Q8Activation> = acts.iter().collect();
                for nrows in 1..=7usize {
                    let rows: Vec<Vec<u8>> = (0..nrows)
                        .map(|i| {
                            if i % 3 == 1 {
                                awkward(&mut rng, blocks).0
                            } else {
                                quantize_q4_0(&data(&mut rng, n, spread)).unwrap()
                            }
                        })
                        .collect();
                    let all = rows.concat();
                    for &(name, _, gemm, width) in &levels {
                        let tiles = Q8Tiles::build(&refs, width);
                        let stride = tiles.row_stride();
                        let mut out = vec![f32::NAN; nrows * stride];
                        // SAFETY: as above.
                        unsafe { gemm(&all, &tiles, &mut scratch, &mut out) };
                        for (r, row) in rows.iter().enumerate() {
                            for (t, a) in acts.iter().enumerate() {
                                assert_eq!(
                                    out[r * stride + t].to_bits(),
                                    dot_q4_0_q8(row, a).to_bits(),
                                    "{name} gemm, {blocks} blocks, {nrows} rows, row {r} token {t}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
