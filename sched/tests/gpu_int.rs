//! The GPU tier with the CPU tier's default arithmetic for the quantized
//! formats (Q4_0, Q8_0, the k-quants, llama.cpp's fallbacks and IQ4):
//! products quantize their input to 8-bit blocks and sum integers (no
//! `--exact-quant`). The exact path is sched/tests/gpu.rs's.
//!
//! With a GPU (`cargo test -p colibri-sched --test gpu_int -- --ignored
//! --test-threads=1`, `COLIBRI_NVRTC_DIR` pointing at libnvrtc.so.13):
//!
//! * a product on the GPU has the bits of the CPU's own `dot_*_q8` (the
//!   dispatched SIMD kernel and the scalar reference), for one token and
//!   for a batch, in every quantized format;
//! * on the Q4_0, Q8_0, fallback-quant and low-bit GGUF fixtures, greedy
//!   continuations equal the CPU tier's and per-position NLL is within
//!   [`NLL_REL_TOL`] of it;
//! * logits are bit-identical across VRAM budgets and pass sizes.

use colibri_cuda::{WeightFormat as DevFormat, WeightView};
use colibri_model::kernels::Q8Activation;
use colibri_sched::gpu::DeviceChoice;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod gpu_common;
use gpu_common::*;

/// The CPU reference of this binary runs the default 8-bit activations.
const EXACT_QUANT: bool = false;

/// Per-position NLL tolerance (relative) on the fallback-quant and low-bit
/// fixtures. Their products have the CPU's bits (the tests above), but the
/// GPU's norms and attention round differently, and where that moves an
/// input across an 8-bit rounding boundary the next product moves by half
/// a step. On these tiny random models the 8-bit activations themselves
/// move the CPU's NLL by up to 3.3e-2 (legacy) and 5.5e-2 (low) relative
/// against the exact product (medians 5.5e-3, 2.9e-3); on an H100 the
/// legacy fixture's GPU–CPU difference reached 4.6e-3 at 2 of 47 positions
/// (mean 1.7e-4), the low one's 2.6e-7. 1e-2 stays well inside the
/// quantization's own effect; greedy continuations and the bits across
/// budgets are still checked exactly.
const LOW_NLL_REL_TOL: f64 = 1e-2;

fn q4_0_models() -> Vec<std::path::PathBuf> {
    let f = fixtures().join("gguf");
    vec![
        f.join("qwen3_moe.q4_0.gguf"),
        f.join("deepseek_v3.q4_0.gguf"),
    ]
}

fn q8_0_models() -> Vec<std::path::PathBuf> {
    let f = fixtures().join("gguf");
    vec![f.join("qwen3_moe.q8_0.gguf"), f.join("mixtral.q8_0.gguf")]
}

/// `ntok` random tokens of `cols` inputs, ±[0.01, 2).
fn random_tokens(rng: &mut ChaCha8Rng, ntok: usize, cols: usize) -> Vec<f32> {
    (0..ntok * cols)
        .map(|_| {
            let v: f32 = rng.random_range(0.01..2.0);
            if rng.random() { v } else { -v }
        })
        .collect()
}

