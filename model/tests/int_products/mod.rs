//! The 8-bit-activation products of the block formats checked against
//! gguf-py's values (shared by legacy_quants.rs and low_quants.rs): a
//! row's integer product against the f64 product of gguf-py's row with the
//! quantized activation's values, and against the activation itself.

use colibri_model::Pool;
use colibri_model::format::WeightFormat;
use colibri_model::kernels::{self, KernelSet, Q8Activation};
use colibri_model::quant::QK;
use colibri_model::tensor::QMatrix;
use rand::{Rng, SeedableRng};

/// f32's unit roundoff.
pub const U: f64 = f32::EPSILON as f64 / 2.0;

/// Activations of `cols` elements: random; then with a block of ±1
/// (quants ±127) and, where the row has three blocks or more, a zero
/// block; then random of another scale and sign balance. None is zero.
pub fn activations(cols: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed + cols as u64);
    let mut xs = Vec::new();
    xs.push((0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect());
    let mut x: Vec<f32> = (0..cols).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    for v in &mut x[..QK] {
        *v = if rng.random() { 1.0 } else { -1.0 };
    }
    if cols >= 3 * QK {
        x[2 * QK..3 * QK].fill(0.0);
    }
    xs.push(x);
    xs.push((0..cols).map(|_| rng.random_range(-40.0f32..7.0)).collect());
    xs
}

/// One row of a block format: its bytes, gguf-py's values, and per
/// element the magnitudes the product's rounding errors scale with
/// (`|d·sc·q| + |dmin·m|`, or `|value|` for a format without a min).
pub struct Row<'a> {
    pub bytes: &'a [u8],
    pub values: &'a [f32],
    pub parts: Vec<f64>,
}

/// Checks `k`'s integer product of `row` with `x` (quantized as the
/// kernels do):
///
/// - against the f64 product of gguf-py's row with the quantized
///   activation's values: each 32-element block's term takes at most
///   `term_roundings` f32 roundings (the kernel's docs count them), the
///   terms go into 4 lanes (`⌈blocks/4⌉` adds each) reduced in a tree (2),
///   and gguf-py's element rounds once more than the exact `parts`: at
///   most `(term_roundings + ⌈blocks/4⌉ + 3)·u·P`, `P = Σₑ partsₑ·|aₑ|`;
/// - against the product with `x` itself: the quantization moves each
///   element by at most half its block's step (plus 256u steps from the
///   rounded inverse scale);
/// - it gives the scalar reference's bits.
///
/// Returns the product, and whether any term of it was non-zero (a row
/// whose blocks all have zero scales, or meet only zero activation
/// blocks, checks nothing: callers assert that most rows do not).
pub fn check_row(
    k: &KernelSet,
    format: WeightFormat,
    row: &Row<'_>,
    x: &[f32],
    term_roundings: usize,
    what: &str,
) -> (f32, bool) {
    let a = Q8Activation::quantize(x);
    assert!(a.quants.iter().any(|&q| q != 0));
    let cols = row.values.len();
    let blocks = cols / QK;
    let got = (k.dot_more_q8)(format, row.bytes, &a);
    let xa = |e: usize| a.scales[e / QK] as f64 * a.quants[e] as f64;
    let terms = || (0..cols).map(|e| row.values[e] as f64 * xa(e));
    let dequantized: f64 = terms().sum();
    let p: f64 = (0..cols).map(|e| row.parts[e] * xa(e).abs()).sum();
    let bound = (term_roundings + blocks.div_ceil(4) + 3) as f64 * U * p;
    let off = (got as f64 - dequantized).abs();
    assert!(
        off <= bound,
        "{what}: integer product {got:e} vs {dequantized:e} (P {p:e}, off by {:.2}u·P)",
        off / (U * p)
    );
    let full: f64 = row
        .values
        .iter()
        .zip(x)
        .map(|(&w, &x)| w as f64 * x as f64)
        .sum();
    let act_err: f64 = (0..cols)
        .map(|e| (row.values[e] as f64).abs() * a.scales[e / QK] as f64 * (0.5 + 256.0 * U))
        .sum();
    assert!(
        (got as f64 - full).abs() <= act_err + bound,
        "{what}: integer product {got:e} vs the product with x {full:e} (bound {act_err:e})"
    );
    let reference = colibri_model::kernels::dot_more_q8(format, row.bytes, &a);
    assert_eq!(
        got.to_bits(),
        reference.to_bits(),
        "{what}: {got:e} vs the scalar reference {reference:e}"
    );
    (got, terms().any(|v| v != 0.0))
}

