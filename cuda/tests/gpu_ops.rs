//! GPU checks of the non-matvec kernels (run with `cargo test -p
//! colibri-cuda -- --ignored` on a GPU machine, or tools/gpu_check.sh),
//! each on random data of awkward sizes against a reference written here
//! from the CPU tier's math (colibri-cuda may not depend on colibri-model):
//!
//! * RMSNorm, SwiGLU, attention: within 1e-5 relative of an f64 reference
//!   (attention: relative to Σ p·|v|, the size of what is summed);
//! * RoPE, MoE combine, MLA absorption: the same bits as the CPU tier's f32
//!   operation sequence (they have no reduction to reorder);
//! * routers: the same experts as an f64 reference (logits spaced so no two
//!   candidates are within rounding of each other), weights within 1e-5;
//! * everything: bit-identical when repeated and, for attention, whether a
//!   row runs alone or in a batch;
//! * the upload path: registered host memory copied on the copy stream
//!   arrives intact before compute work that waits for its event.

mod common;

use colibri_cuda::{
    ATTENTION_CHUNK, Attention, AttentionSplit, KvView, RopeTable, WeightFormat, WeightView,
    attention_split_records, q8_row_bytes,
};
use common::*;
use rand::Rng;
use rand::seq::SliceRandom;

const REL: f64 = 1e-5;

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn rms_norm_matches_f64_and_is_in_place_safe() {
    let g = gpu();
    for (seed, rows, n) in [(1u64, 5usize, 1000usize), (2, 3, 4099), (3, 17, 80)] {
        let mut rng = rng(100 + seed);
        let x = nonzero(&mut rng, rows * n, 0.01, 2.0);
        let w = nonzero(&mut rng, n, 0.5, 1.5);
        let eps = 1e-6f32;
        let (xb, wb) = (upload(&x), upload(&w));
        let mut y = poisoned(rows * n);
        g.k.rms_norm(&g.dev, xb.as_view(), wb.as_view(), y.as_mut(), rows, n, eps)
            .unwrap();
        let got = g.dev.download(y.as_view()).unwrap();
        let want: Vec<f64> = (0..rows * n)
            .map(|i| {
                let row = &x[i / n * n..(i / n + 1) * n];
                let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
                w[i % n] as f64 * x[i] as f64 / (ms + eps as f64).sqrt()
            })
            .collect();
        assert_close(&format!("rms_norm {rows}x{n}"), &got, &want, |i| {
            REL * want[i].abs()
        });
        let mut inplace = upload(&x);
        g.k.rms_norm_inplace(&g.dev, inplace.as_mut(), wb.as_view(), rows, n, eps)
            .unwrap();
        assert_bits(
            "rms_norm in place",
            &g.dev.download(inplace.as_view()).unwrap(),
            &got,
        );
    }
}

