//! Synthetic models: the presets' documented geometry, and small models
//! written in every quantization as packed stores and GGUF files that load
//! to the same model (bit-identical logits), with finite, non-flat output.

use std::path::Path;

use colibri_model::convert::cast::Quant;
use colibri_model::convert::{ConvertOptions, Silent, convert};
use colibri_model::format::WeightFormat;
use colibri_model::source::PackedStore;
use colibri_model::source::gguf::GgufFile;
use colibri_model::synth::{self, SynthFormat, SynthSource, presets};
use colibri_model::{KvCache, Logits, Model, Pool, ResidentExperts, SeqInput};
use serde_json::{Value, json};

fn logits(path: &Path, tokens: &[u32]) -> Vec<f32> {
    let (model, src) = Model::load(path).unwrap();
    let experts = ResidentExperts::load(&model.spec, &src).unwrap();
    let pool = Pool::new(2).unwrap();
    let mut cache = KvCache::new(&model.spec, 64);
    model
        .forward(
            &pool,
            &experts,
            &mut [SeqInput {
                cache: &mut cache,
                tokens,
                logits: Logits::All,
            }],
        )
        .unwrap()
        .remove(0)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn presets_have_the_released_geometry() {
    // (preset, layers, hidden, experts, top-k, expert width, vocab,
    //  total and active parameters in billions as published)
    let want = [
        ("qwen3-30b-a3b", 48, 2048, 128, 8, 768, 151936, 30.5, 3.3),
        (
            "qwen3-235b-a22b",
            94,
            4096,
            128,
            8,
            1536,
            151936,
            235.1,
            22.2,
        ),
        // The 671B main model (the published 685B adds the 14B MTP module).
        ("deepseek-v3", 61, 7168, 256, 8, 2048, 129280, 671.0, 37.5),
        ("mixtral-8x7b", 32, 4096, 8, 2, 14336, 32000, 46.7, 12.9),
    ];
    for (name, layers, hidden, experts, k, inter, vocab, total, active) in want {
        let config = synth::config(Some(name), None, None).unwrap();
        let src = SynthSource::new(config, 1).unwrap();
        let g = synth::geometry(src.spec()).unwrap();
        assert_eq!(
            (g.layers, g.hidden_size, g.experts, g.experts_per_token),
            (layers, hidden, experts, k),
            "{name}"
        );
        assert_eq!(
            (g.expert_intermediate_size, g.vocab_size),
            (inter, vocab),
            "{name}"
        );
        let b = |p: u64| p as f64 / 1e9;
        assert!(
            (b(g.total_params) / total - 1.0).abs() < 0.01,
            "{name}: {} B",
            b(g.total_params)
        );
        assert!(
            (b(g.active_params) / active - 1.0).abs() < 0.03,
            "{name}: {} B active",
            b(g.active_params)
        );
    }
    // Sizes of the full files, planned without writing.
    let config = synth::config(Some("qwen3-30b-a3b"), None, None).unwrap();
    let src = SynthSource::new(config, 1).unwrap();
    for format in [SynthFormat::Gguf, SynthFormat::Packed] {
        let p = synth::plan(&src, Quant::Q4_0, format, Path::new("x")).unwrap();
        // ~17 GiB: 29B q4_0 expert weights, bf16 embeddings and head.
        let gib = p.file_bytes as f64 / (1u64 << 30) as f64;
        assert!((16.5..17.5).contains(&gib), "{format:?}: {gib} GiB");
        // One expert: 3 × 768 × 2048 q4_0 elements (18 bytes per 32).
        let raw = 3 * 768 * 2048 / 32 * 18;
        assert!(
            p.expert_bytes >= raw && p.expert_bytes < raw + 4096,
            "{}",
            p.expert_bytes
        );
        assert!(!p.written);
    }
}

#[test]
fn layers_override_keeps_a_moe_layer() {
    let c = synth::config(Some("deepseek-v3"), None, Some(2)).unwrap();
    let g = synth::geometry(SynthSource::new(c, 1).unwrap().spec()).unwrap();
    assert_eq!((g.layers, g.dense_layers, g.moe_layers), (2, 1, 1));
    let c = synth::config(Some("qwen3-235b-a22b"), None, Some(2)).unwrap();
    let g = synth::geometry(SynthSource::new(c, 1).unwrap().spec()).unwrap();
    assert_eq!((g.layers, g.moe_layers, g.hidden_size), (2, 2, 4096));
    assert!(synth::config(Some("nope"), None, None).is_err());
    assert!(synth::config(Some("mixtral-8x7b"), None, Some(0)).is_err());
}

/// Small versions of the presets' architectures (same families, routing,
/// RoPE; small widths) so every format and quantization runs in a test.
fn small(name: &str) -> Value {
    let mut c = presets::preset(name).unwrap();
    let set = |c: &mut Value, kv: Value| {
        for (k, v) in kv.as_object().unwrap() {
            c[k] = v.clone();
        }
    };
    set(
        &mut c,
        json!({"hidden_size": 64, "vocab_size": 300, "max_position_embeddings": 512}),
    );
    match name {
        "deepseek-v3" => set(
            &mut c,
            json!({"num_hidden_layers": 3, "first_k_dense_replace": 1, "intermediate_size": 96,
                   "moe_intermediate_size": 32, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
                   "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                   "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                   "v_head_dim": 32}),
        ),
        "mixtral-8x7b" => set(
            &mut c,
            json!({"num_hidden_layers": 2, "intermediate_size": 96, "num_local_experts": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2}),
        ),
        _ => set(
            &mut c,
            json!({"num_hidden_layers": 2, "moe_intermediate_size": 32, "num_experts": 8,
                   "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16}),
        ),
    }
    c
}

#[test]
fn packed_and_gguf_synth_models_are_the_same_model() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = [3u32, 250, 17, 99, 4, 4, 120];
    for name in ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"] {
        let src = SynthSource::new(small(name), 42).unwrap();
        for quant in [Quant::F32, Quant::Bf16, Quant::Q8_0, Quant::Q4_0] {
            let p = dir.path().join(format!("{name}-{}", quant.name()));
            let g = dir.path().join(format!("{name}-{}.gguf", quant.name()));
            let sp = synth::write(&src, quant, SynthFormat::Packed, &p, &Silent).unwrap();
            let sg = synth::write(&src, quant, SynthFormat::Gguf, &g, &Silent).unwrap();
            assert!(sp.written && sg.written);
            let planned = synth::plan(&src, quant, SynthFormat::Gguf, &g).unwrap();
            assert_eq!(planned.file_bytes, std::fs::metadata(&g).unwrap().len());
            let (pm, _) = Model::load(&p).unwrap();
            let (gm, _) = Model::load(&g).unwrap();
            assert_eq!(pm.spec, gm.spec, "{name} {quant:?}");
            assert_eq!(&pm.spec, src.spec());
            let lp = logits(&p, &tokens);
            assert!(lp.iter().all(|v| v.is_finite()), "{name} {quant:?}");
            let spread = lp.iter().copied().fold(f32::MIN, f32::max)
                - lp.iter().copied().fold(f32::MAX, f32::min);
            assert!(spread > 0.5, "{name} {quant:?}: flat logits ({spread})");
            let lg = logits(&g, &tokens);
            // GGUF quantizes DeepSeek's kv_b along other rows (attn_k_b is
            // stored transposed), so only exact formats agree there.
            if name != "deepseek-v3" || matches!(quant, Quant::F32 | Quant::Bf16) {
                assert!(
                    bits(&lp) == bits(&lg),
                    "{name} {quant:?}: packed and GGUF differ"
                );
            }
        }
        // The q4_0 store's experts are the f32 store's converted to q4_0,
        // byte for byte (its embeddings and routers stay bf16 where the
        // f32 store's stay f32), and the bf16 store is the f32 one
        // converted to bf16 (no rounding: the values are bf16 values).
        let f = dir.path().join(format!("{name}-f32"));
        for quant in [Quant::Q4_0, Quant::Bf16] {
            let c = dir.path().join(format!("{name}-conv-{}", quant.name()));
            let s = convert(&f, &c, &ConvertOptions::new(quant), &Silent).unwrap();
            assert_eq!(s.rounded_matrices, 0);
            let files: &[&str] = match quant {
                Quant::Q4_0 => &["experts.bin"],
                _ => &["dense.bin", "experts.bin", "manifest.json"],
            };
            for file in files {
                let a = std::fs::read(c.join(file)).unwrap();
                let b = std::fs::read(
                    dir.path()
                        .join(format!("{name}-{}", quant.name()))
                        .join(file),
                )
                .unwrap();
                assert!(a == b, "{name} {quant:?}: {file} differs");
            }
        }
    }
}

#[test]
fn synth_values_are_seeded_and_never_zero_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    let c = dir.path().join("c");
    let config = small("qwen3-30b-a3b");
    synth::write(
        &SynthSource::new(config.clone(), 1).unwrap(),
        Quant::Bf16,
        SynthFormat::Packed,
        &a,
        &Silent,
    )
    .unwrap();
    synth::write(
        &SynthSource::new(config.clone(), 1).unwrap(),
        Quant::Bf16,
        SynthFormat::Packed,
        &b,
        &Silent,
    )
    .unwrap();
    synth::write(
        &SynthSource::new(config, 2).unwrap(),
        Quant::Bf16,
        SynthFormat::Packed,
        &c,
        &Silent,
    )
    .unwrap();
    let read = |d: &Path, f: &str| std::fs::read(d.join(f)).unwrap();
    assert_eq!(read(&a, "experts.bin"), read(&b, "experts.bin"));
    assert_ne!(read(&a, "experts.bin"), read(&c, "experts.bin"));
    let store = PackedStore::open(&a).unwrap();
    let dense = read(&a, "dense.bin");
    for t in &store.manifest().dense.tensors {
        let bytes = &dense[t.offset as usize..(t.offset + t.bytes) as usize];
        assert!(bytes.iter().any(|&x| x != 0), "{} is all zero", t.name);
    }
    let experts = read(&a, "experts.bin");
    for l in &store.manifest().experts.layers {
        for e in 0..l.experts() {
            let o = l.record_offset(e) as usize;
            for m in l.matrices() {
                let s = &experts[o + m.offset as usize..o + (m.offset + m.bytes) as usize];
                assert!(s.iter().any(|&x| x != 0));
            }
        }
    }
    // A GGUF output loads with the GGUF reader's own checks.
    let g = dir.path().join("m.gguf");
    synth::write(
        &SynthSource::new(small("mixtral-8x7b"), 1).unwrap(),
        Quant::Q8_0,
        SynthFormat::Gguf,
        &g,
        &Silent,
    )
    .unwrap();
    let f = GgufFile::open(&g).unwrap();
    assert_eq!(f.architecture().unwrap(), "llama");
    assert!(f.contains("blk.1.ffn_down_exps.weight"));
}

