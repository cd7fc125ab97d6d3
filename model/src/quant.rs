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
//! ggml's k-quants that llama.cpp's most downloaded files are made of are
//! read too: Q6_K, which it gives a model's output matrix (and, in its
//! `_M` mixes, some others), see [`dequantize_q6_k`]; Q4_K, the bulk of a
//! Q4_K_M file, and Q5_K (of the Q5_K mixes), see [`dequantize_q4_k`].
//! So are the formats of the smaller files of huge models, read only:
//! Q2_K and Q3_K (the Q2_K and Q3_K_S/M/L files), see [`dequantize_q2_k`]
//! and [`dequantize_q3_k`], and IQ4_NL/IQ4_XS, see [`dequantize_iq4_xs`].

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

/// Bytes of one Q4_1 block: f16 `d`, f16 `m`, 32 nibbles.
pub const Q4_1_BLOCK_BYTES: usize = 4 + QK / 2;
/// Bytes of one Q5_0 block: f16 `d`, 32 fifth bits (`qh`, a little-endian
/// u32), 32 nibbles.
pub const Q5_0_BLOCK_BYTES: usize = 2 + 4 + QK / 2;
/// Bytes of one Q5_1 block: f16 `d`, f16 `m`, `qh`, 32 nibbles.
pub const Q5_1_BLOCK_BYTES: usize = 4 + 4 + QK / 2;

/// The second f16 of a block (`m` of Q4_1 and Q5_1).
#[inline(always)]
fn block_min(block: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([block[2], block[3]]))
}

/// The codes (0..=31) of a 5-bit block's elements `j` and `j + 16` (j <
/// 16), as ggml's `dequantize_row_q5_0` reads them: the low and the high
/// nibble of `qs[j]`, with bits `j` and `j + 16` of `qh` above them.
/// (Branch-free, so the loops over a block vectorize.)
#[inline(always)]
fn q5_codes(qh: u32, qs: &[u8], j: usize) -> (u32, u32) {
    let q = u32::from(qs[j]);
    (
        (q & 0x0f) | (((qh >> j) & 1) << 4),
        (q >> 4) | (((qh >> (j + QK / 2)) & 1) << 4),
    )
}

/// Dequantizes Q4_1 blocks as ggml's `dequantize_row_q4_1`: element `q·d +
/// m` (a product, then a sum: two roundings).
#[inline(always)] // into kernels::dequant's AVX2 twins
pub fn dequantize_q4_1(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .chunks_exact(Q4_1_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        let (d, m) = (block_scale(b), block_min(b));
        for (j, &q) in b[4..].iter().enumerate() {
            o[j] = f32::from(q & 0x0f) * d + m;
            o[j + QK / 2] = f32::from(q >> 4) * d + m;
        }
    }
}

/// Dequantizes Q5_0 blocks as ggml's `dequantize_row_q5_0`: element
/// `(code − 16)·d`.
#[inline(always)] // into kernels::dequant's AVX2 twins
pub fn dequantize_q5_0(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .chunks_exact(Q5_0_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        let d = block_scale(b);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let (lo, hi) = o.split_at_mut(QK / 2);
        for j in 0..QK / 2 {
            let (l, h) = q5_codes(qh, &b[6..], j);
            lo[j] = (l as i32 - 16) as f32 * d;
            hi[j] = (h as i32 - 16) as f32 * d;
        }
    }
}

