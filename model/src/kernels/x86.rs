//! AVX2 + FMA (+ F16C) kernels for x86-64, chosen at run time.
//!
//! # Safety
//! Every function here is `unsafe` because it is compiled for CPU features
//! the baseline target lacks; callers must have checked them with
//! `is_x86_feature_detected!` (see `super::select`).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::format::FP8_E4M3_TABLE;

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: plain register arithmetic under the caller's avx guarantee.
    unsafe {
        let hi = _mm256_extractf128_ps(v, 1);
        let lo = _mm256_castps256_ps128(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

/// # Safety
/// Requires AVX2 and FMA; `w.len() == x.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    // SAFETY: forwarded contract.
    unsafe { dot_f32_body(w, x) }
}

/// `out[t] = dot_f32(q, k_t)` for rows `k_t = k[t·stride..t·stride +
/// q.len()]` (attention's scores), each exactly as [`dot_f32`] computes it;
/// one call, so consecutive rows overlap in the pipeline.
///
/// # Safety
/// Requires AVX2 and FMA; `k.len() >= (out.len() - 1) · stride + q.len()`
/// when `out` is not empty.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32_rows(q: &[f32], k: &[f32], stride: usize, out: &mut [f32]) {
    for (t, o) in out.iter_mut().enumerate() {
        // SAFETY: row t is in bounds (caller).
        *o = unsafe { dot_f32_body(q, k.get_unchecked(t * stride..t * stride + q.len())) };
    }
}

/// `out[j·rows + t] = dot_f32(q_j, k_t)` for `g` queries `q_j =
/// qs[j·d..(j + 1)·d]` (`d = qs.len() / g`) and `rows = out.len() / g`
/// rows `k_t = k[t·stride..t·stride + d]`: grouped-query attention's
/// scores of the heads that share a KV head. Each result has the bits of
/// [`dot_f32`]; four queries share every load of a key row (one load per
/// FMA instead of two).
///
/// # Safety
/// Requires AVX2 and FMA; `qs.len() == g · d`, `out.len() == g · rows`,
/// `k.len() >= (rows - 1) · stride + d` when `rows > 0`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32_rows_group(
    qs: &[f32],
    g: usize,
    k: &[f32],
    stride: usize,
    out: &mut [f32],
    ahead: bool,
) {
    // SAFETY: forwarded contract.
    unsafe {
        if ahead {
            rows_group::<false, true>(qs, g, k, stride, out)
        } else {
            rows_group::<false, false>(qs, g, k, stride, out)
        }
    }
}

/// How far ahead of the row it reads a decode's attention asks L2 for
/// the KV cache's rows, in bytes of the rows' data: 32 rows of 128
/// floats. The cache comes from memory, the weights streamed since having
/// evicted it, and the hardware's streams alone read it at 12.2–13.9 GB/s
/// where this distance gives 13.3–15.8 (`cargo bench --bench kernels --
/// --attention`, "cold", the AMX Xeon VM; 16 to 64 rows were alike within
/// the spread of runs), a 2048-position decode 5–9% faster
/// (docs/benchmarks.md).
const KV_AHEAD_BYTES: usize = 16 << 10;

/// Rows of `floats` floats [`KV_AHEAD_BYTES`] ahead.
fn kv_ahead_rows(floats: usize) -> usize {
    (KV_AHEAD_BYTES / (4 * floats.max(1))).max(1)
}

/// Asks L2 for the cache lines of `len` floats at `p` (a hint).
#[inline(always)]
fn ask_l2_floats(p: *const f32, len: usize) {
    let lead = p as usize % 64;
    let first = p.cast::<i8>().wrapping_sub(lead);
    for at in (0..lead + 4 * len).step_by(64) {
        // SAFETY: a prefetch is a hint that never faults, whatever the
        // address; `wrapping_*` keeps the pointer arithmetic defined.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(first.wrapping_add(at)) };
    }
}

/// The body of [`dot_f32_rows_group`] (`WIDE`: four queries through
/// [`dot_four_avx512`], else [`dot_four`]), inlined into each.
///
/// # Safety
/// As [`dot_f32_rows_group`], and AVX-512 F when `WIDE`.
#[inline(always)]
unsafe fn rows_group<const WIDE: bool, const AHEAD: bool>(
    qs: &[f32],
    g: usize,
    k: &[f32],
    stride: usize,
    out: &mut [f32],
) {
    let d = qs.len() / g.max(1);
    let rows = out.len() / g.max(1);
    // With `AHEAD`, the first queries' pass over a row asks for the row
    // [`KV_AHEAD_BYTES`] on (within `k`, which may run past `rows`).
    let far = kv_ahead_rows(d);
    let ask = |t: usize, n: usize| {
        if !AHEAD {
            return;
        }
        for r in t + far..t + far + n {
            if r * stride + d <= k.len() {
                ask_l2_floats(k.as_ptr().wrapping_add(r * stride), d);
            }
        }
    };
    let mut j0 = 0;
    while j0 < g {
        let m = (g - j0).min(4);
        // Four rows at a time where the steps cover the rows exactly: the
        // 4 × 4 kernel keeps sixteen sums in registers and reduces them
        // together (the same bits, a quarter of the query loads).
        let mut t0 = 0;
        if WIDE && m == 4 && d >= 16 && d.is_multiple_of(16) {
            while t0 + 4 <= rows {
                if j0 == 0 {
                    ask(t0, 4);
                }
                // SAFETY: rows t0..t0 + 4 lie in k (caller); queries j0..j0
                // + 4 in qs; out has g · rows entries, so each query's four
                // results at (j0 + jj) · rows + t0 are in it.
                unsafe {
                    let kp = k.as_ptr().add(t0 * stride);
                    let keys = [kp, kp.add(stride), kp.add(2 * stride), kp.add(3 * stride)];
                    let r = dot_four_by_four_avx512(qs.as_ptr().add(j0 * d), d, keys);
                    let o = out.as_mut_ptr();
                    _mm_storeu_ps(o.add(j0 * rows + t0), _mm512_extractf32x4_ps::<0>(r));
                    _mm_storeu_ps(o.add((j0 + 1) * rows + t0), _mm512_extractf32x4_ps::<1>(r));
                    _mm_storeu_ps(o.add((j0 + 2) * rows + t0), _mm512_extractf32x4_ps::<2>(r));
                    _mm_storeu_ps(o.add((j0 + 3) * rows + t0), _mm512_extractf32x4_ps::<3>(r));
                }
                t0 += 4;
            }
        }
        for t in t0..rows {
            if j0 == 0 {
                ask(t, 1);
            }
            // SAFETY: row t lies in k (caller); queries j0..j0 + m in qs.
            unsafe {
                let kr = k.get_unchecked(t * stride..t * stride + d);
                if m == 4 {
                    let q = qs.as_ptr().add(j0 * d);
                    let r = if WIDE {
                        dot_four_avx512(q, d, kr)
                    } else {
                        dot_four(q, d, kr)
                    };
                    for (jj, v) in r.into_iter().enumerate() {
                        *out.get_unchecked_mut((j0 + jj) * rows + t) = v;
                    }
                } else {
                    for jj in 0..m {
                        let q = qs.get_unchecked((j0 + jj) * d..(j0 + jj + 1) * d);
                        *out.get_unchecked_mut((j0 + jj) * rows + t) = dot_f32_body(q, kr);
                    }
                }
            }
        }
        j0 += m;
    }
}