/// `--head q6_k`: llama.cpp's layout of a Q4_0 file (the output head in
/// Q6_K, everything else as `--quant q4_0` writes it). The model loads, its
/// head is read as Q6_K, and its logits are the bf16-head model's up to
/// the head's 6-bit quantization. A packed store refuses the option.
#[test]
fn a_q6_k_head_gives_llama_cpp_layout() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = [3u32, 250, 17, 99, 4];
    // Q6_K rows are whole super-blocks of 256.
    let mut config = small("qwen3-30b-a3b");
    config["hidden_size"] = json!(256);
    let plain = SynthSource::new(config.clone(), 42).unwrap();
    let mixed = SynthSource::new(config, 42)
        .unwrap()
        .with_head(WeightFormat::Q6K);
    let (a, b) = (dir.path().join("a.gguf"), dir.path().join("b.gguf"));
    synth::write(&plain, Quant::Q4_0, SynthFormat::Gguf, &a, &Silent).unwrap();
    let sb = synth::write(&mixed, Quant::Q4_0, SynthFormat::Gguf, &b, &Silent).unwrap();
    let planned = synth::plan(&mixed, Quant::Q4_0, SynthFormat::Gguf, &b).unwrap();
    assert_eq!(planned.file_bytes, sb.file_bytes);
    assert_eq!(sb.file_bytes, std::fs::metadata(&b).unwrap().len());
    let (fa, fb) = (GgufFile::open(&a).unwrap(), GgufFile::open(&b).unwrap());
    assert_eq!(fb.tensor("output.weight").unwrap().ty.name(), "Q6_K");
    assert_eq!(fa.tensor("output.weight").unwrap().ty.name(), "BF16");
    // Every other tensor is stored alike.
    for t in &fb.header().tensors {
        if t.name != "output.weight" {
            assert_eq!(fa.tensor(&t.name).unwrap().ty, t.ty, "{}", t.name);
        }
    }
    let (la, lb) = (logits(&a, &tokens), logits(&b, &tokens));
    assert_eq!(la.len(), lb.len());
    let spread =
        la.iter().copied().fold(f32::MIN, f32::max) - la.iter().copied().fold(f32::MAX, f32::min);
    let worst = la
        .iter()
        .zip(&lb)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(bits(&la) != bits(&lb), "the head's format changed nothing");
    assert!(
        worst < 0.05 * spread,
        "q6_k head: logits moved {worst} (spread {spread})"
    );
    let err = synth::plan(&mixed, Quant::Q4_0, SynthFormat::Packed, &a);
    assert!(err.is_err(), "a packed store cannot take --head");
    // `colibri convert` keeps the Q6_K head's bytes: the same model.
    let c = dir.path().join("c");
    convert(&b, &c, &ConvertOptions::new(Quant::Keep), &Silent).unwrap();
    assert!(
        bits(&logits(&c, &tokens)) == bits(&lb),
        "converted store differs"
    );
}

