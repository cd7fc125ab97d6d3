//! The GPU tier against the CPU tier and against itself.
//!
//! Without a GPU (CI): `--device auto` quietly runs on the CPU tier and
//! says why (with one device or several), `--device cuda` fails with a
//! clear message.
//!
//! With one (`cargo test -p colibri-sched --test gpu -- --ignored
//! --test-threads=1`, `COLIBRI_NVRTC_DIR` pointing at libnvrtc.so.13): on
//! every model fixture and on GGUF files in Q4_0/Q8_0/BF16, in llama.cpp's
//! fallbacks Q4_1/Q5_0/Q5_1 and in its small files' Q2_K/Q3_K/IQ4, greedy
//! continuations equal the CPU tier's (run with `--exact-quant`: the GPU
//! dequantizes Q8_0/Q4_0 exactly) and per-position NLL is within
//! [`NLL_REL_TOL`] of it; logits are bit-identical across VRAM budgets
//! (nothing resident, partial, everything), RAM budgets, pass sizes and
//! batch compositions; the layers split over two devices (`--devices`;
//! device 0 twice on a one-GPU host) give the same bits as one device.

use colibri_cuda::{CudaDevice, CudaError};
use colibri_model::{KvCache, Logits, SeqInput};
use colibri_sched::gpu::{Attached, DeviceChoice, GpuOptions, attach};
use colibri_sched::{Engine, EngineOptions};

mod gpu_common;
use gpu_common::*;

/// The CPU reference of this binary runs `--exact-quant`: the GPU's exact
/// dequantized products (sched/tests/gpu_int.rs checks the default
/// 8-bit-activation products).
const EXACT_QUANT: bool = true;

#[test]
fn device_choice_parses() {
    assert_eq!("auto".parse::<DeviceChoice>(), Ok(DeviceChoice::Auto));
    assert_eq!("cpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Cpu));
    assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda));
    assert!("tpu".parse::<DeviceChoice>().is_err());
}

#[test]
fn auto_without_a_gpu_runs_on_the_cpu_tier_and_says_why() {
    if !no_gpu() {
        eprintln!("a GPU is present: nothing to check here");
        return;
    }
    colibri_model::kernels::set_exact_quant(true);
    let model = fixtures().join("models/qwen3_moe");
    let mut e = Engine::load(
        &model,
        &EngineOptions {
            threads: 2,
            ctx: 256,
            tier: tier(None),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    match attach(&mut e, &GpuOptions::default()).unwrap() {
        Attached::Cpu { reason: Some(why) } => {
            assert!(why.contains("CUDA unavailable"), "{why}")
        }
        _ => panic!("expected the CPU tier with a reason"),
    }
    assert!(e.gpu.is_none());
    let (prompt, _) = reference_tokens(&model);
    let mut cache = KvCache::new(&e.model.spec, 64);
    let out = e
        .forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: &prompt,
            logits: Logits::Last,
        }])
        .unwrap();
    assert_eq!(out[0].len(), e.model.spec.vocab_size);
    // `--device cpu` attaches nothing and gives no reason.
    assert!(matches!(
        attach(
            &mut e,
            &GpuOptions {
                device: DeviceChoice::Cpu,
                ..GpuOptions::default()
            }
        )
        .unwrap(),
        Attached::Cpu { reason: None }
    ));
}