/// Four queries at `q` (`d` apart) against one key row, each exactly as
/// [`dot_f32_body`] computes it (same accumulators, steps and tail).
///
/// # Safety
/// `q` holds `4 · d` floats, `kr.len() == d`; AVX2 and FMA.
#[inline(always)]
unsafe fn dot_four(q: *const f32, d: usize, kr: &[f32]) -> [f32; 4] {
    let kp = kr.as_ptr();
    // SAFETY: loads of 8 floats at i ≤ d − 8 of a query or of the key row.
    unsafe {
        let mut a0 = [_mm256_setzero_ps(); 4];
        let mut a1 = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 16 <= d {
            let (k0, k1) = (_mm256_loadu_ps(kp.add(i)), _mm256_loadu_ps(kp.add(i + 8)));
            for j in 0..4 {
                let qj = q.add(j * d);
                a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qj.add(i)), k0, a0[j]);
                a1[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qj.add(i + 8)), k1, a1[j]);
            }
            i += 16;
        }
        while i + 8 <= d {
            let k0 = _mm256_loadu_ps(kp.add(i));
            for (j, a) in a0.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(j * d + i)), k0, *a);
            }
            i += 8;
        }
        let mut out = [0.0f32; 4];
        for (j, o) in out.iter_mut().enumerate() {
            let mut s = hsum(_mm256_add_ps(a0[j], a1[j]));
            for t in i..d {
                s += *q.add(j * d + t) * *kp.add(t);
            }
            *o = s;
        }
        out
    }
}

/// The body of [`dot_f32`], inlined into its callers.
///
/// # Safety
/// As [`dot_f32`].
#[inline(always)]
unsafe fn dot_f32_body(w: &[f32], x: &[f32]) -> f32 {
    let n = x.len().min(w.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut i = 0;
    // SAFETY: every load reads 8 floats at i < n - 7 from slices of length
    // n; register arithmetic under the caller's avx2/fma guarantee.
    unsafe {
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        while i + 16 <= n {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(i)), _mm256_loadu_ps(xp.add(i)), a0);
            a1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(wp.add(i + 8)),
                _mm256_loadu_ps(xp.add(i + 8)),
                a1,
            );
            i += 16;
        }
        while i + 8 <= n {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(i)), _mm256_loadu_ps(xp.add(i)), a0);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(a0, a1));
        while i < n {
            s += *wp.add(i) * *xp.add(i);
            i += 1;
        }
        s
    }
}

#[inline(always)]
unsafe fn load_bf16x8(p: *const u16) -> __m256 {
    // SAFETY: reads 16 bytes at p, guaranteed by the caller.
    unsafe {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
}

/// # Safety
/// Requires AVX2 and FMA; `w.len() == x.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    let n = x.len().min(w.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut a0 = _mm256_setzero_ps();
    let mut a1 = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: loads stay below n as in dot_f32.
    unsafe {
        while i + 16 <= n {
            a0 = _mm256_fmadd_ps(load_bf16x8(wp.add(i)), _mm256_loadu_ps(xp.add(i)), a0);
            a1 = _mm256_fmadd_ps(
                load_bf16x8(wp.add(i + 8)),
                _mm256_loadu_ps(xp.add(i + 8)),
                a1,
            );
            i += 16;
        }
        while i + 8 <= n {
            a0 = _mm256_fmadd_ps(load_bf16x8(wp.add(i)), _mm256_loadu_ps(xp.add(i)), a0);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(a0, a1));
        while i < n {
            s += crate::format::bf16_to_f32(*wp.add(i)) * *xp.add(i);
            i += 1;
        }
        s
    }
}

/// A 16-bit weight format as the one-row kernels widen it: 8 values into
/// a register, one value for the scalar tail.
trait Half16 {
    /// # Safety
    /// Reads 16 bytes at `p`; needs the CPU features of the caller.
    unsafe fn load8(p: *const u16) -> __m256;
    fn widen(v: u16) -> f32;
}

struct Bf16;
impl Half16 for Bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> __m256 {
        // SAFETY: forwarded contract.
        unsafe { load_bf16x8(p) }
    }
    fn widen(v: u16) -> f32 {
        crate::format::bf16_to_f32(v)
    }
}

struct F16;
impl Half16 for F16 {
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> __m256 {
        // SAFETY: forwarded contract (F16C with the caller's features).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    fn widen(v: u16) -> f32 {
        crate::format::f16_to_f32(v)
    }
}

/// The end of a one-row 16-bit kernel: its chains summed as it sums them,
/// then the scalar tail `from..n` of row `w` against `x`.
///
/// # Safety
/// Requires AVX; `w` and `x` hold `n` values.
#[inline(always)]
unsafe fn finish<H: Half16, const CHAINS: usize>(
    a: &[__m256; CHAINS],
    w: *const u16,
    x: *const f32,
    from: usize,
    n: usize,
) -> f32 {
    // SAFETY: reads below n in both (the contract).
    unsafe {
        let v = if CHAINS == 2 {
            _mm256_add_ps(a[0], a[1])
        } else {
            a[0]
        };
        let mut s = hsum(v);
        for k in from..n {
            s += H::widen(*w.add(k)) * *x.add(k);
        }
        s
    }
}

/// Rows of a 16-bit matrix against one vector, `out[r]` exactly the
/// one-row kernel's result for row `r` (`w[r × n..(r + 1) × n]`, `n =
/// x.len()`): that kernel runs `CHAINS` accumulators over `8 × CHAINS`
/// values per step, then (with two) one more step of 8 into the first,
/// then the scalar tail; here four rows do so together, sharing each load
/// of `x`. One row at a time streamed at 0.65-0.80 of the read bandwidth
/// on Zen 3: its one or two chains of dependent FMAs leave too few loads
/// in flight. Rows past the last four take `one`.
///
/// # Safety
/// Requires AVX2, FMA and F16C; `w.len() == out.len() × x.len()`.
#[inline(always)]
unsafe fn rows4<H: Half16, const CHAINS: usize>(
    w: &[u16],
    x: &[f32],
    out: &mut [f32],
    one: unsafe fn(&[u16], &[f32]) -> f32,
) {
    let n = x.len();
    debug_assert_eq!(w.len(), out.len() * n);
    let mut quads = out.chunks_exact_mut(4);
    let mut r = 0;
    for o in &mut quads {
        // SAFETY: rows r..r + 4 lie inside w (the contract); loads stay
        // below n in each, as in the one-row kernels.
        unsafe {
            let wp = w.as_ptr().add(r * n);
            let xp = x.as_ptr();
            let mut a = [[_mm256_setzero_ps(); CHAINS]; 4];
            let mut i = 0;
            while i + 8 * CHAINS <= n {
                let xs: [__m256; CHAINS] =
                    std::array::from_fn(|c| _mm256_loadu_ps(xp.add(i + 8 * c)));
                for (j, a) in a.iter_mut().enumerate() {
                    for (c, (a, x)) in a.iter_mut().zip(&xs).enumerate() {
                        *a = _mm256_fmadd_ps(H::load8(wp.add(j * n + i + 8 * c)), *x, *a);
                    }
                }
                i += 8 * CHAINS;
            }
            if CHAINS == 2 && i + 8 <= n {
                let x0 = _mm256_loadu_ps(xp.add(i));
                for (j, a) in a.iter_mut().enumerate() {
                    a[0] = _mm256_fmadd_ps(H::load8(wp.add(j * n + i)), x0, a[0]);
                }
                i += 8;
            }
            for (j, (o, a)) in o.iter_mut().zip(&a).enumerate() {
                *o = finish::<H, CHAINS>(a, wp.add(j * n), xp, i, n);
            }
        }
        r += 4;
    }
    for (j, o) in quads.into_remainder().iter_mut().enumerate() {
        // SAFETY: the caller's features; row r + j lies in w.
        *o = unsafe { one(&w[(r + j) * n..(r + j + 1) * n], x) };
    }
}