/// Dequantizes Q5_1 blocks as ggml's `dequantize_row_q5_1`: element
/// `code·d + m`.
#[inline(always)] // into kernels::dequant's AVX2 twins
pub fn dequantize_q5_1(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .chunks_exact(Q5_1_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        let (d, m) = (block_scale(b), block_min(b));
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let (lo, hi) = o.split_at_mut(QK / 2);
        for j in 0..QK / 2 {
            let (l, h) = q5_codes(qh, &b[8..], j);
            lo[j] = l as f32 * d + m;
            hi[j] = h as f32 * d + m;
        }
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
#[inline(always)] // into kernels::dequant's AVX2 twins
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

/// Bytes of one Q4_K super-block: f16 `d`, f16 `dmin`, 12 bytes of
/// packed 6-bit sub-block scales and mins, then 128 bytes of nibbles.
pub const Q4_K_BLOCK_BYTES: usize = 4 + K_SCALE_BYTES + QK_K / 2;
/// Bytes of one Q5_K super-block: Q4_K's with 32 bytes of fifth bits
/// (`qh`) between the scales and the nibbles.
pub const Q5_K_BLOCK_BYTES: usize = 4 + K_SCALE_BYTES + QK_K / 8 + QK_K / 2;
/// Bytes of the packed scales and mins of a Q4_K/Q5_K super-block.
pub const K_SCALE_BYTES: usize = 12;
/// Where the packed scales of a Q4_K/Q5_K super-block begin.
pub const K_SCALES: usize = 4;
/// Where a Q4_K super-block's nibbles begin.
pub const Q4_K_QS: usize = K_SCALES + K_SCALE_BYTES;
/// Where a Q5_K super-block's fifth bits and nibbles begin.
pub const Q5_K_QH: usize = K_SCALES + K_SCALE_BYTES;
pub const Q5_K_QS: usize = Q5_K_QH + QK_K / 8;

/// The f16 `d` and `dmin` of a Q4_K/Q5_K super-block.
#[inline(always)]
pub fn k4_d_dmin(blk: &[u8]) -> (f32, f32) {
    (
        f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])),
        f16_to_f32(u16::from_le_bytes([blk[2], blk[3]])),
    )
}

/// Sub-block `j`'s (< 8) 6-bit scale and min from a Q4_K/Q5_K
/// super-block's 12 packed bytes `s` (ggml's `get_scale_min_k4`): for
/// `j < 4` the low 6 bits of `s[j]` and `s[j + 4]`; for `j ≥ 4` the
/// nibbles of `s[j + 4]` under the top 2 bits of `s[j − 4]` and `s[j]`.
#[inline(always)]
pub fn k4_scale_min(s: &[u8], j: usize) -> (i32, i32) {
    if j < 4 {
        ((s[j] & 63) as i32, (s[j + 4] & 63) as i32)
    } else {
        (
            ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4)) as i32,
            ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as i32,
        )
    }
}

/// Element `e` (< 256) of a Q4_K super-block as its code (0..=15): each
/// 64 elements take 32 bytes, element `l` (< 32) of them the low nibble
/// of byte `l`, element `32 + l` its high nibble. It is in sub-block
/// `e / 32`.
#[inline(always)]
pub fn q4_k_code(blk: &[u8], e: usize) -> i32 {
    let byte = blk[Q4_K_QS + 32 * (e / 64) + e % 32];
    (if (e / 32).is_multiple_of(2) {
        byte & 0x0f
    } else {
        byte >> 4
    }) as i32
}

/// Element `e` (< 256) of a Q5_K super-block as its code (0..=31): Q4_K's
/// nibble (from `qs`) with bit `e / 32` of `qh[e mod 32]` above it.
#[inline(always)]
pub fn q5_k_code(blk: &[u8], e: usize) -> i32 {
    let byte = blk[Q5_K_QS + 32 * (e / 64) + e % 32];
    let low = if (e / 32).is_multiple_of(2) {
        byte & 0x0f
    } else {
        byte >> 4
    };
    let high = (blk[Q5_K_QH + e % 32] >> (e / 32)) & 1;
    (low | (high << 4)) as i32
}

/// Dequantizes a whole Q4_K row as ggml's `dequantize_row_q4_K` (and
/// gguf-py): element = `d·sc · q − dmin·m`. `d·sc` and `dmin·m` are exact
/// (11 + 6 significant bits) and so is `d·sc · q` (4 more); the one
/// rounding is the subtraction's, which ggml's code and a fused
/// multiply-add round alike. model/tests/k_quants.rs checks it against
/// gguf-py bit for bit.
#[inline(always)] // into kernels::dequant's AVX2 twins
pub fn dequantize_q4_k(bytes: &[u8], out: &mut [f32]) {
    dequantize_k4(bytes, out, Q4_K_BLOCK_BYTES, q4_k_code);
}

