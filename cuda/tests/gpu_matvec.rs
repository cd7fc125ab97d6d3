//! GPU checks of the matvec kernels (run on a GPU machine with
//! `cargo test -p colibri-cuda -- --ignored`, or tools/gpu_check.sh).
//!
//! For every format, on random matrices of awkward shapes (columns not a
//! multiple of 32 or 128 where the format allows, odd row lengths that
//! misalign rows, several shared-memory tiles):
//!
//! * against an f64 reference on the exact f32 elements: per element
//!   `|y − ref| ≤ 1e-5 · Σ|wᵢ·xᵢ|` — the sum's own scale, since cancellation
//!   can bring `ref` arbitrarily close to 0 (a wrong index or a lost group
//!   errs by ~Σ|wᵢxᵢ|/√n, thousands of times the bound);
//! * bit-identical across batch sizes (each token alone vs. 13 at once),
//!   repeated runs, placement (the same matrix at another alignment), and
//!   against the dequantized f32 twin of the same matrix;
//! * the grouped launch gives each matrix what a single launch gives.

mod common;

use colibri_cuda::{Fp8Scales, MatvecGroup, WeightFormat, WeightView, q8_row_bytes};
use common::*;

const BOUND: f64 = 1e-5;

/// Runs `y = W x` for `ntok` tokens with the matrix placed `shift` bytes
/// into its buffer.
fn run(
    fmt: WeightFormat,
    w: &Weights,
    rows: usize,
    cols: usize,
    x: &[f32],
    ntok: usize,
    shift: usize,
) -> Vec<f32> {
    let g = gpu();
    let mut bytes = vec![0xa5u8; shift];
    bytes.extend_from_slice(&w.bytes);
    let wb = upload(&bytes);
    let sb = upload(if w.scales.is_empty() {
        &[0.0f32][..]
    } else {
        &w.scales
    });
    let xb = upload(&x[..ntok * cols]);
    let mut y = poisoned(ntok * rows);
    let view = WeightView {
        format: fmt,
        rows,
        cols,
        data: wb.view(shift..bytes.len()).unwrap(),
        fp8: (fmt == WeightFormat::F8E4M3).then(|| Fp8Scales {
            scales: sb.as_view(),
            block: w.block,
        }),
    };
    g.k.matvec(&g.dev, &view, xb.as_view(), ntok, y.as_mut())
        .unwrap();
    g.dev.download(y.as_view()).unwrap()
}

/// A CPU reference of the 8-bit-activation formats: one row · one token.
type IntDot = fn(&[u8], &Q8Ref) -> f32;

