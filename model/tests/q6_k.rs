//! Q6_K against the reference: the PyPI `gguf` package (gguf-py, which
//! llama.cpp maintains).
//!
//! Fixture `tests/fixtures/gguf/q6_k.gguf`, made by
//! tools/make_q6_k_fixture.py with gguf-py's GGUFWriter: `q6k`, 3 rows of
//! 768 random Q6_K elements (every code, both scale signs, the scale
//! extremes; `d` ordinary, negative, subnormal, f16's smallest normal and
//! 0), and `q6k.f32`, gguf-py's `quants.dequantize` of it. Checked here:
//! - our reader sees a Q6_K matrix of ggml dims [768, 3];
//! - `row_to_f32` and `quant::dequantize_q6_k` give gguf-py's values bit
//!   for bit (signed zeros included);
//! - the exact product `dot_row` is `dot_f32` over gguf-py's row, bit for
//!   bit; the integer kernel is within rounding of the f64 product of
//!   gguf-py's row with the quantized activation, and within the
//!   activation's quantization error of the product with `x` itself;
//! - our quantizer, given gguf-py's values, re-dequantizes within a bound
//!   derived from its scale choice.

use std::path::{Path, PathBuf};

use colibri_model::format::WeightFormat;
use colibri_model::kernels::{self, KernelSet, Q8Activation, dot_row, row_to_f32};
use colibri_model::quant::{self, Q6_K_BLOCK_BYTES, QK, QK_K};
use colibri_model::source::gguf::{GgmlType, GgufFile};
use rand::{Rng, SeedableRng};

const ROWS: usize = 3;
const COLS: usize = 768;
/// Bytes of one row: 3 super-blocks.
const ROW_BYTES: usize = COLS / QK_K * Q6_K_BLOCK_BYTES;
/// f32's unit roundoff.
const U: f64 = f32::EPSILON as f64 / 2.0;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf/q6_k.gguf")
}

struct Fixture {
    file: GgufFile,
    /// The raw Q6_K bytes, row after row.
    raw: Vec<u8>,
    /// gguf-py's dequantization, row after row.
    reference: Vec<f32>,
}

fn open() -> Fixture {
    let file = GgufFile::open(&fixture()).unwrap();
    let t = file.tensor("q6k").unwrap();
    assert_eq!(t.ty, GgmlType::Q6_K);
    assert_eq!(t.ne, [COLS as u64, ROWS as u64]);
    assert_eq!(t.size as usize, ROWS * ROW_BYTES);
    let t = file.tensor("q6k.f32").unwrap();
    assert_eq!(t.ty, GgmlType::F32);
    assert_eq!(t.ne, [COLS as u64, ROWS as u64]);
    let raw = file.bytes("q6k").unwrap().as_slice().to_vec();
    let reference: Vec<f32> = file
        .bytes("q6k.f32")
        .unwrap()
        .as_slice()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(reference.len(), ROWS * COLS);
    Fixture {
        file,
        raw,
        reference,
    }
}

/// The first element where `got` and gguf-py's values differ in bits.
fn first_difference(got: &[f32], want: &[f32]) -> Option<(usize, f32, f32)> {
    got.iter()
        .zip(want)
        .enumerate()
        .find(|(_, (g, w))| g.to_bits() != w.to_bits())
        .map(|(i, (&g, &w))| (i, g, w))
}

