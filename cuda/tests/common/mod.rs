//! Shared pieces of the GPU tests: the device, random inputs (never zeros),
//! weight encoders for every format with their exact f32 values, and the
//! comparison helpers that state each bound.

#![allow(dead_code)]

use std::sync::OnceLock;

use colibri_cuda::{CudaDevice, DeviceBuffer, KernelCache, KernelSet, WeightFormat};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Every weight format the kernels take.
pub const FORMATS: [WeightFormat; 28] = [
    WeightFormat::F32,
    WeightFormat::F16,
    WeightFormat::Bf16,
    WeightFormat::F8E4M3,
    WeightFormat::Q8_0,
    WeightFormat::Q4_0,
    WeightFormat::Q4_0Q8,
    WeightFormat::Q8_0Q8,
    WeightFormat::Q6K,
    WeightFormat::Q6KQ8,
    WeightFormat::Q4K,
    WeightFormat::Q4KQ8,
    WeightFormat::Q5K,
    WeightFormat::Q5KQ8,
    WeightFormat::Q4_1,
    WeightFormat::Q5_0,
    WeightFormat::Q5_1,
    WeightFormat::Q2K,
    WeightFormat::Q3K,
    WeightFormat::Iq4Nl,
    WeightFormat::Iq4Xs,
    WeightFormat::Q4_1Q8,
    WeightFormat::Q5_0Q8,
    WeightFormat::Q5_1Q8,
    WeightFormat::Q2KQ8,
    WeightFormat::Q3KQ8,
    WeightFormat::Iq4NlQ8,
    WeightFormat::Iq4XsQ8,
];

pub struct Gpu {
    pub dev: CudaDevice,
    pub k: KernelSet,
}

/// The device and kernels, opened once per test binary. A machine without
/// a usable GPU fails here with the reason (these tests are only run on
/// purpose, with `--ignored`).
pub fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let dev = CudaDevice::open(0).unwrap_or_else(|e| panic!("{e}"));
        let k =
            KernelSet::load(&dev, &KernelCache::user_default()).unwrap_or_else(|e| panic!("{e}"));
        let i = dev.info();
        eprintln!(
            "GPU: {} ({}), {} SMs, {} MiB, driver CUDA {}.{}",
            i.name,
            i.arch,
            i.multiprocessors,
            i.total_mem >> 20,
            i.driver_version.0,
            i.driver_version.1
        );
        Gpu { dev, k }
    })
}

/// A seeded generator; `COLIBRI_TEST_SEED` draws other inputs.
pub fn rng(test: u64) -> ChaCha8Rng {
    let base: u64 = std::env::var("COLIBRI_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    ChaCha8Rng::seed_from_u64(base ^ test.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Uniform in ±[lo, hi) with a random sign: never zero.
pub fn nonzero(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v = rng.random_range(lo..hi);
            if rng.random::<bool>() { v } else { -v }
        })
        .collect()
}

pub fn upload<T: colibri_cuda::DeviceElem>(v: &[T]) -> DeviceBuffer<T> {
    gpu().dev.upload(v).unwrap()
}

/// An f32 output buffer filled with NaN bit patterns, so an element the
/// kernel forgot to write fails every comparison.
pub fn poisoned(n: usize) -> DeviceBuffer<f32> {
    let mut b = gpu().dev.alloc::<f32>(n).unwrap();
    gpu().dev.fill_bytes(b.as_mut(), 0xff).unwrap();
    b
}

pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 7) as f32;
    if exp == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * (1.0 / 512.0)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// A random matrix in `fmt`: its bytes, its exact f32 elements (row-major)
/// and, for FP8, its block scales.
pub struct Weights {
    pub bytes: Vec<u8>,
    pub f32: Vec<f32>,
    pub scales: Vec<f32>,
    pub block: usize,
}

