//! ggml's block quantization formats Q8_0 and Q4_0: their exact byte
//! layouts, exact dequantization, and quantizers that reproduce ggml's
//! reference quantizers (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`)
//! bit for bit.
//!
//! Both formats cut a row into blocks of [`QK`] = 32 elements, each with
//! one f16 scale `d` stored first (little-endian):
//!
//! - Q8_0 (34 bytes): `d`, then 32 × i8 `q`; element = `d · q`.
//! - Q4_0 (18 bytes): `d`, then 16 bytes; element `j < 16` is the low
//!   nibble of byte `j`, element `j + 16` its high nibble; element =
//!   `d · (q − 8)`.
//!
//! Every element `d · q` is exact in f32 (an f16 has 11 significant bits,
//! `q` at most 8), so dequantizing never rounds and a quantized model
//! computes the same function as its dequantized f32 twin.
//!
//! Q6_K, the k-quant llama.cpp gives a model's output matrix (and, in its
//! `_M` mixes, some others), is read too: see [`dequantize_q6_k`].

use crate::error::{ModelError, Result};
use crate::format::f16_to_f32;

/// Elements per block of both formats.
pub const QK: usize = 32;
/// Bytes of one Q8_0 block (f16 scale + 32 × i8).
pub const Q8_0_BLOCK_BYTES: usize = 2 + QK;
/// Bytes of one Q4_0 block (f16 scale + 32 nibbles).
pub const Q4_0_BLOCK_BYTES: usize = 2 + QK / 2;

/// The scale of a block (its first two bytes, little-endian f16).
#[inline(always)]
pub fn block_scale(block: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([block[0], block[1]]))
}

/// Dequantizes one Q8_0 block (34 bytes) into 32 floats.
#[inline]
pub fn dequantize_q8_0_block(block: &[u8], out: &mut [f32]) {
    let d = block_scale(block);
    for (o, &q) in out[..QK].iter_mut().zip(&block[2..Q8_0_BLOCK_BYTES]) {
        *o = d * (q as i8) as f32;
    }
}

/// Dequantizes one Q4_0 block (18 bytes) into 32 floats.
#[inline]
pub fn dequantize_q4_0_block(block: &[u8], out: &mut [f32]) {
    let d = block_scale(block);
    for (j, &b) in block[2..Q4_0_BLOCK_BYTES].iter().enumerate() {
        out[j] = d * ((b & 0x0f) as i32 - 8) as f32;
        out[j + QK / 2] = d * ((b >> 4) as i32 - 8) as f32;
    }
}

fn check_len(what: &str, n: usize) -> Result<()> {
    if !n.is_multiple_of(QK) {
        return Err(ModelError::Invalid(format!(
            "{what}: a row of {n} elements is not a multiple of the {QK}-element block"
        )));
    }
    Ok(())
}

/// f32 to f16 bits, rounding to nearest even (as ggml's `GGML_FP32_TO_FP16`).
fn f16_bits(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Quantizes a row to Q8_0 exactly as ggml's `quantize_row_q8_0_ref`:
/// `d = amax / 127` (f32), `id = 1/d` (0 when `d == 0`), `q = roundf(x·id)`
/// (half away from zero), `d` stored as f16.
pub fn quantize_q8_0(x: &[f32]) -> Result<Vec<u8>> {
    check_len("q8_0", x.len())?;
    let mut out = Vec::with_capacity(x.len() / QK * Q8_0_BLOCK_BYTES);
    for blk in x.chunks_exact(QK) {
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16_bits(d));
        // `as i8` saturates; |x·id| ≤ 127 up to rounding, as in ggml.
        out.extend(blk.iter().map(|&v| (v * id).round() as i8 as u8));
    }
    Ok(out)
}

/// Quantizes a row to Q4_0 exactly as ggml's `quantize_row_q4_0_ref`: the
/// element of largest magnitude `max` (the first one on ties, sign kept)
/// gives `d = max / −8`, `id = 1/d` (0 when `d == 0`), and
/// `q = min(15, trunc(x·id + 8.5))`.
pub fn quantize_q4_0(x: &[f32]) -> Result<Vec<u8>> {
    check_len("q4_0", x.len())?;
    let mut out = Vec::with_capacity(x.len() / QK * Q4_0_BLOCK_BYTES);
    for blk in x.chunks_exact(QK) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in blk {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16_bits(d));
        // ggml casts through int8_t (truncation toward zero) and clamps at
        // 15; the value is never below zero for finite input.
        let q = |v: f32| ((v * id + 8.5) as i8).clamp(0, 15) as u8;
        for j in 0..QK / 2 {
            out.push(q(blk[j]) | (q(blk[j + QK / 2]) << 4));
        }
    }
    Ok(out)
}

