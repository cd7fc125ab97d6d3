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

#[test]
fn keep_from_gguf_is_bit_identical_to_the_gguf() {
    let dir = tempfile::tempdir().unwrap();
    for (file, family) in [
        ("qwen3_moe.f32.gguf", "qwen3_moe"),
        ("qwen3_moe.q4_0.gguf", "qwen3_moe"),
        ("qwen3_moe.q8_0.gguf", "qwen3_moe"),
        ("qwen2_moe.f32.gguf", "qwen2_moe"),
        ("mixtral.q8_0.gguf", "mixtral"),
        ("olmoe.bf16.gguf", "olmoe"),
        ("deepseek_v3.q4_0.gguf", "deepseek_v3"),
    ] {
        let out = dir.path().join(file);
        run(&gguf(file), &out, Quant::Keep);
        let toks = tokens(family);
        assert!(
            logits(&out, &toks) == logits(&gguf(file), &toks),
            "{file}: packed logits differ from the GGUF"
        );
        let (a, _) = Model::load(&out).unwrap();
        let (b, _) = Model::load(&gguf(file)).unwrap();
        assert_eq!(a.spec, b.spec, "{file}");
        check_records(&out);
    }
    // An f32 GGUF, its packed copy and the safetensors source all agree.
    let toks = tokens("mixtral");
    let out = dir.path().join("mixtral.f32");
    run(&gguf("mixtral.f32.gguf"), &out, Quant::Keep);
    assert!(logits(&out, &toks) == logits(&hf("mixtral"), &toks));
}

/// A store of `quant` equals its f32 twin (the same store converted to f32,
/// exactly), and the twin computes what the quantized store computes.
fn quantized_equals_twin(name: &str, quant: Quant) {
    let dir = tempfile::tempdir().unwrap();
    let q = dir.path().join("q");
    let s = run(&hf(name), &q, quant);
    let twin = dir.path().join("twin");
    run(&q, &twin, Quant::F32);
    let toks = tokens(reference_family(name));
    let got = logits(&q, &toks);
    assert_twin(&got, &logits(&twin, &toks), &format!("{name} {quant:?}"));
    // Quantized or rounded: not the source's logits.
    if quant != Quant::F32 {
        assert!(got != logits(&hf(name), &toks), "{name} {quant:?}");
    }
    // Every routed expert is in the requested format (unless kept).
    let store = PackedStore::open(&q).unwrap();
    let want = match quant {
        Quant::F32 => WeightFormat::F32,
        Quant::Bf16 => WeightFormat::Bf16,
        Quant::Q8_0 => WeightFormat::Q8_0,
        Quant::Q4_0 => WeightFormat::Q4_0,
        Quant::Keep => unreachable!(),
    };
    for l in &store.manifest().experts.layers {
        for m in l.matrices() {
            assert!(
                m.format == want || !s.kept.is_empty(),
                "{name}: {:?}",
                m.format
            );
        }
    }
    // Embeddings, norms and routers are never quantized.
    for t in &store.manifest().dense.tensors {
        if t.name.contains("embed_tokens") || t.name.ends_with("mlp.gate.weight") {
            assert!(
                !matches!(t.format, WeightFormat::Q8_0 | WeightFormat::Q4_0),
                "{}",
                t.name
            );
        }
    }
}

#[test]
fn f32_and_bf16_stores_equal_their_twins() {
    quantized_equals_twin("qwen3_moe", Quant::F32);
    quantized_equals_twin("qwen3_moe", Quant::Bf16);
    quantized_equals_twin("olmoe", Quant::Bf16);
    quantized_equals_twin("deepseek_v3_fp8", Quant::Bf16);
}

#[test]
fn q8_0_and_q4_0_stores_equal_their_twins() {
    quantized_equals_twin("qwen3_moe", Quant::Q8_0);
    quantized_equals_twin("qwen3_moe", Quant::Q4_0);
    quantized_equals_twin("qwen2_moe", Quant::Q4_0);
    quantized_equals_twin("mixtral", Quant::Q8_0);
    quantized_equals_twin("deepseek_v3", Quant::Q4_0);
    quantized_equals_twin("qwen3_moe_bf16_sharded", Quant::Q4_0);
}