/// The `rows × cols` matrix `w` (rows of `rb` bytes) in `format` on the
/// GPU, for all tokens of `x` at once and for the first alone, against
/// `cpu(row, activation)` bit for bit.
fn assert_cpu_bits(
    format: DevFormat,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    cpu: impl Fn(&[u8], &Q8Activation) -> f32,
) {
    let (dev, k) = colibri_sched::gpu::open_device(0).unwrap();
    let rb = format.row_bytes(cols).unwrap();
    let ntok = x.len() / cols;
    let want: Vec<u32> = (0..ntok * rows)
        .map(|i| {
            let (t, r) = (i / rows, i % rows);
            let a = Q8Activation::quantize(&x[t * cols..(t + 1) * cols]);
            cpu(&w[r * rb..(r + 1) * rb], &a).to_bits()
        })
        .collect();
    let wb = dev.upload(w).unwrap();
    let xb = dev.upload(x).unwrap();
    let view = WeightView {
        format,
        rows,
        cols,
        data: wb.as_view(),
        fp8: None,
    };
    for n in [ntok, 1] {
        let mut y = dev.alloc::<f32>(n * rows).unwrap();
        k.matvec(&dev, &view, xb.as_view(), n, y.as_mut()).unwrap();
        let got: Vec<u32> = dev
            .download(y.as_view())
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got, want[..n * rows], "{format:?}, {n} tokens: GPU vs CPU");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn q4_0_products_have_the_cpu_kernel_bits() {
    colibri_model::kernels::set_exact_quant(EXACT_QUANT);
    let mut rng = ChaCha8Rng::seed_from_u64(0x0d4a);
    // 97 rows of 67 blocks (chains of 17 and 16), 6 tokens.
    let (rows, cols, ntok) = (97usize, 2144usize, 6usize);
    let mut w = Vec::with_capacity(rows * cols / 32 * 18);
    for _ in 0..rows * cols / 32 {
        // f16 scales between 2^-9 and 0.047 (exponent fields 6..10).
        let d: u16 = rng.random_range(0x1800..0x2a00);
        w.extend_from_slice(&d.to_le_bytes());
        w.extend((0..16).map(|_| rng.random::<u8>()));
    }
    let x = random_tokens(&mut rng, ntok, cols);
    let cpu = colibri_model::kernels::kernels();
    assert_cpu_bits(DevFormat::Q4_0Q8, &w, rows, cols, &x, |row, a| {
        let simd = (cpu.dot_q4_0_q8)(row, a);
        let scalar = colibri_model::kernels::q4_0::dot_q4_0_q8(row, a);
        assert_eq!(simd.to_bits(), scalar.to_bits(), "CPU kernels disagree");
        simd
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn q8_0_products_have_the_cpu_kernel_bits() {
    colibri_model::kernels::set_exact_quant(EXACT_QUANT);
    let mut rng = ChaCha8Rng::seed_from_u64(0x0d80);
    // 97 rows of 67 blocks (chains of 34 and 33 blocks; two tiles for
    // one token), 6 tokens; every weight byte, -128 included.
    let (rows, cols, ntok) = (97usize, 2144usize, 6usize);
    let mut w = Vec::with_capacity(rows * cols / 32 * 34);
    for _ in 0..rows * cols / 32 {
        let d: u16 = rng.random_range(0x1800..0x2a00);
        w.extend_from_slice(&d.to_le_bytes());
        w.extend((0..32).map(|_| rng.random::<u8>()));
    }
    let x = random_tokens(&mut rng, ntok, cols);
    let cpu = colibri_model::kernels::kernels();
    assert_cpu_bits(DevFormat::Q8_0Q8, &w, rows, cols, &x, |row, a| {
        let simd = (cpu.dot_q8_0_q8)(row, a);
        let scalar = colibri_model::kernels::q8act::dot_q8_0_q8(row, a);
        let mut multi = [0.0f32];
        (cpu.dot_q8_0_q8_multi)(row, &[a], &mut multi);
        assert_eq!(simd.to_bits(), scalar.to_bits(), "CPU kernels disagree");
        assert_eq!(multi[0].to_bits(), scalar.to_bits(), "CPU multi kernel");
        simd
    });
}

/// Random super-blocks (or blocks of 32) of `format`'s storage: every code,
/// scale, min and high-bit byte random, the f16 scales (Q2_K's dmin too,
/// Q4_1/Q5_1's min) of either sign between 2^-13 and 2^-7 (exponent fields
/// 2..8).
fn random_rows(rng: &mut ChaCha8Rng, format: DevFormat, rows: usize, cols: usize) -> Vec<u8> {
    let (block, f16s): (usize, &[usize]) = match format {
        DevFormat::Q4_1Q8 | DevFormat::Q5_1Q8 => (32, &[0, 2]),
        DevFormat::Q5_0Q8 | DevFormat::Iq4NlQ8 => (32, &[0]),
        DevFormat::Q2KQ8 => (256, &[80, 82]),
        DevFormat::Q3KQ8 => (256, &[108]),
        DevFormat::Iq4XsQ8 => (256, &[0]),
        other => panic!("{other:?}: not one of the seven"),
    };
    let size = format.row_bytes(block).unwrap();
    let mut w = Vec::with_capacity(rows * cols / block * size);
    for _ in 0..rows * cols / block {
        let mut blk: Vec<u8> = (0..size).map(|_| rng.random()).collect();
        for &at in f16s {
            let sign: u16 = if rng.random() { 0x8000 } else { 0 };
            let v: u16 = rng.random_range(0x0800..0x2000) | sign;
            blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        w.extend_from_slice(&blk);
    }
    w
}

/// Q4_1, Q5_0, Q5_1, IQ4_NL (legacy_q8.rs) and Q2_K, Q3_K, IQ4_XS
/// (low_k.rs) products on the GPU have the bits of the CPU's dispatched
/// kernel and of its scalar reference, for 97 rows of 2304 columns (72
/// blocks: chains of 18, two tiles for one token), 6 tokens and one.
#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn legacy_and_low_bit_products_have_the_cpu_kernel_bits() {
    use colibri_model::format::WeightFormat as F;
    use colibri_model::kernels::{legacy_q8, low_k};
    colibri_model::kernels::set_exact_quant(EXACT_QUANT);
    type CpuDot = fn(&[u8], &Q8Activation) -> f32;
    let cases: [(DevFormat, F, CpuDot, u64); 7] = [
        (DevFormat::Q4_1Q8, F::Q4_1, legacy_q8::dot_q4_1_q8, 0x0e41),
        (DevFormat::Q5_0Q8, F::Q5_0, legacy_q8::dot_q5_0_q8, 0x0e50),
        (DevFormat::Q5_1Q8, F::Q5_1, legacy_q8::dot_q5_1_q8, 0x0e51),
        (
            DevFormat::Iq4NlQ8,
            F::Iq4Nl,
            legacy_q8::dot_iq4_nl_q8,
            0x0e4e,
        ),
        (DevFormat::Q2KQ8, F::Q2K, low_k::dot_q2_k_q8, 0x0e2c),
        (DevFormat::Q3KQ8, F::Q3K, low_k::dot_q3_k_q8, 0x0e3c),
        (DevFormat::Iq4XsQ8, F::Iq4Xs, low_k::dot_iq4_xs_q8, 0x0e4c),
    ];
    let cpu = colibri_model::kernels::kernels();
    for (format, cpu_format, scalar, seed) in cases {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (rows, cols, ntok) = (97usize, 2304usize, 6usize);
        let w = random_rows(&mut rng, format, rows, cols);
        let x = random_tokens(&mut rng, ntok, cols);
        assert_cpu_bits(format, &w, rows, cols, &x, |row, a| {
            let simd = (cpu.dot_more_q8)(cpu_format, row, a);
            assert_eq!(
                simd.to_bits(),
                scalar(row, a).to_bits(),
                "{format:?}: CPU kernels disagree"
            );
            simd
        });
    }
}

/// Greedy continuations, NLL against the CPU tier, and bit-identity across
/// VRAM budgets and pass sizes, on each of `models` (with its reference
/// prompt and text).
fn models_match_the_cpu_tier_and_themselves(models: Vec<std::path::PathBuf>) {
    models_match_within(models, NLL_REL_TOL);
}

/// As [`models_match_the_cpu_tier_and_themselves`], with per-position NLL
/// within `tol` (relative) of the CPU tier's.
fn models_match_within(models: Vec<std::path::PathBuf>, tol: f64) {
    for model in models {
        let (prompt, tokens) = reference_tokens(&model);
        model_matches_the_cpu_tier_and_itself(&model, &prompt, &tokens, tol);
    }
}

fn model_matches_the_cpu_tier_and_itself(
    model: &std::path::Path,
    prompt: &[u32],
    tokens: &[u32],
    tol: f64,
) {
    {
        let name = model.display().to_string();
        let (prompt, tokens) = (prompt.to_vec(), tokens.to_vec());
        let cpu = engine(model, DeviceChoice::Cpu, None, None, 512);
        let gpu = engine(model, DeviceChoice::Cuda, None, None, 512);
        assert_eq!(
            colibri_model::kernels::kernels().int_activations,
            !EXACT_QUANT
        );
        let vocab = cpu.model.spec.vocab_size;
        let want = greedy(&cpu, &prompt, 24);
        assert_eq!(
            greedy(&gpu, &prompt, 24),
            want,
            "{name}: greedy continuation"
        );
        let c = nll(&teacher_forced(&cpu, &tokens, 64), &tokens, vocab);
        let full = teacher_forced(&gpu, &tokens, 16);
        let g = nll(&full, &tokens, vocab);
        let rel: Vec<f64> = g
            .iter()
            .zip(&c)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-6))
            .collect();
        let worst = rel.iter().copied().fold(0.0f64, f64::max);
        let mean = rel.iter().sum::<f64>() / rel.len().max(1) as f64;
        let over = rel.iter().filter(|&&r| r > NLL_REL_TOL).count();
        eprintln!(
            "{name}: NLL relative difference over {} positions: max {worst:.2e}, mean {mean:.2e}, \
             {over} above {NLL_REL_TOL:.0e}",
            rel.len()
        );
        for (i, (&r, (a, b))) in rel.iter().zip(g.iter().zip(&c)).enumerate() {
            assert!(
                r <= tol,
                "{name}: position {i}: GPU NLL {a} vs CPU {b} ({r:.2e} relative)"
            );
        }
        for (vram, rows) in [(Some(0), 7), (None, 3)] {
            let e = engine(model, DeviceChoice::Cuda, vram, None, rows);
            assert!(
                bits(&teacher_forced(&e, &tokens, 16)) == bits(&full),
                "{name}: logits differ at --vram-budget {vram:?}, {rows} rows per pass"
            );
        }
        eprintln!(
            "{name}: greedy equal ({} tokens), NLL max relative difference {worst:.2e}, \
             bit-identical across budgets",
            want.len()
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn q4_0_models_match_the_cpu_tier_and_themselves() {
    models_match_the_cpu_tier_and_themselves(q4_0_models());
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn q8_0_models_match_the_cpu_tier_and_themselves() {
    models_match_the_cpu_tier_and_themselves(q8_0_models());
}

/// llama.cpp's fallback quants (experts in Q4_1/Q5_1/Q5_0, attention in
/// Q5_0/Q4_1) and its small files' (Q2_K/Q3_K/IQ4_XS/IQ4_NL).
#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn legacy_and_low_bit_models_match_the_cpu_tier_and_themselves() {
    let f = fixtures().join("gguf");
    models_match_within(
        vec![
            f.join("qwen3_moe.legacy.gguf"),
            f.join("qwen3_moe.low.gguf"),
        ],
        LOW_NLL_REL_TOL,
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn q6_k_products_have_the_cpu_kernel_bits() {
    colibri_model::kernels::set_exact_quant(EXACT_QUANT);
    let mut rng = ChaCha8Rng::seed_from_u64(0x0d6c);
    // 97 rows of 9 super-blocks (72 blocks: chains of 18, two tiles for one
    // token), 6 tokens; every code and scale byte.
    let (rows, cols, ntok) = (97usize, 2304usize, 6usize);
    let mut w = Vec::with_capacity(rows * cols / 256 * 210);
    for _ in 0..rows * cols / 256 {
        w.extend((0..208).map(|_| rng.random::<u8>()));
        // f16 d between 2^-13 and 2^-9 (exponent fields 2..6).
        let d: u16 = rng.random_range(0x0800..0x1800);
        w.extend_from_slice(&d.to_le_bytes());
    }
    let x = random_tokens(&mut rng, ntok, cols);
    let cpu = colibri_model::kernels::kernels();
    assert_cpu_bits(DevFormat::Q6KQ8, &w, rows, cols, &x, |row, a| {
        let simd = (cpu.dot_q6_k_q8)(row, a);
        let scalar = colibri_model::kernels::q6_k::dot_q6_k_q8(row, a);
        assert_eq!(simd.to_bits(), scalar.to_bits(), "CPU kernels disagree");
        simd
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn q4_k_and_q5_k_products_have_the_cpu_kernel_bits() {
    use colibri_model::kernels::q4_k;
    colibri_model::kernels::set_exact_quant(EXACT_QUANT);
    for (format, seed) in [(DevFormat::Q4KQ8, 0x0d4b), (DevFormat::Q5KQ8, 0x0d5b)] {
        let five = format == DevFormat::Q5KQ8;
        let size = format.row_bytes(256).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // 97 rows of 9 super-blocks (72 blocks: chains of 18, two tiles for
        // one token), 6 tokens; every code, scale, min and fifth-bit byte.
        let (rows, cols, ntok) = (97usize, 2304usize, 6usize);
        let mut w = Vec::with_capacity(rows * cols / 256 * size);
        for _ in 0..rows * cols / 256 {
            // f16 d and dmin of either sign between 2^-13 and 2^-9
            // (exponent fields 2..6).
            for _ in 0..2 {
                let sign: u16 = if rng.random() { 0x8000 } else { 0 };
                let v: u16 = rng.random_range(0x0800..0x1800) | sign;
                w.extend_from_slice(&v.to_le_bytes());
            }
            w.extend((4..size).map(|_| rng.random::<u8>()));
        }
        let x = random_tokens(&mut rng, ntok, cols);
        let cpu = colibri_model::kernels::kernels();
        assert_cpu_bits(format, &w, rows, cols, &x, |row, a| {
            let (simd, scalar) = if five {
                ((cpu.dot_q5_k_q8)(row, a), q4_k::dot_q5_k_q8(row, a))
            } else {
                ((cpu.dot_q4_k_q8)(row, a), q4_k::dot_q4_k_q8(row, a))
            };
            assert_eq!(
                simd.to_bits(),
                scalar.to_bits(),
                "{format:?}: CPU kernels disagree"
            );
            simd
        });
    }
}

/// A 2-layer Qwen3-MoE geometry for synthetic GGUF files: hidden 256 (a
/// k-quant super-block), 8 experts of width `moe_intermediate`, top 2.
fn small_qwen3_moe(moe_intermediate: usize) -> serde_json::Value {
    let mut config = colibri_model::synth::config(Some("qwen3-30b-a3b"), None, Some(2)).unwrap();
    for (k, v) in [
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("moe_intermediate_size", moe_intermediate),
        ("num_experts", 8),
        ("num_experts_per_tok", 2),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("head_dim", 64),
        ("vocab_size", 1024),
    ] {
        config[k] = serde_json::json!(v);
    }
    config
}

/// A synthetic Qwen3-MoE GGUF laid out as llama.cpp's Q4_0 files are (the
/// output head in Q6_K): the GPU tier equals the CPU tier on it.
#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn a_q6_k_head_matches_the_cpu_tier() {
    use colibri_model::convert::{Silent, cast::Quant};
    use colibri_model::synth::{self, SynthFormat, SynthSource};
    colibri_model::kernels::set_exact_quant(EXACT_QUANT);
    let config = small_qwen3_moe(64);
    let src = SynthSource::new(config, 7)
        .unwrap()
        .with_head(colibri_model::format::WeightFormat::Q6K);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q6k_head.gguf");
    synth::write(&src, Quant::Q4_0, SynthFormat::Gguf, &path, &Silent).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(0x6b);
    let tokens: Vec<u32> = (0..40).map(|_| rng.random_range(0..1024)).collect();
    model_matches_the_cpu_tier_and_itself(&path, &tokens[..6], &tokens, NLL_REL_TOL);
}

/// A synthetic Qwen3-MoE GGUF laid out as llama.cpp's Q4_K_M and Q5_K files
/// mostly are (experts in Q4_K or Q5_K, the output head in Q6_K): the GPU
/// tier equals the CPU tier on it.
#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn k_quant_experts_match_the_cpu_tier() {
    use colibri_model::convert::{Silent, cast::Quant};
    use colibri_model::format::WeightFormat;
    use colibri_model::synth::{self, SynthFormat, SynthSource};
    colibri_model::kernels::set_exact_quant(EXACT_QUANT);
    let config = small_qwen3_moe(256);
    let dir = tempfile::tempdir().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(0x4b);
    let tokens: Vec<u32> = (0..40).map(|_| rng.random_range(0..1024)).collect();
    // Q4_K_M: layer 1's down projections in Q6_K.
    for (name, format) in [
        ("q4_k", Some(WeightFormat::Q4K)),
        ("q5_k", Some(WeightFormat::Q5K)),
        ("q4_k_m", None),
    ] {
        let src = SynthSource::new(config.clone(), 11).unwrap();
        let src = match format {
            Some(f) => src.with_experts(f),
            None => src.with_q4_k_m_experts(),
        }
        .with_head(WeightFormat::Q6K);
        let path = dir.path().join(format!("{name}.gguf"));
        synth::write(&src, Quant::Q4_0, SynthFormat::Gguf, &path, &Silent).unwrap();
        model_matches_the_cpu_tier_and_itself(&path, &tokens[..6], &tokens, NLL_REL_TOL);
    }
}
