//! The GPU tier with the CPU tier's default arithmetic for Q4_0: products
//! quantize their input to 8-bit blocks and sum integers (no
//! `--exact-quant`). The exact path is sched/tests/gpu.rs's.
//!
//! With a GPU (`cargo test -p colibri-sched --test gpu_int -- --ignored
//! --test-threads=1`, `COLIBRI_NVRTC_DIR` pointing at libnvrtc.so.13):
//!
//! * a Q4_0 product on the GPU has the bits of the CPU's own
//!   `dot_q4_0_q8` (the dispatched SIMD kernel and the scalar reference),
//!   for one token and for a batch;
//! * on the Q4_0 GGUF fixtures, greedy continuations equal the CPU tier's
//!   and per-position NLL is within [`NLL_REL_TOL`] of it;
//! * logits are bit-identical across VRAM budgets and pass sizes.

use colibri_cuda::{WeightFormat as DevFormat, WeightView};
use colibri_model::kernels::Q8Activation;
use colibri_sched::gpu::DeviceChoice;
use rand::{Rng, SeedableRng};

mod gpu_common;
use gpu_common::*;

/// The CPU reference of this binary runs the default 8-bit activations.
const EXACT_QUANT: bool = false;

fn q4_0_models() -> Vec<std::path::PathBuf> {
    let f = fixtures().join("gguf");
    vec![
        f.join("qwen3_moe.q4_0.gguf"),
        f.join("deepseek_v3.q4_0.gguf"),
    ]
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn q4_0_products_have_the_cpu_kernel_bits() {
    colibri_model::kernels::set_exact_quant(EXACT_QUANT);
    let (dev, k) = colibri_sched::gpu::open_device(0).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x0d4a);
    // 97 rows of 67 blocks (chains of 17 and 16), 6 tokens.
    let (rows, cols, ntok) = (97usize, 2144usize, 6usize);
    let rb = cols / 32 * 18;
    let mut w = Vec::with_capacity(rows * rb);
    for _ in 0..rows * cols / 32 {
        // f16 scales between 2^-9 and 0.047 (exponent fields 6..10).
        let d: u16 = rng.random_range(0x1800..0x2a00);
        w.extend_from_slice(&d.to_le_bytes());
        w.extend((0..16).map(|_| rng.random::<u8>()));
    }
    let x: Vec<f32> = (0..ntok * cols)
        .map(|_| {
            let v: f32 = rng.random_range(0.01..2.0);
            if rng.random() { v } else { -v }
        })
        .collect();
    let cpu = colibri_model::kernels::kernels();
    let want: Vec<u32> = (0..ntok * rows)
        .map(|i| {
            let (t, r) = (i / rows, i % rows);
            let a = Q8Activation::quantize(&x[t * cols..(t + 1) * cols]);
            let row = &w[r * rb..(r + 1) * rb];
            let simd = (cpu.dot_q4_0_q8)(row, &a);
            let scalar = colibri_model::kernels::q4_0::dot_q4_0_q8(row, &a);
            assert_eq!(simd.to_bits(), scalar.to_bits(), "CPU kernels disagree");
            simd.to_bits()
        })
        .collect();
    let wb = dev.upload(&w).unwrap();
    let xb = dev.upload(&x).unwrap();
    let view = WeightView {
        format: DevFormat::Q4_0Q8,
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
        assert_eq!(got, want[..n * rows], "{n} tokens: GPU vs dot_q4_0_q8");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn q4_0_models_match_the_cpu_tier_and_themselves() {
    for model in q4_0_models() {
        let name = model.display().to_string();
        let (prompt, tokens) = reference_tokens(&model);
        let cpu = engine(&model, DeviceChoice::Cpu, None, None, 512);
        let gpu = engine(&model, DeviceChoice::Cuda, None, None, 512);
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
        let mut worst = 0.0f64;
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            let rel = (a - b).abs() / b.abs().max(1e-6);
            assert!(
                rel <= NLL_REL_TOL,
                "{name}: position {i}: GPU NLL {a} vs CPU {b} ({rel:.2e} relative)"
            );
            worst = worst.max(rel);
        }
        for (vram, rows) in [(Some(0), 7), (None, 3)] {
            let e = engine(&model, DeviceChoice::Cuda, vram, None, rows);
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