pub fn random_weights(
    rng: &mut ChaCha8Rng,
    fmt: WeightFormat,
    rows: usize,
    cols: usize,
) -> Weights {
    let mut w = Weights {
        bytes: Vec::new(),
        f32: Vec::with_capacity(rows * cols),
        scales: Vec::new(),
        block: 128,
    };
    match fmt {
        WeightFormat::F32 => {
            w.f32 = nonzero(rng, rows * cols, 0.01, 1.0);
            w.bytes = w.f32.iter().flat_map(|v| v.to_le_bytes()).collect();
        }
        WeightFormat::F16 | WeightFormat::Bf16 => {
            for v in nonzero(rng, rows * cols, 0.01, 1.0) {
                let (bits, exact) = if fmt == WeightFormat::F16 {
                    let h = half::f16::from_f32(v);
                    (h.to_bits(), h.to_f32())
                } else {
                    let h = half::bf16::from_f32(v);
                    (h.to_bits(), h.to_f32())
                };
                w.bytes.extend_from_slice(&bits.to_le_bytes());
                w.f32.push(exact);
            }
        }
        WeightFormat::F8E4M3 => {
            let (gr, gc) = (rows.div_ceil(w.block), cols.div_ceil(w.block));
            w.scales = (0..gr * gc)
                .map(|_| rng.random_range(0.001f32..0.01))
                .collect();
            for r in 0..rows {
                for c in 0..cols {
                    let mut b: u8 = rng.random();
                    if b & 0x7f == 0x7f || b & 0x7f == 0 {
                        b ^= 0x11; // no NaN, no zero
                    }
                    w.bytes.push(b);
                    w.f32
                        .push(fp8_e4m3_to_f32(b) * w.scales[(r / w.block) * gc + c / w.block]);
                }
            }
        }
        WeightFormat::Q8_0 | WeightFormat::Q8_0Q8 | WeightFormat::Q4_0 | WeightFormat::Q4_0Q8 => {
            assert!(cols.is_multiple_of(32));
            for _ in 0..rows * cols / 32 {
                let d = half::f16::from_f32(rng.random_range(0.002f32..0.05));
                w.bytes.extend_from_slice(&d.to_bits().to_le_bytes());
                let d = d.to_f32();
                if matches!(fmt, WeightFormat::Q8_0 | WeightFormat::Q8_0Q8) {
                    for _ in 0..32 {
                        let q: i8 = rng.random_range(-127..=127);
                        w.bytes.push(q as u8);
                        w.f32.push(d * q as f32);
                    }
                } else {
                    let nib: Vec<u8> = (0..32).map(|_| rng.random_range(0..16u8)).collect();
                    for j in 0..16 {
                        w.bytes.push(nib[j] | (nib[j + 16] << 4));
                    }
                    w.f32.extend(nib.iter().map(|&q| d * (q as i32 - 8) as f32));
                }
            }
        }
        WeightFormat::Q6K | WeightFormat::Q6KQ8 => {
            assert!(cols.is_multiple_of(256));
            for _ in 0..rows * cols / 256 {
                // Random codes and sub-block scales of both signs (never a
                // zero scale), a random d.
                let mut blk: Vec<u8> = (0..210).map(|_| rng.random()).collect();
                for s in &mut blk[192..208] {
                    if *s == 0 {
                        *s = 1;
                    }
                }
                let d = half::f16::from_f32(rng.random_range(0.0001f32..0.001));
                blk[208..].copy_from_slice(&d.to_bits().to_le_bytes());
                w.f32.extend((0..256).map(|e| q6_k_value(&blk, e)));
                w.bytes.extend_from_slice(&blk);
            }
        }
        WeightFormat::Q4K | WeightFormat::Q4KQ8 | WeightFormat::Q5K | WeightFormat::Q5KQ8 => {
            assert!(cols.is_multiple_of(256));
            let five = matches!(fmt, WeightFormat::Q5K | WeightFormat::Q5KQ8);
            let size = if five { 176 } else { 144 };
            for _ in 0..rows * cols / 256 {
                // Random codes, scales and mins (never a zero scale), d and
                // dmin of both signs.
                let mut blk: Vec<u8> = (0..size).map(|_| rng.random()).collect();
                for at in [0, 2] {
                    let v = rng.random_range(0.0001f32..0.001);
                    let v = if rng.random::<bool>() { v } else { -v };
                    blk[at..at + 2]
                        .copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
                }
                for j in 0..8 {
                    if k4_scale_min(&blk, j).0 == 0 {
                        // Bit 0 of sub-block j's scale (and of nothing else).
                        blk[4 + if j < 4 { j } else { j + 4 }] |= 1;
                    }
                }
                w.f32.extend((0..256).map(|e| k4_value(&blk, e, five)));
                w.bytes.extend_from_slice(&blk);
            }
        }
        WeightFormat::Q4_1
        | WeightFormat::Q5_0
        | WeightFormat::Q5_1
        | WeightFormat::Q4_1Q8
        | WeightFormat::Q5_0Q8
        | WeightFormat::Q5_1Q8 => {
            // The 8-bit-activation twins share their exact format's bytes.
            let fmt = fmt.storage();
            assert!(cols.is_multiple_of(32));
            let size = fmt.row_bytes(32).expect("a block");
            for _ in 0..rows * cols / 32 {
                // Random codes and fifth bits; d (and the min) of both
                // signs.
                let mut blk: Vec<u8> = (0..size).map(|_| rng.random()).collect();
                let halves = if fmt == WeightFormat::Q5_0 { 1 } else { 2 };
                for at in 0..halves {
                    let v = rng.random_range(0.0005f32..0.05);
                    let v = if rng.random::<bool>() { v } else { -v };
                    blk[2 * at..2 * at + 2]
                        .copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
                }
                w.f32.extend((0..32).map(|e| legacy_value(fmt, &blk, e)));
                w.bytes.extend_from_slice(&blk);
            }
        }
        WeightFormat::Q2K
        | WeightFormat::Q3K
        | WeightFormat::Iq4Nl
        | WeightFormat::Iq4Xs
        | WeightFormat::Q2KQ8
        | WeightFormat::Q3KQ8
        | WeightFormat::Iq4NlQ8
        | WeightFormat::Iq4XsQ8 => {
            let fmt = fmt.storage();
            // Random codes and scales; d (Q2_K's dmin too) of both signs at
            // the scale that keeps elements near those of the other formats.
            let block = if fmt == WeightFormat::Iq4Nl { 32 } else { 256 };
            assert!(cols.is_multiple_of(block));
            let size = fmt.row_bytes(block).expect("a block");
            let (d_at, range): (&[usize], _) = match fmt {
                WeightFormat::Q2K => (&[80, 82], 0.0005f32..0.005),
                WeightFormat::Q3K => (&[108], 0.0002f32..0.002),
                _ => (&[0], 0.00005f32..0.0005),
            };
            for _ in 0..rows * cols / block {
                let mut blk: Vec<u8> = (0..size).map(|_| rng.random()).collect();
                for &at in d_at {
                    let v = rng.random_range(range.clone());
                    let v = if rng.random::<bool>() { v } else { -v };
                    blk[at..at + 2]
                        .copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
                }
                w.f32.extend((0..block).map(|e| low_value(fmt, &blk, e)));
                w.bytes.extend_from_slice(&blk);
            }
        }
    }
    w
}