/// How far ahead of the group it multiplies the one-token quads kernel
/// asks L1 for bytes, where [`super::quads16::prefetch_ahead`] (farther)
/// asks L2: the far request alone into L1 (as before) held the core's few
/// L1 miss buffers for lines from memory. `cargo bench --bench kernels --
/// --quads --threads 2`, one token, on the AMX Xeon VM: quads at 0.69
/// (bf16) and 0.63 (f16) of the row-major kernel's GB/s with 8 KiB into
/// L1 alone, 0.81–0.83 and 0.89–0.90 with 8 KiB into L2 and 1 KiB into L1
/// (docs/benchmarks.md).
const NEAR_L1: usize = 1024;

/// [`rows4`] over rows in quads ([`super::quads16`]; `w` starts at a quad
/// boundary, `n` a multiple of 16): every row's result has the bits of
/// the one-row kernel, whose chains and steps each row runs in the same
/// order; the bytes are read in order, asked of L2
/// [`super::quads16::prefetch_ahead`] bytes ahead and of L1 [`NEAR_L1`]
/// bytes ahead. The last `out.len() % 4` rows (row-major) take `one`.
///
/// # Safety
/// Requires AVX2, FMA and F16C; `w.len() == out.len() × x.len()`,
/// `x.len()` a multiple of 16.
#[inline(always)]
unsafe fn quads4<H: Half16, const CHAINS: usize>(
    w: &[u16],
    x: &[f32],
    out: &mut [f32],
    one: unsafe fn(&[u16], &[f32]) -> f32,
) {
    let n = x.len();
    debug_assert!(w.len() == out.len() * n && n.is_multiple_of(16));
    let pf = super::quads16::prefetch_ahead();
    let mut quads = out.chunks_exact_mut(4);
    let mut r = 0;
    for o in &mut quads {
        // SAFETY: the quad's 4·n values lie inside w (the contract); group
        // g's row j is the 16 values at 64g + 16j, loads of 8 at +0 and
        // +8; x is read below n. The prefetch names bytes past the quad
        // (the next quad's, or past the matrix): a prefetch is a hint that
        // never faults, and `wrapping_add` keeps the address arithmetic
        // defined.
        unsafe {
            let qp = w.as_ptr().add(r * n);
            let xp = x.as_ptr();
            let mut a = [[_mm256_setzero_ps(); CHAINS]; 4];
            for g in 0..n / 16 {
                let gp = qp.add(64 * g);
                if pf != 0 {
                    // Far into L2, then near into L1 (lines the far request
                    // already sent for).
                    let ahead = (gp as *const i8).wrapping_add(pf);
                    _mm_prefetch::<_MM_HINT_T1>(ahead);
                    _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64));
                    let near = (gp as *const i8).wrapping_add(pf.min(NEAR_L1));
                    _mm_prefetch::<_MM_HINT_T0>(near);
                    _mm_prefetch::<_MM_HINT_T0>(near.wrapping_add(64));
                }
                let x0 = _mm256_loadu_ps(xp.add(16 * g));
                let x1 = _mm256_loadu_ps(xp.add(16 * g + 8));
                for (j, a) in a.iter_mut().enumerate() {
                    let row = gp.add(16 * j);
                    // The one-row kernel's steps: with two chains, columns
                    // 16g.. into the first and 16g + 8.. into the second;
                    // with one, both into it in column order.
                    a[0] = _mm256_fmadd_ps(H::load8(row), x0, a[0]);
                    a[CHAINS - 1] = _mm256_fmadd_ps(H::load8(row.add(8)), x1, a[CHAINS - 1]);
                }
            }
            for (o, a) in o.iter_mut().zip(&a) {
                // No scalar tail: n is a multiple of 16.
                *o = finish::<H, CHAINS>(a, qp, xp, n, n);
            }
        }
        r += 4;
    }
    for (j, o) in quads.into_remainder().iter_mut().enumerate() {
        // SAFETY: the caller's features; the last rows are row-major.
        *o = unsafe { one(&w[(r + j) * n..(r + j + 1) * n], x) };
    }
}

/// Rows in quads ([`super::quads16`]; `w` from a quad boundary) against
/// several vectors, `out[r × xs.len() + t]` exactly the one-row kernel's
/// result for row `r` and vector `t` (each runs its chains in the same
/// order). Quad by quad: its two pairs of rows (each pair shares every
/// group's 64-byte line) against `V` vectors at a time, each load and
/// widening serving `V` vectors; the quad's first pass streams its bytes
/// in order with the prefetch, the later ones find them in L1. The last
/// `rows % 4` rows (row-major) take `one`. GB/s of weights × vectors
/// against row-major [`rows_tokens`] (`cargo bench --bench kernels --
/// --quads`, docs/benchmarks.md "Quads of 16-bit rows"), 2 to 128
/// vectors: ×1.05–1.41 on Zen 3 (2 threads), ×1.00–1.56 on a Xeon (2 and
/// 8 threads). (Row by row through the quads, as [`rows_tokens`] reads,
/// ran at ×0.75–0.90.)
///
/// # Safety
/// Requires AVX2, FMA and F16C; every `xs[t].len() == n`, `n` a positive
/// multiple of 16, `w.len()` a multiple of n, `out.len() >= w.len() / n ×
/// xs.len()`.
#[inline(always)]
unsafe fn quads_tokens<H: Half16, const CHAINS: usize, const V: usize>(
    w: &[u16],
    xs: &[&[f32]],
    out: &mut [f32],
    one: unsafe fn(&[u16], &[f32]) -> f32,
) {
    let nt = xs.len();
    let Some(n) = xs.first().map(|x| x.len()) else {
        return;
    };
    let rows = w.len() / n;
    let whole = rows / 4 * 4;
    let pf = super::quads16::prefetch_ahead();
    for q in 0..whole / 4 {
        for t0 in (0..nt).step_by(V) {
            let xs = &xs[t0..(t0 + V).min(nt)];
            // SAFETY: quad q's 4·n values lie in w; every vector holds n.
            unsafe {
                let qp = w.as_ptr().add(q * 4 * n);
                for pair in 0..2 {
                    let first = t0 == 0 && pair == 0;
                    let a = match xs.len() {
                        1 => quad_pair::<H, CHAINS, 1, V>(qp, pair, xs, n, first, pf),
                        2 => quad_pair::<H, CHAINS, 2, V>(qp, pair, xs, n, first, pf),
                        3 => quad_pair::<H, CHAINS, 3, V>(qp, pair, xs, n, first, pf),
                        _ => quad_pair::<H, CHAINS, 4, V>(qp, pair, xs, n, first, pf),
                    };
                    for (r, a) in a.iter().enumerate() {
                        for (v, (a, x)) in a.iter().zip(xs).enumerate() {
                            out[(4 * q + 2 * pair + r) * nt + t0 + v] =
                                finish::<H, CHAINS>(a, qp, x.as_ptr(), n, n);
                        }
                    }
                }
            }
        }
    }
    for r in whole..rows {
        for (t, x) in xs.iter().enumerate() {
            // SAFETY: the caller's features; the last rows are row-major.
            out[r * nt + t] = unsafe { one(&w[r * n..(r + 1) * n], x) };
        }
    }
}

