//! Q4_0 experts tiled for the CPU's tile kernel as they arrive in RAM, and
//! dense weights laid out for the CPU at load (Q4_0 tiles, 16-bit quads):
//! the same bits as the stored layout,
//! checksums still checked on the bytes as stored, and the stored layout
//! back when the tiles are turned off (as the GPU tier does).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use colibri_io::IoBackendChoice;
use colibri_model::convert::cast::Quant;
use colibri_model::convert::{ConvertOptions, Silent, convert};
use colibri_model::format::WeightFormat;
use colibri_model::kernels::{q4_0_tiles_run_here, quads16_run_here};
use colibri_model::source::packed::PackedStore;
use colibri_model::{ExpertSource, Model, ResidentExperts};
use colibri_sched::tier::TierOptions;
use colibri_sched::{Engine, EngineOptions};

use crate::common::*;

fn tiles(on: bool, budget: u64) -> TierOptions {
    TierOptions {
        tile_q4_0: on,
        ..options(budget, IoBackendChoice::Auto)
    }
}

/// The fixture's first MoE layer.
fn first_moe_layer(model: &Model) -> usize {
    (0..model.spec.num_layers())
        .find(|&l| model.spec.layers[l].ffn == colibri_model::config::FfnKind::Moe)
        .unwrap()
}

/// A Q4_0 packed store converted from the HF fixture `name`.
fn q4_0_store(dir: &Path, name: &str) -> PathBuf {
    let out = dir.join("store");
    convert(
        &fixture(name),
        &out,
        &ConvertOptions::new(Quant::Q4_0),
        &Silent,
    )
    .unwrap();
    out
}

#[test]
fn tiled_experts_give_the_oracles_logits_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let store = q4_0_store(dir.path(), "qwen3_moe");
    for path in [
        gguf("qwen3_moe.q4_0.gguf"),
        gguf("deepseek_v3.q4_0.gguf"),
        store,
    ] {
        let oracle = {
            let (model, src) = Model::load(&path).unwrap();
            let experts = ResidentExperts::load(&model.spec, &src).unwrap();
            logits_all(
                &engine_with(model, Arc::new(experts), 2),
                &[3, 1, 4, 1, 5, 9, 2],
            )
        };
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (on, budget) in [(true, 0), (true, 1 << 30), (false, 1 << 30)] {
            let (model, tier) = tier_over(&path, tiles(on, budget));
            assert_eq!(tier.tiles_q4_0(), on && q4_0_tiles_run_here());
            let layer = first_moe_layer(&model);
            let kept = fetch_keep(tier.as_ref(), layer, &[0, 1]);
            let w = &kept[0].1;
            assert_eq!(w.gate.format, WeightFormat::Q4_0, "{}", path.display());
            assert!(
                w.gate.rows >= 16 && w.down.rows >= 16,
                "whole tiles to exercise"
            );
            for m in [&w.gate, &w.up, &w.down] {
                assert_eq!(m.is_tiled(), tier.tiles_q4_0(), "{}", path.display());
            }
            drop(kept);
            for threads in [1, 3] {
                let engine = engine_with(
                    Model::load(&path).unwrap().0,
                    tier.clone() as Arc<dyn ExpertSource>,
                    threads,
                );
                assert_eq!(
                    bits(&logits_all(&engine, &[3, 1, 4, 1, 5, 9, 2])),
                    bits(&oracle),
                    "{}: tiles {on}, budget {budget}, {threads} threads",
                    path.display()
                );
            }
            drop(model);
        }
    }
}