/// ggml's table of IQ4_NL and IQ4_XS values (`kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

fn f16_at(blk: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([blk[at], blk[at + 1]])).to_f32()
}

/// The 2-bit code of element `e` of a Q2_K super-block (the low bits of a
/// Q3_K code, 32 bytes later): bits `2k`, `2k + 1` (`k = (e mod 128) / 32`)
/// of `qs[32 (e / 128) + e mod 32]`.
pub fn two_bit_code(blk: &[u8], qs: usize, e: usize) -> i32 {
    let (n, k, l) = (e / 128, (e % 128) / 32, e % 32);
    ((blk[qs + 32 * n + l] >> (2 * k)) & 3) as i32
}

/// The signed code (−4..=3) of element `e` of a Q3_K super-block: its two
/// low bits, less 4 unless bit `e / 32` of `hmask[e mod 32]` is set.
pub fn q3_k_code(blk: &[u8], e: usize) -> i32 {
    let high = ((blk[e % 32] >> (e / 32)) & 1) as i32;
    (two_bit_code(blk, 32, e) | high << 2) - 4
}

/// Scale `i` (< 16) of a Q3_K super-block, −32..=31: the low (i < 8) or
/// high nibble of byte `96 + i mod 8` under bits `2 (i / 4)`, +1 of byte
/// `104 + i mod 4`.
pub fn q3_k_scale(blk: &[u8], i: usize) -> i32 {
    let low = (blk[96 + i % 8] >> (4 * (i / 8))) & 15;
    let high = (blk[104 + i % 4] >> (2 * (i / 4))) & 3;
    (low | high << 4) as i32 - 32
}