/// Rows `2·pair` and `2·pair + 1` of the quad at `qp` (they share each
/// group's 64-byte line) against `T ≤ V` vectors: their chains, as the
/// one-row kernel runs them. `first`: the quad's first pass, which asks
/// for both lines of each group `pf` bytes ahead (0: none).
///
/// # Safety
/// Requires AVX2, FMA and F16C; the quad's 4·n values at `qp`, `xs.len()
/// == T`, each of n values, n a multiple of 16.
#[inline(always)]
unsafe fn quad_pair<H: Half16, const CHAINS: usize, const T: usize, const V: usize>(
    qp: *const u16,
    pair: usize,
    xs: &[&[f32]],
    n: usize,
    first: bool,
    pf: usize,
) -> [[[__m256; CHAINS]; V]; 2] {
    debug_assert!(xs.len() == T && T <= V);
    let xp: [*const f32; T] = std::array::from_fn(|t| xs[t].as_ptr());
    // SAFETY: group g's rows 2·pair.. are 32 values at 64g + 32·pair; the
    // loads of 8 stay inside them and below n in each vector; the prefetch
    // is a hint (see quads4).
    unsafe {
        let mut a = [[[_mm256_setzero_ps(); CHAINS]; V]; 2];
        for g in 0..n / 16 {
            let gp = qp.add(64 * g);
            if first && pf != 0 {
                let ahead = (gp as *const i8).wrapping_add(pf);
                _mm_prefetch::<_MM_HINT_T0>(ahead);
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
            }
            let rp = gp.add(32 * pair);
            let ws: [[__m256; 2]; 2] =
                std::array::from_fn(|r| [H::load8(rp.add(16 * r)), H::load8(rp.add(16 * r + 8))]);
            for (v, x) in xp.iter().enumerate() {
                let x0 = _mm256_loadu_ps(x.add(16 * g));
                let x1 = _mm256_loadu_ps(x.add(16 * g + 8));
                for (a, w) in a.iter_mut().zip(&ws) {
                    let a = &mut a[v];
                    a[0] = _mm256_fmadd_ps(w[0], x0, a[0]);
                    a[CHAINS - 1] = _mm256_fmadd_ps(w[1], x1, a[CHAINS - 1]);
                }
            }
        }
        a
    }
}

/// The full steps of columns `c0..c1` (multiples of `8 × CHAINS`) of one
/// row against `T` vectors, continuing the chains in `a` (each vector's
/// own `CHAINS` accumulators, as the one-row kernel runs them; see
/// [`rows4`]): each load and widening of the row serves every vector, and
/// the `T × CHAINS` independent FMA chains keep the FMA units busy.
///
/// # Safety
/// Requires AVX2, FMA and F16C; columns below `c1` lie in the row and in
/// every vector.
#[inline(always)]
unsafe fn tokens_span<H: Half16, const CHAINS: usize, const T: usize>(
    wp: *const u16,
    xp: &[*const f32],
    a: &mut [[__m256; CHAINS]],
    c0: usize,
    c1: usize,
) {
    debug_assert!(xp.len() == T && a.len() == T);
    let xp: [*const f32; T] = std::array::from_fn(|t| xp[t]);
    // SAFETY: loads stay below c1 (the contract).
    unsafe {
        let mut acc: [[__m256; CHAINS]; T] = std::array::from_fn(|t| a[t]);
        let mut i = c0;
        while i < c1 {
            let ws: [__m256; CHAINS] = std::array::from_fn(|c| H::load8(wp.add(i + 8 * c)));
            for (a, x) in acc.iter_mut().zip(&xp) {
                for (c, (a, w)) in a.iter_mut().zip(&ws).enumerate() {
                    *a = _mm256_fmadd_ps(*w, _mm256_loadu_ps(x.add(i + 8 * c)), *a);
                }
            }
            i += 8 * CHAINS;
        }
        a.copy_from_slice(&acc);
    }
}

/// Columns per pass of [`rows_tokens`]: four vectors' share (16 KiB) stays
/// in L1 while each row of a group runs over it.
const SPAN: usize = 1024;
/// Rows per group of [`rows_tokens`]: their span (64 KiB of weights) stays
/// in L2 while each group of four vectors runs over it.
const SPAN_ROWS: usize = 32;