fn check(fmt: WeightFormat, rows: usize, cols: usize, seed: u64) {
    let mut rng = rng(seed);
    let w = random_weights(&mut rng, fmt, rows, cols);
    let max_tok = 13;
    let x = nonzero(&mut rng, max_tok * cols, 0.01, 1.0);
    let name = format!("{fmt:?} {rows}x{cols}");

    let all = run(fmt, &w, rows, cols, &x, max_tok, 0);
    let (want, scale): (Vec<f64>, Vec<f64>) = (0..max_tok * rows)
        .map(|i| {
            let (t, r) = (i / rows, i % rows);
            let row = &w.f32[r * cols..(r + 1) * cols];
            let xt = &x[t * cols..(t + 1) * cols];
            let terms = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64);
            (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>())
        })
        .unzip();
    let int_dot: Option<(IntDot, &str)> = match fmt {
        WeightFormat::Q4_0Q8 => Some((dot_q4_0_q8_ref, "dot_q4_0_q8")),
        WeightFormat::Q8_0Q8 => Some((dot_q8_0_q8_ref, "dot_q8_0_q8")),
        WeightFormat::Q6KQ8 => Some((dot_q6_k_q8_ref, "dot_q6_k_q8")),
        WeightFormat::Q4KQ8 => Some((dot_q4_k_q8_ref, "dot_q4_k_q8")),
        WeightFormat::Q5KQ8 => Some((dot_q5_k_q8_ref, "dot_q5_k_q8")),
        WeightFormat::Q4_1Q8 => Some((
            |r, x| dot_legacy_q8_ref(WeightFormat::Q4_1, r, x),
            "dot_q4_1_q8",
        )),
        WeightFormat::Q5_0Q8 => Some((
            |r, x| dot_legacy_q8_ref(WeightFormat::Q5_0, r, x),
            "dot_q5_0_q8",
        )),
        WeightFormat::Q5_1Q8 => Some((
            |r, x| dot_legacy_q8_ref(WeightFormat::Q5_1, r, x),
            "dot_q5_1_q8",
        )),
        WeightFormat::Iq4NlQ8 => Some((
            |r, x| dot_legacy_q8_ref(WeightFormat::Iq4Nl, r, x),
            "dot_iq4_nl_q8",
        )),
        WeightFormat::Q2KQ8 => Some((
            |r, x| dot_low_k_q8_ref(WeightFormat::Q2K, r, x),
            "dot_q2_k_q8",
        )),
        WeightFormat::Q3KQ8 => Some((
            |r, x| dot_low_k_q8_ref(WeightFormat::Q3K, r, x),
            "dot_q3_k_q8",
        )),
        WeightFormat::Iq4XsQ8 => Some((
            |r, x| dot_low_k_q8_ref(WeightFormat::Iq4Xs, r, x),
            "dot_iq4_xs_q8",
        )),
        _ => None,
    };
    if let Some((dot, dot_name)) = int_dot {
        // The CPU tier's integer arithmetic, bit for bit; and near the exact
        // product: each input element moves by at most half its block's
        // step d, so |y − exact| ≤ Σ |wᵢ| · dᵢ / 2 (plus f32 rounding).
        let rb = fmt.row_bytes(cols).unwrap();
        let qs: Vec<Q8Ref> = (0..max_tok)
            .map(|t| quantize_q8_ref(&x[t * cols..(t + 1) * cols]))
            .collect();
        let reference: Vec<f32> = (0..max_tok * rows)
            .map(|i| dot(&w.bytes[(i % rows) * rb..][..rb], &qs[i / rows]))
            .collect();
        assert_bits(&format!("{name} vs {dot_name}"), &all, &reference);
        let step: Vec<f64> = (0..max_tok * rows)
            .map(|i| {
                let (t, r) = (i / rows, i % rows);
                let row = &w.f32[r * cols..(r + 1) * cols];
                row.iter()
                    .enumerate()
                    .map(|(c, &a)| (a as f64).abs() * qs[t].d[c / 32] as f64 / 2.0)
                    .sum::<f64>()
            })
            .collect();
        assert_close(&format!("{name} vs f64"), &all, &want, |i| {
            1.001 * step[i] + BOUND * scale[i]
        });
    } else {
        assert_close(&format!("{name} vs f64"), &all, &want, |i| BOUND * scale[i]);
    }

    for ntok in [1, 2, 3, 5, 8] {
        let part = run(fmt, &w, rows, cols, &x, ntok, 0);
        assert_bits(
            &format!("{name}: {ntok} tokens vs 13"),
            &part,
            &all[..ntok * rows],
        );
    }
    for t in [0, 7, 12] {
        let one = run(fmt, &w, rows, cols, &x[t * cols..], 1, 0);
        assert_bits(
            &format!("{name}: token {t} alone"),
            &one,
            &all[t * rows..(t + 1) * rows],
        );
    }
    assert_bits(
        &format!("{name}: repeated"),
        &run(fmt, &w, rows, cols, &x, max_tok, 0),
        &all,
    );
    let shifts: &[usize] = match fmt {
        WeightFormat::F32 => &[4, 8],
        WeightFormat::F8E4M3 => &[1, 2, 3],
        _ => &[2, 4, 6],
    };
    for &s in shifts {
        let moved = run(fmt, &w, rows, cols, &x, max_tok, s);
        assert_bits(&format!("{name}: placed {s} bytes further"), &moved, &all);
    }
    if int_dot.is_none() && fmt != WeightFormat::F32 {
        let twin = Weights {
            bytes: w.f32.iter().flat_map(|v| v.to_le_bytes()).collect(),
            f32: w.f32.clone(),
            scales: Vec::new(),
            block: w.block,
        };
        let f32_out = run(WeightFormat::F32, &twin, rows, cols, &x, max_tok, 0);
        assert_bits(
            &format!("{name} vs its dequantized f32 twin"),
            &all,
            &f32_out,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_f32() {
    check(WeightFormat::F32, 77, 1000, 1);
    check(WeightFormat::F32, 45, 131, 2);
    check(WeightFormat::F32, 33, 2500, 3);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_f16() {
    check(WeightFormat::F16, 77, 1000, 11);
    check(WeightFormat::F16, 45, 131, 12);
    check(WeightFormat::F16, 33, 2500, 13);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_bf16() {
    check(WeightFormat::Bf16, 77, 1000, 21);
    check(WeightFormat::Bf16, 45, 131, 22);
    check(WeightFormat::Bf16, 33, 2500, 23);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_fp8_block_scaled() {
    check(WeightFormat::F8E4M3, 259, 333, 31);
    check(WeightFormat::F8E4M3, 45, 131, 32);
    check(WeightFormat::F8E4M3, 130, 2100, 33);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q8_0() {
    check(WeightFormat::Q8_0, 301, 1184, 41);
    check(WeightFormat::Q8_0, 7, 96, 42);
    check(WeightFormat::Q8_0, 45, 2080, 43);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q4_0() {
    check(WeightFormat::Q4_0, 301, 1184, 51);
    check(WeightFormat::Q4_0, 7, 96, 52);
    check(WeightFormat::Q4_0, 45, 2080, 53);
}

/// Q4_0 with 8-bit activations: the CPU's `dot_q4_0_q8` bits, for rows of
/// 3, 37, 65 and 74 blocks (chains of unequal lengths, partial rounds).
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q4_0_q8_activations() {
    check(WeightFormat::Q4_0Q8, 301, 1184, 54);
    check(WeightFormat::Q4_0Q8, 7, 96, 55);
    check(WeightFormat::Q4_0Q8, 45, 2080, 56);
    check(WeightFormat::Q4_0Q8, 130, 2368, 57);
}

/// Q8_0 with 8-bit activations: the CPU's `dot_q8_0_q8` bits, for rows of
/// 3, 37, 65, 74 and 129 blocks (even and odd chains of unequal lengths,
/// partial rounds and tiles).
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q8_0_q8_activations() {
    check(WeightFormat::Q8_0Q8, 301, 1184, 58);
    check(WeightFormat::Q8_0Q8, 7, 96, 59);
    check(WeightFormat::Q8_0Q8, 45, 2080, 60);
    check(WeightFormat::Q8_0Q8, 130, 2368, 62);
    check(WeightFormat::Q8_0Q8, 33, 4128, 63);
}

/// Q6_K (llama.cpp's output matrices), exact: the dequantized twin's bits;
/// rows of 1, 3 and 9 super-blocks.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q6_k() {
    check(WeightFormat::Q6K, 301, 768, 64);
    check(WeightFormat::Q6K, 7, 256, 65);
    check(WeightFormat::Q6K, 45, 2304, 66);
}

/// Q6_K with 8-bit activations: the CPU's `dot_q6_k_q8` bits, for rows of
/// 8, 24, 72 and 80 blocks (one or two rounds of a tile, partial rounds).
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q6_k_q8_activations() {
    check(WeightFormat::Q6KQ8, 301, 768, 67);
    check(WeightFormat::Q6KQ8, 7, 256, 68);
    check(WeightFormat::Q6KQ8, 45, 2304, 69);
    check(WeightFormat::Q6KQ8, 130, 2560, 71);
}

/// Q4_K (llama.cpp's Q4_K_M files), exact: the dequantized twin's bits;
/// rows of 1, 3, 9 and 17 super-blocks.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q4_k() {
    check(WeightFormat::Q4K, 301, 768, 110);
    check(WeightFormat::Q4K, 7, 256, 111);
    check(WeightFormat::Q4K, 45, 2304, 112);
    check(WeightFormat::Q4K, 33, 4352, 113);
}

/// Q4_K with 8-bit activations: the CPU's `dot_q4_k_q8` bits, for rows of
/// 8, 24, 72, 80 and 136 blocks (one or two rounds of a tile, partial
/// rounds and tiles).
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q4_k_q8_activations() {
    check(WeightFormat::Q4KQ8, 301, 768, 114);
    check(WeightFormat::Q4KQ8, 7, 256, 115);
    check(WeightFormat::Q4KQ8, 45, 2304, 116);
    check(WeightFormat::Q4KQ8, 130, 2560, 117);
    check(WeightFormat::Q4KQ8, 33, 4352, 118);
}

/// Q5_K, exact: the dequantized twin's bits; rows of 1, 3, 9 and 17
/// super-blocks.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q5_k() {
    check(WeightFormat::Q5K, 301, 768, 120);
    check(WeightFormat::Q5K, 7, 256, 121);
    check(WeightFormat::Q5K, 45, 2304, 122);
    check(WeightFormat::Q5K, 33, 4352, 123);
}

/// Q5_K with 8-bit activations: the CPU's `dot_q5_k_q8` bits, for rows of
/// 8, 24, 72, 80 and 136 blocks.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q5_k_q8_activations() {
    check(WeightFormat::Q5KQ8, 301, 768, 124);
    check(WeightFormat::Q5KQ8, 7, 256, 125);
    check(WeightFormat::Q5KQ8, 45, 2304, 126);
    check(WeightFormat::Q5KQ8, 130, 2560, 127);
    check(WeightFormat::Q5KQ8, 33, 4352, 128);
}

/// Three q4_0 matrices at an odd stride, each with its own 3 tokens, in one
/// launch: each equals its own single launch, bit for bit.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_grouped_equals_single() {
    let g = gpu();
    let mut rng = rng(61);
    let (rows, cols, n, ntok) = (83, 640, 3, 3);
    let stride = rows * (cols / 32 * 18) + 6;
    let mut bytes = Vec::new();
    let mut mats = Vec::new();
    for _ in 0..n {
        let w = random_weights(&mut rng, WeightFormat::Q4_0, rows, cols);
        bytes.extend_from_slice(&w.bytes);
        bytes.resize(bytes.len() + 6, 0x5a);
        mats.push(w);
    }
    let x = nonzero(&mut rng, n * ntok * cols, 0.01, 1.0);
    let wb = upload(&bytes);
    let xb = upload(&x);
    let mut y = poisoned(n * ntok * rows);
    let group = MatvecGroup {
        w: WeightView {
            format: WeightFormat::Q4_0,
            rows,
            cols,
            data: wb.as_view(),
            fp8: None,
        },
        matrices: n,
        w_stride: stride,
        scale_stride: 0,
        x: xb.as_view(),
        x_tok_stride: cols,
        x_mat_stride: ntok * cols,
        ntok,
        y_tok_stride: rows,
        y_mat_stride: ntok * rows,
    };
    g.k.matvec_group(&g.dev, &group, y.as_mut()).unwrap();
    let all = g.dev.download(y.as_view()).unwrap();
    for (z, w) in mats.iter().enumerate() {
        let single = run(
            WeightFormat::Q4_0,
            w,
            rows,
            cols,
            &x[z * ntok * cols..],
            ntok,
            0,
        );
        assert_bits(
            &format!("matrix {z}"),
            &all[z * ntok * rows..(z + 1) * ntok * rows],
            &single,
        );
    }
}

/// Tall f16/bf16 matrices (an LM head's shape: many more rows than the
/// device has warps) take the persistent stream kernel for one token; it
/// gives the bits of the plain launches (two tokens at once, or the matrix
/// placed off 16 bytes) and the f64 reference's value, for rows of one,
/// two and three 2048-column units (the last one partial).
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_tall_half_matrices_stream() {
    let g = gpu();
    // Every warp of the persistent grid gets at least 4 rows, and some 5.
    let rows = g.dev.info().multiprocessors as usize * 2 * 8 * 4 + 37;
    for (fi, fmt) in [WeightFormat::F16, WeightFormat::Bf16]
        .into_iter()
        .enumerate()
    {
        for (ci, cols) in [96, 2080, 4128].into_iter().enumerate() {
            let mut rng = rng(90 + 10 * fi as u64 + ci as u64);
            let w = random_weights(&mut rng, fmt, rows, cols);
            let x = nonzero(&mut rng, 2 * cols, 0.01, 1.0);
            let name = format!("{fmt:?} {rows}x{cols}");
            let wb = upload(&w.bytes);
            let view = WeightView {
                format: fmt,
                rows,
                cols,
                data: wb.as_view(),
                fp8: None,
            };
            assert!(
                g.k.matvec_streams(&g.dev, &view, 1),
                "{name} does not stream"
            );
            assert!(
                !g.k.matvec_streams(&g.dev, &view, 2),
                "{name}: two tokens stream"
            );
            let one = run(fmt, &w, rows, cols, &x, 1, 0);
            let two = run(fmt, &w, rows, cols, &x, 2, 0);
            assert_bits(
                &format!("{name}: streamed vs two tokens"),
                &one,
                &two[..rows],
            );
            let moved = run(fmt, &w, rows, cols, &x, 1, 2);
            assert_bits(
                &format!("{name}: streamed vs placed 2 bytes further"),
                &one,
                &moved,
            );
            let (want, scale): (Vec<f64>, Vec<f64>) = (0..rows)
                .map(|r| {
                    let terms = w.f32[r * cols..(r + 1) * cols]
                        .iter()
                        .zip(&x[..cols])
                        .map(|(&a, &b)| a as f64 * b as f64);
                    (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>())
                })
                .unzip();
            assert_close(&format!("{name} vs f64"), &one, &want, |i| BOUND * scale[i]);
        }
    }
    // Wider than the stream kernel stages: the plain launch.
    let w = random_weights(&mut rng(99), WeightFormat::Bf16, rows, 8224);
    let wb = upload(&w.bytes);
    let view = WeightView {
        format: WeightFormat::Bf16,
        rows,
        cols: 8224,
        data: wb.as_view(),
        fp8: None,
    };
    assert!(!g.k.matvec_streams(&g.dev, &view, 1));
}

/// Three matrices of different heights (a layer's q, k and v) through one
/// `matvec_seg` launch, for every format: each output equals its own
/// one-token matvec, bit for bit; two matrices work too.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_seg_equals_single() {
    let g = gpu();
    for (fi, &fmt) in FORMATS.iter().enumerate() {
        let mut rng = rng(70 + fi as u64);
        let cols = 2304;
        let heights = [263usize, 37, 128];
        let ws: Vec<_> = heights
            .iter()
            .map(|&h| random_weights(&mut rng, fmt, h, cols))
            .collect();
        let x = nonzero(&mut rng, cols, 0.01, 1.0);
        let xb = upload(&x);
        let wbs: Vec<_> = ws.iter().map(|w| upload(&w.bytes)).collect();
        let sbs: Vec<_> = ws
            .iter()
            .map(|w| {
                upload(&if w.scales.is_empty() {
                    vec![0.0f32]
                } else {
                    w.scales.clone()
                })
            })
            .collect();
        let view = |i: usize| WeightView {
            format: fmt,
            rows: heights[i],
            cols,
            data: wbs[i].as_view(),
            fp8: (fmt == WeightFormat::F8E4M3).then(|| colibri_cuda::Fp8Scales {
                scales: sbs[i].as_view(),
                block: ws[i].block,
            }),
        };
        for n in [3usize, 2] {
            let mut ys: Vec<_> = heights.iter().map(|&h| poisoned(h)).collect();
            let outs = ys
                .iter_mut()
                .take(n)
                .enumerate()
                .map(|(i, y)| (view(i), y.as_mut()))
                .collect();
            g.k.matvec_seg(&g.dev, xb.as_view(), outs).unwrap();
            for i in 0..n {
                let got = g.dev.download(ys[i].as_view()).unwrap();
                let single = run(fmt, &ws[i], heights[i], cols, &x, 1, 0);
                assert_bits(&format!("{fmt:?} matrix {i} of {n}"), &got, &single);
            }
        }
    }
}

/// One token through one matrix with x's Q8 row (as attention writes it
/// for the output projection): every format gives the plain launch's bits
/// (three tiles, the last partial); the 8-bit-activation formats read the
/// row (quants of other values give those values' product); a row too
/// short is refused.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_from_q8_rows_equals_plain() {
    let g = gpu();
    for (fi, &fmt) in FORMATS.iter().enumerate() {
        let mut rng = rng(170 + fi as u64);
        let cols = if fmt.row_bytes(4160).is_some() {
            4160
        } else {
            4352
        };
        let rows = 45usize;
        let w = random_weights(&mut rng, fmt, rows, cols);
        let x = nonzero(&mut rng, cols, 0.01, 1.0);
        let other: Vec<f32> = x.iter().map(|v| v * -0.75).collect();
        let (wb, xb) = (upload(&w.bytes), upload(&x));
        let sb = upload(&if w.scales.is_empty() {
            vec![0.0f32]
        } else {
            w.scales.clone()
        });
        let view = WeightView {
            format: fmt,
            rows,
            cols,
            data: wb.as_view(),
            fp8: (fmt == WeightFormat::F8E4M3).then(|| Fp8Scales {
                scales: sb.as_view(),
                block: w.block,
            }),
        };
        let plain = run(fmt, &w, rows, cols, &x, 1, 0);
        for (src, want) in [
            (&x, plain.clone()),
            (&other, run(fmt, &w, rows, cols, &other, 1, 0)),
        ] {
            let xq = upload(&q8_rows_ref(src, cols));
            let mut y = poisoned(rows);
            g.k.matvec_from_q8(&g.dev, &view, xb.as_view(), xq.as_view(), y.as_mut())
                .unwrap();
            let got = g.dev.download(y.as_view()).unwrap();
            // The float formats read x itself.
            let want = if int_act(fmt) { want } else { plain.clone() };
            assert_bits(&format!("{fmt:?} from a Q8 row"), &got, &want);
        }
        let short = upload(&vec![0u8; q8_row_bytes(cols) - 16]);
        let mut y = poisoned(rows);
        assert!(
            g.k.matvec_from_q8(&g.dev, &view, xb.as_view(), short.as_view(), y.as_mut())
                .is_err()
        );
    }
}