#[test]
fn the_fixture_covers_what_it_claims() {
    // Guards the other tests' meaning: if the fixture were regenerated
    // without its special cases, they would prove less.
    let f = open();
    let ds: Vec<f32> = f
        .raw
        .chunks_exact(Q6_K_BLOCK_BYTES)
        .map(quant::q6_k_d)
        .collect();
    assert_eq!(ds.len(), ROWS * COLS / QK_K);
    assert!(ds.iter().any(|&d| d > 0.0));
    assert!(ds.iter().any(|&d| d < 0.0));
    assert_eq!(ds.iter().filter(|&&d| d == 0.0).count(), 1);
    assert!(
        ds.iter()
            .any(|&d| d != 0.0 && d.abs() < half::f16::MIN_POSITIVE.to_f32())
    );
    let mut codes = [false; 64];
    let (mut neg, mut pos) = (false, false);
    for blk in f.raw.chunks_exact(Q6_K_BLOCK_BYTES) {
        for e in 0..QK_K {
            codes[(quant::q6_k_code(blk, e) + 32) as usize] = true;
        }
        for j in 0..QK_K / 16 {
            neg |= quant::q6_k_scale(blk, j) < 0;
            pos |= quant::q6_k_scale(blk, j) > 0;
        }
    }
    assert!(codes.iter().all(|&c| c), "not every code occurs");
    assert!(neg && pos);
    // Zeros of both signs occur (the d = 0 super-block, code 0 under
    // either scale sign): the bit comparisons below check the signs too.
    assert!(f.reference.iter().any(|v| v.to_bits() == 0x8000_0000));
    assert!(f.reference.iter().any(|v| v.to_bits() == 0));
}

#[test]
fn dequantization_equals_gguf_py_bit_for_bit() {
    let f = open();
    let m = f.file.matrix("q6k", ROWS, COLS).unwrap();
    assert_eq!(m.format, WeightFormat::Q6K);
    assert_eq!((m.rows, m.cols), (ROWS, COLS));
    assert_eq!(m.data().as_slice(), &f.raw[..]);
    let mut row = vec![0.0f32; COLS];
    for r in 0..ROWS {
        let want = &f.reference[r * COLS..(r + 1) * COLS];
        row.fill(f32::NAN);
        row_to_f32(&m, r, &mut row);
        if let Some((i, g, w)) = first_difference(&row, want) {
            panic!(
                "row_to_f32: row {r} element {i}: {g:e} ({:#010x}) vs gguf-py {w:e} ({:#010x})",
                g.to_bits(),
                w.to_bits()
            );
        }
    }
    let mut all = vec![f32::NAN; ROWS * COLS];
    quant::dequantize_q6_k(&f.raw, &mut all);
    if let Some((i, g, w)) = first_difference(&all, &f.reference) {
        panic!(
            "dequantize_q6_k: element {i} (row {}, column {}): {g:e} ({:#010x}) vs gguf-py {w:e} ({:#010x})",
            i / COLS,
            i % COLS,
            g.to_bits(),
            w.to_bits()
        );
    }
    // The matrix as a whole (QMatrix::to_f32) agrees too.
    assert!(first_difference(&m.to_f32(), &f.reference).is_none());
}

/// Activations: random, then with a block at ±1 (quants ±127) and a zero
/// block, then random of another scale.
fn activations() -> Vec<Vec<f32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(614);
    let mut xs = Vec::new();
    xs.push((0..COLS).map(|_| rng.random_range(-1.0f32..1.0)).collect());
    let mut x: Vec<f32> = (0..COLS).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    for v in &mut x[..QK] {
        *v = if rng.random() { 1.0 } else { -1.0 };
    }
    x[5 * QK..6 * QK].fill(0.0);
    xs.push(x);
    xs.push((0..COLS).map(|_| rng.random_range(-40.0f32..7.0)).collect());
    xs
}