/// The IQ4 value of element `j` (< 32) of the block whose 16 nibble bytes
/// start at `qs`: the low nibble of byte `j` (j < 16) or the high one of
/// byte `j − 16`, through [`IQ4_VALUES`].
pub fn iq4_value(blk: &[u8], qs: usize, j: usize) -> i32 {
    let byte = blk[qs + j % 16];
    let code = if j < 16 { byte & 15 } else { byte >> 4 };
    IQ4_VALUES[code as usize] as i32
}

/// The 6-bit scale (−32..=31) of block `ib` of an IQ4_XS super-block: the
/// nibble `ib mod 2` of `scales_l[ib / 2]` under bits `2 ib`, +1 of the
/// u16 `scales_h`.
pub fn iq4_xs_scale(blk: &[u8], ib: usize) -> i32 {
    let sh = u16::from_le_bytes([blk[2], blk[3]]);
    let low = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 15) as i32;
    (low | (((sh >> (2 * ib)) & 3) << 4) as i32) - 32
}

/// Element `e` of a Q2_K, Q3_K or IQ4_XS super-block (or an IQ4_NL block)
/// as ggml dequantizes it (`dequantize_row_q2_K`, `_q3_K`, `_iq4_nl`,
/// `_iq4_xs`): the scale of its 16 (Q2_K/Q3_K) or 32 elements rounded to
/// f32 first, then one more rounding (Q2_K's min) or none (the others'
/// products are exact).
pub fn low_value(fmt: WeightFormat, blk: &[u8], e: usize) -> f32 {
    let h = |at: usize| f16_at(blk, at);
    match fmt {
        WeightFormat::Q2K => {
            let sc = blk[e / 16];
            let dl = h(80) * (sc & 15) as f32;
            let ml = h(82) * (sc >> 4) as f32;
            dl * two_bit_code(blk, 16, e) as f32 - ml
        }
        WeightFormat::Q3K => h(108) * q3_k_scale(blk, e / 16) as f32 * q3_k_code(blk, e) as f32,
        WeightFormat::Iq4Nl => h(0) * iq4_value(blk, 2, e) as f32,
        WeightFormat::Iq4Xs => {
            let ib = e / 32;
            h(0) * iq4_xs_scale(blk, ib) as f32 * iq4_value(blk, 8 + 16 * ib, e % 32) as f32
        }
        other => panic!("{other:?} is not a low-bit format"),
    }
}

/// Element `e` of a Q4_1, Q5_0 or Q5_1 block as ggml dequantizes it:
/// `d · (code − 16)` for Q5_0, `d · code + m` (two roundings, the first
/// exact) for the others (colibri-model's `quant::dequantize_q4_1`, written
/// out from ggml's layout: f16 d, Q4_1/Q5_1's f16 m, Q5_0/Q5_1's u32 of
/// fifth bits, 16 bytes of nibbles with element j < 16 in the low nibble of
/// byte j and j + 16 in its high one).
pub fn legacy_value(fmt: WeightFormat, blk: &[u8], e: usize) -> f32 {
    let code = legacy_code(fmt, blk, e);
    if fmt == WeightFormat::Q5_0 {
        f16_at(blk, 0) * (code - 16) as f32
    } else {
        f16_at(blk, 0) * code as f32 + f16_at(blk, 2)
    }
}

/// The code (0..=31) of element `e` of a Q4_1, Q5_0 or Q5_1 block.
pub fn legacy_code(fmt: WeightFormat, blk: &[u8], e: usize) -> i32 {
    let min = fmt != WeightFormat::Q5_0;
    let five = fmt != WeightFormat::Q4_1;
    let qh = if min { 4 } else { 2 };
    let qs = qh + if five { 4 } else { 0 };
    let byte = blk[qs + e % 16];
    let mut code = if e < 16 { byte & 15 } else { byte >> 4 } as i32;
    if five {
        let bits = u32::from_le_bytes([blk[qh], blk[qh + 1], blk[qh + 2], blk[qh + 3]]);
        code |= (((bits >> e) & 1) << 4) as i32;
    }
    code
}

