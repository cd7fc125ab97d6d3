//! The GPU tier's MoE routing, computed bit for bit alike on the host and
//! on the device (cuda/kernels/moe.cu).
//!
//! It follows the CPU tier's `colibri_model::moe::route` step by step with
//! two changes that make it reproducible on both sides:
//!
//! * `exp` is [`exp_portable`] (basic IEEE f64 operations only, rounded
//!   once to f32) instead of the platform's `expf`, which the device does
//!   not have;
//! * the softmax denominator is summed in the device's warp shape (lane `l`
//!   adds values `l, l + 32, ...` in order, then a fixed butterfly) instead
//!   of left to right.
//!
//! Both are as exact as the CPU tier's (the exp is within an ulp of e^x, the
//! sum is another fixed order). What matters is that a layer routed on the
//! device (every expert in VRAM, no host round trip) gives exactly what the
//! host gives for a layer whose experts must be fetched, so a GPU run stays
//! bit-identical across VRAM budgets.

use colibri_model::config::MoeSpec;
use colibri_model::moe::{RouterMath, Routing, route_with};

/// 1/n! for n = 0..=11 as f64 bit patterns (kernels/moe.cu `mr_coef`).
const COEF_BITS: [u64; 12] = [
    0x3ff0000000000000,
    0x3ff0000000000000,
    0x3fe0000000000000,
    0x3fc5555555555555,
    0x3fa5555555555555,
    0x3f81111111111111,
    0x3f56c16c16c16c17,
    0x3f2a01a01a01a01a,
    0x3efa01a01a01a01a,
    0x3ec71de3a556c734,
    0x3e927e4fb7789f5c,
    0x3e5ae64567f544e4,
];
const LOG2E_BITS: u64 = 0x3ff71547652b82fe;
const LN2_BITS: u64 = 0x3fe62e42fefa39ef;

/// e^x: k = floor(x·log2(e) + 0.5), r = x − k·ln2 (|r| ≤ ln2/2), a
/// degree-11 Taylor polynomial of e^r in Horner form, times 2^k, rounded
/// once to f32. Only f64 multiplications, additions and a floor, each
/// rounded to nearest: the device runs the same operations with explicit
/// rounding intrinsics and gets the same bits. Within an ulp of e^x.
pub fn exp_portable(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > 89.0 {
        return f32::INFINITY;
    }
    if x < -104.0 {
        return 0.0;
    }
    let xd = x as f64;
    let k = (xd * f64::from_bits(LOG2E_BITS) + 0.5).floor();
    let r = xd - k * f64::from_bits(LN2_BITS);
    let mut p = f64::from_bits(COEF_BITS[11]);
    for n in (0..11).rev() {
        p = p * r + f64::from_bits(COEF_BITS[n]);
    }
    let scale = f64::from_bits(((k as i64 + 1023) as u64) << 52);
    (p * scale) as f32
}

/// `1 / (1 + e^-x)` with [`exp_portable`].
pub fn sigmoid_portable(x: f32) -> f32 {
    1.0 / (1.0 + exp_portable(-x))
}

/// The sum of `v` in the device's warp shape: lane `l` adds `v[l]`,
/// `v[l + 32]`, ... from 0.0, then lanes `l` and `l ^ o` are added for
/// o = 16, 8, 4, 2, 1 (every lane ends with lane 0's value).
pub fn warp_shaped_sum(v: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 32];
    for (i, &x) in v.iter().enumerate() {
        lanes[i % 32] += x;
    }
    let mut o = 16;
    while o > 0 {
        let prev = lanes;
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane = prev[l] + prev[l ^ o];
        }
        o >>= 1;
    }
    lanes[0]
}

/// Softmax in place with [`exp_portable`] and [`warp_shaped_sum`]
/// (max-subtracted, then multiplied by the inverse of the sum).
pub fn softmax_portable(p: &mut [f32]) {
    let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    p.iter_mut().for_each(|v| *v = exp_portable(*v - max));
    let inv = 1.0 / warp_shaped_sum(p);
    p.iter_mut().for_each(|v| *v *= inv);
}

/// The GPU tier's router functions (see the module docs).
pub const PORTABLE: RouterMath = RouterMath {
    softmax: softmax_portable,
    sigmoid: sigmoid_portable,
};