/// Rows of a 16-bit matrix (`w`: rows × n, `n = xs[t].len()`) against
/// several vectors, `out[r × xs.len() + t]` exactly the one-row kernel's
/// result for row `r` and vector `t`: each (row, vector) runs the one-row
/// kernel's chains, in the same steps and order, but the columns are taken
/// a span at a time (the chains wait in memory between spans, which
/// changes no bit), for a group of rows and four vectors at a time. One
/// row at a time against all the vectors read each vector from L2 once
/// per row; here a span of four vectors is read from L1 by every row of
/// the group, and the group's span of weights from L1/L2 by each group of
/// vectors.
///
/// # Safety
/// Requires AVX2, FMA and F16C; every `xs[t].len() == n > 0`, `w.len()`
/// a multiple of n, `out.len() >= w.len() / n × xs.len()`.
#[inline(always)]
unsafe fn rows_tokens<H: Half16, const CHAINS: usize>(w: &[u16], xs: &[&[f32]], out: &mut [f32]) {
    let nt = xs.len();
    if nt == 0 {
        return;
    }
    let n = xs[0].len();
    let rows = w.len() / n;
    let step = 8 * CHAINS;
    let main = n / step * step;
    let wp = w.as_ptr();
    let xp: Vec<*const f32> = xs.iter().map(|x| x.as_ptr()).collect();
    // SAFETY: a zero vector is a valid __m256.
    let zero = unsafe { _mm256_setzero_ps() };
    // Up to sixteen vectors: each row whole, on its own; spans and row
    // groups did not pay there (`cargo bench --bench kernels`, Zen 3:
    // batch 8 and 16 as fast or slower with them).
    let (span, group) = if nt <= 16 {
        (main.max(step), 1)
    } else {
        (SPAN, SPAN_ROWS)
    };
    // The chains of one row group, finished before the next group starts.
    let mut acc = vec![[zero; CHAINS]; group * nt];
    for g0 in (0..rows).step_by(group) {
        let g1 = (g0 + group).min(rows);
        acc.fill([zero; CHAINS]);
        let mut c0 = 0;
        while c0 < main {
            let c1 = (c0 + span).min(main);
            for t0 in (0..nt).step_by(4) {
                let t1 = (t0 + 4).min(nt);
                for r in g0..g1 {
                    let k = (r - g0) * nt;
                    let a = &mut acc[k + t0..k + t1];
                    // SAFETY: row r lies in w, columns below c1 ≤ n in it and
                    // in every vector (the contract).
                    unsafe {
                        let row = wp.add(r * n);
                        match t1 - t0 {
                            4 => tokens_span::<H, CHAINS, 4>(row, &xp[t0..t1], a, c0, c1),
                            3 => tokens_span::<H, CHAINS, 3>(row, &xp[t0..t1], a, c0, c1),
                            2 => tokens_span::<H, CHAINS, 2>(row, &xp[t0..t1], a, c0, c1),
                            _ => tokens_span::<H, CHAINS, 1>(row, &xp[t0..t1], a, c0, c1),
                        }
                    }
                }
            }
            c0 = c1;
        }
        for r in g0..g1 {
            for t in 0..nt {
                let mut a = acc[(r - g0) * nt + t];
                // SAFETY: as above; the last step and the tail stay below n.
                unsafe {
                    let (row, x) = (wp.add(r * n), xp[t]);
                    let mut i = main;
                    if CHAINS == 2 && i + 8 <= n {
                        a[0] =
                            _mm256_fmadd_ps(H::load8(row.add(i)), _mm256_loadu_ps(x.add(i)), a[0]);
                        i += 8;
                    }
                    out[r * nt + t] = finish::<H, CHAINS>(&a, row, x, i, n);
                }
            }
        }
    }
}

/// Rows of a bf16 matrix against several vectors, each result exactly
/// [`dot_bf16`]'s (see [`rows_tokens`]).
///
/// # Safety
/// As [`rows_tokens`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_bf16_multi(w: &[u16], xs: &[&[f32]], out: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe { rows_tokens::<Bf16, 2>(w, xs, out) }
}

/// [`dot_bf16_multi`] over rows in quads ([`super::quads16`]).
///
/// # Safety
/// As [`quads_tokens`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_bf16_quads_multi(w: &[u16], xs: &[&[f32]], out: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe { quads_tokens::<Bf16, 2, 2>(w, xs, out, dot_bf16) }
}

/// [`dot_f16_multi`] over rows in quads ([`super::quads16`]).
///
/// # Safety
/// As [`quads_tokens`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_quads_multi(w: &[u16], xs: &[&[f32]], out: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe { quads_tokens::<F16, 1, 4>(w, xs, out, dot_f16) }
}

/// Rows of an f16 matrix against several vectors, each result exactly
/// [`dot_f16`]'s (see [`rows_tokens`]).
///
/// # Safety
/// As [`rows_tokens`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_multi(w: &[u16], xs: &[&[f32]], out: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe { rows_tokens::<F16, 1>(w, xs, out) }
}

/// Rows of a bf16 matrix in quads against one vector, each result
/// exactly [`dot_bf16`]'s for its row (see [`quads4`]).
///
/// # Safety
/// Requires AVX2, FMA and F16C; `w.len() == out.len() × x.len()`,
/// `x.len()` a multiple of 16, `w` starting at a quad boundary.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_bf16_quads(w: &[u16], x: &[f32], out: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe { quads4::<Bf16, 2>(w, x, out, dot_bf16) }
}

/// Rows of an f16 matrix in quads against one vector, each result exactly
/// [`dot_f16`]'s for its row (see [`quads4`]).
///
/// # Safety
/// As [`dot_bf16_quads`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_quads(w: &[u16], x: &[f32], out: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe { quads4::<F16, 1>(w, x, out, dot_f16) }
}

/// Rows of a bf16 matrix against one vector, each result exactly
/// [`dot_bf16`]'s for its row (see [`rows4`]).
///
/// # Safety
/// Requires AVX2, FMA and F16C; `w.len() == out.len() × x.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_bf16_rows(w: &[u16], x: &[f32], out: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe { rows4::<Bf16, 2>(w, x, out, dot_bf16) }
}

/// Rows of an f16 matrix against one vector, each result exactly
/// [`dot_f16`]'s for its row (see [`rows4`]).
///
/// # Safety
/// Requires AVX2, FMA and F16C; `w.len() == out.len() × x.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_rows(w: &[u16], x: &[f32], out: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe { rows4::<F16, 1>(w, x, out, dot_f16) }
}

/// # Safety
/// Requires AVX2, FMA and F16C; `w.len() == x.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
    let n = x.len().min(w.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut a0 = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: loads stay below n as in dot_f32.
    unsafe {
        while i + 8 <= n {
            let h = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i) as *const __m128i));
            a0 = _mm256_fmadd_ps(h, _mm256_loadu_ps(xp.add(i)), a0);
            i += 8;
        }
        let mut s = hsum(a0);
        while i < n {
            s += crate::format::f16_to_f32(*wp.add(i)) * *xp.add(i);
            i += 1;
        }
        s
    }
}

/// # Safety
/// Requires AVX2 and FMA; `w.len() == x.len()`, `block` a multiple of 8,
/// `scales.len() >= ceil(n / block)`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_fp8(w: &[u8], x: &[f32], scales: &[f32], block: usize) -> f32 {
    let n = x.len().min(w.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let table = FP8_E4M3_TABLE.as_ptr();
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: loads stay below n; gathers index a 256-entry table with
    // zero-extended bytes; scales are indexed below ceil(n / block).
    unsafe {
        while i + 8 <= n {
            let s = _mm256_set1_ps(*scales.as_ptr().add(i / block));
            let bytes = _mm_loadl_epi64(wp.add(i) as *const __m128i);
            let idx = _mm256_cvtepu8_epi32(bytes);
            let v = _mm256_i32gather_ps::<4>(table, idx);
            let wv = _mm256_mul_ps(v, s);
            acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(i)), acc);
            i += 8;
        }
        let mut s = hsum(acc);
        while i < n {
            s += (FP8_E4M3_TABLE[*wp.add(i) as usize] * scales[i / block]) * *xp.add(i);
            i += 1;
        }
        s
    }
}

/// Eight i32 lanes times the block scale, as f32 (exact: `d · q`).
#[inline(always)]
unsafe fn scaled(q: __m256i, d: __m256) -> __m256 {
    // SAFETY: register arithmetic under the caller's avx2 guarantee.
    unsafe { _mm256_mul_ps(_mm256_cvtepi32_ps(q), d) }
}

