//! The packed expert store against the other sources of the same weights.
//!
//! - every fixture converted with `keep` (from safetensors and from GGUF)
//!   gives logits bit-identical to its source, and the same spec;
//! - f32, bf16, q8_0 and q4_0 stores give logits bit-identical to their
//!   exactly dequantized f32 twin (a store converted from them with f32),
//!   and their quantized expert bytes are the GGUF fixtures' (same ggml
//!   quantizers);
//! - packed → packed with `keep` reproduces the store byte for byte;
//! - every record is one 4 KiB-aligned extent holding gate, up and down
//!   back to back, and plain reads of it assemble to the resident experts;
//! - a flipped byte is caught (file, layer and expert or tensor named), a
//!   truncated file is refused, an interrupted conversion resumes to a
//!   byte-identical store, and nothing is written outside `OUT` and
//!   `OUT.partial`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use colibri_model::convert::cast::Quant;
use colibri_model::convert::{ConvertOptions, ConvertSummary, Silent, convert};
use colibri_model::experts::ExpertSource;
use colibri_model::format::WeightFormat;
use colibri_model::source::packed::manifest::ALIGN;
use colibri_model::source::{
    ExpertLocator, GgufExpertLocator, GgufFile, MatrixLocation, PackedExpertLocator, PackedStore,
    load_packed,
};
use colibri_model::tensor::Bytes;
use colibri_model::{KvCache, Logits, Model, ModelError, Pool, ResidentExperts, SeqInput};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn hf(name: &str) -> PathBuf {
    root().join("models").join(name)
}

fn gguf(name: &str) -> PathBuf {
    root().join("gguf").join(name)
}

fn tokens(family: &str) -> Vec<u32> {
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf(family).join("reference.json")).unwrap())
            .unwrap();
    r["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Logits after every token, as bits.
fn logits(path: &Path, tokens: &[u32]) -> Vec<u32> {
    let (model, src) = Model::load(path).unwrap();
    let experts = ResidentExperts::load(&model.spec, &src).unwrap();
    forward_bits(&model, &experts, tokens)
}

fn forward_bits(model: &Model, experts: &dyn ExpertSource, tokens: &[u32]) -> Vec<u32> {
    let pool = Pool::new(2).unwrap();
    let mut cache = KvCache::new(&model.spec, 4096);
    let out = model
        .forward(
            &pool,
            experts,
            &mut [SeqInput {
                cache: &mut cache,
                tokens,
                logits: Logits::All,
            }],
        )
        .unwrap();
    out[0].iter().map(|v| v.to_bits()).collect()
}

fn run(src: &Path, out: &Path, quant: Quant) -> ConvertSummary {
    convert(src, out, &ConvertOptions::new(quant), &Silent)
        .unwrap_or_else(|e| panic!("{} -> {quant:?}: {e}", src.display()))
}

const FAMILIES: [&str; 7] = [
    "qwen3_moe",
    "qwen3_moe_bf16_sharded",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v3",
    "deepseek_v3_fp8",
];

fn reference_family(name: &str) -> &str {
    match name {
        "qwen3_moe_bf16_sharded" => "qwen3_moe",
        "deepseek_v3_fp8" => "deepseek_v3",
        n => n,
    }
}

#[test]
fn keep_from_safetensors_is_bit_identical_for_every_fixture() {
    let dir = tempfile::tempdir().unwrap();
    for name in FAMILIES {
        let out = dir.path().join(name);
        let s = run(&hf(name), &out, Quant::Keep);
        assert!(s.kept.is_empty(), "{name}: {:?}", s.kept);
        let toks = tokens(reference_family(name));
        assert!(
            logits(&out, &toks) == logits(&hf(name), &toks),
            "{name}: packed logits differ from safetensors"
        );
        let (a, _) = Model::load(&out).unwrap();
        let (b, _) = Model::load(&hf(name)).unwrap();
        assert_eq!(a.spec, b.spec, "{name}");
        check_records(&out);
    }
}

/// Every record is one aligned extent with the matrices back to back, and
/// reading it with plain file reads assembles to the resident expert.
fn check_records(store: &Path) {
    let (model, src) = load_packed(store).unwrap();
    let locator = PackedExpertLocator::new(&model.spec, &src).unwrap();
    let resident = ResidentExperts::load(&model.spec, &src).unwrap();
    let data = std::fs::read(&locator.files()[0]).unwrap();
    let moe = model.spec.moe.as_ref().unwrap();
    let mut records = 0;
    for (l, ls) in model.spec.layers.iter().enumerate() {
        if ls.ffn != colibri_model::config::FfnKind::Moe {
            assert!(locator.locate(l, 0).is_err());
            continue;
        }
        for e in 0..moe.num_experts {
            let loc = locator.locate(l, e).unwrap();
            let r = loc.record.as_ref().expect("a packed expert has a record");
            assert_eq!(r.extent.offset % ALIGN, 0);
            assert_eq!(r.extent.len % ALIGN, 0);
            let payload = loc.stored_bytes();
            assert!(r.extent.len >= payload && r.extent.len - payload < ALIGN);
            assert_eq!(loc.gate.extent.offset, r.extent.offset);
            assert_eq!(
                loc.up.extent.offset,
                loc.gate.extent.offset + loc.gate.extent.len
            );
            assert_eq!(
                loc.down.extent.offset,
                loc.up.extent.offset + loc.up.extent.len
            );
            // The padding is zero.
            let end = (r.extent.offset + r.extent.len) as usize;
            let scales: u64 = loc
                .matrices()
                .iter()
                .filter_map(|m| m.scales.as_ref().map(|s| s.scales.len() as u64 * 4))
                .sum();
            let pad_from = (loc.down.extent.offset + loc.down.extent.len + scales) as usize;
            assert!(data[pad_from..end].iter().all(|&b| b == 0));
            let part = |m: &MatrixLocation| {
                let (o, n) = (m.extent.offset as usize, m.extent.len as usize);
                Bytes::from_vec(data[o..o + n].to_vec())
            };
            let ew = loc
                .assemble([part(&loc.gate), part(&loc.up), part(&loc.down)])
                .unwrap();
            let mut got = None;
            resident
                .fetch(l, &[e], &mut |_, w: Arc<_>| {
                    got = Some(w);
                    Ok(())
                })
                .unwrap();
            let w = got.unwrap();
            assert_eq!(ew.gate.data().as_slice(), w.gate.data().as_slice());
            assert_eq!(ew.down.to_f32(), w.down.to_f32());
            records += 1;
        }
    }
    assert!(records > 0);
}