/// [`check_row`] on every row of `m` (named `name`; `values`, gguf-py's
/// values of it, row-major; `parts(row, e)`, element `e`'s parts from the
/// row's bytes) against [`activations`] of seed `seed`, with the scalar
/// and the selected kernels; most rows must give a non-zero product. Then
/// the pool's `matvec` and `matmul` give the selected row kernel's bits,
/// where 8-bit activations are on.
pub fn check_matrix(
    m: &QMatrix,
    name: &str,
    values: &[f32],
    parts: impl Fn(&[u8], usize) -> f64,
    seed: u64,
    term_roundings: usize,
) {
    let (rows, cols) = (m.rows, m.cols);
    let raw = m.data().as_slice();
    let rb = raw.len() / rows;
    let rows_: Vec<Row<'_>> = (0..rows)
        .map(|r| {
            let bytes = &raw[r * rb..(r + 1) * rb];
            Row {
                bytes,
                values: &values[r * cols..(r + 1) * cols],
                parts: (0..cols).map(|e| parts(bytes, e)).collect(),
            }
        })
        .collect();
    let xs = activations(cols, seed);
    let mut want = Vec::new();
    for (xi, x) in xs.iter().enumerate() {
        for k in [&kernels::SCALAR, kernels::kernels()] {
            let (products, nonzero): (Vec<f32>, Vec<bool>) = rows_
                .iter()
                .enumerate()
                .map(|(r, row)| {
                    let what = format!("{} kernels, {name} row {r}, x {xi}", k.name);
                    check_row(k, m.format, row, x, term_roundings, &what)
                })
                .unzip();
            let n = nonzero.iter().filter(|&&v| v).count();
            assert!(2 * n > rows, "{name}: {n} non-zero products");
            if std::ptr::eq(k, kernels::kernels()) {
                want.extend(products);
            }
        }
    }
    // The pool's products take these kernels (unless the exact ones were
    // asked for).
    if !kernels::kernels().int_activations {
        return;
    }
    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let pool = Pool::new(3).unwrap();
    let mut y = vec![f32::NAN; rows];
    kernels::matvec(&pool, m, &xs[0], &mut y);
    assert_eq!(bits(&y), bits(&want[..rows]), "{name} matvec");
    let mut y = vec![f32::NAN; xs.len() * rows];
    kernels::matmul(&pool, m, &xs.concat(), xs.len(), &mut y);
    assert_eq!(bits(&y), bits(&want), "{name} matmul");
}

/// The exact product (`dot_row`, f32 input) of every row of `m` is
/// `dot_f32` over gguf-py's row (`values`, row-major), bit for bit, with
/// the scalar and the selected kernels.
pub fn check_exact(m: &QMatrix, name: &str, values: &[f32], seed: u64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<f32> = (0..m.cols)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    for k in [&kernels::SCALAR, kernels::kernels()] {
        for r in 0..m.rows {
            let want = (k.dot_f32)(&values[r * m.cols..(r + 1) * m.cols], &x);
            let got = kernels::dot_row(k, m, r, &x);
            let what = format!("{} {name} row {r}", k.name);
            assert_eq!(got.to_bits(), want.to_bits(), "{what}");
        }
    }
}

/// Runs test `name` of this binary again with `COLIBRI_EXACT_QUANT=1`.
pub fn exact_in_a_child(name: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env("COLIBRI_EXACT_QUANT", "1")
        .args([name, "--exact", "--test-threads", "1"])
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

/// 8-bit activations move a random model's logits a little, never to the
/// twin's bits: the mean |Δ| stays under 5% of the logits' spread, and
/// most positions keep their argmax.
pub fn close_to_the_twin(got: &[f32], want: &[f32], positions: usize, what: &str) {
    assert!(
        got.iter()
            .zip(want)
            .any(|(a, b)| a.to_bits() != b.to_bits()),
        "{what}: 8-bit activations changed nothing"
    );
    let spread = want.iter().copied().fold(f32::MIN, f32::max)
        - want.iter().copied().fold(f32::MAX, f32::min);
    let mean = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .sum::<f32>()
        / got.len() as f32;
    assert!(
        mean < 0.05 * spread,
        "{what}: mean |Δ| {mean}, spread {spread}"
    );
    let vocab = got.len() / positions;
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .fold((0, f32::MIN), |m, (i, &x)| if x > m.1 { (i, x) } else { m })
            .0
    };
    let same = got
        .chunks_exact(vocab)
        .zip(want.chunks_exact(vocab))
        .filter(|(g, w)| argmax(g) == argmax(w))
        .count();
    assert!(
        2 * same > positions,
        "{what}: argmax kept at {same} of {positions} positions"
    );
}
