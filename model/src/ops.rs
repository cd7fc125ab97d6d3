//! Small element-wise operations of the forward pass, written to follow
//! transformers' float32 arithmetic step by step.

/// RMSNorm as transformers computes it: `w * (x * rsqrt(mean(x²) + eps))`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let var = mean_square(x);
    let r = 1.0 / (var + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * r);
    }
}

/// In-place RMSNorm.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let var = mean_square(x);
    let r = 1.0 / (var + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(w) {
        *v = g * (*v * r);
    }
}

/// RMSNorm's `mean(x²)`, defined as the sum of the squares in f64, one
/// after the other in order ([`mean_square_in_order`]), divided by the
/// length and rounded to f32: the CPU tier's bits since its first day.
///
/// That sum is a chain of dependent additions (2,048 of them, ~2.7 µs, for
/// a hidden row of Qwen3-30B-A3B: time a decode's other threads wait for).
/// So it is first summed in eight chains ([`sum_squares_8`]). Every square
/// of an f32 is exact in f64, so both sums lie within `(n − 1)·2⁻⁵³` of the
/// exact sum relatively (recursive summation of non-negative terms); if
/// every value within twice that, with margin, of the fast sum rounds to
/// the same f32 mean, the in-order sum's mean is that f32 too (division
/// and rounding are monotonic). Otherwise (a mean within ~1e-12 of an f32
/// rounding boundary, or a non-finite sum) the chain runs in order. Either
/// way the result is [`mean_square_in_order`]'s, bit for bit.
pub fn mean_square(x: &[f32]) -> f32 {
    mean_square_checked(x).0
}

/// [`mean_square`], and whether it took the in-order chain.
fn mean_square_checked(x: &[f32]) -> (f32, bool) {
    let n = x.len() as f64;
    let fast = sum_squares_8(x);
    // (n − 1)·2⁻⁵³ for each sum, twice for the two, twice again for the
    // rounding of the bound's own arithmetic, plus a few ulp.
    let rel = (4.0 * n + 8.0) * f64::EPSILON / 2.0;
    let (lo, hi) = (fast * (1.0 - rel), fast * (1.0 + rel));
    let (a, b) = ((lo / n) as f32, (hi / n) as f32);
    if fast.is_finite() && a.to_bits() == b.to_bits() {
        (a, false)
    } else {
        (mean_square_in_order(x), true)
    }
}

/// The definition of RMSNorm's mean of squares (see [`mean_square`]).
pub fn mean_square_in_order(x: &[f32]) -> f32 {
    let mut ss = 0.0f64;
    for &v in x {
        ss += (v as f64) * (v as f64);
    }
    (ss / x.len() as f64) as f32
}

/// `Σ x²` in f64 over eight chains (element `i` in chain `i mod 8`),
/// joined as `((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7))`: eight
/// additions in flight instead of one.
fn sum_squares_8(x: &[f32]) -> f64 {
    let mut c = [0.0f64; 8];
    let mut blocks = x.chunks_exact(8);
    for b in &mut blocks {
        for (ci, &v) in c.iter_mut().zip(b) {
            *ci += (v as f64) * (v as f64);
        }
    }
    for (ci, &v) in c.iter_mut().zip(blocks.remainder()) {
        *ci += (v as f64) * (v as f64);
    }
    ((c[0] + c[1]) + (c[2] + c[3])) + ((c[4] + c[5]) + (c[6] + c[7]))
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x · sigmoid(x)`, with `e^-|x|` from [`fast_exp`] so that slices of it
/// vectorize ([`swiglu_inplace`]): `sigmoid(x)` is `1 / (1 + t)` for `x ≥
/// 0` and `t · (1 / (1 + t))` below, `t = e^-|x|` in (0, 1]. Within 3 ulp
/// of `x · sigmoid(x)` through libm's `expf` (the test below); ±∞ and NaN
/// give what that gives (∞, NaN, NaN).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    let t = fast_exp(-x.abs());
    let r = 1.0 / (1.0 + t);
    let s = if x >= 0.0 { r } else { t * r };
    x * s
}

/// SwiGLU's elementwise step in place: `g[i] = silu(g[i]) · u[i]`.
///
/// libm's scalar `expf` behind it took 1.7% of a 512-token prefill and the
/// loop around it another ~4% (docs/benchmarks.md). The same body is
/// compiled for AVX-512 and for AVX2 and picked at run time: the same
/// operations on each element, so the same bits on every CPU.
pub fn swiglu_inplace(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "SwiGLU gate and up lengths");
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (checked above).
            return unsafe { swiglu_avx512(g, u) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { swiglu_avx2(g, u) };
        }
    }
    swiglu_body(g, u)
}