/// Views that do not fit are refused before anything is launched.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_rejects_bad_views() {
    let g = gpu();
    let wb = upload(&vec![1u8; 18 * 4 * 10]);
    let xb = upload(&vec![1.0f32; 128]);
    let mut y = poisoned(10);
    let mut view = WeightView {
        format: WeightFormat::Q4_0,
        rows: 10,
        cols: 128,
        data: wb.as_view(),
        fp8: None,
    };
    assert!(
        g.k.matvec(&g.dev, &view, xb.as_view(), 1, y.as_mut())
            .is_ok()
    );
    view.rows = 11; // one row past the buffer
    assert!(
        g.k.matvec(&g.dev, &view, xb.as_view(), 1, y.as_mut())
            .is_err()
    );
    view.rows = 10;
    view.cols = 120; // not whole blocks
    assert!(
        g.k.matvec(&g.dev, &view, xb.as_view(), 1, y.as_mut())
            .is_err()
    );
    view.cols = 128;
    assert!(
        g.k.matvec(&g.dev, &view, xb.as_view(), 2, y.as_mut())
            .is_err()
    ); // x too short
    view.data = wb.view(1..wb.len()).unwrap(); // misaligned
    view.rows = 9;
    assert!(
        g.k.matvec(&g.dev, &view, xb.as_view(), 1, y.as_mut())
            .is_err()
    );
    g.dev.synchronize().unwrap();
}