#[test]
fn turning_tiles_off_restores_the_stored_bytes() {
    if !q4_0_tiles_run_here() {
        eprintln!("SKIP: this CPU runs no Q4_0 tile kernel, so nothing is tiled");
        return;
    }
    let path = gguf("qwen3_moe.q4_0.gguf");
    let (model, src) = Model::load(&path).unwrap();
    let layer = first_moe_layer(&model);
    let stored = expert_bytes(
        &fetch_keep(
            &ResidentExperts::load(&model.spec, &src).unwrap(),
            layer,
            &[2],
        )[0]
        .1,
    );
    let (_, tier) = tier_over(&path, tiles(true, 1 << 30));
    let kept = fetch_keep(tier.as_ref(), layer, &[2]);
    assert!(kept[0].1.gate.is_tiled());
    assert_ne!(
        expert_bytes(&kept[0].1),
        stored,
        "the tiles differ from the rows"
    );
    // An expert in use cannot change layout under its reader.
    assert!(tier.set_tile_q4_0(false).is_err());
    drop(kept);
    tier.set_tile_q4_0(false).unwrap();
    assert!(!tier.tiles_q4_0());
    let kept = fetch_keep(tier.as_ref(), layer, &[2, 3]);
    assert!(!kept[0].1.gate.is_tiled() && !kept[1].1.gate.is_tiled());
    assert_eq!(
        expert_bytes(&kept[0].1),
        stored,
        "the cached expert as stored"
    );
    let s = ExpertSource::stats(tier.as_ref());
    assert_eq!((s.ram_hits, s.ram_misses), (1, 2), "expert 2 stayed cached");
}