/// # Safety
/// Requires AVX2 and FMA; `x.len()` a multiple of 32 and
/// `w.len() == x.len() / 32 * 34`.
///
/// The four groups of eight elements of each block go to the two
/// accumulators in the order `dot_f32` uses for 16-element steps
/// (a0, a1, a0, a1) and are reduced the same way, so the result equals
/// `dot_f32` on the dequantized row bit for bit.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_q8_0(w: &[u8], x: &[f32]) -> f32 {
    let blocks = (x.len() / 32).min(w.len() / 34);
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut a0 = _mm256_setzero_ps();
    let mut a1 = _mm256_setzero_ps();
    // SAFETY: block b reads bytes [34b, 34b + 34) of w and floats
    // [32b, 32b + 32) of x, both in bounds for b < blocks.
    unsafe {
        for b in 0..blocks {
            let blk = wp.add(b * 34);
            let d = _mm256_set1_ps(crate::format::f16_to_f32(u16::from_le_bytes([
                *blk,
                *blk.add(1),
            ])));
            let q = blk.add(2);
            let xb = xp.add(b * 32);
            for g in 0..4 {
                let bytes = _mm_loadl_epi64(q.add(8 * g) as *const __m128i);
                let wv = scaled(_mm256_cvtepi8_epi32(bytes), d);
                let xv = _mm256_loadu_ps(xb.add(8 * g));
                if g % 2 == 0 {
                    a0 = _mm256_fmadd_ps(wv, xv, a0);
                } else {
                    a1 = _mm256_fmadd_ps(wv, xv, a1);
                }
            }
        }
        hsum(_mm256_add_ps(a0, a1))
    }
}

/// # Safety
/// Requires AVX2 and FMA; `x.len()` a multiple of 32 and
/// `w.len() == x.len() / 32 * 18`. Same summation order as [`dot_q8_0`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_q4_0(w: &[u8], x: &[f32]) -> f32 {
    let blocks = (x.len() / 32).min(w.len() / 18);
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut a0 = _mm256_setzero_ps();
    let mut a1 = _mm256_setzero_ps();
    let low = _mm_set1_epi8(0x0f);
    let eight = _mm256_set1_epi32(8);
    // SAFETY: block b reads bytes [18b, 18b + 18) of w and floats
    // [32b, 32b + 32) of x, both in bounds for b < blocks.
    unsafe {
        for b in 0..blocks {
            let blk = wp.add(b * 18);
            let d = _mm256_set1_ps(crate::format::f16_to_f32(u16::from_le_bytes([
                *blk,
                *blk.add(1),
            ])));
            let raw = _mm_loadu_si128(blk.add(2) as *const __m128i);
            // Elements 0..16 are the low nibbles, 16..32 the high ones.
            let lo = _mm_and_si128(raw, low);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
            let xb = xp.add(b * 32);
            let groups = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
            for (g, nib) in groups.into_iter().enumerate() {
                let q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(nib), eight);
                let wv = scaled(q, d);
                let xv = _mm256_loadu_ps(xb.add(8 * g));
                if g % 2 == 0 {
                    a0 = _mm256_fmadd_ps(wv, xv, a0);
                } else {
                    a1 = _mm256_fmadd_ps(wv, xv, a1);
                }
            }
        }
        hsum(_mm256_add_ps(a0, a1))
    }
}

/// [`super::scalar::weighted_rows`] with 8 lanes: 64 outputs at a time held
/// in registers over every row (loaded from `o`, stored back), the same
/// fused multiply-add per element.
///
/// # Safety
/// Requires AVX; `v.len() >= (s.len() - 1) · stride + o.len()` when `s` is
/// not empty.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn weighted_rows(o: &mut [f32], s: &[f32], v: &[f32], stride: usize) {
    let n = o.len();
    let vp = v.as_ptr();
    let mut i = 0;
    // SAFETY: row t's elements i..i+64 (or i..i+8) are below
    // t·stride + n <= v.len() (caller), and i + 64 <= n (or i + 8 <= n)
    // for o.
    unsafe {
        while i + 64 <= n {
            let op = o.as_ptr().add(i);
            let mut acc = [_mm256_setzero_ps(); 8];
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(op.add(8 * k));
            }
            for (t, &st) in s.iter().enumerate() {
                let w = _mm256_set1_ps(st);
                let row = vp.add(t * stride + i);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(8 * k)), *a);
                }
            }
            for (k, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(i + 8 * k), *a);
            }
            i += 64;
        }
        while i + 8 <= n {
            let mut a = _mm256_loadu_ps(o.as_ptr().add(i));
            for (t, &st) in s.iter().enumerate() {
                let row = vp.add(t * stride + i);
                a = _mm256_fmadd_ps(_mm256_set1_ps(st), _mm256_loadu_ps(row), a);
            }
            _mm256_storeu_ps(o.as_mut_ptr().add(i), a);
            i += 8;
        }
    }
    if i < n && !s.is_empty() {
        super::scalar::weighted_rows(&mut o[i..], s, &v[i..], stride);
    }
}

/// [`weighted_rows`] for `g` heads over the same value rows, as
/// [`weighted_rows_group_avx512`] with 256-bit registers: four heads at a
/// time share every load of a value row (16 columns: eight sums in
/// registers); each element is still `o + s·v` in one fused multiply-add
/// per row, rows in order, so every head gets the bits [`weighted_rows`]
/// gives it alone. Heads past the last four, and rows whose length is not
/// a multiple of 8, go through [`weighted_rows`]. `ahead`: the first four
/// heads ask L2 for whole rows [`KV_AHEAD_BYTES`] on.
///
/// # Safety
/// AVX2 and FMA; the extents of [`weighted_rows_group_avx512`].
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn weighted_rows_group_avx2(
    o: &mut [f32],
    g: usize,
    s: &[f32],
    s_stride: usize,
    rows: usize,
    v: &[f32],
    v_stride: usize,
    ahead: bool,
) {
    let n = o.len() / g.max(1);
    let (vp, sp) = (v.as_ptr(), s.as_ptr());
    let mut j0 = 0;
    if n.is_multiple_of(8) {
        let avail = match v.len().checked_sub(n) {
            Some(rest) => rest / v_stride.max(1) + 1,
            None => 0,
        };
        let ask = (kv_ahead_rows(n), avail);
        while j0 + 4 <= g {
            // SAFETY: as in `weighted_rows_group_avx512`, for 8·C columns.
            unsafe {
                let op = o.as_mut_ptr().add(j0 * n);
                let wp = sp.add(j0 * s_stride);
                let mut i = 0;
                while i + 16 <= n {
                    let (o, v) = (op.add(i), vp.add(i));
                    if ahead && j0 == 0 && i == 0 {
                        group_columns_avx2::<2, true>(o, n, wp, s_stride, rows, v, v_stride, ask);
                    } else {
                        group_columns_avx2::<2, false>(o, n, wp, s_stride, rows, v, v_stride, ask);
                    }
                    i += 16;
                }
                while i + 8 <= n {
                    let (o, v) = (op.add(i), vp.add(i));
                    if ahead && j0 == 0 && i == 0 {
                        group_columns_avx2::<1, true>(o, n, wp, s_stride, rows, v, v_stride, ask);
                    } else {
                        group_columns_avx2::<1, false>(o, n, wp, s_stride, rows, v, v_stride, ask);
                    }
                    i += 8;
                }
            }
            j0 += 4;
        }
    }
    for j in j0..g {
        // SAFETY: forwarded contract, one head.
        unsafe {
            weighted_rows(
                &mut o[j * n..(j + 1) * n],
                &s[j * s_stride..j * s_stride + rows],
                v,
                v_stride,
            )
        }
    }
}