/// Q4_1, Q5_0 and Q5_1 (llama.cpp's fallbacks for rows that are not whole
/// super-blocks: DeepSeek-V2-Lite's 1408-wide down projections), exact:
/// the dequantized twin's bits; rows of 1, 3, 44 (1408 columns) and 45
/// blocks, odd row lengths misaligning the rows.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q4_1_q5_0_q5_1() {
    for (i, fmt) in [WeightFormat::Q4_1, WeightFormat::Q5_0, WeightFormat::Q5_1]
        .into_iter()
        .enumerate()
    {
        let seed = 130 + 4 * i as u64;
        check(fmt, 301, 32, seed);
        check(fmt, 7, 96, seed + 1);
        check(fmt, 45, 1408, seed + 2);
        check(fmt, 33, 1440, seed + 3);
    }
}

/// Q2_K, Q3_K, IQ4_NL and IQ4_XS (llama.cpp's Q2_K, Q3_K_S/M/L and IQ4
/// files), exact: the dequantized twin's bits; rows of 1, 3, 9 and 17
/// super-blocks (IQ4_NL: blocks of 32, 1408-wide rows among them).
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q2_k_q3_k_iq4() {
    for (i, fmt) in [
        WeightFormat::Q2K,
        WeightFormat::Q3K,
        WeightFormat::Iq4Nl,
        WeightFormat::Iq4Xs,
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 150 + 4 * i as u64;
        check(fmt, 301, 768, seed);
        check(fmt, 7, 256, seed + 1);
        check(fmt, 45, 2304, seed + 2);
        let wide = if fmt == WeightFormat::Iq4Nl {
            1408
        } else {
            4352
        };
        check(fmt, 33, wide, seed + 3);
    }
}