/// The expert bytes quantized by convert are the bytes gguf-py's
/// quantizers wrote into the GGUF fixtures from the same weights.
#[test]
fn quantized_experts_are_the_gguf_fixtures_bytes() {
    let dir = tempfile::tempdir().unwrap();
    for (family, quant, file) in [
        ("qwen3_moe", Quant::Q8_0, "qwen3_moe.q8_0.gguf"),
        ("qwen3_moe", Quant::Q4_0, "qwen3_moe.q4_0.gguf"),
        ("mixtral", Quant::Q8_0, "mixtral.q8_0.gguf"),
        ("deepseek_v3", Quant::Q4_0, "deepseek_v3.q4_0.gguf"),
    ] {
        let out = dir.path().join(file);
        run(&hf(family), &out, quant);
        let (model, store) = load_packed(&out).unwrap();
        let packed = PackedExpertLocator::new(&model.spec, &store).unwrap();
        let gf = GgufFile::open(&gguf(file)).unwrap();
        let gl = GgufExpertLocator::new(&model.spec, &gf).unwrap();
        let pdata = std::fs::read(store.experts_path()).unwrap();
        let gdata = std::fs::read(gguf(file)).unwrap();
        let bytes = |d: &[u8], m: &MatrixLocation| {
            d[m.extent.offset as usize..(m.extent.offset + m.extent.len) as usize].to_vec()
        };
        let mut n = 0;
        for (l, ls) in model.spec.layers.iter().enumerate() {
            if ls.ffn != colibri_model::config::FfnKind::Moe {
                continue;
            }
            for e in 0..model.spec.moe.as_ref().unwrap().num_experts {
                let (p, g) = (packed.locate(l, e).unwrap(), gl.locate(l, e).unwrap());
                for (pm, gm) in p.matrices().into_iter().zip(g.matrices()) {
                    assert_eq!(pm.format, gm.format, "{file}");
                    assert!(
                        bytes(&pdata, pm) == bytes(&gdata, gm),
                        "{file}: layer {l} expert {e}"
                    );
                    n += 1;
                }
            }
        }
        assert!(n > 0);
    }
}

#[test]
fn packed_to_packed_keep_is_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    run(&hf("deepseek_v3_fp8"), &a, Quant::Keep);
    run(&a, &b, Quant::Keep);
    assert_same_dirs(&a, &b);
    // Also through a quantized store.
    let q = dir.path().join("q");
    let q2 = dir.path().join("q2");
    run(&hf("qwen2_moe"), &q, Quant::Q4_0);
    run(&q, &q2, Quant::Keep);
    assert_same_dirs(&q, &q2);
}