/// The f16 `d` and `dmin` of a Q4_K/Q5_K super-block.
pub fn k4_d_dmin(blk: &[u8]) -> (f32, f32) {
    let h = |at: usize| half::f16::from_bits(u16::from_le_bytes([blk[at], blk[at + 1]])).to_f32();
    (h(0), h(2))
}

/// Sub-block `j`'s 6-bit scale and min in a Q4_K/Q5_K super-block (ggml's
/// `get_scale_min_k4`; colibri-model's `quant::k4_scale_min`).
pub fn k4_scale_min(blk: &[u8], j: usize) -> (i32, i32) {
    let s = &blk[4..16];
    if j < 4 {
        ((s[j] & 63) as i32, (s[j + 4] & 63) as i32)
    } else {
        (
            ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4)) as i32,
            ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as i32,
        )
    }
}

/// The code of element `e` of a Q4_K (0..=15) or Q5_K (`five`: 0..=31)
/// super-block: the nibble `(e / 32) mod 2` of `qs[32 (e / 64) + e mod
/// 32]`, Q5_K's under bit `e / 32` of `qh[e mod 32]`.
pub fn k4_code(blk: &[u8], e: usize, five: bool) -> i32 {
    let qs = if five { 48 } else { 16 };
    let byte = blk[qs + 32 * (e / 64) + e % 32];
    let low = (byte >> (4 * ((e / 32) % 2))) & 15;
    let high = u8::from(five) * ((blk[16 + e % 32] >> (e / 32)) & 1);
    (low | (high << 4)) as i32
}

/// Element `e` of a Q4_K/Q5_K super-block as ggml dequantizes it: `(d ·
/// sc) · code − dmin · m`, whose products are exact and whose subtraction
/// rounds once (colibri-model's `quant::dequantize_q4_k`/`_q5_k`).
pub fn k4_value(blk: &[u8], e: usize, five: bool) -> f32 {
    let (d, dmin) = k4_d_dmin(blk);
    let (sc, m) = k4_scale_min(blk, e / 32);
    d * sc as f32 * k4_code(blk, e, five) as f32 - dmin * m as f32
}

/// Element `e` of a Q6_K super-block, as ggml dequantizes it: `d · sc ·
/// (code − 32)`, exact in f32 (colibri-model's `quant::dequantize_q6_k`,
/// written out from ggml's layout).
pub fn q6_k_value(blk: &[u8], e: usize) -> f32 {
    let d = half::f16::from_bits(u16::from_le_bytes([blk[208], blk[209]])).to_f32();
    let sc = blk[192 + e / 16] as i8 as f32;
    d * sc * q6_k_code(blk, e) as f32
}

/// The signed 6-bit code (−32..=31) of element `e` of a Q6_K super-block.
pub fn q6_k_code(blk: &[u8], e: usize) -> i32 {
    let (n, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = blk[64 * n + 32 * (k % 2) + l];
    let nib = if k < 2 { ql & 15 } else { ql >> 4 };
    let hi = (blk[128 + 32 * n + l] >> (2 * k)) & 3;
    (nib | (hi << 4)) as i32 - 32
}

/// One token quantized as colibri-model's `Q8Activation::quantize`: per
/// block of 32, `d = amax / 127`, `q = round(x · (1/d))` clamped to ±127.
pub struct Q8Ref {
    pub d: Vec<f32>,
    pub q: Vec<i8>,
}

pub fn quantize_q8_ref(x: &[f32]) -> Q8Ref {
    let mut r = Q8Ref {
        d: Vec::new(),
        q: Vec::new(),
    };
    for block in x.chunks_exact(32) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        r.d.push(d);
        r.q.extend(
            block
                .iter()
                .map(|v| (v * id).round().clamp(-127.0, 127.0) as i8),
        );
    }
    r
}

