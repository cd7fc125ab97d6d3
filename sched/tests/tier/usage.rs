//! Usage history: round trip through the file, atomic replacement, and
//! every kind of bad file ignored (with a warning) rather than fatal.

use std::io::Read;
use std::sync::Arc;

use colibri_io::IoBackendChoice;
use colibri_model::Model;
use colibri_sched::tier::usage::{USAGE_VERSION, model_key};
use colibri_sched::tier::{ExpertLayout, FileFacts, TierOptions, UsageHistory, UsageMode};

use crate::common::*;

fn layout_of(name: &str) -> (ExpertLayout, String) {
    let dir = fixture(name);
    let (model, ck) = Model::load(&dir).unwrap();
    let locator = ck.locator(&model.spec).unwrap();
    let files = colibri_io::FileSet::open(locator.files(), colibri_io::DirectIo::Auto).unwrap();
    let layout =
        ExpertLayout::build(&model.spec, locator.as_ref(), &FileFacts::of(&files)).unwrap();
    let config = std::fs::read(dir.join("config.json")).unwrap();
    let key = model_key(&config, &layout, locator.files());
    (layout, key)
}

#[test]
fn a_history_round_trips_through_its_file() {
    let (layout, key) = layout_of("deepseek_v3");
    let dir = tempfile::tempdir().unwrap();
    let mut h = UsageHistory::empty(&key, &layout);
    let l = layout.moe_layers().next().unwrap();
    h.record(l, &[1, 4, 9]);
    h.record(l, &[4]);
    let path = h.save(dir.path()).unwrap();
    assert_eq!(path, UsageHistory::path(dir.path(), &key));
    let back = UsageHistory::load(dir.path(), &key, &layout);
    assert_eq!(back, h);
    assert_eq!(back.rate(l, 4), Some(1.0));
    assert_eq!(back.rate(l, 1), Some(0.5));
    assert_eq!(back.rate(l, 2), Some(0.0));
    assert_eq!(back.total_steps(), 2);
}

#[test]
fn the_key_changes_with_the_config_and_the_locations() {
    let (a, key_a) = layout_of("qwen3_moe");
    let (_, key_b) = layout_of("qwen3_moe_bf16_sharded");
    assert_ne!(key_a, key_b);
    let other = model_key(b"{}", &a, &[]);
    assert_ne!(other, key_a);
    assert_eq!(key_a.len(), 16);
}

#[test]
fn saving_replaces_the_file_atomically() {
    let (layout, key) = layout_of("olmoe");
    let dir = tempfile::tempdir().unwrap();
    let mut h = UsageHistory::empty(&key, &layout);
    h.record(0, &[0]);
    let path = h.save(dir.path()).unwrap();
    // A reader that opened the old file keeps reading the old, whole file:
    // the new one arrives by rename, never by rewriting in place.
    let mut old = std::fs::File::open(&path).unwrap();
    let old_len = old.metadata().unwrap().len();
    for _ in 0..50 {
        h.record(0, &[1, 2, 3]);
    }
    h.save(dir.path()).unwrap();
    let mut text = String::new();
    old.read_to_string(&mut text).unwrap();
    assert_eq!(text.len() as u64, old_len);
    let old_h: UsageHistory = serde_json::from_str(&text).unwrap();
    assert_eq!(old_h.total_steps(), 1);
    assert_eq!(UsageHistory::load(dir.path(), &key, &layout), h);
    // No temporary files are left behind.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec![format!("{key}.json")]);
    // A directory that cannot be created is an error, not a panic.
    let blocker = dir.path().join("blocker");
    std::fs::write(&blocker, b"x").unwrap();
    let err = h.save(&blocker.join("sub")).unwrap_err();
    assert!(err.to_string().contains("blocker"), "{err}");
}

#[test]
fn bad_histories_are_ignored() {
    let (layout, key) = layout_of("olmoe");
    let dir = tempfile::tempdir().unwrap();
    let path = UsageHistory::path(dir.path(), &key);
    let mut good = UsageHistory::empty(&key, &layout);
    good.record(0, &[2]);
    let text = serde_json::to_string(&good).unwrap();
    let wrong_version = text.replace(&format!("\"version\":{USAGE_VERSION}"), "\"version\":99");
    let wrong_key = text.replace(&key, "0123456789abcdef");
    let mut short = good.clone();
    short.layers[0].counts.pop();
    let mut impossible = good.clone();
    impossible.layers[0].counts[0] = 7;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"\x00\xffnot json".to_vec()),
        ("truncated", text.as_bytes()[..text.len() / 2].to_vec()),
        ("empty", Vec::new()),
        ("wrong version", wrong_version.into_bytes()),
        ("wrong model", wrong_key.into_bytes()),
        ("wrong shape", serde_json::to_vec(&short).unwrap()),
        (
            "count above steps",
            serde_json::to_vec(&impossible).unwrap(),
        ),
    ];
    for (what, bytes) in cases {
        assert!(
            UsageHistory::parse(&bytes, &key, &layout).is_err(),
            "{what} parsed"
        );
        std::fs::write(&path, &bytes).unwrap();
        let loaded = UsageHistory::load(dir.path(), &key, &layout);
        assert_eq!(loaded.total_steps(), 0, "{what}");
    }
    // A tier over a corrupt history starts and runs (and pins nothing).
    std::fs::write(&path, b"{corrupt").unwrap();
    let (_, tier) = open_tier(
        &fixture("olmoe"),
        TierOptions {
            usage: UsageMode::Dir(dir.path().to_path_buf()),
            ..options(1 << 30, IoBackendChoice::Auto)
        },
    );
    assert!(tier.plan().pinned.is_empty());
    assert_eq!(tier.plan().expected.basis, "uniform_routing");
    assert_eq!(fetch_order(tier.as_ref(), 0, &[1, 2]).len(), 2);
    // ... and replaces it with a good one when it is dropped.
    drop(tier);
    let h = UsageHistory::load(dir.path(), &key, &layout);
    assert_eq!(h.total_steps(), 1);
}

#[test]
fn an_engine_learns_usage_and_the_next_start_pins_from_it() {
    let name = "qwen3_moe";
    let dir = fixture(name);
    let r = reference(&dir);
    let usage = tempfile::tempdir().unwrap();
    let opts = TierOptions {
        usage: UsageMode::Dir(usage.path().to_path_buf()),
        ..options(1 << 30, IoBackendChoice::Auto)
    };
    let (model, tier) = open_tier(&dir, opts.clone());
    let engine = engine_with(model, tier.clone() as Arc<_>, 1);
    let want = logits_all(&engine, &r.tokens);
    drop(engine);
    drop(tier);
    let (model, tier) = open_tier(&dir, opts);
    assert_eq!(tier.plan().expected.basis, "usage_history");
    assert!(!tier.plan().pinned.is_empty());
    assert!(tier.plan().pinned_bytes <= tier.plan().pin_budget_bytes);
    let engine = engine_with(model, tier.clone() as Arc<_>, 1);
    assert!(logits_all(&engine, &r.tokens) == want);
}
