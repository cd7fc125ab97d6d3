//! Q2_K, Q3_K, IQ4_NL and IQ4_XS against the reference: the PyPI `gguf`
//! package (gguf-py, which llama.cpp maintains). They make up llama.cpp's
//! Q2_K, Q3_K_S/M/L, IQ4_NL and IQ4_XS files, the ones a DeepSeek-V3 or a
//! Qwen3-235B fits in.
//!
//! Fixture `tests/fixtures/gguf/low_quants.gguf`, made by
//! tools/make_kquant_low_fixture.py with gguf-py's GGUFWriter: for each
//! of `q2_k`, `q3_k`, `iq4_xs`, random raw tensors `.a` (4 rows of 256),
//! `.b` (3 rows of 768) and `.c` (1 row of 1536), for `iq4_nl` `.a` (5
//! rows of 32), `.b` (3 rows of 96) and `.c` (2 rows of 1408), holding
//! every code and every sub-block scale (and Q2_K min), with f16 scales of
//! both signs, zero of both signs, subnormal, f16's smallest normal and
//! ±65504; beside each, `.f32`, gguf-py's `quants.dequantize` of it.
//! Checked here:
//! - our reader sees matrices of the stated ggml type and dims, and
//!   `format_of` maps them to `WeightFormat::Q2K`/`Q3K`/`Iq4Nl`/`Iq4Xs`;
//! - the fixture covers what it claims (a decoder written out here, which
//!   also gives gguf-py's values);
//! - `quant::dequantize_*`, `row_to_f32` and `QMatrix::to_f32` give
//!   gguf-py's values bit for bit (signed zeros included);
//! - the exact product (`dot_row`) is `dot_f32` over gguf-py's row, bit
//!   for bit;
//! - the integer products against 8-bit activations (the default; the
//!   pool's `matvec` and `matmul`) are within their stated bound of
//!   gguf-py's row, on every kernel level this CPU has, with the scalar
//!   reference's bits;
//! - a model with experts and attention projections in these formats
//!   (tools/make_low_quant_model.py) gives the logits of its twin holding
//!   gguf-py's dequantized values in F32, bit for bit with the exact
//!   products (`COLIBRI_EXACT_QUANT=1`), close with 8-bit activations.

mod int_products;

use std::path::{Path, PathBuf};

use colibri_model::Pool;
use colibri_model::format::WeightFormat;
use colibri_model::kernels::row_to_f32;
use colibri_model::quant;
use colibri_model::source::gguf::{GgmlType, GgufFile};
use int_products::{check_exact, check_matrix, close_to_the_twin, exact_in_a_child};