/// Dequantizes a whole Q8_0 row.
pub fn dequantize_q8_0(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .chunks_exact(Q8_0_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        dequantize_q8_0_block(b, o);
    }
}

/// Dequantizes a whole Q4_0 row.
pub fn dequantize_q4_0(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .chunks_exact(Q4_0_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        dequantize_q4_0_block(b, o);
    }
}

/// Elements per super-block of ggml's k-quants.
pub const QK_K: usize = 256;
/// Bytes of one Q6_K super-block: `ql` (128: the low 4 bits), `qh` (64:
/// the high 2 bits), 16 × i8 sub-block scales, then an f16 `d`.
pub const Q6_K_BLOCK_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
/// Where a Q6_K super-block's parts begin.
pub const Q6_K_QH: usize = QK_K / 2;
pub const Q6_K_SCALES: usize = Q6_K_QH + QK_K / 4;
pub const Q6_K_D: usize = Q6_K_SCALES + QK_K / 16;

/// Element `e` (< 256) of a Q6_K super-block as its signed 6-bit code
/// (−32..=31), by ggml's layout: each half of 128 elements takes 64 bytes
/// of `ql` and 32 of `qh`; element `l + 32k` of a half (l < 32, k < 4) is
/// the low (k < 2) or high (k ≥ 2) nibble of `ql[64n + 32(k mod 2) + l]`
/// with bits `2k, 2k + 1` of `qh[32n + l]` above it. Its scale is
/// `scales[e / 16]`.
#[inline(always)]
pub fn q6_k_code(blk: &[u8], e: usize) -> i32 {
    let (n, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = blk[64 * n + 32 * (k % 2) + l];
    let nib = if k < 2 { ql & 0x0f } else { ql >> 4 };
    let hi = (blk[Q6_K_QH + 32 * n + l] >> (2 * k)) & 3;
    (nib | (hi << 4)) as i32 - 32
}

/// Sub-block `j`'s (< 16) scale of a Q6_K super-block.
#[inline(always)]
pub fn q6_k_scale(blk: &[u8], j: usize) -> i32 {
    blk[Q6_K_SCALES + j] as i8 as i32
}

/// The f16 `d` of a Q6_K super-block.
#[inline(always)]
pub fn q6_k_d(blk: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([blk[Q6_K_D], blk[Q6_K_D + 1]]))
}

/// Dequantizes a whole Q6_K row as ggml's `dequantize_row_q6_K` (and
/// gguf-py): element = `d · scale · q`, exact in f32 as Q4_0's are (`d`
/// has at most 11 significant bits, `|scale| ≤ 128` at most 7, `|q| ≤ 32`
/// at most 5). model/tests/q6_k.rs checks it against gguf-py bit for bit.
pub fn dequantize_q6_k(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes
        .chunks_exact(Q6_K_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK_K))
    {
        let d = q6_k_d(blk);
        for (e, v) in o.iter_mut().enumerate() {
            *v = d * q6_k_scale(blk, e / 16) as f32 * q6_k_code(blk, e) as f32;
        }
    }
}

