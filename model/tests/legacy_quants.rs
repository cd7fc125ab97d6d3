//! Q4_1, Q5_0 and Q5_1 against the reference: the PyPI `gguf` package
//! (gguf-py, which llama.cpp maintains). llama.cpp writes these where a
//! k-quant cannot go (a row that is not whole 256-element super-blocks,
//! e.g. a 1408-wide down projection in a Q4_K_M file) and in its older
//! whole-file types.
//!
//! Fixture `tests/fixtures/gguf/legacy_quants.gguf`, made by
//! tools/make_legacy_quant_fixture.py with gguf-py's GGUFWriter: for each
//! of `q4_1`, `q5_0`, `q5_1`, random raw tensors `.a` (5 rows of 32), `.b`
//! (3 rows of 96) and `.c` (2 rows of 1408), holding every 4-/5-bit code
//! and scales (and mins) of both signs, zero of both signs, subnormal,
//! f16's smallest normal and ±65504; beside each, `.f32`, gguf-py's
//! `quants.dequantize` of it. Checked here:
//! - our reader sees matrices of the stated ggml type and dims, and
//!   `format_of` maps them to `WeightFormat::Q4_1`/`Q5_0`/`Q5_1`;
//! - the fixture covers what it claims (a decoder written out here);
//! - `quant::dequantize_*`, `row_to_f32` and `QMatrix::to_f32` give
//!   gguf-py's values bit for bit (signed zeros included);
//! - the exact product (`dot_row`) is `dot_f32` over gguf-py's row, bit
//!   for bit;
//! - the integer products against 8-bit activations (the default; the
//!   pool's `matvec` and `matmul`) are within their stated bound of
//!   gguf-py's row, on every kernel level this CPU has, with the scalar
//!   reference's bits;
//! - a model with experts and attention projections in these formats
//!   (tools/make_legacy_quant_model.py) gives the logits of its twin
//!   holding gguf-py's dequantized values in F32, bit for bit with the
//!   exact products (`COLIBRI_EXACT_QUANT=1`), close with 8-bit
//!   activations.

mod int_products;

use std::path::{Path, PathBuf};

use colibri_model::Pool;
use colibri_model::format::WeightFormat;
use colibri_model::kernels::row_to_f32;
use colibri_model::quant::{self, QK};
use colibri_model::source::gguf::{GgmlType, GgufFile};
use int_products::{check_exact, check_matrix, close_to_the_twin, exact_in_a_child};

const SHAPES: [(&str, usize, usize); 3] = [("a", 5, 32), ("b", 3, 96), ("c", 2, 1408)];

#[derive(Clone, Copy)]
struct Format {
    name: &'static str,
    ty: GgmlType,
    weight: WeightFormat,
    block: usize,
    has_min: bool,
    bits: u32,
    dequantize: fn(&[u8], &mut [f32]),
}

const FORMATS: [Format; 3] = [
    Format {
        name: "q4_1",
        ty: GgmlType::Q4_1,
        weight: WeightFormat::Q4_1,
        block: quant::Q4_1_BLOCK_BYTES,
        has_min: true,
        bits: 4,
        dequantize: quant::dequantize_q4_1,
    },
    Format {
        name: "q5_0",
        ty: GgmlType::Q5_0,
        weight: WeightFormat::Q5_0,
        block: quant::Q5_0_BLOCK_BYTES,
        has_min: false,
        bits: 5,
        dequantize: quant::dequantize_q5_0,
    },
    Format {
        name: "q5_1",
        ty: GgmlType::Q5_1,
        weight: WeightFormat::Q5_1,
        block: quant::Q5_1_BLOCK_BYTES,
        has_min: true,
        bits: 5,
        dequantize: quant::dequantize_q5_1,
    },
];

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf/legacy_quants.gguf")
}

struct Tensor {
    name: String,
    rows: usize,
    cols: usize,
    raw: Vec<u8>,
    reference: Vec<f32>,
}

fn open(f: Format) -> (GgufFile, Vec<Tensor>) {
    let file = GgufFile::open(&fixture()).unwrap();
    let mut tensors = Vec::new();
    for (suffix, rows, cols) in SHAPES {
        let name = format!("{}.{suffix}", f.name);
        let t = file.tensor(&name).unwrap();
        assert_eq!(t.ty, f.ty, "{name}");
        assert_eq!(t.ne, [cols as u64, rows as u64], "{name}");
        assert_eq!(t.size as usize, rows * cols / QK * f.block, "{name}");
        assert_eq!(file.format_of(t).unwrap(), f.weight, "{name}");
        assert_eq!(f.weight.row_bytes(cols).unwrap(), cols / QK * f.block);
        let raw = file.bytes(&name).unwrap().as_slice().to_vec();
        let reference: Vec<f32> = file
            .bytes(&format!("{name}.f32"))
            .unwrap()
            .as_slice()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(reference.len(), rows * cols);
        tensors.push(Tensor {
            name,
            rows,
            cols,
            raw,
            reference,
        });
    }
    (file, tensors)
}