/// Rows of n values (n a multiple of 32) as Q8 rows, the layout of
/// kernels/common.cuh written out from [`quantize_q8_ref`]: per row, the
/// blocks' first 16 quants (16 bytes per block), their last 16, the f32
/// scales, the i32 values 8·Σq; rows `colibri_cuda::q8_row_bytes(n)` apart.
pub fn q8_rows_ref(x: &[f32], n: usize) -> Vec<u8> {
    let stride = colibri_cuda::q8_row_bytes(n);
    let mut out = vec![0u8; x.len() / n * stride];
    for (row, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(stride)) {
        let r = quantize_q8_ref(row);
        for (b, (q, d)) in r.q.chunks_exact(32).zip(&r.d).enumerate() {
            for (j, &v) in q.iter().enumerate() {
                dst[if j < 16 { 0 } else { n / 2 } + 16 * b + j % 16] = v as u8;
            }
            dst[n + 4 * b..n + 4 * b + 4].copy_from_slice(&d.to_ne_bytes());
            let z = 8 * q.iter().map(|&v| v as i32).sum::<i32>();
            dst[n + n / 8 + 4 * b..n + n / 8 + 4 * b + 4].copy_from_slice(&z.to_ne_bytes());
        }
    }
    out
}

/// Whether `fmt` takes the 8-bit-activation path (the formats whose
/// one-token launches read Q8 rows when given them).
pub fn int_act(fmt: WeightFormat) -> bool {
    fmt.storage() != fmt
}

/// colibri-model's `dot_q4_0_q8`, written out: block b's exact integer sum
/// times `f16(w.d) · x.d`, fused-added into accumulator b mod 4, reduced
/// as `(a0 + a2) + (a1 + a3)`. (sched/tests/gpu.rs holds the GPU to the
/// CPU tier's own function.)
pub fn dot_q4_0_q8_ref(row: &[u8], x: &Q8Ref) -> f32 {
    let mut acc = [0.0f32; 4];
    for (b, blk) in row.chunks_exact(18).enumerate() {
        let d = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32() * x.d[b];
        let q = &x.q[b * 32..(b + 1) * 32];
        let mut s = 0i32;
        for (j, &v) in blk[2..].iter().enumerate() {
            s += ((v & 0x0f) as i32 - 8) * q[j] as i32;
            s += ((v >> 4) as i32 - 8) * q[j + 16] as i32;
        }
        acc[b % 4] = d.mul_add(s as f32, acc[b % 4]);
    }
    (acc[0] + acc[2]) + (acc[1] + acc[3])
}

/// colibri-model's `dot_q6_k_q8`, written out: block b (32 elements, two
/// sub-blocks of 16) gives the exact integer `sc₀ · Σ₀ + sc₁ · Σ₁`, times
/// `f16(d) · x.d`, fused-added into accumulator b mod 4 as Q4_0's.
pub fn dot_q6_k_q8_ref(row: &[u8], x: &Q8Ref) -> f32 {
    let mut acc = [0.0f32; 4];
    for (i, blk) in row.chunks_exact(210).enumerate() {
        let d = half::f16::from_bits(u16::from_le_bytes([blk[208], blk[209]])).to_f32();
        for g in 0..8 {
            let b = 8 * i + g;
            let q = &x.q[b * 32..(b + 1) * 32];
            let half = |h: usize| -> i32 {
                (0..16)
                    .map(|l| q6_k_code(blk, 32 * g + 16 * h + l) * q[16 * h + l] as i32)
                    .sum()
            };
            let s =
                blk[192 + 2 * g] as i8 as i32 * half(0) + blk[193 + 2 * g] as i8 as i32 * half(1);
            acc[b % 4] = (d * x.d[b]).mul_add(s as f32, acc[b % 4]);
        }
    }
    (acc[0] + acc[2]) + (acc[1] + acc[3])
}