#[test]
fn cuda_without_a_gpu_fails_with_the_reason() {
    if !no_gpu() {
        eprintln!("a GPU is present: nothing to check here");
        return;
    }
    let model = fixtures().join("models/olmoe");
    let mut e = Engine::load(
        &model,
        &EngineOptions {
            threads: 1,
            ctx: 64,
            tier: tier(None),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let err = match attach(
        &mut e,
        &GpuOptions {
            device: DeviceChoice::Cuda,
            ..GpuOptions::default()
        },
    ) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("--device cuda must fail without a GPU"),
    };
    assert!(err.contains("CUDA unavailable"), "{err}");
    assert!(matches!(
        CudaDevice::open(0),
        Err(CudaError::Unavailable { .. })
    ));
}

#[test]
fn several_devices_without_a_gpu_run_on_the_cpu_tier_or_fail() {
    if !no_gpu() {
        eprintln!("a GPU is present: nothing to check here");
        return;
    }
    let model = fixtures().join("models/olmoe");
    let mut e = Engine::load(
        &model,
        &EngineOptions {
            threads: 1,
            ctx: 64,
            tier: tier(None),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let two = |device| GpuOptions {
        device,
        devices: vec![0, 1],
        ..GpuOptions::default()
    };
    match attach(&mut e, &two(DeviceChoice::Auto)).unwrap() {
        Attached::Cpu { reason: Some(why) } => assert!(why.contains("CUDA unavailable"), "{why}"),
        _ => panic!("expected the CPU tier with a reason"),
    }
    let err = match attach(&mut e, &two(DeviceChoice::Cuda)) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("--device cuda must fail without a GPU"),
    };
    assert!(err.contains("CUDA unavailable"), "{err}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn gpu_matches_the_cpu_tier_on_every_fixture() {
    let mut worst = 0.0f64;
    for model in models() {
        let name = model.display().to_string();
        let (prompt, tokens) = reference_tokens(&model);
        let cpu = engine(&model, DeviceChoice::Cpu, None, None, 512);
        let gpu = engine(&model, DeviceChoice::Cuda, None, None, 512);
        let vocab = cpu.model.spec.vocab_size;
        let want = greedy(&cpu, &prompt, 24);
        let got = greedy(&gpu, &prompt, 24);
        assert_eq!(got, want, "{name}: greedy continuation");
        let c = nll(&teacher_forced(&cpu, &tokens, 64), &tokens, vocab);
        let g = nll(&teacher_forced(&gpu, &tokens, 64), &tokens, vocab);
        assert_eq!(c.len(), g.len());
        let mut model_worst = 0.0f64;
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            let rel = (a - b).abs() / b.abs().max(1e-6);
            assert!(
                rel <= NLL_REL_TOL,
                "{name}: position {i}: GPU NLL {a} vs CPU {b} ({rel:.2e} relative)"
            );
            model_worst = model_worst.max(rel);
        }
        worst = worst.max(model_worst);
        eprintln!(
            "{name}: greedy equal ({} tokens), NLL max relative difference {model_worst:.2e}",
            want.len()
        );
    }
    eprintln!("all fixtures: worst NLL relative difference {worst:.2e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn gpu_is_bit_identical_across_vram_and_ram_budgets() {
    for model in models() {
        let name = model.display().to_string();
        let (prompt, tokens) = reference_tokens(&model);
        // The full placement, to size the partial budgets from.
        let full = engine(&model, DeviceChoice::Cuda, None, None, 512);
        let plan = full.gpu.as_ref().unwrap().plan().clone();
        let dense: u64 = plan.dense_resident_bytes + plan.dense_streamed_bytes;
        let slot = plan.classes.first().map_or(0, |c| c.slot_bytes);
        let budgets: Vec<(Option<u64>, Option<u64>, usize)> = vec![
            (None, None, 512),
            (Some(0), None, 512),
            (Some(0), Some(0), 7),
            (Some(dense / 2), None, 512),
            (Some(dense + 3 * slot), Some(0), 512),
            (Some(dense + plan.kv_vram_bytes + 3 * slot), None, 3),
        ];
        let run = |e: &Engine| -> (Vec<u32>, Vec<u32>) {
            let tf = teacher_forced(e, &tokens, 16);
            let continuation = greedy(e, &prompt, 16);
            (bits(&tf), continuation)
        };
        let want = run(&full);
        let s = full.gpu.as_ref().unwrap().stats();
        // Everything fits: every expert is preloaded, decode steps route on
        // the device and run as graphs; the budgets below route on the host.
        assert!(
            s.device_routed_layers > 0 && s.graphs_captured > 0 && s.graph_launches > 0,
            "{name}: the all-in-VRAM run did not take the device-routed, captured path ({s:?})"
        );
        assert!(
            s.cache.hits > 0 || s.device_routed_layers > 0,
            "{name}: the all-in-VRAM run never used a VRAM expert"
        );
        for (vram, ram, rows) in budgets {
            let e = engine(&model, DeviceChoice::Cuda, vram, ram, rows);
            let got = run(&e);
            let s = e.gpu.as_ref().unwrap().stats();
            assert!(
                got.0 == want.0,
                "{name}: logits differ at --vram-budget {vram:?} --ram-budget {ram:?}, {rows} \
                 rows per pass ({s:?})"
            );
            assert_eq!(got.1, want.1, "{name}: greedy differs at {vram:?}/{ram:?}");
            if vram == Some(0) {
                assert_eq!(s.cache.hits, 0, "{name}: nothing may be cached at budget 0");
                assert!(s.experts_copied > 0);
                assert!(s.dense_h2d_bytes > 0, "{name}: dense blocks must stream");
                assert_eq!(s.kv_vram_bytes, 0);
            }
            eprintln!("{name}: identical at --vram-budget {vram:?} --ram-budget {ram:?} ({s:?})");
        }
    }
}

/// A KV cache that grows past half of its VRAM grant (a doubling holds the
/// old and the grown cache at once) still ends in VRAM, not in mapped RAM
/// read over the bus at every step, and its positions keep every bit: the
/// logits equal those of an engine whose grant never made the cache move
/// through RAM. (The fixture with a context of 4,096 positions instead of
/// 256: same weights.)
#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn a_kv_cache_grown_past_half_its_grant_stays_in_vram() {
    let src = fixtures().join("models").join("qwen3_moe");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = serde_json::json!(4096);
    std::fs::write(&cfg_path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    let (_, reference) = reference_tokens(&src);
    let tokens: Vec<u32> = (0..1000).map(|i| reference[i % reference.len()]).collect();
    // Prefill in passes of 100 rows to position 960, then 40 decode steps
    // (split attention over four chunks, captured graphs). The cache grows
    // 256 → 512 → 1,000 positions.
    let run = |ctx: usize| {
        let opts = GpuOptions {
            device: DeviceChoice::Cuda,
            ..GpuOptions::default()
        };
        let e = engine_ctx(dir.path(), &opts, None, ctx);
        let mut cache = KvCache::new(&e.model.spec, tokens.len());
        let (prefill, decode) = tokens.split_at(960);
        let logits = forward_pieces(&e, &mut cache, prefill.chunks(100).chain(decode.chunks(1)));
        // While the cache lives: where it is.
        let s = e.gpu.as_ref().unwrap().stats();
        (bits(&logits), s)
    };
    let (want, roomy) = run(4096);
    assert_eq!(roomy.kv_host_bytes, 0, "{roomy:?}");
    let plan_kv = |ctx: usize| {
        let opts = GpuOptions {
            device: DeviceChoice::Cuda,
            ..GpuOptions::default()
        };
        engine_ctx(dir.path(), &opts, None, ctx)
            .gpu
            .as_ref()
            .unwrap()
            .plan()
            .kv_vram_bytes
    };
    // A grant of 1,024 positions: the step from 512 to 1,000 positions
    // holds 1,512 at once.
    let tight = 1024;
    assert!(plan_kv(tight) < roomy.kv_vram_bytes / 1000 * 1512);
    let (got, s) = run(tight);
    assert!(got == want, "logits differ after the cache moved ({s:?})");
    assert_eq!(
        s.kv_host_bytes, 0,
        "the grown cache landed in mapped RAM: {s:?}"
    );
    assert_eq!(s.kv_vram_bytes, roomy.kv_vram_bytes, "{s:?}");
}

/// A fixture's all-in-VRAM run (teacher-forced logits' bits and greedy
/// tokens) and the VRAM budgets that hold its dense weights and KV cache
/// plus a few expert slots.
struct SlotBudgets {
    name: String,
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    want: (Vec<u32>, Vec<u32>),
    /// Dense weights and KV cache.
    small: u64,
    /// One expert slot (the first size class).
    slot: u64,
}

impl SlotBudgets {
    fn of(model: &std::path::Path) -> SlotBudgets {
        let (prompt, tokens) = reference_tokens(model);
        let full = engine(model, DeviceChoice::Cuda, None, None, 512);
        let plan = full.gpu.as_ref().unwrap().plan().clone();
        let mut b = SlotBudgets {
            name: model.display().to_string(),
            prompt,
            tokens,
            want: (Vec::new(), Vec::new()),
            small: plan.dense_resident_bytes + plan.dense_streamed_bytes + plan.kv_vram_bytes,
            slot: plan.classes.first().map_or(0, |c| c.slot_bytes),
        };
        b.want = b.run(&full);
        b
    }

    fn budget(&self, slots: u64) -> u64 {
        self.small + slots * self.slot
    }

    fn run(&self, e: &Engine) -> (Vec<u32>, Vec<u32>) {
        let tf = teacher_forced(e, &self.tokens, 4);
        (bits(&tf), greedy(e, &self.prompt, 16))
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn copying_experts_ahead_changes_no_bit() {
    let mut exercised = 0;
    for model in models() {
        // Dense weights and KV cache in VRAM, a few expert slots: layers
        // route on the host, and the cache churns.
        let b = SlotBudgets::of(&model);
        let (name, want) = (&b.name, &b.want);
        let run = |e: &Engine| b.run(e);
        for (slots, ahead, rows) in [(0, 8, 4), (4, 1, 4), (4, 8, 1), (12, 8, 4), (12, 0, 4)] {
            let opts = GpuOptions {
                device: DeviceChoice::Cuda,
                vram_budget: Some(b.budget(slots)),
                max_rows: rows,
                ahead,
                ..GpuOptions::default()
            };
            let e = engine_with(&model, &opts, None);
            let got = run(&e);
            let s = e.gpu.as_ref().unwrap().stats();
            assert!(
                got.0 == want.0,
                "{name}: logits differ with {slots} slots, {ahead} ahead, {rows} rows ({s:?})"
            );
            assert_eq!(
                got.1, want.1,
                "{name}: greedy differs ({slots} slots, {ahead} ahead)"
            );
            assert!(s.ahead_used <= s.ahead_copied, "{name}: {s:?}");
            if ahead == 0 || slots == 0 {
                assert_eq!(
                    s.ahead_copied, 0,
                    "{name}: copied ahead with {ahead} / {slots}"
                );
            }
            if s.ahead_used > 0 {
                exercised += 1;
            }
            eprintln!(
                "{name}: identical with {slots} slots, {ahead} ahead, {rows} rows: {} copied \
                 ahead, {} used",
                s.ahead_copied, s.ahead_used
            );
        }
    }
    assert!(exercised > 0, "no run used an expert copied ahead");
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn reading_experts_in_place_changes_no_bit() {
    let (mut promoted, mut switched) = (0, 0);
    for model in models() {
        let b = SlotBudgets::of(&model);
        let (name, want) = (&b.name, &b.want);
        let run = |e: &Engine| b.run(e);
        // Few or no VRAM slots, RAM holding every expert: decode layers
        // route on the device and read the experts without a slot from
        // pinned RAM; with 512 rows a pass the prompt routes on the host.
        for (slots, rows, in_place) in [(0, 4, true), (3, 4, true), (12, 512, true), (3, 4, false)]
        {
            let opts = GpuOptions {
                device: DeviceChoice::Cuda,
                vram_budget: Some(b.budget(slots)),
                max_rows: rows,
                in_place,
                ..GpuOptions::default()
            };
            let e = engine_with(&model, &opts, None);
            let got = run(&e);
            let s = e.gpu.as_ref().unwrap().stats();
            // A budget that caches every expert has nothing to read in
            // place; FP8 scales are unpacked into ordinary memory, which
            // the device cannot read, so FP8 experts always route on the
            // host.
            let cached = e.gpu.as_ref().unwrap().plan().every_expert_cached();
            let fp8 = name.contains("fp8");
            assert!(
                got.0 == want.0,
                "{name}: logits differ with {slots} slots, {rows} rows, in place {in_place} \
                 ({s:?})"
            );
            assert_eq!(
                got.1, want.1,
                "{name}: greedy differs ({slots} slots, {rows} rows, in place {in_place})"
            );
            if in_place && !cached && !fp8 {
                assert!(
                    s.in_place_passes > 0 && s.in_place_reads > 0 && s.in_place_bytes > 0,
                    "{name}: nothing was read in place with {slots} slots ({s:?})"
                );
                if std::env::var_os("COLIBRI_GPU_NO_GRAPH").is_none() {
                    assert!(s.graph_launches > 0, "{name}: no graph replayed ({s:?})");
                }
                if slots > 0 && s.promotions > 0 {
                    promoted += 1;
                }
                // The route picker measured both routes (an epoch each).
                switched += s.route_switches;
            } else if !in_place {
                assert_eq!(s.in_place_passes, 0, "{name}: read in place when off");
            }
            eprintln!(
                "{name}: identical with {slots} slots, {rows} rows, in place {in_place}: {} \
                 passes, {} switches, {} experts read in place, {} promoted, {} hits / {} misses",
                s.in_place_passes,
                s.route_switches,
                s.in_place_reads,
                s.promotions,
                s.cache.hits,
                s.cache.misses
            );
        }
    }
    assert!(promoted > 0, "no run promoted an expert read in place");
    assert!(
        switched > 0,
        "no run switched between reading in place and host routing"
    );
}

/// A GGUF whose experts all sit alike in their RAM slots (stacked tensors
/// of whole 4 KiB experts, as in the released models): a VRAM slot mirrors
/// the RAM slot, so every copied expert is one host-to-device copy, gaps
/// included, and the bits are those of every expert in VRAM; the greedy
/// continuation is the CPU tier's.
#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn a_gguf_expert_is_copied_in_one_piece_with_the_same_bits() {
    use colibri_model::convert::Silent;
    use colibri_model::convert::cast::Quant;
    use colibri_model::synth::{self, SynthFormat, SynthSource};
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("small.gguf");
    let src = SynthSource::new(synth::small_qwen3_moe(), 11).unwrap();
    synth::write(&src, Quant::Q4_0, SynthFormat::Gguf, &model, &Silent).unwrap();
    let tokens: Vec<u32> = (0..24u32).map(|i| (i * 37 + 11) % 512).collect();
    let prompt = &tokens[..6];
    let run = |e: &Engine| (bits(&teacher_forced(e, &tokens, 4)), greedy(e, prompt, 12));
    let full = engine(&model, DeviceChoice::Cuda, None, None, 512);
    let want = run(&full);
    let cpu = engine(&model, DeviceChoice::Cpu, None, None, 512);
    assert_eq!(want.1, greedy(&cpu, prompt, 12), "greedy: GPU against CPU");
    let plan = full.gpu.as_ref().unwrap().plan().clone();
    let small = plan.dense_resident_bytes + plan.dense_streamed_bytes + plan.kv_vram_bytes;
    let slot = plan.classes.first().map_or(0, |c| c.slot_bytes);
    for slots in [0, 3] {
        let opts = GpuOptions {
            device: DeviceChoice::Cuda,
            vram_budget: Some(small + slots * slot),
            max_rows: 4,
            in_place: false,
            ..GpuOptions::default()
        };
        let e = engine_with(&model, &opts, None);
        let got = run(&e);
        let s = e.gpu.as_ref().unwrap().stats();
        assert!(got.0 == want.0, "logits differ with {slots} slots ({s:?})");
        assert_eq!(got.1, want.1, "greedy differs with {slots} slots");
        assert!(
            s.experts_copied > 0,
            "{slots} slots: nothing copied ({s:?})"
        );
        assert_eq!(
            s.expert_h2d_copies,
            s.experts_copied + s.ahead_copied,
            "{slots} slots: not one copy per expert ({s:?})"
        );
        eprintln!(
            "{slots} slots: identical; {} experts copied in {} copies",
            s.experts_copied + s.ahead_copied,
            s.expert_h2d_copies
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn gpu_is_bit_identical_across_batch_compositions() {
    for model in models() {
        let name = model.display().to_string();
        let (_, toks) = reference_tokens(&model);
        for (vram, rows) in [(None, 512), (Some(0), 4)] {
            let e = engine(&model, DeviceChoice::Cuda, vram, None, rows);
            let spec = &e.model.spec;
            let splits = [(0usize, 20usize), (5, 9), (11, 30)];
            let mut alone = Vec::new();
            let mut caches = Vec::new();
            for &(a, b) in &splits {
                let mut c = KvCache::new(spec, 256);
                e.forward(&mut [SeqInput {
                    cache: &mut c,
                    tokens: &toks[a..b],
                    logits: Logits::None,
                }])
                .unwrap();
                caches.push(c);
            }
            for (c, &(_, b)) in caches.iter_mut().zip(&splits) {
                alone.push(
                    e.forward(&mut [SeqInput {
                        cache: c,
                        tokens: &toks[b..b + 3],
                        logits: Logits::All,
                    }])
                    .unwrap()
                    .remove(0),
                );
            }
            // The same three, prefilled and continued together.
            let mut cs: Vec<KvCache> = splits.iter().map(|_| KvCache::new(spec, 256)).collect();
            {
                let mut batch: Vec<SeqInput<'_>> = cs
                    .iter_mut()
                    .zip(&splits)
                    .map(|(c, &(a, b))| SeqInput {
                        cache: c,
                        tokens: &toks[a..b],
                        logits: Logits::None,
                    })
                    .collect();
                e.forward(&mut batch).unwrap();
            }
            let mut batch: Vec<SeqInput<'_>> = cs
                .iter_mut()
                .zip(&splits)
                .map(|(c, &(_, b))| SeqInput {
                    cache: c,
                    tokens: &toks[b..b + 3],
                    logits: Logits::All,
                })
                .collect();
            let together = e.forward(&mut batch).unwrap();
            for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
                assert!(
                    bits(a) == bits(t),
                    "{name}: sequence {i} differs alone vs batched (vram {vram:?}, {rows} rows)"
                );
            }
            eprintln!("{name}: batch-invariant (vram {vram:?}, {rows} rows per pass)");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn a_gpu_cache_refuses_the_cpu_tier_and_vice_versa() {
    let model = fixtures().join("models/qwen3_moe");
    let gpu = engine(&model, DeviceChoice::Cuda, None, None, 512);
    let cpu = engine(&model, DeviceChoice::Cpu, None, None, 512);
    let (prompt, _) = reference_tokens(&model);
    let mut cache = KvCache::new(&gpu.model.spec, 64);
    gpu.forward(&mut [SeqInput {
        cache: &mut cache,
        tokens: &prompt,
        logits: Logits::None,
    }])
    .unwrap();
    let err = cpu
        .forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: &prompt[..1],
            logits: Logits::Last,
        }])
        .unwrap_err();
    assert!(err.to_string().contains("GPU tier"), "{err}");
    let mut cache = KvCache::new(&gpu.model.spec, 64);
    cpu.forward(&mut [SeqInput {
        cache: &mut cache,
        tokens: &prompt,
        logits: Logits::None,
    }])
    .unwrap();
    let err = gpu
        .forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: &prompt[..1],
            logits: Logits::Last,
        }])
        .unwrap_err();
    assert!(err.to_string().contains("CPU tier"), "{err}");
}

/// The device's routing and launch plan (cuda/kernels/moe.cu) against the
/// host's (sched::gpu::route), bit for bit, on random logits and on rows
/// made of ties and of large values.
#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn device_routing_equals_the_host_routing_bit_for_bit() {
    use colibri_cuda::{DeviceRouter, MoeRoutePlan};
    use colibri_model::config::{MoeSpec, RouterKind};
    use colibri_sched::gpu::route::route_portable;
    use rand::{Rng, SeedableRng};

    let (dev, k) = colibri_sched::gpu::open_device(0).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let cases = [
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
            60,
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
        (
            RouterKind::SigmoidGrouped {
                n_group: 4,
                topk_group: 2,
                norm_topk_prob: false,
                routed_scaling_factor: 1.0,
            },
            64,
            6,
        ),
    ];
    for (router, e, topk) in cases {
        let spec = MoeSpec {
            num_experts: e,
            top_k: topk,
            intermediate_size: 16,
            router: router.clone(),
            shared: None,
        };
        let sigmoid = matches!(router, RouterKind::SigmoidGrouped { .. });
        let bias: Vec<f32> = (0..e).map(|_| rng.random_range(-0.05..0.05)).collect();
        // A single row takes the block-wide path of moe_route_plan (random,
        // then all tied); several rows the warp-per-row one.
        for (rows, tied) in [(1usize, false), (1, true), (3, false), (19, false)] {
            let mut logits: Vec<f32> = (0..rows * e)
                .map(|_| rng.random_range(-10.0f32..10.0))
                .collect();
            if tied {
                logits.fill(-1.5);
            }
            if rows > 1 {
                logits[e..2 * e].fill(0.25); // all tied
            }
            if rows > 2 {
                for v in &mut logits[2 * e..3 * e] {
                    *v *= 9.0; // exp far from 1, sigmoid saturating
                }
            }
            let want: Vec<_> = logits
                .chunks_exact(e)
                .map(|l| route_portable(&spec, l, sigmoid.then_some(&bias[..])))
                .collect();
            let d_logits = dev.upload(&logits).unwrap();
            let d_bias = dev.upload(&bias).unwrap();
            let ptrs: Vec<u64> = (0..e as u64 * 6).map(|i| 0x1000 + i).collect();
            let d_eptrs = dev.upload(&ptrs).unwrap();
            let nk = rows * topk;
            let tl = e.min(nk);
            let mut ids = dev.alloc::<u32>(nk).unwrap();
            let mut w = dev.alloc::<f32>(nk).unwrap();
            let mut tptrs = dev.alloc::<u64>(6 * tl).unwrap();
            let mut off = dev.alloc::<u32>(tl).unwrap();
            let mut cnt = dev.alloc::<u32>(tl).unwrap();
            let mut pairs = dev.alloc::<u32>(nk).unwrap();
            let mut pair_of = dev.alloc::<u32>(nk).unwrap();
            dev.fill_bytes(ids.as_mut(), 0xa5).unwrap();
            dev.fill_bytes(w.as_mut(), 0xa5).unwrap();
            dev.fill_bytes(cnt.as_mut(), 0xa5).unwrap();
            dev.fill_bytes(pairs.as_mut(), 0xa5).unwrap();
            dev.fill_bytes(pair_of.as_mut(), 0xa5).unwrap();
            let dr = match &router {
                RouterKind::Softmax { norm_topk_prob } => DeviceRouter::Softmax {
                    norm: *norm_topk_prob,
                },
                RouterKind::SigmoidGrouped {
                    n_group,
                    topk_group,
                    norm_topk_prob,
                    routed_scaling_factor,
                } => DeviceRouter::SigmoidGrouped {
                    n_group: *n_group,
                    topk_group: *topk_group,
                    norm: *norm_topk_prob,
                    scaling: *routed_scaling_factor,
                },
            };
            // SAFETY: the expert pointers are only copied into the tables
            // here; nothing launches from them.
            unsafe {
                k.moe_route_plan(
                    &dev,
                    MoeRoutePlan {
                        logits: d_logits.as_view(),
                        rows,
                        experts: e,
                        k: topk,
                        router: dr,
                        bias: sigmoid.then(|| d_bias.as_view()),
                        expert_ptrs: d_eptrs.as_view(),
                        ids: ids.as_mut(),
                        weights: w.as_mut(),
                        ptrs: tptrs.as_mut(),
                        ptr_stride: tl,
                        tok_off: off.as_mut(),
                        tok_cnt: cnt.as_mut(),
                        table_len: tl,
                        pairs: pairs.as_mut(),
                        pair_of: pair_of.as_mut(),
                    },
                )
                .unwrap();
            }
            let got_ids = dev.download(ids.as_view()).unwrap();
            let got_w = dev.download(w.as_view()).unwrap();
            for (r, h) in want.iter().enumerate() {
                let ids_r: Vec<usize> = got_ids[r * topk..(r + 1) * topk]
                    .iter()
                    .map(|&i| i as usize)
                    .collect();
                assert_eq!(ids_r, h.experts, "{router:?} {rows} rows: row {r} experts");
                assert_eq!(
                    bits(&got_w[r * topk..(r + 1) * topk]),
                    bits(&h.weights),
                    "{router:?} {rows} rows: row {r} weights"
                );
            }
            // The plan: used experts ascending, their users in row order.
            let mut users: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
            for (j, &id) in got_ids.iter().enumerate() {
                users.entry(id as usize).or_default().push(j);
            }
            let (off, cnt) = (
                dev.download(off.as_view()).unwrap(),
                dev.download(cnt.as_view()).unwrap(),
            );
            let (pairs, pair_of) = (
                dev.download(pairs.as_view()).unwrap(),
                dev.download(pair_of.as_view()).unwrap(),
            );
            let tptrs = dev.download(tptrs.as_view()).unwrap();
            let mut p = 0usize;
            for (i, (ex, js)) in users.iter().enumerate() {
                assert_eq!((off[i] as usize, cnt[i] as usize), (p, js.len()));
                for t in 0..6 {
                    assert_eq!(tptrs[t * tl + i], ptrs[ex * 6 + t]);
                }
                for &j in js {
                    assert_eq!(pairs[p] as usize, j / topk);
                    assert_eq!(pair_of[j] as usize, p);
                    p += 1;
                }
            }
            assert_eq!(p, nk);
            for (i, c) in cnt.iter().enumerate().take(tl).skip(users.len()) {
                assert_eq!(*c, 0, "unused launch index {i} has tokens");
            }
        }
    }
}

/// Two devices for the multi-device test: GPUs 0 and 1 when there are
/// two, else GPU 0 twice (two stages on one device: the same layer split,
/// hidden-row hop and per-stage KV caches, without a second GPU).
fn two_devices() -> Vec<usize> {
    match CudaDevice::count() {
        Ok(n) if n >= 2 => vec![0, 1],
        _ => vec![0, 0],
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: CUDA 13 driver and NVRTC (COLIBRI_NVRTC_DIR)"]
fn two_devices_are_bit_identical_to_one() {
    let devices = two_devices();
    eprintln!("devices {devices:?}");
    for model in models() {
        let name = model.display().to_string();
        let (prompt, tokens) = reference_tokens(&model);
        let run = |e: &Engine| -> (Vec<u32>, Vec<u32>) {
            (
                bits(&teacher_forced(e, &tokens, 16)),
                greedy(e, &prompt, 16),
            )
        };
        let one = engine(&model, DeviceChoice::Cuda, None, None, 512);
        let want = run(&one);
        let layers = one.model.spec.num_layers();
        let plan = one.gpu.as_ref().unwrap().plan().clone();
        let dense = plan.dense_resident_bytes + plan.dense_streamed_bytes;
        for (vram, ram, rows) in [
            (None, None, 512),
            (Some(0), None, 7),
            (Some(dense / 3), Some(0), 512),
        ] {
            let e = engine_on(&model, DeviceChoice::Cuda, devices.clone(), vram, ram, rows);
            let g = e.gpu.as_ref().unwrap();
            // Two consecutive layer ranges covering the model, the head on
            // the second.
            let shares: Vec<_> = g
                .plans()
                .iter()
                .map(|p| p.share.clone().expect("a share per device"))
                .collect();
            assert_eq!(shares.len(), 2, "{name}");
            assert_eq!(shares[0].start, 0);
            assert_eq!(shares[0].end, shares[1].start);
            assert_eq!(shares[1].end, layers);
            assert!(shares[0].end > 0 && shares[0].end < layers);
            assert!(!shares[0].head && shares[1].head);
            let got = run(&e);
            // Each device holds the KV cache of its own layers while a
            // sequence lives.
            let mut live = KvCache::new(&e.model.spec, 256);
            e.forward(&mut [SeqInput {
                cache: &mut live,
                tokens: &prompt,
                logits: Logits::Last,
            }])
            .unwrap();
            let per = g.stage_stats();
            drop(live);
            assert!(
                got.0 == want.0,
                "{name}: logits on two devices differ from one (vram {vram:?}, ram {ram:?}, \
                 {rows} rows; {per:?})"
            );
            assert_eq!(got.1, want.1, "{name}: greedy differs on two devices");
            for (i, s) in per.iter().enumerate() {
                assert!(s.passes > 0 && s.rows > 0, "{name}: stage {i} idle ({s:?})");
                assert!(
                    s.kv_vram_bytes + s.kv_host_bytes > 0,
                    "{name}: stage {i} holds no KV cache ({s:?})"
                );
            }
            if vram.is_none() {
                let all = g.stats();
                assert!(
                    all.graphs_captured >= 2 && all.graph_launches > 0,
                    "{name}: both stages should replay captured steps ({per:?})"
                );
            }
            if vram == Some(0) {
                let all = g.stats();
                assert_eq!(all.cache.hits, 0);
                assert!(all.experts_copied > 0 && all.dense_h2d_bytes > 0, "{per:?}");
            }
            eprintln!(
                "{name}: two devices identical to one (vram {vram:?}, ram {ram:?}, {rows} rows; \
                 layers {}..{} | {}..{})",
                shares[0].start, shares[0].end, shares[1].start, shares[1].end
            );
        }
        // A KV cache of the one-device tier is not continued by the
        // two-device tier.
        let two = engine_on(&model, DeviceChoice::Cuda, devices.clone(), None, None, 512);
        let mut cache = KvCache::new(&one.model.spec, 256);
        one.forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: &prompt,
            logits: Logits::Last,
        }])
        .unwrap();
        let err = two
            .forward(&mut [SeqInput {
                cache: &mut cache,
                tokens: &prompt[..1],
                logits: Logits::Last,
            }])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("another GPU engine"), "{name}: {err}");
    }
}
