//! Q4_K and Q5_K against the reference: the PyPI `gguf` package (gguf-py,
//! which llama.cpp maintains).
//!
//! Fixture `tests/fixtures/gguf/k_quants.gguf`, made by
//! tools/make_k_quant_fixture.py with gguf-py's GGUFWriter: for each of
//! `q4k` and `q5k`, random raw tensors `.a` (5 rows of 256), `.b` (3 rows
//! of 512) and `.c` (3 rows of 768), 20 super-blocks in all, holding every
//! 4-/5-bit code, every 6-bit scale and min (0 and 63 included) and `d`,
//! `dmin` ordinary of both signs, subnormal, f16's smallest normal, zero of
//! both signs and ±65504; beside each, `.f32`, gguf-py's
//! `quants.dequantize` of it. Checked here:
//! - our reader sees Q4_K/Q5_K matrices of the stated ggml dims, and
//!   `format_of` maps them to `WeightFormat::Q4K`/`Q5K`;
//! - `quant`'s unpacking helpers read ggml's layout (against a decoder
//!   written out here);
//! - `quant::dequantize_q4_k`/`dequantize_q5_k`, `row_to_f32` and
//!   `QMatrix::to_f32` give gguf-py's values bit for bit (signed zeros
//!   included);
//! - the exact product `dot_row` is `dot_f32` over gguf-py's row, bit for
//!   bit; the integer kernels (`kernels::q4_k::dot_q4_k_q8`/`dot_q5_k_q8`
//!   and the dispatched `KernelSet` entries, which give the scalar
//!   reference's bits) are within a rounding bound of the f64 product of
//!   gguf-py's row with the quantized activation, and within the
//!   activation's quantization error of the product with `x` itself;
//! - our quantizers, given gguf-py's values, re-dequantize within a bound
//!   derived from their scale choice.

use std::path::{Path, PathBuf};

use colibri_model::format::WeightFormat;
use colibri_model::kernels::{self, KernelSet, Q8Activation, dot_row, row_to_f32};
use colibri_model::quant::{self, Q4_K_BLOCK_BYTES, Q5_K_BLOCK_BYTES, QK, QK_K};
use colibri_model::source::gguf::{GgmlType, GgufFile};
use colibri_model::tensor::QMatrix;
use rand::{Rng, SeedableRng};

/// The fixture's tensors of each format: name suffix, rows, columns.
const SHAPES: [(&str, usize, usize); 3] = [("a", 5, 256), ("b", 3, 512), ("c", 3, 768)];
/// Super-blocks of each format over the three tensors.
const SUPERS: usize = 5 + 3 * 2 + 3 * 3;
/// f32's unit roundoff.
const U: f64 = f32::EPSILON as f64 / 2.0;

type Dequantize = fn(&[u8], &mut [f32]);
type Dot = fn(&[u8], &Q8Activation) -> f32;

/// One of the two formats, and colibri's functions for it.
#[derive(Clone, Copy)]
struct Format {
    /// The tensor name prefix in the fixture.
    name: &'static str,
    ty: GgmlType,
    weight: WeightFormat,
    block: usize,
    /// Bits per code: 4 or 5.
    bits: u32,
    dequantize: Dequantize,
    /// The scalar reference kernel.
    dot: Dot,
    /// A kernel set's entry for the format.
    pick: fn(&KernelSet) -> Dot,
    quantize: fn(&[f32]) -> colibri_model::Result<Vec<u8>>,
}

const FORMATS: [Format; 2] = [
    Format {
        name: "q4k",
        ty: GgmlType::Q4_K,
        weight: WeightFormat::Q4K,
        block: Q4_K_BLOCK_BYTES,
        bits: 4,
        dequantize: quant::dequantize_q4_k,
        dot: kernels::q4_k::dot_q4_k_q8,
        pick: |k| k.dot_q4_k_q8,
        quantize: quant::quantize_q4_k,
    },
    Format {
        name: "q5k",
        ty: GgmlType::Q5_K,
        weight: WeightFormat::Q5K,
        block: Q5_K_BLOCK_BYTES,
        bits: 5,
        dequantize: quant::dequantize_q5_k,
        dot: kernels::q4_k::dot_q5_k_q8,
        pick: |k| k.dot_q5_k_q8,
        quantize: quant::quantize_q5_k,
    },
];

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf/k_quants.gguf")
}