/// Dequantizes a whole Q5_K row as ggml's `dequantize_row_q5_K`: Q4_K's
/// arithmetic on 5-bit codes (`d·sc · q` stays exact: 11 + 6 + 5 bits).
#[inline(always)] // into kernels::dequant's AVX2 twins
pub fn dequantize_q5_k(bytes: &[u8], out: &mut [f32]) {
    dequantize_k4(bytes, out, Q5_K_BLOCK_BYTES, q5_k_code);
}

/// Generic over `code` and inlined, so that the code's bit arithmetic
/// compiles into the loop (through a function pointer, a call per element
/// made `--exact-quant` Q4_K rows 28× slower than Q4_1's).
#[inline(always)]
fn dequantize_k4(bytes: &[u8], out: &mut [f32], size: usize, code: impl Fn(&[u8], usize) -> i32) {
    for (blk, o) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = k4_d_dmin(blk);
        let scales = &blk[K_SCALES..K_SCALES + K_SCALE_BYTES];
        for (j, sub) in o.chunks_exact_mut(QK).enumerate() {
            let (sc, m) = k4_scale_min(scales, j);
            let (d1, m1) = (d * sc as f32, dmin * m as f32);
            for (l, v) in sub.iter_mut().enumerate() {
                *v = d1 * code(blk, QK * j + l) as f32 - m1;
            }
        }
    }
}

/// Quantizes a row (`len % 256 == 0`) to Q4_K. Each sub-block of 32 takes
/// the step `(max − min) / 15` and the min `−min(min, 0)`; `d` and `dmin`
/// are the largest of them / 63, the 6-bit scales and mins round to them
/// and each code is `round((x + dmin·m) / (d·sc))` clamped to 0..=15. Not
/// ggml's quantizer (which searches for the error-minimizing scales):
/// colibri reads Q4_K files and writes Q4_K only for synthetic models and
/// tests, where any valid encoding serves.
pub fn quantize_q4_k(x: &[f32]) -> Result<Vec<u8>> {
    quantize_k4(x, false)
}

/// Quantizes a row to Q5_K, as [`quantize_q4_k`] with 31 steps.
pub fn quantize_q5_k(x: &[f32]) -> Result<Vec<u8>> {
    quantize_k4(x, true)
}

fn quantize_k4(x: &[f32], five: bool) -> Result<Vec<u8>> {
    let (name, size, levels) = if five {
        ("q5_k", Q5_K_BLOCK_BYTES, 31.0f32)
    } else {
        ("q4_k", Q4_K_BLOCK_BYTES, 15.0f32)
    };
    if !x.len().is_multiple_of(QK_K) {
        return Err(ModelError::Invalid(format!(
            "{name}: a row of {} elements is not a multiple of the {QK_K}-element super-block",
            x.len()
        )));
    }
    let mut out = vec![0u8; x.len() / QK_K * size];
    for (xs, blk) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(size)) {
        let (mut steps, mut mins) = ([0.0f32; 8], [0.0f32; 8]);
        for (j, sub) in xs.chunks_exact(QK).enumerate() {
            let lo = sub.iter().fold(0.0f32, |m, &v| m.min(v));
            let hi = sub.iter().fold(lo, |m, &v| m.max(v));
            steps[j] = (hi - lo) / levels;
            mins[j] = -lo;
        }
        let top =
            |v: &[f32; 8]| half::f16::from_f32(v.iter().fold(0.0f32, |m, &s| m.max(s)) / 63.0);
        let (d, dmin) = (top(&steps), top(&mins));
        blk[..2].copy_from_slice(&d.to_bits().to_le_bytes());
        blk[2..4].copy_from_slice(&dmin.to_bits().to_le_bytes());
        let (d, dmin) = (d.to_f32(), dmin.to_f32());
        let six = |v: f32, by: f32| {
            if by > 0.0 {
                (v / by).round().clamp(0.0, 63.0) as u8
            } else {
                0
            }
        };
        let s = &mut blk[K_SCALES..K_SCALES + K_SCALE_BYTES];
        for j in 0..8 {
            let (sc, m) = (six(steps[j], d), six(mins[j], dmin));
            if j < 4 {
                s[j] |= sc;
                s[j + 4] |= m;
            } else {
                s[j + 4] = (sc & 0x0f) | ((m & 0x0f) << 4);
                s[j - 4] |= (sc >> 4) << 6;
                s[j] |= (m >> 4) << 6;
            }
        }
        let scales: [u8; K_SCALE_BYTES] = std::array::from_fn(|i| s[i]);
        for (e, &v) in xs.iter().enumerate() {
            let (sc, m) = k4_scale_min(&scales, e / QK);
            let step = d * sc as f32;
            let q = if step > 0.0 {
                ((v + dmin * m as f32) / step).round().clamp(0.0, levels) as u8
            } else {
                0
            };
            let (c, l, high) = (e / 64, e % 32, (e / 32) % 2 == 1);
            let qs = if five { Q5_K_QS } else { Q4_K_QS };
            blk[qs + 32 * c + l] |= if high { (q & 0x0f) << 4 } else { q & 0x0f };
            if five {
                blk[Q5_K_QH + l] |= (q >> 4) << (e / 32);
            }
        }
    }
    Ok(out)
}

