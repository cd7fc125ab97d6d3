//! Scalar reference kernels. Every SIMD kernel in this module's siblings is
//! tested against these on random data. They accumulate in eight lanes so
//! the reduction shape matches the vector kernels closely.

use crate::format::{bf16_to_f32, f16_to_f32, fp8_e4m3_to_f32};
use crate::quant::{Q4_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK, block_scale};

#[inline(always)]
fn reduce8(acc: [f32; 8]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

#[inline(always)]
fn dot_by(n: usize, mut elem: impl FnMut(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += elem(i + l);
        }
        i += 8;
    }
    for (l, j) in (full..n).enumerate() {
        acc[l] += elem(j);
    }
    reduce8(acc)
}

pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    dot_by(x.len(), |i| w[i] * x[i])
}

pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    dot_by(x.len(), |i| bf16_to_f32(w[i]) * x[i])
}

pub fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    dot_by(x.len(), |i| f16_to_f32(w[i]) * x[i])
}

/// Dot of one FP8 row with `x`. `scales` holds this row's scale for each
/// column block of `block` elements. Each element is dequantized exactly as
/// a reference would (`fp8 as f32 * scale`, rounded to f32) before the
/// multiply-add.
pub fn dot_fp8(w: &[u8], x: &[f32], scales: &[f32], block: usize) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    dot_by(x.len(), |i| {
        (fp8_e4m3_to_f32(w[i]) * scales[i / block]) * x[i]
    })
}

/// Dot of one Q8_0 row (`x.len() / 32` blocks) with `x`. Each element is
/// dequantized (`d · q`, exact in f32) and then multiplied and added in
/// the same order as [`dot_f32`], so a Q8_0 row gives bit for bit what its
/// dequantized f32 row gives.
pub fn dot_q8_0(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len() / QK * Q8_0_BLOCK_BYTES);
    dot_by(x.len(), |i| {
        let b = &w[i / QK * Q8_0_BLOCK_BYTES..];
        (block_scale(b) * (b[2 + i % QK] as i8) as f32) * x[i]
    })
}

/// Dot of one Q4_0 row with `x`; same contract as [`dot_q8_0`].
pub fn dot_q4_0(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len() / QK * Q4_0_BLOCK_BYTES);
    dot_by(x.len(), |i| {
        let b = &w[i / QK * Q4_0_BLOCK_BYTES..];
        let j = i % QK;
        let byte = b[2 + j % (QK / 2)];
        let q = if j < QK / 2 { byte & 0x0f } else { byte >> 4 };
        (block_scale(b) * (q as i32 - 8) as f32) * x[i]
    })
}

/// `o += Σ_t s[t] · v_t` over rows `v_t = v[t·stride..t·stride + o.len()]`,
/// each element accumulated onto its value in `o`, in row order, with one
/// fused multiply-add (`f32::mul_add`; attention's weighted sum of values;
/// the vector kernels do the same per lane, so they agree bit for bit).
/// Fused, a 512-bit kernel issues one instruction per 16 products where a
/// separate multiply and add took two (docs/benchmarks.md). On a
/// zeroed `o` it is the weighted sum; called on consecutive blocks of rows,
/// it continues each element's chain and gives one call's bits.
pub fn weighted_rows(o: &mut [f32], s: &[f32], v: &[f32], stride: usize) {
    for (t, &st) in s.iter().enumerate() {
        let row = &v[t * stride..t * stride + o.len()];
        for (oo, vv) in o.iter_mut().zip(row) {
            *oo = st.mul_add(*vv, *oo);
        }
    }
}

/// `out[t] = dot_f32(q, k_t)` for rows `k_t = k[t·stride..t·stride +
/// q.len()]`.
pub fn dot_f32_rows(q: &[f32], k: &[f32], stride: usize, out: &mut [f32]) {
    for (t, o) in out.iter_mut().enumerate() {
        *o = dot_f32(q, &k[t * stride..t * stride + q.len()]);
    }
}