/// ggml's block layout, written out: the f16 `d` (and `m`), and element
/// `j`'s code (low nibbles of `qs` are elements 0..16, high ones 16..32;
/// bit `j` of the little-endian `qh` is the fifth bit).
fn scales(f: Format, blk: &[u8]) -> (f32, Option<f32>) {
    let h = |i: usize| half::f16::from_bits(u16::from_le_bytes([blk[i], blk[i + 1]])).to_f32();
    (h(0), f.has_min.then(|| h(2)))
}

fn code(f: Format, blk: &[u8], j: usize) -> u32 {
    let head = if f.has_min { 4 } else { 2 };
    let qs = head + if f.bits == 5 { 4 } else { 0 };
    let byte = blk[qs + j % 16];
    let low = u32::from(if j < 16 { byte & 0x0f } else { byte >> 4 });
    if f.bits == 4 {
        return low;
    }
    let qh = u32::from_le_bytes([blk[head], blk[head + 1], blk[head + 2], blk[head + 3]]);
    low | (((qh >> j) & 1) << 4)
}

/// Element `j`'s magnitudes the integer product's roundings scale with:
/// `|d·q|` (`q − 16` for Q5_0) and `|m|`.
fn parts(f: Format, blk: &[u8], j: usize) -> f64 {
    let (d, m) = scales(f, blk);
    let q = code(f, blk, j) as f64 - if f.has_min { 0.0 } else { 16.0 };
    (d as f64 * q).abs() + m.map_or(0.0, |m| (m as f64).abs())
}

fn first_difference(got: &[f32], want: &[f32]) -> Option<(usize, f32, f32)> {
    got.iter()
        .zip(want)
        .enumerate()
        .find(|(_, (g, w))| g.to_bits() != w.to_bits())
        .map(|(i, (&g, &w))| (i, g, w))
}

#[test]
fn the_fixture_covers_what_it_claims() {
    for f in FORMATS {
        let (_, tensors) = open(f);
        let mut codes = vec![false; 1 << f.bits];
        let mut values: Vec<f32> = Vec::new();
        for t in &tensors {
            for blk in t.raw.chunks_exact(f.block) {
                for j in 0..QK {
                    codes[code(f, blk, j) as usize] = true;
                }
                let (d, m) = scales(f, blk);
                values.push(d);
                values.extend(m);
            }
            for row in t.reference.chunks_exact(t.cols) {
                assert!(row.iter().any(|&v| v != 0.0), "{}: a zero row", t.name);
            }
        }
        let n = f.name;
        assert!(codes.iter().all(|&c| c), "{n}: not every code occurs");
        assert!(values.iter().any(|&v| v > 0.0) && values.iter().any(|&v| v < 0.0));
        assert!(values.iter().any(|&v| v.to_bits() == 0), "{n}: no +0");
        assert!(
            values.iter().any(|&v| v.to_bits() == 0x8000_0000),
            "{n}: no -0"
        );
        assert!(
            values
                .iter()
                .any(|&v| v != 0.0 && v.abs() < half::f16::MIN_POSITIVE.to_f32()),
            "{n}: no subnormal"
        );
        assert!(values.iter().any(|&v| v.abs() == half::f16::MAX.to_f32()));
        // Our decoder of the layout gives gguf-py's values (a layout
        // mistake shows here as a position, not just a wrong value).
        for t in &tensors {
            for (b, blk) in t.raw.chunks_exact(f.block).enumerate() {
                let (d, m) = scales(f, blk);
                for j in 0..QK {
                    let q = code(f, blk, j);
                    let want = t.reference[b * QK + j];
                    let got = match m {
                        Some(m) => q as f32 * d + m,
                        None => (q as i32 - 16) as f32 * d,
                    };
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{} block {b} element {j}",
                        t.name
                    );
                }
            }
        }
        let all = || tensors.iter().flat_map(|t| &t.reference);
        assert!(
            all().any(|v| v.to_bits() == 0x8000_0000),
            "{n}: no -0 value"
        );
        assert!(all().any(|v| v.to_bits() == 0), "{n}: no +0 value");
    }
}

#[test]
fn dequantization_equals_gguf_py_bit_for_bit() {
    for f in FORMATS {
        let (file, tensors) = open(f);
        for t in &tensors {
            let m = file.matrix(&t.name, t.rows, t.cols).unwrap();
            assert_eq!(m.format, f.weight, "{}", t.name);
            assert_eq!(m.data().as_slice(), &t.raw[..]);
            let mut all = vec![f32::NAN; t.rows * t.cols];
            (f.dequantize)(&t.raw, &mut all);
            if let Some((i, g, w)) = first_difference(&all, &t.reference) {
                panic!(
                    "{}: element {i} (block {}): {g:e} ({:#010x}) vs gguf-py {w:e} ({:#010x})",
                    t.name,
                    i / QK,
                    g.to_bits(),
                    w.to_bits()
                );
            }
            let mut row = vec![0.0f32; t.cols];
            for r in 0..t.rows {
                row.fill(f32::NAN);
                row_to_f32(&m, r, &mut row);
                let want = &t.reference[r * t.cols..(r + 1) * t.cols];
                assert!(first_difference(&row, want).is_none(), "{} row {r}", t.name);
            }
            assert!(first_difference(&m.to_f32(), &t.reference).is_none());
        }
    }
}