/// Bytes of one Q2_K super-block: 16 sub-block bytes (a 4-bit scale under
/// a 4-bit min), 64 bytes of 2-bit codes, then f16 `d` and `dmin`.
pub const Q2_K_BLOCK_BYTES: usize = QK_K / 16 + QK_K / 4 + 4;
/// Where a Q2_K super-block's codes and its `d` begin (its sub-block
/// scales are its first bytes).
pub const Q2_K_QS: usize = QK_K / 16;
pub const Q2_K_D: usize = Q2_K_QS + QK_K / 4;
/// Bytes of one Q3_K super-block: `hmask` (32 bytes: the third bits),
/// 64 bytes of low 2-bit codes, 12 bytes of packed 6-bit sub-block
/// scales, then an f16 `d`.
pub const Q3_K_BLOCK_BYTES: usize = QK_K / 8 + QK_K / 4 + K_SCALE_BYTES + 2;
/// Where a Q3_K super-block's parts begin.
pub const Q3_K_QS: usize = QK_K / 8;
pub const Q3_K_SCALES: usize = Q3_K_QS + QK_K / 4;
pub const Q3_K_D: usize = Q3_K_SCALES + K_SCALE_BYTES;
/// Bytes of one IQ4_NL block: an f16 `d`, then 32 nibbles indexing
/// [`IQ4_NL_VALUES`].
pub const IQ4_NL_BLOCK_BYTES: usize = 2 + QK / 2;
/// Bytes of one IQ4_XS super-block: f16 `d`, `scales_h` (a little-endian
/// u16: 2 high bits of each of the 8 sub-block scales), `scales_l` (4
/// bytes: their low nibbles), then 128 bytes of nibbles.
pub const IQ4_XS_BLOCK_BYTES: usize = 2 + 2 + QK_K / 64 + QK_K / 2;
/// Where an IQ4_XS super-block's `scales_l` and nibbles begin.
pub const IQ4_XS_SCALES_L: usize = 4;
pub const IQ4_XS_QS: usize = IQ4_XS_SCALES_L + QK_K / 64;

/// The 16 values an IQ4_NL/IQ4_XS nibble stands for (ggml's
/// `kvalues_iq4nl`): a format constant, not data.
pub const IQ4_NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// [`IQ4_NL_VALUES`] as f32 (each exact).
const IQ4_NL_F32: [f32; 16] = {
    let mut t = [0.0f32; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = IQ4_NL_VALUES[i] as f32;
        i += 1;
    }
    t
};