fn check_products(k: &KernelSet, f: &Fixture, m: &colibri_model::tensor::QMatrix) {
    for (xi, x) in activations().iter().enumerate() {
        let a = Q8Activation::quantize(x);
        for r in 0..ROWS {
            let w = &f.reference[r * COLS..(r + 1) * COLS];
            let bytes = &f.raw[r * ROW_BYTES..(r + 1) * ROW_BYTES];
            let at = format!("{} kernels, x {xi}, row {r}", k.name);

            // The exact product is dot_f32 over gguf-py's row.
            let exact = dot_row(k, m, r, x);
            let want = (k.dot_f32)(w, x);
            assert_eq!(
                exact.to_bits(),
                want.to_bits(),
                "{at}: dot_row {exact:e} vs {want:e}"
            );

            // The integer kernel against the f64 product of gguf-py's row
            // with the quantized activation's values. Its integer sums are
            // exact; each block's `f16(d) · x.d` rounds once, each of the 4
            // lanes adds its 6 blocks with an FMA each, and the lanes are
            // added twice: at most 9 roundings per term, so the error is
            // at most γ₉ ≤ 10u times Σ|terms|.
            let got = (k.dot_q6_k_q8)(bytes, &a) as f64;
            let terms =
                || (0..COLS).map(|e| w[e] as f64 * (a.scales[e / QK] as f64 * a.quants[e] as f64));
            let dequantized: f64 = terms().sum();
            let mag: f64 = terms().map(f64::abs).sum();
            assert!(mag > 0.0, "{at}: an all-zero product proves nothing");
            assert!(
                (got - dequantized).abs() <= 10.0 * U * mag,
                "{at}: integer kernel {got:e} vs {dequantized:e} (Σ|terms| {mag:e})"
            );
            // The scalar reference kernel gives the selected kernel's bits.
            let reference = kernels::q6_k::dot_q6_k_q8(bytes, &a);
            assert_eq!(
                got as f32, reference,
                "{at}: vs the scalar reference kernel"
            );

            // And against x itself: the activation's quantization moves
            // each element by at most half its block's step (plus the
            // step's own rounding).
            let full: f64 = w.iter().zip(x).map(|(&w, &x)| w as f64 * x as f64).sum();
            let act_err: f64 = (0..COLS)
                .map(|e| (w[e] as f64).abs() * a.scales[e / QK] as f64 * (0.5 + 4.0 * U))
                .sum();
            assert!(
                (got - full).abs() <= act_err + 10.0 * U * mag,
                "{at}: integer kernel {got:e} vs the product with x {full:e} (bound {act_err:e})"
            );
        }
    }
}

#[test]
fn products_agree_with_gguf_py_values() {
    let f = open();
    let m = f.file.matrix("q6k", ROWS, COLS).unwrap();
    // dot_row's Q6_K product dequantizes whatever the kernel set's mode:
    // the selected set and the scalar one both.
    check_products(kernels::kernels(), &f, &m);
    check_products(&kernels::SCALAR, &f, &m);
}

#[test]
fn our_quantizer_re_dequantizes_close_to_gguf_py_values() {
    // gguf-py's values are a valid Q6_K encoding, but our quantizer picks
    // its own scales (amax/31 per sub-block, d = largest/127 in f16), so
    // the bytes differ; the values must come back within the error its
    // choice allows. Per super-block with M = max|x| and D = M/(31·127)
    // (the d it wants), d = f16(D) is within h = max(D·2⁻¹¹, 2⁻²⁵) of D;
    // an element's error is at most half a step (d · sc ≤ 127 d), or what
    // a clamped code or sub-block scale leaves (≤ 15.5 d, or ≤ 31·127·h):
    // ≤ 64 (D + h) + 3937 h, plus the f32 roundings of dequantization.
    let f = open();
    let q = quant::quantize_q6_k(&f.reference).unwrap();
    assert_eq!(q.len(), f.raw.len());
    let mut y = vec![f32::NAN; ROWS * COLS];
    quant::dequantize_q6_k(&q, &mut y);
    for (s, (xs, ys)) in f
        .reference
        .chunks_exact(QK_K)
        .zip(y.chunks_exact(QK_K))
        .enumerate()
    {
        let m = xs.iter().fold(0.0f64, |m, &v| m.max((v as f64).abs()));
        let d = m / (31.0 * 127.0);
        let h = (d * 2f64.powi(-11)).max(2f64.powi(-25));
        let bound = 64.0 * (d + h) + 3937.0 * h + 4.0 * U * m;
        for (e, (&a, &b)) in xs.iter().zip(ys).enumerate() {
            assert!(
                ((a as f64) - (b as f64)).abs() <= bound,
                "super-block {s} element {e}: {a:e} re-dequantized as {b:e} (bound {bound:e})"
            );
        }
        if m == 0.0 {
            // The d = 0 super-block comes back as zeros.
            assert!(ys.iter().all(|&v| v == 0.0));
        }
    }
}