type Shapes = [(&'static str, usize, usize); 3];

const SHAPES_K: Shapes = [("a", 4, 256), ("b", 3, 768), ("c", 1, 1536)];
const SHAPES_NL: Shapes = [("a", 5, 32), ("b", 3, 96), ("c", 2, 1408)];

/// The 16 values of an IQ4 nibble, written out from ggml's
/// `kvalues_iq4nl`.
const IQ4: [i32; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

#[derive(Clone, Copy)]
struct Format {
    name: &'static str,
    ty: GgmlType,
    weight: WeightFormat,
    /// Elements and bytes per block.
    elems: usize,
    block: usize,
    shapes: Shapes,
    /// Where the block's f16 scales are (`d`, and Q2_K's `dmin`).
    f16s: &'static [usize],
    /// The codes every element may hold: `codes.0..=codes.1`.
    codes: (i32, i32),
    /// Sub-blocks per block and the values a sub-block's scale byte(s) may
    /// hold (Q2_K: scale and min as one byte).
    subs: usize,
    sub_values: usize,
    dequantize: fn(&[u8], &mut [f32]),
}

const FORMATS: [Format; 4] = [
    Format {
        name: "q2_k",
        ty: GgmlType::Q2_K,
        weight: WeightFormat::Q2K,
        elems: 256,
        block: 84,
        shapes: SHAPES_K,
        f16s: &[80, 82],
        codes: (0, 3),
        subs: 16,
        sub_values: 256,
        dequantize: quant::dequantize_q2_k,
    },
    Format {
        name: "q3_k",
        ty: GgmlType::Q3_K,
        weight: WeightFormat::Q3K,
        elems: 256,
        block: 110,
        shapes: SHAPES_K,
        f16s: &[108],
        codes: (-4, 3),
        subs: 16,
        sub_values: 64,
        dequantize: quant::dequantize_q3_k,
    },
    Format {
        name: "iq4_nl",
        ty: GgmlType::IQ4_NL,
        weight: WeightFormat::Iq4Nl,
        elems: 32,
        block: 18,
        shapes: SHAPES_NL,
        f16s: &[0],
        codes: (0, 15),
        subs: 0,
        sub_values: 0,
        dequantize: quant::dequantize_iq4_nl,
    },
    Format {
        name: "iq4_xs",
        ty: GgmlType::IQ4_XS,
        weight: WeightFormat::Iq4Xs,
        elems: 256,
        block: 136,
        shapes: SHAPES_K,
        f16s: &[0],
        codes: (0, 15),
        subs: 8,
        sub_values: 64,
        dequantize: quant::dequantize_iq4_xs,
    },
];

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf/low_quants.gguf")
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
    for (suffix, rows, cols) in f.shapes {
        let name = format!("{}.{suffix}", f.name);
        let t = file.tensor(&name).unwrap();
        assert_eq!(t.ty, f.ty, "{name}");
        assert_eq!(t.ne, [cols as u64, rows as u64], "{name}");
        assert_eq!(t.size as usize, rows * cols / f.elems * f.block, "{name}");
        assert_eq!(file.format_of(t).unwrap(), f.weight, "{name}");
        assert_eq!(f.weight.row_bytes(cols).unwrap(), cols / f.elems * f.block);
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

// ggml's layouts, written out element by element (ggml-quants.c's
// `dequantize_row_*`).

fn f16_at(blk: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([blk[at], blk[at + 1]])).to_f32()
}

/// The 2-bit code of element `e` of a Q2_K/Q3_K super-block whose codes
/// begin at `qs`: each half of 128 elements takes 32 bytes, element `l +
/// 32s` of a half (l < 32) bits `2s, 2s + 1` of byte `l`.
fn two_bit(blk: &[u8], qs: usize, e: usize) -> i32 {
    i32::from((blk[qs + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3)
}

/// Element `e`'s 4-bit index of an IQ4 block of 32 elements: the low
/// (e < 16) or high nibble of `qs[e mod 16]`.
fn nibble(qs: &[u8], e: usize) -> usize {
    usize::from((qs[e % 16] >> (4 * (e / 16))) & 0x0f)
}

/// Element `e`'s code.
fn code(f: Format, blk: &[u8], e: usize) -> i32 {
    match f.weight {
        WeightFormat::Q2K => two_bit(blk, 16, e),
        WeightFormat::Q3K => {
            let high = (blk[e % 32] >> (e / 32)) & 1;
            two_bit(blk, 32, e) - if high == 1 { 0 } else { 4 }
        }
        WeightFormat::Iq4Nl => nibble(&blk[2..], e) as i32,
        _ => nibble(&blk[8 + 16 * (e / 32)..], e % 32) as i32,
    }
}

/// Sub-block `j`'s scale (Q2_K: its byte, scale and min), unsigned.
fn sub_scale(f: Format, blk: &[u8], j: usize) -> usize {
    match f.weight {
        WeightFormat::Q2K => usize::from(blk[j]),
        WeightFormat::Q3K => {
            let s = &blk[96..108];
            let low = (s[j % 8] >> (4 * (j / 8))) & 0x0f;
            let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
            usize::from(low | (high << 4))
        }
        _ => {
            let h = u16::from_le_bytes([blk[2], blk[3]]);
            let low = usize::from((blk[4 + j / 2] >> (4 * (j % 2))) & 0x0f);
            low | (usize::from((h >> (2 * j)) & 3) << 4)
        }
    }
}

/// Element `e`'s value, in ggml's order of operations.
fn value(f: Format, blk: &[u8], e: usize) -> f32 {
    let q = code(f, blk, e);
    match f.weight {
        WeightFormat::Q2K => {
            let sc = sub_scale(f, blk, e / 16);
            let dl = f16_at(blk, 80) * (sc & 0x0f) as f32;
            let ml = f16_at(blk, 82) * (sc >> 4) as f32;
            dl * q as f32 - ml
        }
        WeightFormat::Q3K => {
            let dl = f16_at(blk, 108) * (sub_scale(f, blk, e / 16) as i32 - 32) as f32;
            dl * q as f32
        }
        WeightFormat::Iq4Nl => f16_at(blk, 0) * IQ4[q as usize] as f32,
        _ => {
            let dl = f16_at(blk, 0) * (sub_scale(f, blk, e / 32) as i32 - 32) as f32;
            dl * IQ4[q as usize] as f32
        }
    }
}

/// Element `e`'s magnitudes the integer product's roundings scale with:
/// `|d·sc·q|` and Q2_K's `|dmin·m|`.
fn parts(f: Format, blk: &[u8], e: usize) -> f64 {
    let q = code(f, blk, e) as f64;
    match f.weight {
        WeightFormat::Q2K => {
            let sc = sub_scale(f, blk, e / 16);
            let d = f16_at(blk, 80) as f64 * (sc & 0x0f) as f64;
            let m = f16_at(blk, 82) as f64 * (sc >> 4) as f64;
            (d * q).abs() + m.abs()
        }
        WeightFormat::Q3K => {
            (f16_at(blk, 108) as f64 * (sub_scale(f, blk, e / 16) as f64 - 32.0) * q).abs()
        }
        WeightFormat::Iq4Nl => (f16_at(blk, 0) as f64 * IQ4[q as usize] as f64).abs(),
        _ => {
            let sc = sub_scale(f, blk, e / 32) as f64 - 32.0;
            (f16_at(blk, 0) as f64 * sc * IQ4[q as usize] as f64).abs()
        }
    }
}

fn first_difference(got: &[f32], want: &[f32]) -> Option<(usize, f32, f32)> {
    got.iter()
        .zip(want)
        .enumerate()
        .find(|(_, (g, w))| g.to_bits() != w.to_bits())
        .map(|(i, (&g, &w))| (i, g, w))
}

/// The f16 scales of every block of `f`.
fn block_scales(f: Format, tensors: &[Tensor]) -> Vec<f32> {
    let blocks = tensors.iter().flat_map(|t| t.raw.chunks_exact(f.block));
    blocks
        .flat_map(|blk| f.f16s.iter().map(move |&at| f16_at(blk, at)))
        .collect()
}

fn assert_edge_scales(n: &str, values: &[f32]) {
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
    assert!(values.iter().any(|&v| v == half::f16::MAX.to_f32()));
    assert!(values.iter().any(|&v| v == -half::f16::MAX.to_f32()));
}

#[test]
fn the_fixture_covers_what_it_claims() {
    for f in FORMATS {
        let (_, tensors) = open(f);
        let n = f.name;
        let mut codes = std::collections::BTreeSet::new();
        let mut subs = vec![false; f.sub_values];
        for t in &tensors {
            for blk in t.raw.chunks_exact(f.block) {
                codes.extend((0..f.elems).map(|e| code(f, blk, e)));
                for j in 0..f.subs {
                    subs[sub_scale(f, blk, j)] = true;
                }
            }
            for row in t.reference.chunks_exact(t.cols) {
                assert!(row.iter().any(|&v| v != 0.0), "{}: a zero row", t.name);
            }
        }
        assert!(
            codes.into_iter().eq(f.codes.0..=f.codes.1),
            "{n}: not every code"
        );
        assert!(subs.iter().all(|&s| s), "{n}: not every sub-block scale");
        assert_edge_scales(n, &block_scales(f, &tensors));
        // Our decoder of the layout gives gguf-py's values (a layout
        // mistake shows here as a position, not just a wrong value).
        for t in &tensors {
            for (b, blk) in t.raw.chunks_exact(f.block).enumerate() {
                for e in 0..f.elems {
                    let want = t.reference[b * f.elems + e];
                    let got = value(f, blk, e);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{} block {b} element {e}",
                        t.name
                    );
                }
            }
        }
        let all = || tensors.iter().flat_map(|t| &t.reference);
        assert!(all().any(|v| v.to_bits() == 0x8000_0000), "{n}: no -0");
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
                    i / f.elems,
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
            check_exact(&m, &t.name, &t.reference, 4700);
        }
    }
}

/// Integer terms per 32-element block take at most this many f32
/// roundings (kernels/low_k.rs and legacy_q8.rs count them).
const TERM_ROUNDINGS: usize = 4;

#[test]
fn integer_products_are_within_their_bound_of_gguf_pys_rows() {
    for f in FORMATS {
        let (file, tensors) = open(f);
        for t in &tensors {
            let m = file.matrix(&t.name, t.rows, t.cols).unwrap();
            let parts = |row: &[u8], e: usize| {
                parts(f, &row[e / f.elems * f.block..][..f.block], e % f.elems)
            };
            check_matrix(&m, &t.name, &t.reference, parts, 4900, TERM_ROUNDINGS);
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
    // tools/make_low_quant_model.py: a 256-wide Qwen3-MoE with its experts
    // and attention projections in Q2_K, Q3_K, IQ4_NL and IQ4_XS, beside a
    // twin holding gguf-py's dequantization of the same tensors in F32.
    let quantized = gguf("qwen3_moe.low.gguf");
    let twin = gguf("qwen3_moe.low.f32.gguf");
    let file = GgufFile::open(&quantized).unwrap();
    for (name, f) in [
        ("blk.0.attn_q.weight", WeightFormat::Iq4Xs),
        ("blk.0.attn_output.weight", WeightFormat::Iq4Nl),
        ("blk.0.ffn_gate_exps.weight", WeightFormat::Q2K),
        ("blk.0.ffn_up_exps.weight", WeightFormat::Q3K),
        ("blk.0.ffn_down_exps.weight", WeightFormat::Iq4Nl),
        ("blk.1.attn_q.weight", WeightFormat::Q3K),
        ("blk.1.attn_k.weight", WeightFormat::Q2K),
        ("blk.1.attn_v.weight", WeightFormat::Iq4Xs),
        ("blk.1.ffn_gate_exps.weight", WeightFormat::Iq4Xs),
        ("blk.1.ffn_up_exps.weight", WeightFormat::Q2K),
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