fn assert_same_dirs(a: &Path, b: &Path) {
    let list = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(list(a), list(b));
    for f in list(a) {
        assert!(
            std::fs::read(a.join(&f)).unwrap() == std::fs::read(b.join(&f)).unwrap(),
            "{f} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

#[test]
fn non_block_rows_stay_in_their_format_and_the_summary_says_so() {
    // deepseek_v3_fp8 has moe_intermediate_size 136: the down projections'
    // rows are not whole 32-element blocks.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q");
    let s = run(&hf("deepseek_v3_fp8"), &out, Quant::Q4_0);
    assert!(
        s.kept
            .iter()
            .any(|k| k.contains("routed expert") && k.contains("136")),
        "{:?}",
        s.kept
    );
    let keep = dir.path().join("keep");
    run(&hf("deepseek_v3_fp8"), &keep, Quant::Keep);
    let (model, q) = load_packed(&out).unwrap();
    let (_, k) = load_packed(&keep).unwrap();
    let (ql, kl) = (
        PackedExpertLocator::new(&model.spec, &q).unwrap(),
        PackedExpertLocator::new(&model.spec, &k).unwrap(),
    );
    let (qd, kd) = (
        std::fs::read(q.experts_path()).unwrap(),
        std::fs::read(k.experts_path()).unwrap(),
    );
    let bytes = |d: &[u8], m: &MatrixLocation| {
        d[m.extent.offset as usize..(m.extent.offset + m.extent.len) as usize].to_vec()
    };
    for l in &q.manifest().experts.layers {
        assert_eq!(l.gate.format, WeightFormat::Q4_0);
        assert_eq!(l.down.format, WeightFormat::F8E4M3);
        for e in 0..l.experts() {
            let (a, b) = (
                ql.locate(l.layer, e).unwrap(),
                kl.locate(l.layer, e).unwrap(),
            );
            // The kept matrix is the source's bytes and scales ...
            assert!(bytes(&qd, &a.down) == bytes(&kd, &b.down));
            assert_eq!(
                a.down.scales.as_ref().unwrap().scales,
                b.down.scales.as_ref().unwrap().scales
            );
            // ... the others are ggml's q4_0 of its exact values.
            let gate = b
                .assemble_unverified([
                    Bytes::from_vec(bytes(&kd, &b.gate)),
                    Bytes::from_vec(bytes(&kd, &b.up)),
                    Bytes::from_vec(bytes(&kd, &b.down)),
                ])
                .unwrap()
                .gate
                .to_f32();
            let want: Vec<u8> = gate
                .chunks(l.gate.cols)
                .flat_map(|r| colibri_model::quant::quantize_q4_0(r).unwrap())
                .collect();
            assert!(bytes(&qd, &a.gate) == want);
        }
    }
    let toks = tokens("deepseek_v3");
    assert!(
        logits(&out, &toks)
            .iter()
            .all(|b| f32::from_bits(*b).is_finite())
    );
}

// ---- corruption, truncation, interruption ----

fn small_store(dir: &Path) -> PathBuf {
    let out = dir.join("store");
    run(&hf("qwen3_moe"), &out, Quant::Q8_0);
    out
}

#[test]
fn a_flipped_byte_in_a_record_names_the_file_layer_and_expert() {
    let dir = tempfile::tempdir().unwrap();
    let out = small_store(dir.path());
    let store = PackedStore::open(&out).unwrap();
    let layer = store.manifest().experts.layers[1].clone();
    let victim = 3;
    let at = layer.record_offset(victim) + layer.up.offset + 7;
    drop(store);
    let path = out.join("experts.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at as usize] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();

    let (model, src) = Model::load(&out).unwrap();
    let experts = ResidentExperts::load(&model.spec, &src).unwrap();
    let check = |err: ModelError| {
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(
            msg.contains(&format!("layer {} expert {victim}", layer.layer)),
            "{msg}"
        );
        assert!(msg.contains("checksum"), "{msg}");
    };
    // The resident source: other experts are fine, the flipped one fails.
    experts
        .fetch(layer.layer, &[0, 1], &mut |_, _| Ok(()))
        .unwrap();
    check(
        experts
            .fetch(layer.layer, &[victim], &mut |_, _| Ok(()))
            .unwrap_err(),
    );
    // Every later fetch fails too (a failed check is not cached as passed).
    assert!(
        experts
            .fetch(layer.layer, &[victim], &mut |_, _| Ok(()))
            .is_err()
    );
    // A streaming read through the locator.
    let (model, store) = load_packed(&out).unwrap();
    let loc = PackedExpertLocator::new(&model.spec, &store)
        .unwrap()
        .locate(layer.layer, victim)
        .unwrap();
    let part = |m: &MatrixLocation| {
        let (o, n) = (m.extent.offset as usize, m.extent.len as usize);
        Bytes::from_vec(bytes[o..o + n].to_vec())
    };
    check(
        loc.assemble([part(&loc.gate), part(&loc.up), part(&loc.down)])
            .unwrap_err(),
    );
    // Converting from the corrupt store refuses too.
    let err = convert(
        &out,
        &dir.path().join("again"),
        &ConvertOptions::new(Quant::Keep),
        &Silent,
    )
    .unwrap_err();
    check(err);
    assert!(!dir.path().join("again").exists());
}

#[test]
fn a_flipped_byte_in_a_dense_tensor_names_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let out = small_store(dir.path());
    let store = PackedStore::open(&out).unwrap();
    let t = store
        .manifest()
        .dense
        .tensors
        .iter()
        .find(|t| t.name == "model.layers.1.self_attn.k_proj.weight")
        .unwrap()
        .clone();
    drop(store);
    let path = out.join("dense.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(t.offset + t.bytes / 2) as usize] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let msg = match Model::load(&out) {
        Ok(_) => panic!("a corrupt dense tensor loaded"),
        Err(e) => e.to_string(),
    };
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(
        msg.contains("model.layers.1.self_attn.k_proj.weight"),
        "{msg}"
    );
}

#[test]
fn truncated_or_inconsistent_stores_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let out = small_store(dir.path());
    let path = out.join("experts.bin");
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 5000)
        .unwrap();
    let msg = match Model::load(&out) {
        Ok(_) => panic!("a truncated store loaded"),
        Err(e) => e.to_string(),
    };
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("truncated"), "{msg}");

    // A manifest whose offsets do not add up is refused before any read.
    let out = dir.path().join("store2");
    run(&hf("olmoe"), &out, Quant::Keep);
    let mpath = out.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    m["experts"]["layers"][0]["down"]["offset"] = serde_json::json!(12);
    std::fs::write(&mpath, serde_json::to_string(&m).unwrap()).unwrap();
    let msg = match Model::load(&out) {
        Ok(_) => panic!("a bad manifest loaded"),
        Err(e) => e.to_string(),
    };
    assert!(
        msg.contains("manifest.json") && msg.contains("back to back"),
        "{msg}"
    );
}