/// One raw tensor of the fixture and gguf-py's dequantization of it.
struct Tensor {
    name: String,
    rows: usize,
    cols: usize,
    /// The raw bytes, row after row.
    raw: Vec<u8>,
    /// gguf-py's values, row after row.
    reference: Vec<f32>,
}

impl Tensor {
    fn row_bytes(&self, f: Format) -> usize {
        self.cols / QK_K * f.block
    }
}

fn open(f: Format) -> (GgufFile, Vec<Tensor>) {
    let file = GgufFile::open(&fixture()).unwrap();
    let mut tensors = Vec::new();
    for (suffix, rows, cols) in SHAPES {
        let name = format!("{}.{suffix}", f.name);
        let t = file.tensor(&name).unwrap();
        assert_eq!(t.ty, f.ty, "{name}");
        assert_eq!(t.ne, [cols as u64, rows as u64], "{name}");
        assert_eq!(t.size as usize, rows * cols / QK_K * f.block, "{name}");
        assert_eq!(file.format_of(t).unwrap(), f.weight, "{name}");
        let fname = format!("{name}.f32");
        let t = file.tensor(&fname).unwrap();
        assert_eq!(t.ty, GgmlType::F32, "{fname}");
        assert_eq!(t.ne, [cols as u64, rows as u64], "{fname}");
        let raw = file.bytes(&name).unwrap().as_slice().to_vec();
        let reference: Vec<f32> = file
            .bytes(&fname)
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

/// ggml's layout, written out independently of `quant`'s helpers: a
/// super-block's f16 `d` and `dmin`, ...
fn d_dmin(blk: &[u8]) -> (f32, f32) {
    let h = |i: usize| half::f16::from_bits(u16::from_le_bytes([blk[i], blk[i + 1]])).to_f32();
    (h(0), h(2))
}

/// ... sub-block `j`'s 6-bit scale and min (`get_scale_min_k4`) ...
fn scale_min(blk: &[u8], j: usize) -> (u8, u8) {
    let s = &blk[4..16];
    if j < 4 {
        (s[j] & 0x3f, s[4 + j] & 0x3f)
    } else {
        let (lo, hi) = (s[8 + (j - 4)], (s[j - 4] >> 6, s[j] >> 6));
        ((lo & 0x0f) | (hi.0 << 4), (lo >> 4) | (hi.1 << 4))
    }
}

/// ... and element `e`'s code: in the 32 bytes of nibbles of its 64
/// elements, the low nibble for the first 32, the high for the next; for
/// Q5_K with bit `e / 32` of `qh[e % 32]` above.
fn code(f: Format, blk: &[u8], e: usize) -> u8 {
    let qs = if f.bits == 4 { 16 } else { 48 };
    let byte = blk[qs + 32 * (e / 64) + e % 32];
    let low = if e % 64 < 32 { byte & 0x0f } else { byte >> 4 };
    if f.bits == 4 {
        low
    } else {
        low | (((blk[16 + e % 32] >> (e / 32)) & 1) << 4)
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
    for f in FORMATS {
        let (_, tensors) = open(f);
        let mut codes = vec![false; 1 << f.bits];
        let (mut scales, mut mins) = ([false; 64], [false; 64]);
        let mut high_bits = [[false; 4]; 2];
        let mut ds = Vec::new();
        for t in &tensors {
            for blk in t.raw.chunks_exact(f.block) {
                for e in 0..QK_K {
                    codes[code(f, blk, e) as usize] = true;
                }
                for j in 0..8 {
                    let (sc, m) = scale_min(blk, j);
                    scales[sc as usize] = true;
                    mins[m as usize] = true;
                    if j >= 4 {
                        high_bits[0][(sc >> 4) as usize] = true;
                        high_bits[1][(m >> 4) as usize] = true;
                    }
                }
                let (d, dmin) = d_dmin(blk);
                ds.push([d, dmin]);
            }
            // No row is all zeros: the products below are never trivial.
            for row in t.reference.chunks_exact(t.cols) {
                assert!(row.iter().any(|&v| v != 0.0), "{}: a zero row", t.name);
            }
        }
        let n = f.name;
        assert_eq!(ds.len(), SUPERS);
        assert!(codes.iter().all(|&c| c), "{n}: not every code occurs");
        assert!(scales.iter().all(|&c| c), "{n}: not every scale occurs");
        assert!(mins.iter().all(|&c| c), "{n}: not every min occurs");
        assert!(
            high_bits.iter().flatten().all(|&c| c),
            "{n}: sub-blocks 4..7 miss some top bits"
        );
        for (which, name) in [(0, "d"), (1, "dmin")] {
            let v: Vec<f32> = ds.iter().map(|p| p[which]).collect();
            assert!(v.iter().any(|&d| d > 0.0), "{n}: no positive {name}");
            assert!(v.iter().any(|&d| d < 0.0), "{n}: no negative {name}");
            assert!(v.iter().any(|&d| d.to_bits() == 0), "{n}: no +0 {name}");
            assert!(
                v.iter().any(|&d| d.to_bits() == 0x8000_0000),
                "{n}: no -0 {name}"
            );
            assert!(
                v.iter()
                    .any(|&d| d != 0.0 && d.abs() < half::f16::MIN_POSITIVE.to_f32()),
                "{n}: no subnormal {name}"
            );
            assert!(
                v.iter().any(|&d| d.abs() == half::f16::MAX.to_f32()),
                "{n}: no large {name}"
            );
            assert!(v.iter().all(|d| d.is_finite()));
        }
        // Zeros of both signs occur in gguf-py's values: the bit
        // comparisons below check the signs too.
        let all = || tensors.iter().flat_map(|t| &t.reference);
        assert!(all().any(|v| v.to_bits() == 0x8000_0000), "{n}: no -0");
        assert!(all().any(|v| v.to_bits() == 0), "{n}: no +0");
    }
}

#[test]
fn unpacking_helpers_read_ggml_layout() {
    // Pinpoints a layout mistake the bit comparisons would only report as
    // a wrong value.
    for f in FORMATS {
        let (_, tensors) = open(f);
        for t in &tensors {
            for (s, blk) in t.raw.chunks_exact(f.block).enumerate() {
                let at = format!("{} super-block {s}", t.name);
                let (d, dmin) = quant::k4_d_dmin(blk);
                let want = d_dmin(blk);
                assert_eq!(
                    (d.to_bits(), dmin.to_bits()),
                    (want.0.to_bits(), want.1.to_bits()),
                    "{at}: d, dmin"
                );
                for j in 0..8 {
                    let (sc, m) = scale_min(blk, j);
                    assert_eq!(
                        quant::k4_scale_min(&blk[quant::K_SCALES..], j),
                        (sc as i32, m as i32),
                        "{at}: sub-block {j}'s scale and min"
                    );
                }
                for e in 0..QK_K {
                    let got = if f.bits == 4 {
                        quant::q4_k_code(blk, e)
                    } else {
                        quant::q5_k_code(blk, e)
                    };
                    assert_eq!(got, code(f, blk, e) as i32, "{at}: element {e}'s code");
                }
            }
        }
    }
}

#[test]
fn dequantization_equals_gguf_py_bit_for_bit() {
    for f in FORMATS {
        let (file, tensors) = open(f);
        for t in &tensors {
            let m = file.matrix(&t.name, t.rows, t.cols).unwrap();
            assert_eq!(m.format, f.weight, "{}", t.name);
            assert_eq!((m.rows, m.cols), (t.rows, t.cols));
            assert_eq!(m.data().as_slice(), &t.raw[..]);

            let mut all = vec![f32::NAN; t.rows * t.cols];
            (f.dequantize)(&t.raw, &mut all);
            if let Some((i, g, w)) = first_difference(&all, &t.reference) {
                panic!(
                    "{} dequantize: {} element {i} (row {}, column {}, super-block {}, \
                     sub-block {}): {g:e} ({:#010x}) vs gguf-py {w:e} ({:#010x})",
                    f.name,
                    t.name,
                    i / t.cols,
                    i % t.cols,
                    i / QK_K,
                    i % QK_K / QK,
                    g.to_bits(),
                    w.to_bits()
                );
            }

            let mut row = vec![0.0f32; t.cols];
            for r in 0..t.rows {
                let want = &t.reference[r * t.cols..(r + 1) * t.cols];
                row.fill(f32::NAN);
                row_to_f32(&m, r, &mut row);
                if let Some((i, g, w)) = first_difference(&row, want) {
                    panic!(
                        "row_to_f32: {} row {r} element {i}: {g:e} ({:#010x}) vs gguf-py {w:e} ({:#010x})",
                        t.name,
                        g.to_bits(),
                        w.to_bits()
                    );
                }
                // A row on its own (the kernels' unit) agrees too.
                let rb = t.row_bytes(f);
                row.fill(f32::NAN);
                (f.dequantize)(&t.raw[r * rb..(r + 1) * rb], &mut row);
                assert!(first_difference(&row, want).is_none(), "{} row {r}", t.name);
            }
            // The matrix as a whole (QMatrix::to_f32) agrees too.
            assert!(first_difference(&m.to_f32(), &t.reference).is_none());
        }
    }
}

/// Activations of `cols` elements: random, then with a block at ±1 (quants
/// ±127) and a zero block, then random of another scale. None is zero.
fn activations(cols: usize) -> Vec<Vec<f32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4500 + cols as u64);
    let mut xs = Vec::new();
    xs.push((0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect());
    let mut x: Vec<f32> = (0..cols).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    for v in &mut x[..QK] {
        *v = if rng.random() { 1.0 } else { -1.0 };
    }
    x[5 * QK..6 * QK].fill(0.0);
    xs.push(x);
    xs.push((0..cols).map(|_| rng.random_range(-40.0f32..7.0)).collect());
    xs
}

fn check_products(k: &KernelSet, f: Format, t: &Tensor, m: &QMatrix) {
    let rb = t.row_bytes(f);
    for (xi, x) in activations(t.cols).iter().enumerate() {
        let a = Q8Activation::quantize(x);
        assert!(a.quants.iter().any(|&q| q != 0));
        for r in 0..t.rows {
            let w = &t.reference[r * t.cols..(r + 1) * t.cols];
            let bytes = &t.raw[r * rb..(r + 1) * rb];
            let at = format!("{} kernels, {} row {r}, x {xi}", k.name, t.name);

            // The integer kernel against the f64 product of gguf-py's row
            // with the quantized activation's values. Block b's exact term
            // is d·x.d·A − dmin·x.d·B (A = sc·Σq·a, B = m·Σa, integers);
            // the kernel rounds d·x.d (1), the min term (2: dmin·x.d, ·B)
            // and the fused multiply-add (1), then adds the terms into 4
            // lanes (at most 6 per lane here: 5 roundings, the first add to
            // 0 being exact) and the lanes in a tree (2): at most γ₁₀ times
            // P = Σₑ (|d·sc·q| + |dmin·m|)·|x.d·a|. gguf-py's element
            // rounds its subtraction once (≤ u·(|d·sc·q| + |dmin·m|)): u·P
            // more, and the f64 sums are far below u. So ≤ 12u·P. (P, not
            // Σ|terms|: the two parts of an element may cancel.)
            let got = (f.pick)(k)(bytes, &a) as f64;
            let terms = || {
                (0..t.cols).map(|e| w[e] as f64 * (a.scales[e / QK] as f64 * a.quants[e] as f64))
            };
            let dequantized: f64 = terms().sum();
            let p: f64 = (0..t.cols)
                .map(|e| {
                    let blk = &bytes[e / QK_K * f.block..][..f.block];
                    let (d, dmin) = d_dmin(blk);
                    let (sc, mn) = scale_min(blk, e % QK_K / QK);
                    let q = code(f, blk, e % QK_K);
                    let part =
                        (d as f64 * sc as f64 * q as f64).abs() + (dmin as f64 * mn as f64).abs();
                    part * (a.scales[e / QK] as f64 * a.quants[e] as f64).abs()
                })
                .sum();
            assert!(
                terms().any(|v| v != 0.0),
                "{at}: an all-zero product proves nothing"
            );
            assert!(
                (got - dequantized).abs() <= 12.0 * U * p,
                "{at}: integer kernel {got:e} vs {dequantized:e} (P {p:e}, off by {:.2}u·P)",
                (got - dequantized).abs() / (U * p)
            );
            // The selected kernel gives the scalar reference kernel's bits.
            let reference = (f.dot)(bytes, &a);
            assert_eq!(
                (got as f32).to_bits(),
                reference.to_bits(),
                "{at}: {got:e} vs the scalar reference kernel {reference:e}"
            );

            // And against x itself: the activation's quantization
            // (q = round(x · fl(1/x.d))) moves each element by at most
            // half its block's step, plus 255u steps from the rounded
            // inverse and product.
            let full: f64 = w.iter().zip(x).map(|(&w, &x)| w as f64 * x as f64).sum();
            let act_err: f64 = (0..t.cols)
                .map(|e| (w[e] as f64).abs() * a.scales[e / QK] as f64 * (0.5 + 256.0 * U))
                .sum();
            assert!(
                (got - full).abs() <= act_err + 12.0 * U * p,
                "{at}: integer kernel {got:e} vs the product with x {full:e} (bound {act_err:e})"
            );

            // The exact product is dot_f32 over gguf-py's row.
            let exact = dot_row(k, m, r, x);
            let want = (k.dot_f32)(w, x);
            assert_eq!(
                exact.to_bits(),
                want.to_bits(),
                "{at}: dot_row {exact:e} vs {want:e}"
            );
        }
    }
}

#[test]
fn products_agree_with_gguf_py_values() {
    for f in FORMATS {
        let (file, tensors) = open(f);
        for t in &tensors {
            let m = file.matrix(&t.name, t.rows, t.cols).unwrap();
            // The scalar set (the reference kernels), then the dispatched
            // one (whatever this CPU selects: AVX2, NEON, ...).
            check_products(&kernels::SCALAR, f, t, &m);
            check_products(kernels::kernels(), f, t, &m);
        }
    }
}

#[test]
fn our_quantizers_re_dequantize_close_to_gguf_py_values() {
    // gguf-py's values are a valid encoding, but our quantizer picks its
    // own scales (per sub-block the step (hi − lo)/L over [lo, hi] ∋ 0,
    // L = 15 or 31, and the min −lo; d, dmin = the largest of them / 63
    // in f16; 6-bit scales and mins rounded to them), so the bytes
    // differ; the values must come back within what that choice allows.
    // Per super-block with D = max step / 63, Dm = max min / 63 (the d,
    // dmin it wants), f16 puts d within h = D·2⁻¹⁰ + 2⁻²⁵ of D (likewise
    // hm). An element's error is at most half a step (d·sc ≤ 63·d), plus
    // where the grid's ends miss [lo, hi]: L times a step's error
    // (≤ d/2 + 63h) and the min's (≤ dmin/2 + 63hm); plus f32 roundings.
    for f in FORMATS {
        let (_, tensors) = open(f);
        let levels = ((1u32 << f.bits) - 1) as f64;
        let mut skipped = 0;
        for t in &tensors {
            let q = (f.quantize)(&t.reference).unwrap();
            assert_eq!(q.len(), t.raw.len());
            let mut y = vec![f32::NAN; t.rows * t.cols];
            (f.dequantize)(&q, &mut y);
            for (s, (xs, ys)) in t
                .reference
                .chunks_exact(QK_K)
                .zip(y.chunks_exact(QK_K))
                .enumerate()
            {
                let (mut step, mut min, mut amax) = (0.0f64, 0.0f64, 0.0f64);
                for sub in xs.chunks_exact(QK) {
                    let lo = sub.iter().fold(0.0f64, |m, &v| m.min(v as f64));
                    let hi = sub.iter().fold(lo, |m, &v| m.max(v as f64));
                    step = step.max((hi - lo) / levels);
                    min = min.max(-lo);
                    amax = sub.iter().fold(amax, |m, &v| m.max((v as f64).abs()));
                }
                let (d, dm) = (step / 63.0, min / 63.0);
                let f16_max = half::f16::MAX.to_f64();
                if d > f16_max || dm > f16_max {
                    // Past f16's range: the super-block with d = dmin =
                    // −65504 spans down to −65504·63·L, a min our form
                    // (d, dmin ≥ 0, the min from lo) needs dmin ≈ 65504·L
                    // for; the quantizer stores dmin = inf and the values
                    // come back NaN (ggml's quantizer, of the same form,
                    // would overflow alike). Real weights are nowhere
                    // near; that one super-block is skipped.
                    skipped += 1;
                    continue;
                }
                let (h, hm) = (
                    d * 2f64.powi(-10) + 2f64.powi(-25),
                    dm * 2f64.powi(-10) + 2f64.powi(-25),
                );
                let bound = 31.5 * (d + h)
                    + levels * ((d + h) / 2.0 + 63.0 * h)
                    + (dm + hm) / 2.0
                    + 63.0 * hm
                    + 16.0 * U * (amax + 63.0 * (dm + hm) + levels * 63.0 * (d + h));
                for (e, (&a, &b)) in xs.iter().zip(ys).enumerate() {
                    assert!(
                        ((a as f64) - (b as f64)).abs() <= bound,
                        "{} super-block {s} element {e}: {a:e} re-dequantized as {b:e} (bound {bound:e})",
                        t.name
                    );
                }
                if amax == 0.0 {
                    // An all-zero super-block comes back as zeros.
                    assert!(ys.iter().all(|&v| v == 0.0));
                }
            }
        }
        assert_eq!(skipped, 1, "{}: super-blocks past f16's range", f.name);
    }
}