/// Four heads' `8·C` columns at `o` (heads `n` apart), over `rows` value
/// rows: see [`weighted_rows_group_avx2`]; `ASK` as [`group_columns`]'s.
///
/// # Safety
/// As there, for these columns; AVX2 and FMA.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group_columns_avx2<const C: usize, const ASK: bool>(
    o: *mut f32,
    n: usize,
    w: *const f32,
    s_stride: usize,
    rows: usize,
    v: *const f32,
    v_stride: usize,
    (ahead, avail): (usize, usize),
) {
    // SAFETY: the caller's bounds.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); C]; 4];
        for (j, aj) in acc.iter_mut().enumerate() {
            for (c, a) in aj.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(o.add(j * n + 8 * c));
            }
        }
        for t in 0..rows {
            let row = v.add(t * v_stride);
            if ASK && t + ahead < avail {
                ask_l2_floats(v.wrapping_add((t + ahead) * v_stride), n);
            }
            let vs: [__m256; C] = core::array::from_fn(|c| _mm256_loadu_ps(row.add(8 * c)));
            for (j, aj) in acc.iter_mut().enumerate() {
                let wt = _mm256_set1_ps(*w.add(j * s_stride + t));
                for (a, vc) in aj.iter_mut().zip(&vs) {
                    *a = _mm256_fmadd_ps(wt, *vc, *a);
                }
            }
        }
        for (j, aj) in acc.iter().enumerate() {
            for (c, a) in aj.iter().enumerate() {
                _mm256_storeu_ps(o.add(j * n + 8 * c), *a);
            }
        }
    }
}

/// [`dot_f32_rows_group`] with 512-bit accumulators. One register holds
/// what the AVX2 kernel keeps in two: lanes 0–7 are its `a0` (elements
/// `i..i + 8` of each 16-element step), lanes 8–15 its `a1`, each lane the
/// same chain of fused multiply-adds. After the steps the halves are split
/// and the AVX2 kernel's tail and reduction follow, so every result has
/// the bits of [`dot_f32`]; half the instructions per step.
///
/// # Safety
/// As [`dot_f32_rows_group`], and AVX-512 F.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn dot_f32_rows_group_avx512(
    qs: &[f32],
    g: usize,
    k: &[f32],
    stride: usize,
    out: &mut [f32],
    ahead: bool,
) {
    // SAFETY: forwarded contract.
    unsafe {
        if ahead {
            rows_group::<true, true>(qs, g, k, stride, out)
        } else {
            rows_group::<true, false>(qs, g, k, stride, out)
        }
    }
}

/// [`dot_four`] with one 512-bit accumulator per query (see
/// [`dot_f32_rows_group_avx512`]).
///
/// # Safety
/// As [`dot_four`], and AVX-512 F.
#[inline(always)]
unsafe fn dot_four_avx512(q: *const f32, d: usize, kr: &[f32]) -> [f32; 4] {
    let kp = kr.as_ptr();
    // SAFETY: loads of 16 (or 8) floats at i ≤ d − 16 (or d − 8) of a
    // query or of the key row.
    unsafe {
        let mut a = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 16 <= d {
            let kv = _mm512_loadu_ps(kp.add(i));
            for (j, aj) in a.iter_mut().enumerate() {
                *aj = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(j * d + i)), kv, *aj);
            }
            i += 16;
        }
        let mut a0 = [_mm256_setzero_ps(); 4];
        let mut a1 = [_mm256_setzero_ps(); 4];
        for j in 0..4 {
            a0[j] = _mm512_castps512_ps256(a[j]);
            a1[j] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1));
        }
        while i + 8 <= d {
            let k0 = _mm256_loadu_ps(kp.add(i));
            for (j, aj) in a0.iter_mut().enumerate() {
                *aj = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(j * d + i)), k0, *aj);
            }
            i += 8;
        }
        let mut out = [0.0f32; 4];
        for (j, o) in out.iter_mut().enumerate() {
            let mut s = hsum(_mm256_add_ps(a0[j], a1[j]));
            for t in i..d {
                s += *q.add(j * d + t) * *kp.add(t);
            }
            *o = s;
        }
        out
    }
}