/// A synthetic model whose experts are in `format` (and head in Q6_K),
/// its other matrices Q4_0: llama.cpp's k-quant layout. Returns the file.
fn k_quant_file(dir: &Path, format: WeightFormat) -> std::path::PathBuf {
    // k-quant rows are whole super-blocks of 256, a down projection's too.
    let mut config = small("qwen3-30b-a3b");
    config["hidden_size"] = json!(256);
    config["moe_intermediate_size"] = json!(256);
    let source = SynthSource::new(config, 42)
        .unwrap()
        .with_experts(format)
        .with_head(WeightFormat::Q6K);
    let path = dir.join(format!("{}.gguf", format.name()));
    let done = synth::write(&source, Quant::Q4_0, SynthFormat::Gguf, &path, &Silent).unwrap();
    let planned = synth::plan(&source, Quant::Q4_0, SynthFormat::Gguf, &path).unwrap();
    assert_eq!(planned.file_bytes, done.file_bytes);
    path
}

#[test]
fn k_quant_experts_give_llama_cpp_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = [3u32, 250, 17, 99, 4];
    for (format, ty) in [(WeightFormat::Q4K, "Q4_K"), (WeightFormat::Q5K, "Q5_K")] {
        let b = k_quant_file(dir.path(), format);
        let file = GgufFile::open(&b).unwrap();
        let mut experts = 0;
        for t in &file.header().tensors {
            let want = if t.name.contains("_exps.") {
                experts += 1;
                ty
            } else if t.name == "output.weight" {
                "Q6_K"
            } else if t.ne.len() == 1 {
                "F32"
            } else if t.name == "token_embd.weight" || t.name.contains("ffn_gate_inp") {
                "BF16"
            } else {
                "Q4_0"
            };
            assert_eq!(t.ty.name(), want, "{}", t.name);
        }
        assert_eq!(experts, 6, "gate, up and down of both layers");
        let lb = logits(&b, &tokens);
        assert!(lb.iter().all(|v| v.is_finite()));
        // `colibri convert` keeps the experts' bytes: the same model, now
        // from 4 KiB-aligned expert records.
        let c = dir.path().join(format!("{ty}.packed"));
        convert(&b, &c, &ConvertOptions::new(Quant::Keep), &Silent).unwrap();
        assert!(
            bits(&logits(&c, &tokens)) == bits(&lb),
            "{ty}: converted store differs"
        );
    }
    // A row that is not whole super-blocks is refused, with the format.
    let mut odd = small("qwen3-30b-a3b");
    odd["hidden_size"] = json!(256);
    odd["moe_intermediate_size"] = json!(96);
    let bad = SynthSource::new(odd, 42)
        .unwrap()
        .with_experts(WeightFormat::Q4K);
    let Err(err) = synth::plan(
        &bad,
        Quant::Q4_0,
        SynthFormat::Gguf,
        &dir.path().join("x.gguf"),
    ) else {
        panic!("96 columns are not a super-block");
    };
    assert!(err.to_string().contains("q4_k"), "{err}");
    // Q4_K_M: llama.cpp's `use_more_bits` layers (of 8: 0, 3, 6, 7) keep
    // their down projections in Q6_K.
    let mut eight = small("qwen3-30b-a3b");
    eight["hidden_size"] = json!(256);
    eight["moe_intermediate_size"] = json!(256);
    eight["num_hidden_layers"] = json!(8);
    let km = SynthSource::new(eight, 42)
        .unwrap()
        .with_q4_k_m_experts()
        .with_head(WeightFormat::Q6K);
    let path = dir.path().join("km.gguf");
    synth::write(&km, Quant::Q4_0, SynthFormat::Gguf, &path, &Silent).unwrap();
    let file = GgufFile::open(&path).unwrap();
    for layer in 0..8 {
        for (m, want) in [("gate", "Q4_K"), ("up", "Q4_K"), ("down", "Q6_K")] {
            let want = if m == "down" && ![0, 3, 6, 7].contains(&layer) {
                "Q4_K"
            } else {
                want
            };
            let t = file
                .tensor(&format!("blk.{layer}.ffn_{m}_exps.weight"))
                .unwrap();
            assert_eq!(t.ty.name(), want, "layer {layer} {m}");
        }
    }
    assert!(logits(&path, &[3, 250, 17]).iter().all(|v| v.is_finite()));
}