#[test]
fn a_corrupt_q4_0_record_fails_its_checksum_before_it_is_tiled() {
    let dir = tempfile::tempdir().unwrap();
    let out = q4_0_store(dir.path(), "qwen3_moe");
    let store = PackedStore::open(&out).unwrap();
    let layer = store.manifest().experts.layers[1].clone();
    let victim = 3;
    let at = layer.record_offset(victim) + layer.down.offset + 11;
    drop(store);
    let path = out.join("experts.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at as usize] ^= 0x04;
    std::fs::write(&path, &bytes).unwrap();
    let (_, tier) = tier_over(&out, tiles(true, 1 << 30));
    tier.fetch(layer.layer, &[0, 1], &mut |_, _| Ok(()))
        .unwrap();
    for _ in 0..2 {
        let msg = tier
            .fetch(layer.layer, &[victim], &mut |_, _| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("checksum"), "{msg}");
        assert!(
            msg.contains(&format!("layer {} expert {victim}", layer.layer)),
            "{msg}"
        );
    }
}

/// `Engine::load` lays the dense weights out for the CPU where the kernels
/// run (and memory allows): Q4_0 in tiles, bf16 in quads, the bf16 output
/// head too. Prefill and decode give the same bits as the stored layout.
#[test]
fn an_engine_with_dense_cpu_layouts_computes_the_same_bits() {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let bf16_dir = fixture("qwen3_moe_bf16_sharded");
    for (path, here) in [
        (gguf("qwen3_moe.q4_0.gguf"), q4_0_tiles_run_here()),
        (gguf("olmoe.bf16.gguf"), quads16_run_here()),
        (bf16_dir, quads16_run_here()),
    ] {
        let load = |tile: bool| {
            Engine::load(
                &path,
                &EngineOptions {
                    threads: 2,
                    tier: tiles(tile, 1 << 30),
                    ..EngineOptions::default()
                },
            )
            .unwrap()
        };
        let (laid_out, plain) = (load(true), load(false));
        let w = &laid_out.model.weights;
        assert_eq!(w.cpu_layouts(), here, "{}", path.display());
        assert!(!plain.model.weights.cpu_layouts());
        let q = match &w.layers[0].attn {
            colibri_model::weights::AttnWeights::Gqa(a) => &a.q.w,
            _ => panic!("a GQA fixture"),
        };
        if here {
            // One storage for every rewritten matrix (one huge-page
            // mapping, not a mapping per matrix).
            let o_last = match &w.layers[w.layers.len() - 1].attn {
                colibri_model::weights::AttnWeights::Gqa(a) => &a.o.w,
                _ => panic!("a GQA fixture"),
            };
            assert!(
                colibri_model::tensor::Bytes::common_span([q.data(), o_last.data()]).is_some(),
                "{}: the first layer's q and the last one's o in one storage",
                path.display()
            );
        }
        match q.format {
            WeightFormat::Q4_0 => assert_eq!(q.is_tiled(), here),
            WeightFormat::Bf16 => {
                assert_eq!(q.is_quads(), here, "{}: q in quads", path.display());
                assert_eq!(
                    w.lm_head.is_quads(),
                    here,
                    "{}: head in quads",
                    path.display()
                );
            }
            f => panic!("{}: a {f:?} fixture", path.display()),
        }
        let tokens = [7, 7, 2, 9, 1, 1, 30];
        assert_eq!(
            bits(&logits_all(&laid_out, &tokens)),
            bits(&logits_all(&plain, &tokens)),
            "{}: prefill",
            path.display()
        );
        assert_eq!(
            bits(&logits_stepwise(&laid_out, &tokens)),
            bits(&logits_stepwise(&plain, &tokens)),
            "{}: decode",
            path.display()
        );
    }
}

#[test]
fn filled_experts_are_tiled_too_and_compute_the_oracles_bits() {
    let path = gguf("qwen3_moe.q4_0.gguf");
    let tokens = [3, 1, 4, 1, 5, 9, 2];
    let (oracle, oracle_steps) = {
        let (model, src) = Model::load(&path).unwrap();
        let experts = ResidentExperts::load(&model.spec, &src).unwrap();
        let engine = engine_with(model, Arc::new(experts), 2);
        (
            logits_all(&engine, &tokens),
            logits_stepwise(&engine, &tokens),
        )
    };
    let (model, tier) = tier_over(&path, tiles(true, 1 << 30));
    let layout = tier.layout().clone();
    // Every odd expert of every layer arrives by a fill read; the even
    // ones on demand.
    let ranked: Vec<u32> = (0..layout.len() as u32)
        .filter(|&e| layout.records[e as usize].expert % 2 == 1)
        .collect();
    let mut cursor = 0;
    while cursor < ranked.len() {
        assert!(tier.fill(&ranked, &mut cursor, 4) > 0, "room for all");
        while tier.occupancy().iter().any(|o| o.loading > 0) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    assert_eq!(tier.stats().fill_reads, ranked.len() as u64);
    let layer = first_moe_layer(&model);
    let kept = fetch_keep(tier.as_ref(), layer, &[0, 1]);
    for (e, w) in &kept {
        for m in [&w.gate, &w.up, &w.down] {
            assert_eq!(m.is_tiled(), tier.tiles_q4_0(), "expert {e}");
        }
    }
    drop(kept);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for threads in [1, 3] {
        let engine = engine_with(
            Model::load(&path).unwrap().0,
            tier.clone() as Arc<dyn ExpertSource>,
            threads,
        );
        assert_eq!(
            bits(&logits_all(&engine, &tokens)),
            bits(&oracle),
            "{threads} threads"
        );
        assert_eq!(
            bits(&logits_stepwise(&engine, &tokens)),
            bits(&oracle_steps),
            "{threads} threads, stepwise"
        );
    }
    let s = tier.stats();
    assert!(s.fill_hits > 0, "{s:?}");
}

#[test]
fn experts_in_llama_cpps_fallback_formats_stream_with_the_oracles_bits() {
    // Q4_1/Q5_0/Q5_1 experts (tools/make_legacy_quant_model.py) through the
    // RAM tier, tiles asked for (nothing to tile: no Q4_0), under every
    // budget, against the experts memory-mapped.
    let path = gguf("qwen3_moe.legacy.gguf");
    let tokens = [3, 1, 4, 1, 5, 9, 2, 6];
    let oracle = {
        let (model, src) = Model::load(&path).unwrap();
        let experts = ResidentExperts::load(&model.spec, &src).unwrap();
        let engine = engine_with(model, Arc::new(experts), 2);
        (
            logits_all(&engine, &tokens),
            logits_stepwise(&engine, &tokens),
        )
    };
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for budget in [0, 1 << 30] {
        let (model, tier) = tier_over(&path, tiles(true, budget));
        let layer = first_moe_layer(&model);
        let kept = fetch_keep(tier.as_ref(), layer, &[0]);
        let formats = [&kept[0].1.gate, &kept[0].1.up, &kept[0].1.down].map(|m| m.format);
        assert_eq!(
            formats,
            [WeightFormat::Q4_1, WeightFormat::Q5_1, WeightFormat::Q5_0]
        );
        drop(kept);
        let engine = engine_with(model, tier.clone() as Arc<dyn ExpertSource>, 3);
        assert_eq!(
            bits(&logits_all(&engine, &tokens)),
            bits(&oracle.0),
            "budget {budget}"
        );
        assert_eq!(
            bits(&logits_stepwise(&engine, &tokens)),
            bits(&oracle.1),
            "budget {budget}, stepwise"
        );
    }
}

#[test]
fn experts_in_the_low_bit_formats_stream_with_the_oracles_bits() {
    // Q2_K/Q3_K/IQ4_NL experts (the first MoE layer's; IQ4_XS and Q2_K in
    // the next, tools/make_low_quant_model.py) through the RAM tier, tiles
    // asked for (nothing to tile: no Q4_0), under every budget, against
    // the experts memory-mapped.
    let path = gguf("qwen3_moe.low.gguf");
    let tokens = [3, 1, 4, 1, 5, 9, 2, 6];
    let oracle = {
        let (model, src) = Model::load(&path).unwrap();
        let experts = ResidentExperts::load(&model.spec, &src).unwrap();
        let engine = engine_with(model, Arc::new(experts), 2);
        (
            logits_all(&engine, &tokens),
            logits_stepwise(&engine, &tokens),
        )
    };
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for budget in [0, 1 << 30] {
        let (model, tier) = tier_over(&path, tiles(true, budget));
        let layer = first_moe_layer(&model);
        let kept = fetch_keep(tier.as_ref(), layer, &[0]);
        let formats = [&kept[0].1.gate, &kept[0].1.up, &kept[0].1.down].map(|m| m.format);
        assert_eq!(
            formats,
            [WeightFormat::Q2K, WeightFormat::Q3K, WeightFormat::Iq4Nl]
        );
        drop(kept);
        let kept = fetch_keep(tier.as_ref(), layer + 1, &[3]);
        let formats = [&kept[0].1.gate, &kept[0].1.up, &kept[0].1.down].map(|m| m.format);
        assert_eq!(
            formats,
            [WeightFormat::Iq4Xs, WeightFormat::Q2K, WeightFormat::Iq4Nl]
        );
        drop(kept);
        let engine = engine_with(model, tier.clone() as Arc<dyn ExpertSource>, 3);
        assert_eq!(
            bits(&logits_all(&engine, &tokens)),
            bits(&oracle.0),
            "budget {budget}"
        );
        assert_eq!(
            bits(&logits_stepwise(&engine, &tokens)),
            bits(&oracle.1),
            "budget {budget}, stepwise"
        );
    }
}

/// A forward pass releases every expert it used before it returns. The
/// MoE layers put off their last group's release to the calling thread's
/// next wait at a job's end (`pool::defer_drop`), which a one-thread pool
/// never has: only the pass's own end can release them there. Turning the
/// tiles off fails while any expert is leased.
#[test]
fn no_expert_stays_leased_after_a_forward_pass() {
    if !q4_0_tiles_run_here() {
        eprintln!("SKIP: this CPU runs no Q4_0 tile kernel, so nothing is tiled");
        return;
    }
    let path = gguf("qwen3_moe.q4_0.gguf");
    for threads in [1, 2] {
        let (model, tier) = tier_over(&path, tiles(true, 1 << 30));
        let engine = engine_with(model, tier.clone(), threads);
        let mut cache = colibri_model::KvCache::new(&engine.model.spec, 64);
        // A prompt, then one-token steps (a decode's path).
        for tokens in [&[1u32, 5, 9][..], &[7], &[3]] {
            forward(&engine, &mut cache, tokens, colibri_model::Logits::Last);
            tier.set_tile_q4_0(false)
                .unwrap_or_else(|e| panic!("{threads} threads, after {tokens:?}: {e}"));
            tier.set_tile_q4_0(true).unwrap();
        }
    }
}