/// Routes one row of router logits: `colibri_model::moe::route` with the
/// [`PORTABLE`] functions.
pub fn route_portable(moe: &MoeSpec, logits: &[f32], selection_bias: Option<&[f32]>) -> Routing {
    route_with(&PORTABLE, moe, logits, selection_bias)
}

#[cfg(test)]
mod tests {
    use super::*;
    use colibri_model::config::RouterKind;
    use colibri_model::moe::route;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn factorial(n: u64) -> f64 {
        (1..=n).product::<u64>() as f64
    }

    #[test]
    fn constants_are_what_they_claim() {
        for (n, &b) in COEF_BITS.iter().enumerate() {
            assert_eq!(f64::from_bits(b), 1.0 / factorial(n as u64), "1/{n}!");
        }
        assert_eq!(f64::from_bits(LOG2E_BITS), std::f64::consts::LOG2_E);
        assert_eq!(f64::from_bits(LN2_BITS), std::f64::consts::LN_2);
    }

    /// Distance in ulps between two finite non-negative f32s.
    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn exp_portable_is_within_an_ulp_of_e_to_the_x() {
        let mut worst = 0;
        let mut x = -103.9f32;
        while x < 88.7 {
            let want = (x as f64).exp() as f32;
            let got = exp_portable(x);
            let d = ulps(got, want);
            assert!(
                d <= 1,
                "exp({x}) = {got:e}, e^x rounded = {want:e} ({d} ulps)"
            );
            worst = worst.max(d);
            x += 0.0137;
        }
        // The edges: overflow, underflow, NaN, exact points.
        assert_eq!(exp_portable(0.0), 1.0);
        assert_eq!(exp_portable(-0.0), 1.0);
        assert_eq!(exp_portable(100.0), f32::INFINITY);
        assert_eq!(exp_portable(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_portable(-200.0), 0.0);
        assert_eq!(exp_portable(f32::NEG_INFINITY), 0.0);
        assert!(exp_portable(f32::NAN).is_nan());
        assert!(exp_portable(88.75).is_infinite()); // e^88.75 > f32::MAX
        assert!(exp_portable(-103.0) > 0.0); // a subnormal, not flushed
        assert!(worst <= 1);
    }

    #[test]
    fn warp_shaped_sum_is_a_sum() {
        let v: Vec<f32> = (0..100).map(|i| i as f32).collect();
        assert_eq!(warp_shaped_sum(&v), 4950.0);
        assert_eq!(warp_shaped_sum(&[]), 0.0);
        assert_eq!(warp_shaped_sum(&[2.5]), 2.5);
    }

    fn spec(router: RouterKind, experts: usize, k: usize) -> MoeSpec {
        MoeSpec {
            num_experts: experts,
            top_k: k,
            intermediate_size: 16,
            router,
            shared: None,
        }
    }

    /// Same experts as the CPU tier's routing, weights within 2e-6 relative.
    #[test]
    fn portable_routing_agrees_with_the_cpu_tiers() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let routers = [
            (
                RouterKind::Softmax {
                    norm_topk_prob: true,
                },
                128,
                8,
            ),
            (
                RouterKind::Softmax {
                    norm_topk_prob: false,
                },
                64,
                4,
            ),
            (
                RouterKind::SigmoidGrouped {
                    n_group: 8,
                    topk_group: 4,
                    norm_topk_prob: true,
                    routed_scaling_factor: 2.5,
                },
                256,
                8,
            ),
        ];
        for (router, e, k) in routers {
            let s = spec(router, e, k);
            let bias: Vec<f32> = (0..e).map(|_| rng.random_range(-0.1..0.1)).collect();
            for _ in 0..200 {
                let logits: Vec<f32> = (0..e).map(|_| rng.random_range(-8.0..8.0)).collect();
                let b = matches!(s.router, RouterKind::SigmoidGrouped { .. }).then_some(&bias[..]);
                let want = route(&s, &logits, b);
                let got = route_portable(&s, &logits, b);
                assert_eq!(got.experts, want.experts, "{:?}", s.router);
                // Another exp and another summation order: a few ulps.
                for (g, w) in got.weights.iter().zip(&want.weights) {
                    assert!(
                        (g - w).abs() <= 2e-6 * w.abs(),
                        "{:?}: weight {g:e} vs the CPU tier's {w:e}",
                        s.router
                    );
                }
            }
        }
    }
}