/// Q4_1, Q5_0, Q5_1 and IQ4_NL with 8-bit activations: the CPU's
/// `dot_*_q8` bits (legacy_q8.rs, written out in tests/common), for rows of
/// 1, 3, 44, 45 and 72 blocks (partial rounds and tiles, misaligned rows).
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q4_1_q5_0_q5_1_iq4_nl_q8_activations() {
    for (i, fmt) in [
        WeightFormat::Q4_1Q8,
        WeightFormat::Q5_0Q8,
        WeightFormat::Q5_1Q8,
        WeightFormat::Iq4NlQ8,
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 170 + 5 * i as u64;
        check(fmt, 301, 32, seed);
        check(fmt, 7, 96, seed + 1);
        check(fmt, 45, 1408, seed + 2);
        check(fmt, 33, 1440, seed + 3);
        check(fmt, 130, 2304, seed + 4);
    }
}

/// Q2_K, Q3_K and IQ4_XS with 8-bit activations: the CPU's `dot_*_q8` bits
/// (low_k.rs, written out in tests/common), for rows of 1, 3, 9, 10 and 17
/// super-blocks.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn matvec_q2_k_q3_k_iq4_xs_q8_activations() {
    for (i, fmt) in [
        WeightFormat::Q2KQ8,
        WeightFormat::Q3KQ8,
        WeightFormat::Iq4XsQ8,
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 190 + 5 * i as u64;
        check(fmt, 301, 768, seed);
        check(fmt, 7, 256, seed + 1);
        check(fmt, 45, 2304, seed + 2);
        check(fmt, 130, 2560, seed + 3);
        check(fmt, 33, 4352, seed + 4);
    }
}