/// colibri-model's `dot_q4_k_q8` / `dot_q5_k_q8`, written out: block b
/// (sub-block b mod 8 of super-block b / 8) gives the exact integers `A =
/// sc · Σ code · q` and `B = m · Σ q`, and the term `fma(d · x.d, A,
/// −((dmin · x.d) · B))` is added into accumulator b mod 4, reduced as
/// Q4_0's.
pub fn dot_k4_q8_ref(row: &[u8], x: &Q8Ref, five: bool) -> f32 {
    let size = if five { 176 } else { 144 };
    let mut acc = [0.0f32; 4];
    for (i, blk) in row.chunks_exact(size).enumerate() {
        let (d, dmin) = k4_d_dmin(blk);
        for j in 0..8 {
            let b = 8 * i + j;
            let q = &x.q[b * 32..(b + 1) * 32];
            let (sc, m) = k4_scale_min(blk, j);
            let dot: i32 = (0..32)
                .map(|l| k4_code(blk, 32 * j + l, five) * q[l] as i32)
                .sum();
            let sum: i32 = q.iter().map(|&v| v as i32).sum();
            let xd = x.d[b];
            acc[b % 4] += (d * xd).mul_add((sc * dot) as f32, -((dmin * xd) * (m * sum) as f32));
        }
    }
    (acc[0] + acc[2]) + (acc[1] + acc[3])
}

pub fn dot_q4_k_q8_ref(row: &[u8], x: &Q8Ref) -> f32 {
    dot_k4_q8_ref(row, x, false)
}

pub fn dot_q5_k_q8_ref(row: &[u8], x: &Q8Ref) -> f32 {
    dot_k4_q8_ref(row, x, true)
}

/// colibri-model's `dot_q4_1_q8`, `dot_q5_0_q8`, `dot_q5_1_q8` and
/// `dot_iq4_nl_q8` (legacy_q8.rs), written out from ggml's layouts: block
/// b gives exact integers; Q4_1/Q5_1 the term `fma(d · x.d, Σ code · q,
/// (m · x.d) · Σ q)` added into accumulator b mod 4, Q5_0 (`code − 16`) and
/// IQ4_NL (the table's values) `S = Σ v · q` fused-added as
/// `fma(d · x.d, S, acc)`; reduced as Q4_0's.
pub fn dot_legacy_q8_ref(fmt: WeightFormat, row: &[u8], x: &Q8Ref) -> f32 {
    let fmt = fmt.storage();
    let size = fmt.row_bytes(32).expect("a block");
    let mut acc = [0.0f32; 4];
    for (b, blk) in row.chunks_exact(size).enumerate() {
        let q = &x.q[b * 32..(b + 1) * 32];
        let xd = x.d[b];
        let dot = |v: &dyn Fn(usize) -> i32| -> i32 { (0..32).map(|e| v(e) * q[e] as i32).sum() };
        let lane = &mut acc[b % 4];
        match fmt {
            WeightFormat::Q4_1 | WeightFormat::Q5_1 => {
                let a = dot(&|e| legacy_code(fmt, blk, e));
                let sum: i32 = q.iter().map(|&v| v as i32).sum();
                let t = (f16_at(blk, 0) * xd).mul_add(a as f32, (f16_at(blk, 2) * xd) * sum as f32);
                *lane += t;
            }
            WeightFormat::Q5_0 => {
                let s = dot(&|e| legacy_code(fmt, blk, e) - 16);
                *lane = (f16_at(blk, 0) * xd).mul_add(s as f32, *lane);
            }
            WeightFormat::Iq4Nl => {
                let s = dot(&|e| iq4_value(blk, 2, e));
                *lane = (f16_at(blk, 0) * xd).mul_add(s as f32, *lane);
            }
            other => panic!("{other:?} is not a legacy format"),
        }
    }
    (acc[0] + acc[2]) + (acc[1] + acc[3])
}