/// [`swiglu_body`] for AVX-512 F.
///
/// # Safety
/// The CPU must have AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn swiglu_avx512(g: &mut [f32], u: &[f32]) {
    swiglu_body(g, u)
}

/// [`swiglu_body`] for AVX2.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn swiglu_avx2(g: &mut [f32], u: &[f32]) {
    swiglu_body(g, u)
}

/// [`swiglu_inplace`]'s arithmetic, inlined into each variant.
#[inline(always)]
fn swiglu_body(g: &mut [f32], u: &[f32]) {
    for (gv, &uv) in g.iter_mut().zip(u) {
        *gv = silu(*gv) * uv;
    }
}

/// Softmax in place (max-subtracted, f32 like torch's float softmax).
///
/// The exponentials are [`fast_exp`]'s (relative error at most 8.2e-8,
/// libm's `expf` about 6e-8), which the compiler vectorizes, and their sum
/// runs in 8 interleaved lanes added by a fixed tree. Both are plain
/// rounded f32 operations, so the bits are the same on every CPU and in
/// every path (the attention's softmax of a prefill and of a decode). A
/// NaN (a NaN score, or an infinite maximum) stays NaN. libm's scalar
/// `expf` with a serial sum took 4.3% of a 512-token prefill's samples,
/// the softmax over every cached position of every head
/// (docs/benchmarks.md).
///
/// On x86-64 the same body is compiled again for AVX-512 and for AVX2 and
/// picked at run time: wider registers, the same operations on each
/// element and the same eight lanes, so the same bits.
pub fn softmax_inplace(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (checked above).
            return unsafe { softmax_avx512(x) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { softmax_avx2(x) };
        }
    }
    softmax_body(x)
}

/// [`softmax_body`] for AVX-512 F.
///
/// # Safety
/// The CPU must have AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_avx512(x: &mut [f32]) {
    softmax_body(x)
}

/// [`softmax_body`] for AVX2.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_avx2(x: &mut [f32]) {
    softmax_body(x)
}