/// The little-endian f16 at `at` of a block.
#[inline(always)]
fn f16_at(blk: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([blk[at], blk[at + 1]]))
}

/// Where the 2-bit codes of sub-block `j` (< 16, elements `16j..16j + 16`)
/// of a Q2_K/Q3_K super-block lie: each half of 128 elements takes 32
/// bytes of codes, element `l + 32s` of a half (l < 32, s < 4) bits `2s,
/// 2s + 1` of byte `l`. Returns the first of the sub-block's 16 bytes (in
/// the codes) and the shift.
#[inline(always)]
fn two_bit_codes(j: usize) -> (usize, u32) {
    (32 * (j / 8) + 16 * (j % 2), 2 * ((j % 8) / 2) as u32)
}

/// Dequantizes a whole Q2_K row as ggml's `dequantize_row_q2_K` (and
/// gguf-py): element = `d·(sc & 15) · q − dmin·(sc >> 4)`. `d·sc` and
/// `dmin·m` are rounded to f32 first (exact: 11 + 4 significant bits), so
/// is `d·sc · q` (2 more); the one rounding is the subtraction's.
#[inline(always)] // into kernels::dequant's AVX2 twins
pub fn dequantize_q2_k(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes
        .chunks_exact(Q2_K_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK_K))
    {
        let (d, dmin) = (f16_at(blk, Q2_K_D), f16_at(blk, Q2_K_D + 2));
        for (j, sub) in o.chunks_exact_mut(16).enumerate() {
            let sc = blk[j];
            let (dl, ml) = (d * f32::from(sc & 0x0f), dmin * f32::from(sc >> 4));
            let (at, shift) = two_bit_codes(j);
            let qs = &blk[Q2_K_QS + at..Q2_K_QS + at + 16];
            for (v, &q) in sub.iter_mut().zip(qs) {
                *v = dl * f32::from((q >> shift) & 3) - ml;
            }
        }
    }
}

/// Sub-block `j`'s (< 16) scale of a Q3_K super-block (−32..=31) from its
/// 12 packed bytes `s`: the low nibble of `s[j mod 8]` (the high one for
/// `j ≥ 8`) under bits `2·(j / 4)`, `2·(j / 4) + 1` of `s[8 + j mod 4]`,
/// less 32.
#[inline(always)]
pub fn q3_k_scale(s: &[u8], j: usize) -> i32 {
    let low = (s[j % 8] >> (4 * (j / 8))) & 0x0f;
    let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    i32::from(low | (high << 4)) - 32
}

/// Dequantizes a whole Q3_K row as ggml's `dequantize_row_q3_K` (and
/// gguf-py): element = `d·scale · q`, where `q` is the 2-bit code less 4
/// unless the element's bit of `hmask` (bit `e / 32` of `hmask[e mod
/// 32]`) is set (−4..=3). Exact in f32: 11 + 6 + 3 significant bits.
#[inline(always)] // into kernels::dequant's AVX2 twins
pub fn dequantize_q3_k(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes
        .chunks_exact(Q3_K_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK_K))
    {
        let d = f16_at(blk, Q3_K_D);
        let scales = &blk[Q3_K_SCALES..Q3_K_D];
        for (j, sub) in o.chunks_exact_mut(16).enumerate() {
            let dl = d * q3_k_scale(scales, j) as f32;
            let (at, shift) = two_bit_codes(j);
            let qs = &blk[Q3_K_QS + at..Q3_K_QS + at + 16];
            let hm = &blk[16 * (j % 2)..16 * (j % 2) + 16];
            let bit = (j / 2) as u32;
            for ((v, &q), &h) in sub.iter_mut().zip(qs).zip(hm) {
                let low = i32::from((q >> shift) & 3);
                let minus = i32::from(((h >> bit) & 1) ^ 1) << 2;
                *v = dl * (low - minus) as f32;
            }
        }
    }
}