/// Quantizes a row (`len % 256 == 0`) to Q6_K: each sub-block of 16 takes
/// the scale `amax / 31`, the super-block `d` = the largest of them / 127,
/// each sub-block scale `round(s / d)` and each code `round(x / (d ·
/// scale))` clamped to −32..=31. Not ggml's quantizer (which searches for
/// the scales that minimize the error): colibri reads Q6_K files, and
/// writes Q6_K only for synthetic models and tests, where any valid
/// encoding of the values serves.
pub fn quantize_q6_k(x: &[f32]) -> Result<Vec<u8>> {
    if !x.len().is_multiple_of(QK_K) {
        return Err(ModelError::Invalid(format!(
            "q6_k: a row of {} elements is not a multiple of the {QK_K}-element super-block",
            x.len()
        )));
    }
    let mut out = vec![0u8; x.len() / QK_K * Q6_K_BLOCK_BYTES];
    for (xs, blk) in x
        .chunks_exact(QK_K)
        .zip(out.chunks_exact_mut(Q6_K_BLOCK_BYTES))
    {
        let subs: Vec<f32> = xs
            .chunks_exact(16)
            .map(|s| s.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0)
            .collect();
        let d = half::f16::from_f32(subs.iter().fold(0.0f32, |m, &v| m.max(v)) / 127.0);
        blk[Q6_K_D..].copy_from_slice(&d.to_bits().to_le_bytes());
        let d = d.to_f32();
        for (j, &s) in subs.iter().enumerate() {
            let sc = if d > 0.0 {
                (s / d).round().clamp(-128.0, 127.0) as i8
            } else {
                0
            };
            blk[Q6_K_SCALES + j] = sc as u8;
            let step = d * sc as f32;
            for (e, &v) in xs.iter().enumerate().skip(16 * j).take(16) {
                let q = if step != 0.0 {
                    (v / step).round().clamp(-32.0, 31.0) as i32
                } else {
                    0
                };
                let u = (q + 32) as u8;
                let (n, k, l) = (e / 128, (e % 128) / 32, e % 32);
                let at = 64 * n + 32 * (k % 2) + l;
                blk[at] |= if k < 2 { u & 0x0f } else { (u & 0x0f) << 4 };
                blk[Q6_K_QH + 32 * n + l] |= (u >> 4) << (2 * k);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn q8_0_round_trip_is_close_and_layout_is_ggml() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let x: Vec<f32> = (0..96).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let q = quantize_q8_0(&x).unwrap();
        assert_eq!(q.len(), 3 * Q8_0_BLOCK_BYTES);
        let mut y = vec![0.0; 96];
        dequantize_q8_0(&q, &mut y);
        for (b, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // The element of largest magnitude maps to ±127.
            let i = xs.iter().position(|v| v.abs() == amax).unwrap();
            assert_eq!((q[b * 34 + 2 + i] as i8).unsigned_abs(), 127);
            for (a, c) in xs.iter().zip(ys) {
                assert!((a - c).abs() <= amax / 127.0, "{a} vs {c}");
            }
        }
    }

    #[test]
    fn q4_0_nibble_order_and_zero_block() {
        // d = max / -8 with max = -8 gives d = 1: q = x + 8.
        let mut x = vec![0.0f32; 32];
        x[0] = -8.0;
        x[16] = 7.0;
        x[1] = 3.0;
        let q = quantize_q4_0(&x).unwrap();
        assert_eq!(block_scale(&q), 1.0);
        assert_eq!(q[2], 15 << 4); // element 0 (q = 0) low, element 16 (q = 15) high
        assert_eq!(q[3] & 0x0f, 11);
        let mut y = vec![0.0; 32];
        dequantize_q4_0(&q, &mut y);
        assert_eq!(y, x);
        let z = quantize_q4_0(&[0.0; 32]).unwrap();
        // max = 0 gives d = 0 / -8 = -0.0, as in ggml and gguf-py.
        assert_eq!(&z[..2], &[0, 0x80]);
        assert!(z[2..].iter().all(|&b| b == 0x88));
        assert!(quantize_q8_0(&[1.0; 33]).is_err());
    }

    #[test]
    fn q6_k_round_trip_is_close() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        let x: Vec<f32> = (0..512).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let q = quantize_q6_k(&x).unwrap();
        assert_eq!(q.len(), 2 * Q6_K_BLOCK_BYTES);
        let mut y = vec![0.0; 512];
        dequantize_q6_k(&q, &mut y);
        for (xs, ys) in x.chunks(16).zip(y.chunks(16)) {
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (a, c) in xs.iter().zip(ys) {
                // Half a code step, plus the scales' own rounding.
                assert!((a - c).abs() <= amax / 31.0, "{a} vs {c}");
            }
        }
        // The codes land where ggml's layout puts them: ±31 (the
        // quantizer's range is symmetric) in the first and in the last
        // quarter of the second half, zeros elsewhere.
        let mut x = vec![0.0f32; 256];
        x[0] = 31.0;
        x[1] = -31.0;
        x[200] = -31.0;
        let q = quantize_q6_k(&x).unwrap();
        assert_eq!(q6_k_code(&q, 0), 31);
        assert_eq!(q6_k_code(&q, 1), -31);
        assert_eq!(q6_k_code(&q, 2), 0);
        assert_eq!(q6_k_code(&q, 200), -31);
        assert_eq!(q6_k_code(&q, 199), 0);
        assert!(quantize_q6_k(&[1.0; 128]).is_err());
    }
}