/// The CPU tier's rotation (model/src/rope.rs), in f32 step by step.
fn rope_cpu(x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = cos.len();
    let tmp = x.to_vec();
    for j in 0..half {
        let (a, b) = if interleaved {
            (tmp[2 * j], tmp[2 * j + 1])
        } else {
            (tmp[j], tmp[j + half])
        };
        x[j] = a * cos[j] - b * sin[j];
        x[j + half] = b * cos[j] + a * sin[j];
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn rope_matches_cpu_bits_both_layouts() {
    let g = gpu();
    let mut rng = rng(200);
    // (heads, head_stride, offset, rot_dim, interleaved): plain GQA heads,
    // and MLA's rotary tail of each query head.
    for (heads, hs, off, rd, inter) in [
        (3usize, 80usize, 0usize, 80usize, false),
        (5, 96, 40, 56, true),
    ] {
        let positions = 5000usize;
        let half = rd / 2;
        let factor = 1.3f32; // a YaRN attention factor
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / 10000f32.powf((2 * i) as f32 / rd as f32))
            .collect();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in 0..positions {
            for &f in &inv {
                let angle = p as f32 * f;
                cos.push((angle as f64).cos() as f32 * factor);
                sin.push((angle as f64).sin() as f32 * factor);
            }
        }
        let pos: Vec<u32> = vec![0, 5, 4000, 17, 4999];
        let ntok = pos.len();
        let x = nonzero(&mut rng, ntok * heads * hs, 0.01, 2.0);
        let (cb, sb, pb) = (upload(&cos), upload(&sin), upload(&pos));
        let mut xb = upload(&x);
        let table = RopeTable {
            cos: cb.as_view(),
            sin: sb.as_view(),
            rot_dim: rd,
            positions,
            interleaved: inter,
        };
        g.k.rope(
            &g.dev,
            xb.as_mut(),
            ntok,
            heads,
            heads * hs,
            hs,
            off,
            &table,
            pb.as_view(),
        )
        .unwrap();
        let got = g.dev.download(xb.as_view()).unwrap();
        let mut want = x.clone();
        for (t, &p) in pos.iter().enumerate() {
            for h in 0..heads {
                let s = t * heads * hs + h * hs + off;
                let p = p as usize;
                rope_cpu(
                    &mut want[s..s + rd],
                    &cos[p * half..(p + 1) * half],
                    &sin[p * half..(p + 1) * half],
                    inter,
                );
            }
        }
        assert_bits(&format!("rope interleaved={inter}"), &got, &want);

        // A position past the table poisons that token's rotary dims.
        let bad = upload(&[positions as u32]);
        let mut one = upload(&x[..heads * hs]);
        g.k.rope(
            &g.dev,
            one.as_mut(),
            1,
            heads,
            heads * hs,
            hs,
            off,
            &table,
            bad.as_view(),
        )
        .unwrap();
        let out = g.dev.download(one.as_view()).unwrap();
        assert!(
            out[off..off + rd].iter().all(|v| v.is_nan()),
            "position past the table must give NaN"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn swiglu_matches_f64() {
    let g = gpu();
    let mut rng = rng(300);
    let (rows, cols) = (3usize, 1001usize);
    let gate = nonzero(&mut rng, rows * cols, 0.01, 8.0);
    let up = nonzero(&mut rng, rows * cols, 0.01, 2.0);
    let (gb, ub) = (upload(&gate), upload(&up));
    let mut out = poisoned(rows * cols);
    g.k.swiglu(&g.dev, gb.as_view(), ub.as_view(), out.as_mut(), rows, cols)
        .unwrap();
    let got = g.dev.download(out.as_view()).unwrap();
    let want: Vec<f64> = gate
        .iter()
        .zip(&up)
        .map(|(&a, &b)| {
            let a = a as f64;
            a / (1.0 + (-a).exp()) * b as f64
        })
        .collect();
    assert_close("swiglu", &got, &want, |i| REL * want[i].abs());
    let mut inplace = upload(&gate);
    g.k.swiglu_inplace(&g.dev, inplace.as_mut(), ub.as_view(), rows, cols)
        .unwrap();
    assert_bits(
        "swiglu in place",
        &g.dev.download(inplace.as_view()).unwrap(),
        &got,
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn moe_combine_matches_cpu_bits() {
    let g = gpu();
    let mut rng = rng(400);
    let (rows, k, hidden) = (4usize, 6usize, 777usize);
    let slot = nonzero(&mut rng, rows * k * hidden, 0.01, 3.0);
    let mut experts = Vec::new();
    for _ in 0..rows {
        let mut ids: Vec<u32> = (0..64).collect();
        ids.shuffle(&mut rng);
        experts.extend_from_slice(&ids[..k]);
    }
    let weights = nonzero(&mut rng, rows * k, 0.01, 1.0);
    let shared = nonzero(&mut rng, rows * hidden, 0.01, 3.0);
    let gate = nonzero(&mut rng, rows, 0.1, 3.0);
    let (sb, eb, wb, shb, gb) = (
        upload(&slot),
        upload(&experts),
        upload(&weights),
        upload(&shared),
        upload(&gate),
    );
    for mode in 0..3 {
        let mut out = poisoned(rows * hidden);
        let (sh, gt) = match mode {
            0 => (None, None),
            1 => (Some(shb.as_view()), None),
            _ => (Some(shb.as_view()), Some(gb.as_view())),
        };
        g.k.moe_combine(
            &g.dev,
            sb.as_view(),
            eb.as_view(),
            wb.as_view(),
            sh,
            gt,
            out.as_mut(),
            rows,
            k,
            hidden,
        )
        .unwrap();
        let got = g.dev.download(out.as_view()).unwrap();
        // model/src/moe.rs: ascending expert order, `y += sv * wgt`, then the
        // (gated) shared expert.
        let mut want = vec![0.0f32; rows * hidden];
        for r in 0..rows {
            let mut order: Vec<usize> = (0..k).collect();
            order.sort_by_key(|&s| experts[r * k + s]);
            for i in 0..hidden {
                let mut y = 0.0f32;
                for &s in &order {
                    y += slot[(r * k + s) * hidden + i] * weights[r * k + s];
                }
                if mode >= 1 {
                    let sv = shared[r * hidden + i];
                    y += if mode == 2 {
                        (1.0 / (1.0 + (-gate[r]).exp())) * sv
                    } else {
                        sv
                    };
                }
                want[r * hidden + i] = y;
            }
        }
        if mode == 2 {
            // The gate's sigmoid goes through expf on the GPU and libm here:
            // allow their last-bit difference.
            // Bound: 1e-6 of the summed magnitudes (a last-bit change of
            // the gate moves each rounding by at most an ulp of a partial
            // sum, and there are k + 1 of them).
            let w64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
            let mag: Vec<f64> = (0..rows * hidden)
                .map(|j| {
                    let (r, i) = (j / hidden, j % hidden);
                    let routed: f64 = (0..k)
                        .map(|s| (slot[(r * k + s) * hidden + i] * weights[r * k + s]).abs() as f64)
                        .sum();
                    routed + shared[j].abs() as f64
                })
                .collect();
            assert_close("moe_combine gated", &got, &w64, |j| 1e-6 * mag[j]);
        } else {
            assert_bits(&format!("moe_combine mode {mode}"), &got, &want);
        }
        // The same slots stored in a shuffled row order and read through
        // their rows: the same bits as the packed layout.
        let mut perm: Vec<u32> = (0..(rows * k) as u32).collect();
        perm.shuffle(&mut rng);
        let mut shuffled = vec![0.0f32; rows * k * hidden];
        for (j, &p) in perm.iter().enumerate() {
            let p = p as usize;
            shuffled[p * hidden..(p + 1) * hidden]
                .copy_from_slice(&slot[j * hidden..(j + 1) * hidden]);
        }
        let (shuf, pb) = (upload(&shuffled), upload(&perm));
        let mut out2 = poisoned(rows * hidden);
        // SAFETY: perm is a permutation of 0..rows·k.
        unsafe {
            g.k.moe_combine_rows_into(
                &g.dev,
                shuf.as_view(),
                pb.as_view(),
                eb.as_view(),
                wb.as_view(),
                sh,
                gt,
                out2.as_mut(),
                rows,
                k,
                hidden,
                false,
            )
            .unwrap();
        }
        let got2 = g.dev.download(out2.as_view()).unwrap();
        assert_bits(&format!("moe_combine_rows_into mode {mode}"), &got2, &got);
    }
}

/// Logits on a shuffled grid of `step` plus a jitter of ±step/5, so no two
/// candidates are within rounding of each other: the ranking is the
/// function's, not the arithmetic's. (For the sigmoid router the grid stays
/// where sigmoid is steep, so scores keep thousands of ulps apart.)
fn spaced_logits(rng: &mut rand_chacha::ChaCha8Rng, rows: usize, e: usize, step: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * e);
    for _ in 0..rows {
        let mut grid: Vec<f32> = (0..e).map(|i| (i as f32 - e as f32 / 2.0) * step).collect();
        grid.shuffle(rng);
        out.extend(
            grid.iter()
                .map(|v| v + rng.random_range(-step / 5.0..step / 5.0)),
        );
    }
    out
}

fn top_k_f64(v: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn router_softmax_topk_matches_f64() {
    let g = gpu();
    let mut rng = rng(500);
    for (rows, e, k, norm) in [
        (7usize, 160usize, 6usize, true),
        (3, 1000, 8, false),
        (2, 60, 4, true),
    ] {
        let logits = spaced_logits(&mut rng, rows, e, 0.1);
        let lb = upload(&logits);
        let mut idx = g.dev.alloc::<u32>(rows * k).unwrap();
        let mut w = poisoned(rows * k);
        g.k.router_softmax_topk(
            &g.dev,
            lb.as_view(),
            rows,
            e,
            k,
            norm,
            idx.as_mut(),
            w.as_mut(),
        )
        .unwrap();
        let (gi, gw) = (
            g.dev.download(idx.as_view()).unwrap(),
            g.dev.download(w.as_view()).unwrap(),
        );
        let mut want_w = Vec::new();
        for r in 0..rows {
            let l = &logits[r * e..(r + 1) * e];
            let m = l.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let ex: Vec<f64> = l.iter().map(|&v| (v as f64 - m).exp()).collect();
            let s: f64 = ex.iter().sum();
            let p: Vec<f64> = ex.iter().map(|v| v / s).collect();
            let sel = top_k_f64(&p, k);
            let got_sel: Vec<usize> = gi[r * k..(r + 1) * k].iter().map(|&i| i as usize).collect();
            assert_eq!(got_sel, sel, "softmax router row {r} (E={e})");
            let ws: f64 = sel.iter().map(|&i| p[i]).sum();
            want_w.extend(sel.iter().map(|&i| if norm { p[i] / ws } else { p[i] }));
        }
        assert_close(
            &format!("softmax router weights E={e}"),
            &gw,
            &want_w,
            |i| REL * want_w[i].abs(),
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn router_sigmoid_grouped_matches_f64() {
    let g = gpu();
    let mut rng = rng(600);
    for (rows, e, ng, tg, k, with_bias) in [
        (5usize, 256usize, 8usize, 4usize, 8usize, true),
        (3, 96, 6, 3, 6, false),
    ] {
        let logits = spaced_logits(&mut rng, rows, e, 0.02);
        let bias: Vec<f32> = (0..e).map(|_| rng.random_range(-0.01f32..0.01)).collect();
        let scaling = 2.5f32;
        let (lb, bb) = (upload(&logits), upload(&bias));
        let mut idx = g.dev.alloc::<u32>(rows * k).unwrap();
        let mut w = poisoned(rows * k);
        let bview = with_bias.then(|| bb.as_view());
        g.k.router_sigmoid_grouped_topk(
            &g.dev,
            lb.as_view(),
            bview,
            rows,
            e,
            ng,
            tg,
            k,
            true,
            scaling,
            idx.as_mut(),
            w.as_mut(),
        )
        .unwrap();
        let (gi, gw) = (
            g.dev.download(idx.as_view()).unwrap(),
            g.dev.download(w.as_view()).unwrap(),
        );
        let per = e / ng;
        let mut want_w = Vec::new();
        for r in 0..rows {
            let sc: Vec<f64> = logits[r * e..(r + 1) * e]
                .iter()
                .map(|&l| 1.0 / (1.0 + (-(l as f64)).exp()))
                .collect();
            let ch: Vec<f64> = sc
                .iter()
                .enumerate()
                .map(|(i, s)| s + if with_bias { bias[i] as f64 } else { 0.0 })
                .collect();
            let gs: Vec<f64> = ch
                .chunks(per)
                .map(|c| {
                    let t = top_k_f64(c, 2);
                    c[t[0]] + c[t[1]]
                })
                .collect();
            let groups = top_k_f64(&gs, tg);
            let masked: Vec<f64> = ch
                .iter()
                .enumerate()
                .map(|(i, &c)| {
                    if groups.contains(&(i / per)) {
                        c
                    } else {
                        f64::NEG_INFINITY
                    }
                })
                .collect();
            let sel = top_k_f64(&masked, k);
            let got_sel: Vec<usize> = gi[r * k..(r + 1) * k].iter().map(|&i| i as usize).collect();
            assert_eq!(got_sel, sel, "grouped router row {r} (E={e})");
            let s: f64 = sel.iter().map(|&i| sc[i]).sum::<f64>() + 1e-20;
            want_w.extend(sel.iter().map(|&i| sc[i] / s * scaling as f64));
        }
        assert_close(
            &format!("grouped router weights E={e}"),
            &gw,
            &want_w,
            |i| REL * want_w[i].abs(),
        );
    }
}

fn kv_view(
    b: &colibri_cuda::DeviceBuffer<f32>,
    slot_stride: usize,
    head_stride: usize,
) -> KvView<'_> {
    KvView {
        data: b.as_view(),
        slot_stride,
        head_stride,
    }
}

/// f64 attention of one (row, head) over keys `first..=pos` of a cache laid
/// out as `slot·stride + kvh·hstride`.
#[allow(clippy::too_many_arguments)]
fn attend_f64(
    q: &[f32],
    ka: (&[f32], usize, usize, usize),
    kb: Option<(&[f32], usize, usize, usize)>,
    v: (&[f32], usize, usize, usize),
    kvh: usize,
    slots: std::ops::RangeInclusive<usize>,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let score = |s: usize| {
        let dot = |(buf, ss, hs, d): (&[f32], usize, usize, usize), q: &[f32]| -> f64 {
            (0..d)
                .map(|i| q[i] as f64 * buf[s * ss + kvh * hs + i] as f64)
                .sum()
        };
        let mut a = dot(ka, q);
        if let Some(kb) = kb {
            a += dot(kb, &q[ka.3..]);
        }
        a * scale
    };
    let sc: Vec<f64> = slots.clone().map(score).collect();
    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
    let sum: f64 = e.iter().sum();
    let (buf, ss, hs, dv) = v;
    let mut out = vec![0.0; dv];
    let mut mag = vec![0.0; dv];
    for (p, s) in e.iter().zip(slots) {
        for d in 0..dv {
            let val = buf[s * ss + kvh * hs + d] as f64;
            out[d] += p / sum * val;
            mag[d] += p / sum * val.abs();
        }
    }
    (out, mag)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn gqa_attention_matches_f64_and_is_batch_invariant() {
    let g = gpu();
    let mut rng = rng(700);
    let (nh, nkv, hd) = (6usize, 2usize, 80usize);
    let group = nh / nkv;
    let capacity = 1000usize;
    let k = nonzero(&mut rng, capacity * nkv * hd, 0.01, 1.0);
    let v = nonzero(&mut rng, capacity * nkv * hd, 0.01, 1.0);
    // Sequence A in slots 0..700, B in 700..1000. Rows: a prefill run of B
    // across the chunk boundary at 256, A's last and first positions.
    let mut rows: Vec<(u32, u32)> = (250..262).map(|p| (p, 700)).collect();
    rows.extend([(699, 0), (0, 0), (299, 700)]);
    let n = rows.len();
    let q = nonzero(&mut rng, n * nh * hd, 0.01, 1.0);
    let (kb, vb, qb) = (upload(&k), upload(&v), upload(&q));
    let scale = (hd as f32).powf(-0.5);
    for window in [None, Some(100usize), Some(7)] {
        let run = |sel: &[usize]| -> Vec<f32> {
            let pos: Vec<u32> = sel.iter().map(|&i| rows[i].0).collect();
            let s0: Vec<u32> = sel.iter().map(|&i| rows[i].1).collect();
            let qs: Vec<f32> = sel
                .iter()
                .flat_map(|&i| q[i * nh * hd..(i + 1) * nh * hd].to_vec())
                .collect();
            let (pb, sb, qsb) = (upload(&pos), upload(&s0), upload(&qs));
            let mut out = poisoned(sel.len() * nh * hd);
            let kv = |b| kv_view(b, nkv * hd, hd);
            let at = Attention {
                q: qsb.as_view(),
                rows: sel.len(),
                heads: nh,
                dim_a: hd,
                dim_b: 0,
                dim_v: hd,
                group,
                key_a: kv(&kb),
                key_b: None,
                value: kv(&vb),
                capacity,
                pos: pb.as_view(),
                slot0: sb.as_view(),
                window,
                scale,
            };
            g.k.attention(&g.dev, &at, out.as_mut()).unwrap();
            g.dev.download(out.as_view()).unwrap()
        };
        let all_idx: Vec<usize> = (0..n).collect();
        let all = run(&all_idx);
        let (mut want, mut mag) = (Vec::new(), Vec::new());
        for &(p, s0) in &rows {
            let (p, s0) = (p as usize, s0 as usize);
            let first = window.map_or(0, |w| (p + 1).saturating_sub(w));
            for h in 0..nh {
                let i = want.len() / (nh * hd);
                let qh = &q[(i * nh + h) * hd..(i * nh + h + 1) * hd];
                let (o, m) = attend_f64(
                    qh,
                    (&k, nkv * hd, hd, hd),
                    None,
                    (&v, nkv * hd, hd, hd),
                    h / group,
                    s0 + first..=s0 + p,
                    scale as f64,
                );
                want.extend(o);
                mag.extend(m);
            }
        }
        assert_close(
            &format!("gqa attention window={window:?}"),
            &all,
            &want,
            |i| REL * mag[i],
        );
        for i in [0usize, 5, n - 1] {
            assert_bits(
                &format!("gqa row {i} alone"),
                &run(&[i]),
                &all[i * nh * hd..(i + 1) * nh * hd],
            );
        }
        assert_bits("gqa repeated", &run(&all_idx), &all);
    }
    // A row whose keys would lie past the cache is answered with NaN.
    let pos = upload(&[10u32]);
    let s0 = upload(&[995u32]);
    let mut out = poisoned(nh * hd);
    let kv = |b| kv_view(b, nkv * hd, hd);
    let at = Attention {
        q: qb.as_view(),
        rows: 1,
        heads: nh,
        dim_a: hd,
        dim_b: 0,
        dim_v: hd,
        group,
        key_a: kv(&kb),
        key_b: None,
        value: kv(&vb),
        capacity,
        pos: pos.as_view(),
        slot0: s0.as_view(),
        window: None,
        scale,
    };
    g.k.attention(&g.dev, &at, out.as_mut()).unwrap();
    assert!(
        g.dev
            .download(out.as_view())
            .unwrap()
            .iter()
            .all(|v| v.is_nan())
    );
}

/// `attention_split` (a (row, head)'s chunks over several blocks, merged
/// by the last to finish) gives `attention`'s bits: GQA and MLA shapes,
/// rows of one to twelve chunks, sliding windows, 1 to 16 blocks, passes of
/// one and two rows, twice in a row (the counters are left at zero); a row
/// with more chunks than the records hold gets NaN.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn split_attention_has_the_bits_of_attention() {
    let g = gpu();
    let mut rng = rng(750);
    let capacity = 3000usize;
    let chunk_cap = capacity.div_ceil(ATTENTION_CHUNK);
    // (heads, group, dim_a, dim_b, dim_v, kv heads' stride): GQA with 128-dim
    // heads, then MLA's latent (the value is the key's first part) and a
    // rotary part, all heads on one latent.
    for (nh, group, da, db, dv) in [
        (8usize, 4usize, 128usize, 0usize, 128usize),
        (4, 4, 80, 24, 80),
    ] {
        let nkv = nh / group;
        let ka = nonzero(&mut rng, capacity * nkv * da, 0.01, 1.0);
        let kb = nonzero(&mut rng, capacity * nkv * db.max(1), 0.01, 1.0);
        let vv = nonzero(&mut rng, capacity * nkv * dv, 0.01, 1.0);
        let (kab, kbb, vb) = (upload(&ka), upload(&kb), upload(&vv));
        let scale = 0.09f32;
        // (position, slot0) pairs: within one chunk, on chunk edges, many
        // chunks, a second sequence further into the cache.
        let rows: [(u32, u32); 9] = [
            (0, 0),
            (255, 0),
            (256, 0),
            (700, 0),
            (1023, 0),
            (2999, 0),
            (1500, 1400),
            (511, 2400),
            (2200, 700),
        ];
        let mut counters = g.dev.upload(&vec![0u32; 2 * nh]).unwrap();
        let mut records = g
            .dev
            .alloc::<f32>(attention_split_records(2, nh, dv, chunk_cap).unwrap())
            .unwrap();
        for window in [None, Some(300usize), Some(7)] {
            for pair in [
                &rows[0..1],
                &rows[1..3],
                &rows[3..4],
                &rows[4..6],
                &rows[6..8],
                &rows[8..9],
                &rows[5..6],
            ] {
                let m = pair.len();
                let q = nonzero(&mut rng, m * nh * (da + db), 0.01, 1.0);
                let pos: Vec<u32> = pair.iter().map(|r| r.0).collect();
                let s0: Vec<u32> = pair.iter().map(|r| r.1).collect();
                let (qb, pb, sb) = (upload(&q), upload(&pos), upload(&s0));
                let view = |data, d: usize| KvView {
                    data,
                    slot_stride: nkv * d,
                    head_stride: d,
                };
                let at = Attention {
                    q: qb.as_view(),
                    rows: m,
                    heads: nh,
                    dim_a: da,
                    dim_b: db,
                    dim_v: dv,
                    group,
                    key_a: view(kab.as_view(), da),
                    key_b: (db > 0).then(|| view(kbb.as_view(), db)),
                    value: view(vb.as_view(), dv),
                    capacity,
                    pos: pb.as_view(),
                    slot0: sb.as_view(),
                    window,
                    scale,
                };
                let mut want = poisoned(m * nh * dv);
                g.k.attention(&g.dev, &at, want.as_mut()).unwrap();
                let want = g.dev.download(want.as_view()).unwrap();
                // Rows of whole blocks of 32 may be quantized as well (the
                // second round): Q8 rows of exactly the output.
                let whole = dv % 32 == 0;
                let qb = q8_row_bytes(nh * dv);
                for blocks in [1usize, 3, 16] {
                    for round in 0..2 {
                        let mut out = poisoned(m * nh * dv);
                        let mut oq = upload(&vec![0xa5u8; m * qb]);
                        let split = AttentionSplit {
                            blocks,
                            chunk_cap,
                            records: records.as_mut(),
                            counters: counters.as_mut(),
                            out_q8: (round == 1).then(|| oq.as_mut()),
                        };
                        let r = g.k.attention_split(&g.dev, &at, split, out.as_mut());
                        if round == 1 && !whole {
                            assert!(r.is_err(), "Q8 rows of {dv}-value heads");
                            continue;
                        }
                        r.unwrap();
                        if round == 1 {
                            let got = g.dev.download(oq.as_view()).unwrap();
                            let refq = q8_rows_ref(&want, nh * dv);
                            let used = nh * dv + nh * dv / 4;
                            for i in 0..m {
                                assert_eq!(
                                    got[i * qb..i * qb + used],
                                    refq[i * qb..i * qb + used],
                                    "Q8 row {i} of split attention, blocks={blocks}"
                                );
                            }
                        }
                        assert_bits(
                            &format!(
                                "split attention heads={nh} dim_b={db} rows={pair:?} \
                                 window={window:?} blocks={blocks} round {round}"
                            ),
                            &g.dev.download(out.as_view()).unwrap(),
                            &want,
                        );
                        assert!(
                            g.dev
                                .download(counters.as_view())
                                .unwrap()
                                .iter()
                                .all(|&c| c == 0),
                            "counters left non-zero"
                        );
                    }
                }
                // Records for fewer chunks than a row has: that row is NaN,
                // the others keep their bits.
                let cap = 2usize;
                let mut out = poisoned(m * nh * dv);
                let mut oq = upload(&vec![0xa5u8; m * qb]);
                let split = AttentionSplit {
                    blocks: 2,
                    chunk_cap: cap,
                    records: records.as_mut(),
                    counters: counters.as_mut(),
                    out_q8: whole.then(|| oq.as_mut()),
                };
                g.k.attention_split(&g.dev, &at, split, out.as_mut())
                    .unwrap();
                let got = g.dev.download(out.as_view()).unwrap();
                if whole {
                    // NaN rows quantize to zeros with scale 0, as on the CPU.
                    let gq = g.dev.download(oq.as_view()).unwrap();
                    let refq = q8_rows_ref(&got, nh * dv);
                    let used = nh * dv + nh * dv / 4;
                    for i in 0..m {
                        assert_eq!(gq[i * qb..i * qb + used], refq[i * qb..i * qb + used]);
                    }
                }
                for (i, &(p, _)) in pair.iter().enumerate() {
                    let p = p as usize;
                    let first = window.map_or(0, |w| (p + 1).saturating_sub(w));
                    let chunks = p / ATTENTION_CHUNK - first / ATTENTION_CHUNK + 1;
                    let row = &got[i * nh * dv..(i + 1) * nh * dv];
                    if chunks > cap {
                        assert!(
                            row.iter().all(|v| v.is_nan()),
                            "row of {chunks} chunks not NaN"
                        );
                    } else {
                        assert_bits(
                            "split attention within its records",
                            row,
                            &want[i * nh * dv..(i + 1) * nh * dv],
                        );
                    }
                }
            }
        }
    }
}

/// MLA in absorbed form: query absorption through kv_b (bf16, q8_0 and
/// the legacy q4_1/q5_0/q5_1 and iq4_nl, whose elements `mla_absorb` reads
/// one by one),
/// attention over the latent + rotary caches, and W_uv as a grouped matvec
/// over the heads' value rows of kv_b.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn mla_absorbed_attention_matches_f64() {
    let g = gpu();
    let mut rng = rng(800);
    let (nh, r, dr, dn, dv) = (3usize, 96usize, 24usize, 40usize, 36usize);
    let (rows_n, capacity) = (4usize, 300usize);
    let latent = nonzero(&mut rng, capacity * r, 0.01, 1.0);
    let kpe = nonzero(&mut rng, capacity * dr, 0.01, 1.0);
    let q = nonzero(&mut rng, rows_n * nh * (dn + dr), 0.01, 1.0);
    let pos: Vec<u32> = vec![0, 100, 257, 299];
    let scale = 0.11f32;
    for fmt in [
        WeightFormat::Bf16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Iq4Nl,
    ] {
        let w = random_weights(&mut rng, fmt, nh * (dn + dv), r);
        let wb = upload(&w.bytes);
        let view = WeightView {
            format: fmt,
            rows: nh * (dn + dv),
            cols: r,
            data: wb.as_view(),
            fp8: None,
        };
        // 1. absorption, against the CPU tier's row_axpy sequence.
        let qb = upload(&q);
        let mut qa = poisoned(rows_n * nh * (r + dr));
        g.k.mla_absorb(
            &g.dev,
            &view,
            nh,
            dn,
            dv,
            qb.as_view(),
            nh * (dn + dr),
            dn + dr,
            rows_n,
            qa.as_mut(),
            nh * (r + dr),
            r + dr,
        )
        .unwrap();
        let mut qa_host = g.dev.download(qa.as_view()).unwrap();
        for t in 0..rows_n {
            for h in 0..nh {
                let mut acc = vec![0.0f32; r];
                for j in 0..dn {
                    let qj = q[(t * nh + h) * (dn + dr) + j];
                    let row = &w.f32[(h * (dn + dv) + j) * r..(h * (dn + dv) + j + 1) * r];
                    for (a, &wv) in acc.iter_mut().zip(row) {
                        *a += qj * wv;
                    }
                }
                let at = (t * nh + h) * (r + dr);
                assert_bits(
                    &format!("{fmt:?} absorb row {t} head {h}"),
                    &qa_host[at..at + r],
                    &acc,
                );
                // q_pe goes after the absorbed query.
                qa_host[at + r..at + r + dr].copy_from_slice(
                    &q[(t * nh + h) * (dn + dr) + dn..(t * nh + h + 1) * (dn + dr)],
                );
            }
        }
        // 2. attention over latent + rotary key.
        let full_q = upload(&qa_host);
        let (lb, pb, posb) = (upload(&latent), upload(&kpe), upload(&pos));
        let s0 = upload(&vec![0u32; rows_n]);
        let mut ctx = poisoned(rows_n * nh * r);
        let at = Attention {
            q: full_q.as_view(),
            rows: rows_n,
            heads: nh,
            dim_a: r,
            dim_b: dr,
            dim_v: r,
            group: nh,
            key_a: KvView {
                data: lb.as_view(),
                slot_stride: r,
                head_stride: 0,
            },
            key_b: Some(KvView {
                data: pb.as_view(),
                slot_stride: dr,
                head_stride: 0,
            }),
            value: KvView {
                data: lb.as_view(),
                slot_stride: r,
                head_stride: 0,
            },
            capacity,
            pos: posb.as_view(),
            slot0: s0.as_view(),
            window: None,
            scale,
        };
        g.k.attention(&g.dev, &at, ctx.as_mut()).unwrap();
        let ctx_host = g.dev.download(ctx.as_view()).unwrap();
        let (mut want, mut mag) = (Vec::new(), Vec::new());
        for (t, &p) in pos.iter().enumerate() {
            for h in 0..nh {
                let qh = &qa_host[(t * nh + h) * (r + dr)..(t * nh + h + 1) * (r + dr)];
                let (o, m) = attend_f64(
                    qh,
                    (&latent, r, 0, r),
                    Some((&kpe, dr, 0, dr)),
                    (&latent, r, 0, r),
                    0,
                    0..=p as usize,
                    scale as f64,
                );
                want.extend(o);
                mag.extend(m);
            }
        }
        assert_close(&format!("{fmt:?} mla attention"), &ctx_host, &want, |i| {
            REL * mag[i]
        });
        // 3. W_uv: o[t][h] = kv_b[h·(dn+dv) + dn ..][..dv] · ctx[t][h], all
        // heads in one grouped launch == one launch per head.
        let rb = fmt.row_bytes(r).unwrap();
        let uv = WeightView {
            format: fmt,
            rows: dv,
            cols: r,
            data: wb.view(dn * rb..wb.len()).unwrap(),
            fp8: None,
        };
        let mut o = poisoned(rows_n * nh * dv);
        let group = colibri_cuda::MatvecGroup {
            w: uv,
            matrices: nh,
            w_stride: (dn + dv) * rb,
            scale_stride: 0,
            x: ctx.as_view(),
            x_tok_stride: nh * r,
            x_mat_stride: r,
            ntok: rows_n,
            y_tok_stride: nh * dv,
            y_mat_stride: dv,
        };
        g.k.matvec_group(&g.dev, &group, o.as_mut()).unwrap();
        let o_host = g.dev.download(o.as_view()).unwrap();
        for h in 0..nh {
            let hv = WeightView {
                data: wb
                    .view((h * (dn + dv) + dn) * rb..(h * (dn + dv) + dn + dv) * rb)
                    .unwrap(),
                ..uv
            };
            let xs: Vec<f32> = (0..rows_n)
                .flat_map(|t| ctx_host[(t * nh + h) * r..(t * nh + h + 1) * r].to_vec())
                .collect();
            let xb = upload(&xs);
            let mut y = poisoned(rows_n * dv);
            g.k.matvec(&g.dev, &hv, xb.as_view(), rows_n, y.as_mut())
                .unwrap();
            let y = g.dev.download(y.as_view()).unwrap();
            for t in 0..rows_n {
                assert_bits(
                    &format!("{fmt:?} W_uv head {h} token {t}"),
                    &o_host[(t * nh + h) * dv..(t * nh + h + 1) * dv],
                    &y[t * dv..(t + 1) * dv],
                );
            }
        }
    }
}

/// The expert-upload path: host memory registered with the driver, copied
/// on the copy stream, ordered before compute work by an event.
#[test]
#[ignore = "needs an NVIDIA GPU: run with cargo test -p colibri-cuda -- --ignored"]
fn registered_host_copy_arrives_in_order() {
    let g = gpu();
    let mut rng = rng(900);
    let n = (1 << 20) + 100;
    let mut host: Vec<u8> = (0..n).map(|_| rng.random()).collect();
    // SAFETY: `host` outlives the registration (dropped first, below) and
    // is not written while copies are in flight (we wait on the event).
    let reg = unsafe { g.dev.register_host(host.as_mut_ptr(), host.len()) }.unwrap();
    let mut dst = g.dev.alloc::<u8>(n - 37).unwrap();
    assert!(
        g.dev
            .download(dst.as_view())
            .unwrap()
            .iter()
            .all(|&b| b == 0),
        "alloc zeroes"
    );
    // SAFETY: nothing writes `host` or reads `dst` until the event is waited
    // for.
    let done = unsafe { g.dev.copy_to_device_async(&reg, 37, dst.as_mut()) }.unwrap();
    g.dev.compute_wait(&done).unwrap();
    let got = g.dev.download(dst.as_view()).unwrap();
    assert!(done.is_complete().unwrap());
    assert!(got == host[37..], "copied bytes differ");
    // Out-of-range copies are refused.
    let mut big = g.dev.alloc::<u8>(n).unwrap();
    // SAFETY: refused before any copy is issued.
    assert!(unsafe { g.dev.copy_to_device_async(&reg, 1, big.as_mut()) }.is_err());
    drop(reg);
    g.dev.synchronize().unwrap();
}