/// Four queries at `q` (`d` apart, `d` a multiple of 16) against four key
/// rows, each result exactly as [`dot_four_avx512`] (so [`dot_f32_body`])
/// computes it. Lane `4j + r` of the result is query `j` against row `r`.
///
/// Sum `4r + j` holds the sixteen lane chains of that pair: lanes 0–7 the
/// AVX2 kernel's `a0`, 8–15 its `a1`. The sixteen are then reduced
/// together, two registers per shuffle, in `hsum(a0 + a1)`'s order for
/// each: v = a0 + a1, then v[i] + v[i + 4], then those two apart, then
/// the last two. (Each addition has the operands it has there; the lanes
/// only move between registers.) Per 16 columns: 4 query loads and 4 key
/// loads for 16 FMAs, where four rows one at a time load 20.
///
/// # Safety
/// `q` holds `4 · d` floats and each key pointer `d`; AVX-512 F.
#[inline(always)]
unsafe fn dot_four_by_four_avx512(q: *const f32, d: usize, keys: [*const f32; 4]) -> __m512 {
    // SAFETY: loads of 16 floats at i ≤ d − 16 of a query or a key row;
    // the rest is register arithmetic.
    unsafe {
        let mut a = [_mm512_setzero_ps(); 16];
        let mut i = 0;
        while i + 16 <= d {
            let qv = [
                _mm512_loadu_ps(q.add(i)),
                _mm512_loadu_ps(q.add(d + i)),
                _mm512_loadu_ps(q.add(2 * d + i)),
                _mm512_loadu_ps(q.add(3 * d + i)),
            ];
            for (r, kp) in keys.iter().enumerate() {
                let kv = _mm512_loadu_ps(kp.add(i));
                for (j, qj) in qv.iter().enumerate() {
                    a[4 * r + j] = _mm512_fmadd_ps(*qj, kv, a[4 * r + j]);
                }
            }
            i += 16;
        }
        // v = a0 + a1: sums 2p and 2p + 1 side by side, each in a half.
        let v: [__m512; 8] = core::array::from_fn(|p| {
            let (x, y) = (a[2 * p], a[2 * p + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(x, y),
                _mm512_shuffle_f32x4::<0xEE>(x, y),
            )
        });
        // v[i] + v[i + 4]: four sums, one per 128-bit quarter.
        let s4: [__m512; 4] = core::array::from_fn(|p| {
            let (x, y) = (v[2 * p], v[2 * p + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(x, y),
                _mm512_shuffle_f32x4::<0xDD>(x, y),
            )
        });
        // s4[0] + s4[2] and s4[1] + s4[3], within each quarter.
        let s2: [__m512; 2] = core::array::from_fn(|p| {
            let (x, y) = (s4[2 * p], s4[2 * p + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(x, y),
                _mm512_shuffle_ps::<0xEE>(x, y),
            )
        });
        // s2[0] + s2[1]. Sum 4r + j ends in lane 4j + r.
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(s2[0], s2[1]),
            _mm512_shuffle_ps::<0xDD>(s2[0], s2[1]),
        )
    }
}

/// [`weighted_rows_avx512`] for `g` heads over the same value rows (the
/// heads of a KV group): head `j` accumulates `s[j·s_stride..][..rows]`
/// onto `o[j·n..(j + 1)·n]` (`n = o.len() / g`). Four heads at a time
/// share every load of a value row (64 columns: sixteen sums in
/// registers); each element is still `o + s·v` in one fused multiply-add
/// per row, rows in order, so every head gets the bits it gets alone. Heads past the last four, and rows whose length is not a
/// multiple of 16, go through [`weighted_rows_avx512`].
///
/// # Safety
/// AVX-512 F; `o.len()` a multiple of `g`; `s.len() >= (g − 1) · s_stride
/// + rows`; `v.len() >= (rows − 1) · v_stride + n` when `rows > 0`.
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn weighted_rows_group_avx512(
    o: &mut [f32],
    g: usize,
    s: &[f32],
    s_stride: usize,
    rows: usize,
    v: &[f32],
    v_stride: usize,
    ahead: bool,
) {
    let n = o.len() / g.max(1);
    let (vp, sp) = (v.as_ptr(), s.as_ptr());
    let mut j0 = 0;
    if n.is_multiple_of(16) {
        while j0 + 4 <= g {
            // SAFETY: head j0 + j's weights are s[(j0 + j)·s_stride + t]
            // for t < rows, and its outputs o[(j0 + j)·n + i..][..16·C]
            // with i + 16·C <= n; row t's columns i..i + 16·C are below
            // t·v_stride + n <= v.len() (caller).
            unsafe {
                let op = o.as_mut_ptr().add(j0 * n);
                let wp = sp.add(j0 * s_stride);
                // With `ahead`, the first heads' first columns ask for
                // whole rows [`KV_AHEAD_BYTES`] on, among the `avail` rows
                // of `v`.
                let avail = match v.len().checked_sub(n) {
                    Some(rest) => rest / v_stride.max(1) + 1,
                    None => 0,
                };
                let ask = (kv_ahead_rows(n), avail);
                let mut i = 0;
                while i + 64 <= n {
                    let (o, v) = (op.add(i), vp.add(i));
                    if ahead && j0 == 0 && i == 0 {
                        group_columns::<4, true>(o, n, wp, s_stride, rows, v, v_stride, ask);
                    } else {
                        group_columns::<4, false>(o, n, wp, s_stride, rows, v, v_stride, ask);
                    }
                    i += 64;
                }
                while i + 16 <= n {
                    let (o, v) = (op.add(i), vp.add(i));
                    if ahead && j0 == 0 && i == 0 {
                        group_columns::<1, true>(o, n, wp, s_stride, rows, v, v_stride, ask);
                    } else {
                        group_columns::<1, false>(o, n, wp, s_stride, rows, v, v_stride, ask);
                    }
                    i += 16;
                }
            }
            j0 += 4;
        }
    }
    for j in j0..g {
        // SAFETY: forwarded contract, one head.
        unsafe {
            weighted_rows_avx512(
                &mut o[j * n..(j + 1) * n],
                &s[j * s_stride..j * s_stride + rows],
                v,
                v_stride,
            )
        }
    }
}

/// Four heads' `16·C` columns at `o` (heads `n` apart), over `rows` value
/// rows: see [`weighted_rows_group_avx512`]. `ASK`: before each row, ask
/// L2 for the whole row (`n` floats at `v`, the first columns) `ahead`
/// rows on, while that row is one of `v`'s `avail`.
///
/// # Safety
/// As there, for these columns; AVX-512 F.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group_columns<const C: usize, const ASK: bool>(
    o: *mut f32,
    n: usize,
    w: *const f32,
    s_stride: usize,
    rows: usize,
    v: *const f32,
    v_stride: usize,
    (ahead, avail): (usize, usize),
) {
    // SAFETY: the caller's bounds.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); C]; 4];
        for (j, aj) in acc.iter_mut().enumerate() {
            for (c, a) in aj.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(o.add(j * n + 16 * c));
            }
        }
        for t in 0..rows {
            let row = v.add(t * v_stride);
            if ASK && t + ahead < avail {
                ask_l2_floats(v.wrapping_add((t + ahead) * v_stride), n);
            }
            let vs: [__m512; C] = core::array::from_fn(|c| _mm512_loadu_ps(row.add(16 * c)));
            for (j, aj) in acc.iter_mut().enumerate() {
                let wt = _mm512_set1_ps(*w.add(j * s_stride + t));
                for (a, vc) in aj.iter_mut().zip(&vs) {
                    *a = _mm512_fmadd_ps(wt, *vc, *a);
                }
            }
        }
        for (j, aj) in acc.iter().enumerate() {
            for (c, a) in aj.iter().enumerate() {
                _mm512_storeu_ps(o.add(j * n + 16 * c), *a);
            }
        }
    }
}

/// [`weighted_rows`] 16 lanes at a time: each element is still `o + s·v`
/// in one fused multiply-add per row, rows in order, so the bits are
/// [`super::scalar::weighted_rows`]'s.
///
/// # Safety
/// As [`weighted_rows`], and AVX-512 F.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn weighted_rows_avx512(o: &mut [f32], s: &[f32], v: &[f32], stride: usize) {
    let n = o.len();
    let vp = v.as_ptr();
    let mut i = 0;
    // SAFETY: row t's elements i..i+128 (or i..i+16) are below
    // t·stride + n <= v.len() (caller), and i + 128 <= n (or i + 16 <= n)
    // for o.
    unsafe {
        while i + 128 <= n {
            let op = o.as_ptr().add(i);
            let mut acc = [_mm512_setzero_ps(); 8];
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(op.add(16 * k));
            }
            for (t, &st) in s.iter().enumerate() {
                let w = _mm512_set1_ps(st);
                let row = vp.add(t * stride + i);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(w, _mm512_loadu_ps(row.add(16 * k)), *a);
                }
            }
            for (k, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(o.as_mut_ptr().add(i + 16 * k), *a);
            }
            i += 128;
        }
        while i + 16 <= n {
            let mut a = _mm512_loadu_ps(o.as_ptr().add(i));
            for (t, &st) in s.iter().enumerate() {
                let row = vp.add(t * stride + i);
                a = _mm512_fmadd_ps(_mm512_set1_ps(st), _mm512_loadu_ps(row), a);
            }
            _mm512_storeu_ps(o.as_mut_ptr().add(i), a);
            i += 16;
        }
        if i < n && !s.is_empty() {
            weighted_rows(&mut o[i..], s, &v[i..], stride);
        }
    }
}