#[test]
fn the_exact_product_is_dot_f32_over_gguf_pys_rows() {
    for f in FORMATS {
        let (file, tensors) = open(f);
        for t in &tensors {
            let m = file.matrix(&t.name, t.rows, t.cols).unwrap();
            check_exact(&m, &t.name, &t.reference, 4600);
        }
    }
}

/// Integer terms per 32-element block take at most this many f32
/// roundings (kernels/legacy_q8.rs counts them).
const TERM_ROUNDINGS: usize = 4;

#[test]
fn integer_products_are_within_their_bound_of_gguf_pys_rows() {
    for f in FORMATS {
        let (file, tensors) = open(f);
        for t in &tensors {
            let m = file.matrix(&t.name, t.rows, t.cols).unwrap();
            let parts =
                |row: &[u8], e: usize| parts(f, &row[e / QK * f.block..][..f.block], e % QK);
            check_matrix(&m, &t.name, &t.reference, parts, 4800, TERM_ROUNDINGS);
        }
    }
}

fn gguf(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gguf")
        .join(name)
}

/// Logits after every token of `tokens` (one batch, or one token at a
/// time).
fn logits(path: &Path, tokens: &[u32], stepwise: bool) -> Vec<f32> {
    use colibri_model::{KvCache, Logits, Model, ResidentExperts, SeqInput};
    let (model, src) = Model::load(path).unwrap();
    let experts = ResidentExperts::load(&model.spec, &src).unwrap();
    let pool = Pool::new(2).unwrap();
    let mut cache = KvCache::new(&model.spec, 4096);
    let mut run = |tokens: &[u32], logits: Logits| {
        model
            .forward(
                &pool,
                &experts,
                &mut [SeqInput {
                    cache: &mut cache,
                    tokens,
                    logits,
                }],
            )
            .unwrap()
            .remove(0)
    };
    if stepwise {
        tokens
            .iter()
            .flat_map(|t| run(std::slice::from_ref(t), Logits::Last))
            .collect()
    } else {
        run(tokens, Logits::All)
    }
}

/// With the exact products (`COLIBRI_EXACT_QUANT=1`, run in a child
/// process) the model computes its dequantized twin's logits bit for bit;
/// with the default 8-bit activations, close to them.
#[test]
fn a_model_in_these_formats_computes_what_its_dequantized_twin_does() {
    let exact = std::env::var_os("COLIBRI_EXACT_QUANT").is_some();
    if !exact {
        exact_in_a_child("a_model_in_these_formats_computes_what_its_dequantized_twin_does");
    }
    // tools/make_legacy_quant_model.py: the qwen3_moe fixture with its
    // experts in Q4_1 (gate), Q5_1 (up), Q5_0 (down) and attn_q/attn_output
    // in Q5_0/Q4_1, beside a twin holding gguf-py's dequantization of the
    // same tensors in F32.
    let quantized = gguf("qwen3_moe.legacy.gguf");
    let twin = gguf("qwen3_moe.legacy.f32.gguf");
    let file = GgufFile::open(&quantized).unwrap();
    for (name, f) in [
        ("blk.0.ffn_gate_exps.weight", WeightFormat::Q4_1),
        ("blk.2.ffn_up_exps.weight", WeightFormat::Q5_1),
        ("blk.2.ffn_down_exps.weight", WeightFormat::Q5_0),
        ("blk.0.attn_q.weight", WeightFormat::Q5_0),
        ("blk.2.attn_output.weight", WeightFormat::Q4_1),
    ] {
        let t = file.tensor(name).unwrap();
        assert_eq!(file.format_of(t).unwrap(), f, "{name}");
    }
    let tokens: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % 256).collect();
    for stepwise in [false, true] {
        let got = logits(&quantized, &tokens, stepwise);
        let want = logits(&twin, &tokens, stepwise);
        assert_eq!(got.len(), want.len());
        assert!(got.iter().all(|v| v.is_finite()));
        if exact {
            // The exact product is the dequantized row through the f32
            // kernel, as the twin's f32 rows do. Same bits.
            if let Some((i, g, w)) = first_difference(&got, &want) {
                panic!("stepwise {stepwise}: logit {i}: {g:e} vs the twin's {w:e}");
            }
        } else {
            close_to_the_twin(&got, &want, tokens.len(), &format!("stepwise {stepwise}"));
        }
    }
}