/// Files of a directory tree with their contents.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn an_interrupted_conversion_resumes_to_a_byte_identical_store() {
    let dir = tempfile::tempdir().unwrap();
    let src = hf("mixtral"); // 10 shards, 2 MoE layers
    let whole = dir.path().join("whole");
    run(&src, &whole, Quant::Q4_0);

    let parent = dir.path().join("work");
    std::fs::create_dir(&parent).unwrap();
    let out = parent.join("out");
    let before = snapshot(&src);
    let opts = ConvertOptions {
        quant: Quant::Q4_0,
        stop_after_layers: Some(1),
    };
    match convert(&src, &out, &opts, &Silent) {
        Err(ModelError::Interrupted(1)) => {}
        other => panic!("expected an interruption, got {other:?}"),
    }
    assert!(!out.exists());
    let partial = parent.join("out.partial");
    assert!(partial.join("progress/globals.json").is_file());
    assert!(partial.join("progress/layer-00000.json").is_file());

    // Resuming keeps the globals and layer 0 and writes the rest.
    let s = run(&src, &out, Quant::Q4_0);
    assert_eq!(s.resumed_units, 2);
    assert_eq!(s.written_units, 1);
    assert!(!partial.exists());
    assert_same_dirs(&whole, &out);

    // Nothing outside OUT and OUT.partial was written, the source untouched.
    let names: Vec<_> = std::fs::read_dir(&parent)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("out")]);
    assert!(snapshot(&src) == before);
}

#[test]
fn resume_redoes_a_layer_whose_bytes_changed() {
    let dir = tempfile::tempdir().unwrap();
    let src = hf("qwen3_moe");
    let whole = dir.path().join("whole");
    run(&src, &whole, Quant::Q8_0);
    let out = dir.path().join("out");
    let opts = ConvertOptions {
        quant: Quant::Q8_0,
        stop_after_layers: Some(2),
    };
    assert!(matches!(
        convert(&src, &out, &opts, &Silent),
        Err(ModelError::Interrupted(2))
    ));
    // Damage layer 0's first record in the partial store (layer 1 is
    // dense in this fixture: its unit is kept).
    let partial = dir.path().join("out.partial");
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(partial.join("plan.json")).unwrap()).unwrap();
    let l0 = plan["experts"]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["layer"] == 0)
        .unwrap();
    let at = l0["offset"].as_u64().unwrap() + 100;
    let ep = partial.join("experts.bin");
    let mut bytes = std::fs::read(&ep).unwrap();
    bytes[at as usize] ^= 0xff;
    std::fs::write(&ep, &bytes).unwrap();

    let s = run(&src, &out, Quant::Q8_0);
    assert_eq!(
        s.resumed_units, 2,
        "globals and layer 1 kept, layer 0 redone"
    );
    assert_eq!(s.written_units, 2);
    assert_same_dirs(&whole, &out);

    // A different quantization does not reuse a partial store of another.
    let out2 = dir.path().join("out2");
    let opts = ConvertOptions {
        quant: Quant::Q4_0,
        stop_after_layers: Some(1),
    };
    assert!(convert(&src, &out2, &opts, &Silent).is_err());
    let s = run(&src, &out2, Quant::Q8_0);
    assert_eq!(s.resumed_units, 0);
    assert_same_dirs(&whole, &out2);
}