/// With the exact kernels (`COLIBRI_EXACT_QUANT=1`, run in a child
/// process) a model with Q4_K/Q5_K experts and a Q6_K head computes its
/// dequantized f32 twin's logits bit for bit: the k-quant products are
/// the dequantized rows' (ggml's dequantization, checked against gguf-py
/// in k_quants.rs). With the default 8-bit activations they are close.
#[test]
fn k_quant_experts_equal_their_dequantized_twins() {
    let exact = std::env::var_os("COLIBRI_EXACT_QUANT").is_some();
    if !exact {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .env("COLIBRI_EXACT_QUANT", "1")
            .args([
                "k_quant_experts_equal_their_dequantized_twins",
                "--test-threads",
                "1",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("test result: ok. 1 passed"), "{text}");
    }
    let dir = tempfile::tempdir().unwrap();
    let tokens = [3u32, 250, 17, 99, 4, 120];
    for format in [WeightFormat::Q4K, WeightFormat::Q5K] {
        let b = k_quant_file(dir.path(), format);
        let twin = dir.path().join(format!("{}.f32", format.name()));
        convert(&b, &twin, &ConvertOptions::new(Quant::F32), &Silent).unwrap();
        let (lb, lt) = (logits(&b, &tokens), logits(&twin, &tokens));
        if exact {
            assert!(
                bits(&lb) == bits(&lt),
                "{}: not the twin's bits",
                format.name()
            );
        } else {
            // 8-bit activations move a random model's logits a little
            // (model/tests/gguf.rs measures how much for Q4_0); the argmax
            // of most positions stays.
            let spread = lt.iter().copied().fold(f32::MIN, f32::max)
                - lt.iter().copied().fold(f32::MAX, f32::min);
            let mean =
                lb.iter().zip(&lt).map(|(a, b)| (a - b).abs()).sum::<f32>() / lb.len() as f32;
            assert!(
                bits(&lb) != bits(&lt),
                "{}: 8-bit activations changed nothing",
                format.name()
            );
            assert!(
                mean < 0.05 * spread,
                "{}: mean |Δ| {mean}, spread {spread}",
                format.name()
            );
        }
    }
}

#[test]
fn formats_without_a_quantizer_are_written_as_random_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = [3u32, 250, 17, 99, 4];
    for (format, ty) in [
        (WeightFormat::Q4_1, "Q4_1"),
        (WeightFormat::Q5_0, "Q5_0"),
        (WeightFormat::Q5_1, "Q5_1"),
        (WeightFormat::Q2K, "Q2_K"),
        (WeightFormat::Q3K, "Q3_K"),
        (WeightFormat::Iq4Nl, "IQ4_NL"),
        (WeightFormat::Iq4Xs, "IQ4_XS"),
    ] {
        let b = k_quant_file(dir.path(), format);
        let file = GgufFile::open(&b).unwrap();
        let experts: Vec<_> = file
            .header()
            .tensors
            .iter()
            .filter(|t| t.name.contains("_exps."))
            .collect();
        assert_eq!(experts.len(), 6, "gate, up and down of both layers");
        assert!(experts.iter().all(|t| t.ty.name() == ty), "{ty}");
        let lb = logits(&b, &tokens);
        assert!(lb.iter().all(|v| v.is_finite()), "{ty}: logits finite");
        // Noise of the right spread: the logits are neither constant nor
        // blown up.
        let (lo, hi) = lb
            .iter()
            .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
        assert!(
            hi - lo > 1e-3 && hi - lo < 1e3,
            "{ty}: logits span {lo}..{hi}"
        );
        let c = dir.path().join(format!("{ty}.packed"));
        convert(&b, &c, &ConvertOptions::new(Quant::Keep), &Silent).unwrap();
        assert!(
            bits(&logits(&c, &tokens)) == bits(&lb),
            "{ty}: converted store differs"
        );
    }
}
