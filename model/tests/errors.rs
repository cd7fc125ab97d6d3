//! Bad checkpoints fail closed with an error that names the cause.

use std::path::{Path, PathBuf};

use colibri_model::{Model, ModelError};
use safetensors::Dtype;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

/// Copies a fixture's config and rewrites its single safetensors file
/// through `edit(name, dtype, shape, bytes)` (None drops the tensor).
fn rewrite(
    name: &str,
    config_edit: impl Fn(&mut serde_json::Value),
    edit: impl Fn(&str, Dtype, &[usize], &[u8]) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) -> tempfile::TempDir {
    let src = fixture(name);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config_edit(&mut cfg);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut kept = Vec::new();
    for (n, t) in st.tensors() {
        if let Some(x) = edit(&n, t.dtype(), t.shape(), t.data()) {
            kept.push((n, x));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = kept
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

fn keep(_: &str, d: Dtype, s: &[usize], b: &[u8]) -> Option<(Dtype, Vec<usize>, Vec<u8>)> {
    Some((d, s.to_vec(), b.to_vec()))
}

fn load_err(dir: &Path) -> ModelError {
    match Model::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn unknown_model_type_is_named() {
    let d = rewrite("olmoe", |c| c["model_type"] = "llama4_moe".into(), keep);
    let e = load_err(d.path()).to_string();
    assert!(
        e.contains("llama4_moe") && e.contains("unsupported model_type"),
        "{e}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let victim = "model.layers.1.self_attn.k_proj.weight";
    let d = rewrite(
        "olmoe",
        |_| {},
        |n, d, s, b| (n != victim).then(|| (d, s.to_vec(), b.to_vec())),
    );
    let e = load_err(d.path()).to_string();
    assert!(e.contains(victim) && e.contains("missing"), "{e}");
}

#[test]
fn unsupported_dtype_is_named() {
    let victim = "model.layers.0.mlp.gate.weight";
    let d = rewrite(
        "olmoe",
        |_| {},
        |n, d, s, b| {
            if n == victim {
                Some((Dtype::I32, s.to_vec(), b.to_vec()))
            } else {
                Some((d, s.to_vec(), b.to_vec()))
            }
        },
    );
    let e = load_err(d.path()).to_string();
    assert!(
        e.contains(victim) && e.contains("I32") && e.contains("unsupported dtype"),
        "{e}"
    );
}

#[test]
fn wrong_shape_is_named() {
    let victim = "model.norm.weight";
    let d = rewrite(
        "olmoe",
        |_| {},
        |n, d, s, b| {
            if n == victim {
                Some((d, vec![s[0] / 2], b[..b.len() / 2].to_vec()))
            } else {
                Some((d, s.to_vec(), b.to_vec()))
            }
        },
    );
    let e = load_err(d.path()).to_string();
    assert!(e.contains(victim) && e.contains("shape"), "{e}");
}

#[test]
fn truncated_and_garbage_files_name_the_file() {
    let d = rewrite("olmoe", |_| {}, keep);
    let st = d.path().join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() - 100]).unwrap();
    let e = load_err(d.path()).to_string();
    assert!(e.contains("model.safetensors"), "{e}");
    std::fs::write(&st, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}").unwrap();
    let e = load_err(d.path()).to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("not a valid safetensors"),
        "{e}"
    );
    std::fs::write(&st, b"\xff\xff\xff\xff\xff\xff\xff\xff").unwrap();
    assert!(load_err(d.path()).to_string().contains("model.safetensors"));
}

#[test]
fn bad_config_values_are_named() {
    let d = rewrite("olmoe", |c| c["num_key_value_heads"] = 3.into(), keep);
    let e = load_err(d.path()).to_string();
    assert!(e.contains("num_key_value_heads"), "{e}");
    let d = rewrite("olmoe", |c| c["hidden_act"] = "gelu".into(), keep);
    assert!(load_err(d.path()).to_string().contains("gelu"));
    let d = rewrite("olmoe", |c| c["hidden_size"] = "big".into(), keep);
    assert!(load_err(d.path()).to_string().contains("hidden_size"));
    let d = rewrite(
        "olmoe",
        |c| c["rope_parameters"] = serde_json::json!({"rope_type": "longrope", "rope_theta": 1e4}),
        keep,
    );
    assert!(load_err(d.path()).to_string().contains("longrope"));
}

#[test]
fn context_overflow_is_an_error_with_numbers() {
    let (model, ck) = Model::load(&fixture("mixtral")).unwrap();
    let experts = colibri_model::ResidentExperts::load(&model.spec, &ck).unwrap();
    let pool = colibri_model::Pool::new(1).unwrap();
    let mut cache = colibri_model::KvCache::new(&model.spec, 8);
    let toks: Vec<u32> = (3..12).collect();
    let err = model
        .forward(
            &pool,
            &experts,
            &mut [colibri_model::SeqInput {
                cache: &mut cache,
                tokens: &toks,
                logits: colibri_model::Logits::Last,
            }],
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::ContextExceeded {
                needed: 9,
                context: 8
            }
        ),
        "{err}"
    );
    let bad = [9999u32];
    let err = model
        .forward(
            &pool,
            &experts,
            &mut [colibri_model::SeqInput {
                cache: &mut cache,
                tokens: &bad,
                logits: colibri_model::Logits::Last,
            }],
        )
        .unwrap_err();
    assert!(err.to_string().contains("9999"));
}