#[test]
fn an_existing_output_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("exists");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), b"mine").unwrap();
    let err = convert(
        &hf("olmoe"),
        &out,
        &ConvertOptions::new(Quant::Keep),
        &Silent,
    )
    .unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    assert_eq!(std::fs::read(out.join("keep.txt")).unwrap(), b"mine");
    // A foreign OUT.partial is not deleted either.
    let out = dir.path().join("x");
    std::fs::create_dir(dir.path().join("x.partial")).unwrap();
    std::fs::write(dir.path().join("x.partial/notes"), b"mine").unwrap();
    let err = convert(
        &hf("olmoe"),
        &out,
        &ConvertOptions::new(Quant::Keep),
        &Silent,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("not an interrupted colibri conversion"),
        "{err}"
    );
    assert!(dir.path().join("x.partial/notes").is_file());
}

#[test]
fn tokenizer_files_are_copied_and_the_demo_model_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let demo = dir.path().join("demo");
    colibri_model::demo::write_demo_model(&demo).unwrap();
    let out = dir.path().join("packed");
    run(&demo, &out, Quant::Q8_0);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            std::fs::read(demo.join(f)).unwrap(),
            std::fs::read(out.join(f)).unwrap()
        );
    }
    let tok = colibri_model::Tokenizer::from_dir(&out).unwrap().unwrap();
    assert_eq!(
        tok.encode("hi", false).unwrap(),
        vec![b'h' as u32, b'i' as u32]
    );
    let twin = dir.path().join("twin");
    run(&out, &twin, Quant::F32);
    let toks: Vec<u32> = b"Hello there".iter().map(|&b| b as u32).collect();
    assert_twin(&logits(&out, &toks), &logits(&twin, &toks), "demo Q8_0");
}

/// A quantized store against its exactly dequantized f32 twin. With exact
/// quantized kernels (`COLIBRI_EXACT_QUANT=1`) they are bit-identical; with
/// the default 8-bit activations they are close (relative L2 of the logits).
/// (`logits` gives the bit patterns.)
fn assert_twin(got: &[u32], twin: &[u32], what: &str) {
    if colibri_model::kernels::kernels().int_activations {
        let f = |v: &u32| f32::from_bits(*v) as f64;
        let num: f64 = got
            .iter()
            .zip(twin)
            .map(|(a, b)| (f(a) - f(b)).powi(2))
            .sum();
        let den: f64 = twin.iter().map(|b| f(b).powi(2)).sum();
        let rel = (num / den).sqrt();
        assert!(
            rel < 0.2,
            "{what}: logits {rel:.3} (relative L2) from the f32 twin"
        );
    } else {
        assert!(got == twin, "{what}: logits differ from the f32 twin");
    }
}

/// The twin tests again, in a child process with exact quantized kernels,
/// where quantized stores must be bit-identical to their twins.
#[test]
fn exact_quant_kernels_make_quantized_stores_bit_identical_to_twins() {
    if std::env::var_os("COLIBRI_EXACT_QUANT").is_some() {
        return; // this is the child
    }
    for filter in [
        "q8_0_and_q4_0_stores_equal_their_twins",
        "tokenizer_files_are_copied",
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .env("COLIBRI_EXACT_QUANT", "1")
            .args([filter, "--test-threads", "1"])
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
}