/// 32 elements of IQ4_NL/IQ4_XS: `dl · value` of each nibble of `qs` (16
/// bytes; the low nibbles are elements 0..16, the high ones 16..32).
#[inline(always)]
fn iq4_block(dl: f32, qs: &[u8], out: &mut [f32]) {
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(qs) {
        *l = dl * IQ4_NL_F32[usize::from(q & 0x0f)];
        *h = dl * IQ4_NL_F32[usize::from(q >> 4)];
    }
}

/// Dequantizes a whole IQ4_NL row as ggml's `dequantize_row_iq4_nl`:
/// element = `d · value[nibble]` (exact: 11 + 7 significant bits).
#[inline(always)] // into kernels::dequant's AVX2 twins
pub fn dequantize_iq4_nl(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes
        .chunks_exact(IQ4_NL_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        iq4_block(block_scale(blk), &blk[2..], o);
    }
}

/// Sub-block `ib`'s (< 8) scale of an IQ4_XS super-block (−32..=31): the
/// nibble `ib mod 2` of `scales_l[ib / 2]` under bits `2·ib`, `2·ib + 1` of
/// `scales_h`, less 32.
#[inline(always)]
pub fn iq4_xs_scale(blk: &[u8], ib: usize) -> i32 {
    let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
    let low = (blk[IQ4_XS_SCALES_L + ib / 2] >> (4 * (ib % 2))) & 0x0f;
    let high = (scales_h >> (2 * ib)) & 3;
    (i32::from(low) | (i32::from(high) << 4)) - 32
}

/// Dequantizes a whole IQ4_XS row as ggml's `dequantize_row_iq4_xs`:
/// element = `(d·scale) · value[nibble]`, `d·scale` rounded to f32 first
/// (both exact: 11 + 6 + 7 significant bits).
#[inline(always)] // into kernels::dequant's AVX2 twins
pub fn dequantize_iq4_xs(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes
        .chunks_exact(IQ4_XS_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK_K))
    {
        let d = block_scale(blk);
        let qs = &blk[IQ4_XS_QS..];
        for (ib, sub) in o.chunks_exact_mut(QK).enumerate() {
            let dl = d * iq4_xs_scale(blk, ib) as f32;
            iq4_block(dl, &qs[ib * QK / 2..(ib + 1) * QK / 2], sub);
        }
    }
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
    fn k4_round_trips_are_close() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013 + if i % 64 < 32 { 0.3 } else { -0.2 })
            .collect();
        for (five, size) in [(false, Q4_K_BLOCK_BYTES), (true, Q5_K_BLOCK_BYTES)] {
            let q = if five {
                quantize_q5_k(&x)
            } else {
                quantize_q4_k(&x)
            }
            .unwrap();
            assert_eq!(q.len(), 2 * size);
            let mut y = vec![0.0f32; 512];
            if five {
                dequantize_q5_k(&q, &mut y);
            } else {
                dequantize_q4_k(&q, &mut y);
            }
            // Half a step of the widest sub-block (its range / 15 or 31),
            // plus the 6-bit rounding of scale and min.
            let bound = if five { 0.06 } else { 0.12 };
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < bound, "{five}: {a} against {b}");
            }
        }
        assert!(quantize_q4_k(&x[..100]).is_err());
    }

    #[test]
    fn k4_scales_unpack_as_ggml_packs_them() {
        // Sub-block j's scale j + 1 and min 62 − j, six bits each.
        let mut s = [0u8; K_SCALE_BYTES];
        for j in 0..8u8 {
            let (sc, m) = (j + 1 + 40 * (j / 4), 62 - j);
            if j < 4 {
                s[j as usize] |= sc;
                s[j as usize + 4] |= m;
            } else {
                s[j as usize + 4] = (sc & 15) | ((m & 15) << 4);
                s[j as usize - 4] |= (sc >> 4) << 6;
                s[j as usize] |= (m >> 4) << 6;
            }
        }
        for j in 0..8 {
            let want = ((j + 1 + 40 * (j / 4)) as i32, (62 - j) as i32);
            assert_eq!(k4_scale_min(&s, j), want, "sub-block {j}");
        }
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