/// [`softmax_inplace`]'s arithmetic, inlined into each variant.
#[inline(always)]
fn softmax_body(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        let d = *v - max;
        *v = if d.is_nan() { d } else { fast_exp(d) };
    }
    let mut lanes = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    for (l, v) in lanes.iter_mut().zip(chunks.remainder()) {
        *l += v;
    }
    let [a0, a1, a2, a3, a4, a5, a6, a7] = lanes;
    let sum = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7));
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `exp(x)` for `x <= 0` in f32, written to vectorize: range reduction to
/// `2^n * exp(r)` with `|r| <= ln 2 / 2`, and Cephes' `expf` polynomial.
/// Relative error at most 8.2e-8 on [-87, 0]; 0 below -87 (where `exp` is
/// under 1.7e-38) and for NaN; positive `x` is taken as 0.
#[inline(always)]
pub(crate) fn fast_exp(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer.
    let xc = if x > -87.0 { x } else { -87.0 };
    let xc = if xc < 0.0 { xc } else { 0.0 };
    let k = xc * std::f32::consts::LOG2_E + SHIFT;
    let n = k.to_bits().wrapping_sub(SHIFT.to_bits()) as i32;
    let fx = k - SHIFT;
    let r = xc - fx * 0.693_359_4 - fx * -2.121_944_4e-4;
    let y = (((((1.987_569_1e-4f32 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r
        + 4.166_579_6e-2)
        * r
        + 0.166_666_65)
        * r
        + 0.5)
        * (r * r)
        + r
        + 1.0;
    let e = y * f32::from_bits((n.wrapping_add(127) as u32) << 23);
    if x >= -87.0 { e } else { 0.0 }
}

/// Indices of the `k` largest values, largest first; ties go to the lower
/// index (a total order, so selection is deterministic).
///
/// A router's choice (8 of 128) in one pass that keeps the best `k` so
/// far: most values lose one comparison against the `k`-th. Sorting every
/// index took ~900 comparisons a row, serial work of every MoE layer of a
/// decode (docs/benchmarks.md). Large `k` sorts, where the pass would
/// shift `k` entries per insert.
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    // Whether index `a` ranks before index `b`.
    let before = |a: usize, b: usize| values[b].total_cmp(&values[a]).then(a.cmp(&b)).is_lt();
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    if k > 32 {
        let mut idx: Vec<usize> = (0..values.len()).collect();
        idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
        idx.truncate(k);
        return idx;
    }
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for i in 0..values.len() {
        if best.len() == k && !before(i, best[k - 1]) {
            continue;
        }
        let at = best.partition_point(|&b| before(b, i));
        best.insert(at, i);
        best.truncate(k);
    }
    best
}

/// `n` zeros for a buffer that is read before it is written (an
/// accumulator, `o += …`), written here, so that its pages are the
/// process's own before any thread reads them. `vec![0.0; n]` of a large `n` takes fresh pages from `calloc`, which
/// map the kernel's shared zero page until written: reading first maps
/// it, and the first write then costs a copy-on-write fault and a TLB
/// shootdown to every CPU running a thread of the process, once per
/// 4 KiB page (perf on a 512-token prefill: 8% of its samples in those
/// faults, for the attention output alone).
pub fn accumulator(n: usize) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    // Opaque to the optimizer, which could otherwise merge the allocation
    // and the fill below back into `calloc`.
    std::hint::black_box(v.as_mut_ptr());
    v.resize(n, 0.0);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The eight-chain mean of squares is the in-order one, bit for bit:
    /// on random rows of awkward lengths and scales (including subnormal
    /// squares' neighbourhood and huge values), on non-finite rows, and on
    /// a row built so that the two sums round differently at a tie of the
    /// f32 mean, where it must take the in-order chain.
    #[test]
    fn mean_square_is_the_in_order_sum() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
        let mut fell_back = 0;
        for n in [1usize, 2, 7, 8, 9, 31, 128, 777, 2048, 3000] {
            for scale in [1e-25f32, 1e-3, 1.0, 7.5, 1e18] {
                for _ in 0..20 {
                    let x: Vec<f32> = (0..n)
                        .map(|_| scale * rng.random_range(-1.0f32..1.0))
                        .collect();
                    let (got, slow) = mean_square_checked(&x);
                    assert_eq!(got.to_bits(), mean_square_in_order(&x).to_bits(), "n {n}");
                    fell_back += slow as usize;
                }
            }
        }
        // Random rows almost never come near a rounding boundary.
        assert!(fell_back < 5, "{fell_back} rows took the in-order chain");
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![0.5f32; 100];
            x[37] = special;
            let (got, slow) = mean_square_checked(&x);
            let want = mean_square_in_order(&x);
            assert!(slow && (got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan()));
        }
        // 1 + 2⁻²⁴ (from 1 and 2⁻¹²) then fourteen squares of 2⁻⁵⁴: in
        // order each is a quarter ulp and vanishes; in eight chains they
        // meet first and add 3·2⁻⁵², so the mean over 16, an exact f32 tie
        // (rounded to even) in order, rounds up from the fast sum.
        let mut x = vec![1.0f32, 2f32.powi(-12)];
        x.resize(16, 2f32.powi(-27));
        let fast = (sum_squares_8(&x) / 16.0) as f32;
        let want = mean_square_in_order(&x);
        assert_ne!(
            fast.to_bits(),
            want.to_bits(),
            "the row no longer splits the sums"
        );
        let (got, slow) = mean_square_checked(&x);
        assert!(slow);
        assert_eq!(got.to_bits(), want.to_bits());
    }

    #[test]
    fn top_k_orders_by_value_then_index() {
        assert_eq!(top_k(&[0.1, 0.5, 0.5, -1.0, 0.7], 3), vec![4, 1, 2]);
        assert_eq!(top_k(&[0.1, 0.5], 5), vec![1, 0]);
        assert!(top_k(&[0.1, 0.5], 0).is_empty());
        assert!(top_k(&[], 3).is_empty());
    }

    /// The single pass chooses what sorting every index chooses, in its
    /// order: on random rows with many ties, infinities, NaNs of both
    /// signs and signed zeros, for `k` on both sides of the switch to
    /// sorting.
    #[test]
    fn top_k_equals_a_full_sort() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let special = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
        ];
        for n in [1usize, 2, 7, 64, 128, 129, 257] {
            for k in [1usize, 2, 3, 8, 31, 32, 33, 64, 300] {
                for _ in 0..20 {
                    let v: Vec<f32> = (0..n)
                        .map(|_| match rng.random_range(0..10) {
                            0 => special[rng.random_range(0..special.len())],
                            // Few distinct values: ties everywhere.
                            1..=4 => rng.random_range(-3..3) as f32 * 0.5,
                            _ => rng.random_range(-4.0f32..4.0),
                        })
                        .collect();
                    let mut idx: Vec<usize> = (0..n).collect();
                    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
                    idx.truncate(k);
                    assert_eq!(top_k(&v, k), idx, "n {n} k {k} {v:?}");
                }
            }
        }
    }

    #[test]
    fn softmax_sums_to_one_and_is_shift_invariant() {
        let mut a = vec![1.0f32, 2.0, 3.0, -4.0];
        let mut b: Vec<f32> = a.iter().map(|v| v + 100.0).collect();
        softmax_inplace(&mut a);
        softmax_inplace(&mut b);
        assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-6);
        }
    }

    /// Against softmax in f64 on awkward lengths (not multiples of the 8
    /// lanes) and wide ranges: within the rounding of `x − max` to f32
    /// and a few more roundings of each value.
    /// Masked (-inf) entries get 0; NaN stays NaN.
    #[test]
    fn softmax_is_within_rounding_of_f64_and_keeps_nan() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for n in [1usize, 3, 7, 8, 9, 31, 64, 257, 1000] {
            for spread in [0.1f32, 5.0, 40.0] {
                let mut x: Vec<f32> = (0..n).map(|_| rng.random_range(-spread..spread)).collect();
                if n > 2 {
                    x[1] = f32::NEG_INFINITY;
                }
                let m = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
                let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let mut got = x.clone();
                softmax_inplace(&mut got);
                for (i, (&g, &w)) in got.iter().zip(&e).enumerate() {
                    let want = w / z;
                    if want == 0.0 {
                        assert_eq!(g, 0.0, "n {n} spread {spread} [{i}]");
                        continue;
                    }
                    // `x − max` is rounded to f32 first (half an ulp of
                    // it, times exp's slope), then a few roundings.
                    let d = (x[i] as f64 - m).abs();
                    let bound = (d * f32::EPSILON as f64 / 2.0 + 5e-7) * want;
                    assert!(
                        (g as f64 - want).abs() <= bound + 1e-30,
                        "n {n} spread {spread} [{i}]: {g} against {want}"
                    );
                }
                if n > 2 {
                    assert_eq!(got[1], 0.0);
                }
                assert!(got.iter().any(|&v| v > 0.0));
            }
        }
        let mut x = vec![1.0f32, f32::NAN, 2.0];
        softmax_inplace(&mut x);
        assert!(x.iter().all(|v| v.is_nan()), "{x:?}");
        let mut x = vec![1.0f32, f32::INFINITY, 2.0];
        softmax_inplace(&mut x);
        assert!(x[1].is_nan(), "{x:?}");
    }

    /// `silu` against `x / (1 + e^-x)` in f64 over the whole range an
    /// activation takes: within 4 ulp relative, or 1e-30 absolute where
    /// the true value is below f32's normal range or nearly so (x < -87,
    /// where `fast_exp` flushes to 0 and silu is under 1e-35); ±∞, NaN
    /// and ±0 as libm's sigmoid gives them.
    #[test]
    fn silu_is_within_a_few_ulp_of_f64() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let mut xs: Vec<f32> = (0..200_000)
            .map(|i| {
                let spread = [1.0f32, 10.0, 100.0][i % 3];
                rng.random_range(-spread..spread)
            })
            .collect();
        xs.extend([
            0.0, 1e-30, -1e-30, 86.9, -86.9, 87.5, -87.5, 89.0, -89.0, 1e30, -1e30,
        ]);
        for &x in &xs {
            let want = x as f64 / (1.0 + (-(x as f64)).exp());
            let got = silu(x) as f64;
            let bound = (4.0 * f32::EPSILON as f64 * want.abs()).max(1e-30);
            assert!(
                (got - want).abs() <= bound,
                "silu({x}) = {got}, want {want}"
            );
        }
        assert_eq!(silu(f32::INFINITY), f32::INFINITY);
        assert!(silu(f32::NEG_INFINITY).is_nan());
        assert!(silu(f32::NAN).is_nan());
        assert_eq!(silu(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(silu(-0.0).to_bits(), (-0.0f32).to_bits());
    }

    /// The dispatched SwiGLU (AVX-512 or AVX2 where the CPU has them) has
    /// the bits of the scalar element function, on lengths that are not
    /// multiples of any vector width and values of every sign and scale.
    #[test]
    fn swiglu_has_the_scalar_bits_at_every_length() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        for n in [0usize, 1, 5, 8, 15, 16, 17, 33, 100, 768, 1001] {
            let g: Vec<f32> = (0..n).map(|_| rng.random_range(-30.0..30.0)).collect();
            let u: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
            let want: Vec<u32> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| (silu(g) * u).to_bits())
                .collect();
            let mut got = g.clone();
            swiglu_inplace(&mut got, &u);
            let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "length {n}");
            if n > 4 {
                assert!(got.iter().any(|&b| f32::from_bits(b) != 0.0));
            }
        }
    }
}