/// colibri-model's `dot_q2_k_q8`, `dot_q3_k_q8` and `dot_iq4_xs_q8`
/// (low_k.rs), written out: block b (part k = b mod 8 of super-block b /
/// 8) gives exact integers. Q2_K: `A = Σ_h sc_h · Σ_h code · q` and `B =
/// Σ_h m_h · Σ_h q` over its halves of 16, the term `fma(d · x.d, A,
/// −((dmin · x.d) · B))` added into accumulator b mod 4; Q3_K (`A = Σ_h
/// sc_h · Σ_h code · q`) and IQ4_XS (`A = ls · Σ v · q`) fused-added as
/// `fma(d · x.d, A, acc)`; reduced as Q4_0's.
pub fn dot_low_k_q8_ref(fmt: WeightFormat, row: &[u8], x: &Q8Ref) -> f32 {
    let fmt = fmt.storage();
    let size = fmt.row_bytes(256).expect("a super-block");
    let mut acc = [0.0f32; 4];
    for (i, blk) in row.chunks_exact(size).enumerate() {
        for k in 0..8 {
            let b = 8 * i + k;
            let q = &x.q[b * 32..(b + 1) * 32];
            let xd = x.d[b];
            // Σ v(e) · q over half h (elements 16h .. 16h + 16 of the block).
            let half = |h: usize, v: &dyn Fn(usize) -> i32| -> i32 {
                (16 * h..16 * h + 16)
                    .map(|l| v(32 * k + l) * q[l] as i32)
                    .sum()
            };
            let lane = &mut acc[b % 4];
            match fmt {
                WeightFormat::Q2K => {
                    let (mut a, mut s) = (0i32, 0i32);
                    for h in 0..2 {
                        let sc = blk[2 * k + h];
                        a += (sc & 15) as i32 * half(h, &|e| two_bit_code(blk, 16, e));
                        s += (sc >> 4) as i32 * half(h, &|_| 1);
                    }
                    let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
                    *lane += (d * xd).mul_add(a as f32, -((dmin * xd) * s as f32));
                }
                WeightFormat::Q3K => {
                    let a: i32 = (0..2)
                        .map(|h| q3_k_scale(blk, 2 * k + h) * half(h, &|e| q3_k_code(blk, e)))
                        .sum();
                    *lane = (f16_at(blk, 108) * xd).mul_add(a as f32, *lane);
                }
                WeightFormat::Iq4Xs => {
                    let v = |e: usize| iq4_value(blk, 8 + 16 * k, e % 32);
                    let a = iq4_xs_scale(blk, k) * (half(0, &v) + half(1, &v));
                    *lane = (f16_at(blk, 0) * xd).mul_add(a as f32, *lane);
                }
                other => panic!("{other:?} is not a low k-quant format"),
            }
        }
    }
    (acc[0] + acc[2]) + (acc[1] + acc[3])
}

/// colibri-model's `dot_q8_0_q8`, written out: block b's eight exact
/// integer sums of four elements times `f16(w.d) · x.d`, each fused-added
/// into lane k of accumulator b mod 2; the two accumulators added lane by
/// lane and the eight lanes reduced in the AVX2 kernel's order (`hsum8`).
pub fn dot_q8_0_q8_ref(row: &[u8], x: &Q8Ref) -> f32 {
    let mut acc = [[0.0f32; 8]; 2];
    for (b, blk) in row.chunks_exact(34).enumerate() {
        let d = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32() * x.d[b];
        let q = &x.q[b * 32..(b + 1) * 32];
        for (k, lane) in acc[b % 2].iter_mut().enumerate() {
            let s: i32 = (4 * k..4 * k + 4)
                .map(|j| blk[2 + j] as i8 as i32 * q[j] as i32)
                .sum();
            *lane = d.mul_add(s as f32, *lane);
        }
    }
    let v: [f32; 8] = std::array::from_fn(|k| acc[0][k] + acc[1][k]);
    ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
}

/// Fails unless `got` is within `tol(i)` of the f64 `want`, element by
/// element (NaN never passes).
pub fn assert_close(what: &str, got: &[f32], want: &[f64], tol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        let t = tol(i);
        assert!(
            err <= t,
            "{what}[{i}]: got {g}, want {w} (error {err:e} > bound {t:e})"
        );
        if t > 0.0 && err / t > worst.0 {
            worst = (err / t, i);
        }
    }
    eprintln!(
        "{what}: {} elements, worst error {:.3} of its bound (at {})",
        got.len(),
        worst.0,
        worst.1
    );
}

/// Fails unless the two are the same bits.
pub fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}[{i}]: {g} ({:#x}) != {w} ({:#x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}
