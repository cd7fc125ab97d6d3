//! The engine-side helpers on a real GPU: the pointer-table matvec gives
//! bit for bit what the plain matvec gives for every format and token
//! count, wherever its matrices sit; the row kernels equal their CPU
//! definitions; mapped pinned host memory is read and written in place by
//! kernels and round-trips through the async upload/download helpers.
//! Ignored without a GPU.

mod common;

use colibri_cuda::{Fp8Scales, MatvecTable, WeightFormat, WeightView};
use common::{FORMATS, gpu, nonzero, poisoned, random_weights, rng, upload};
use rand::Rng;
use rand::seq::SliceRandom;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn table_matvec_equals_single_matvec_bits() {
    let g = gpu();
    for (fi, &fmt) in FORMATS.iter().enumerate() {
        let (rows, cols) = (96usize, 256usize);
        let experts = 5usize;
        let mut r = rng(100 + fi as u64);
        // Each expert in its own slot of one big buffer, in shuffled
        // order, at a 256-byte-aligned offset.
        let rb = fmt.row_bytes(cols).unwrap();
        let slot = (rows * rb).next_multiple_of(256) + 256;
        let ws: Vec<_> = (0..experts)
            .map(|_| random_weights(&mut r, fmt, rows, cols))
            .collect();
        let order = [3usize, 0, 4, 1, 2];
        let mut bytes = vec![0u8; slot * experts];
        let mut scales = Vec::new();
        let mut scale_at = Vec::new();
        for (s, &e) in order.iter().enumerate() {
            bytes[s * slot..s * slot + rows * rb].copy_from_slice(&ws[e].bytes);
            scale_at.push(scales.len());
            scales.extend_from_slice(&ws[e].scales);
        }
        let dw = upload(&bytes);
        let ds = upload(&if scales.is_empty() {
            vec![0.0f32]
        } else {
            scales.clone()
        });
        // Tokens per expert: 1, 3, 0-free mix; pairs packed by expert.
        let counts = [1usize, 3, 2, 8, 5];
        let total: usize = counts.iter().sum();
        let x = nonzero(&mut r, total * cols, 0.1, 1.0);
        let dx = upload(&x);
        let mut offs = Vec::new();
        let mut at = 0;
        for c in counts {
            offs.push(at as u32);
            at += c;
        }
        let w_ptrs: Vec<u64> = (0..experts)
            .map(|e| {
                let s = order.iter().position(|&o| o == e).unwrap();
                dw.as_view().device_ptr() + (s * slot) as u64
            })
            .collect();
        let s_ptrs: Vec<u64> = (0..experts)
            .map(|e| {
                let s = order.iter().position(|&o| o == e).unwrap();
                ds.as_view().device_ptr() + 4 * scale_at[s] as u64
            })
            .collect();
        let (dp, dsp) = (upload(&w_ptrs), upload(&s_ptrs));
        let (doff, dcnt) = (
            upload(&offs),
            upload(&counts.iter().map(|&c| c as u32).collect::<Vec<_>>()),
        );
        let mut y = poisoned(total * rows);
        let t = MatvecTable {
            format: fmt,
            rows,
            cols,
            matrices: experts,
            w_ptrs: dp.as_view(),
            scale_ptrs: (fmt == WeightFormat::F8E4M3).then(|| (dsp.as_view(), ws[0].block)),
            x: dx.as_view(),
            x_tok_stride: cols,
            x_rows: None,
            tok_off: doff.as_view(),
            tok_cnt: dcnt.as_view(),
            max_tok: 8,
            y_tok_stride: rows,
        };
        // SAFETY: every pointer is a matrix (and scale grid) of the table's
        // shape inside live buffers; token ranges are disjoint rows of x/y.
        unsafe { g.k.matvec_table(&g.dev, &t, y.as_mut()).unwrap() };
        let got = g.dev.download(y.as_view()).unwrap();
        for e in 0..experts {
            let s = order.iter().position(|&o| o == e).unwrap();
            let wv = WeightView {
                format: fmt,
                rows,
                cols,
                data: dw.view(s * slot..s * slot + rows * rb).unwrap(),
                fp8: (fmt == WeightFormat::F8E4M3).then(|| Fp8Scales {
                    scales: ds
                        .view(scale_at[s]..scale_at[s] + ws[e].scales.len())
                        .unwrap(),
                    block: ws[e].block,
                }),
            };
            let (o, c) = (offs[e] as usize, counts[e]);
            let mut want = poisoned(c * rows);
            g.k.matvec(
                &g.dev,
                &wv,
                dx.view(o * cols..(o + c) * cols).unwrap(),
                c,
                want.as_mut(),
            )
            .unwrap();
            let want = g.dev.download(want.as_view()).unwrap();
            for (i, (a, b)) in got[o * rows..(o + c) * rows].iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{fmt:?} expert {e} element {i}");
            }
        }
    }
}

/// The fused gate/up/SwiGLU table launch gives the bits of a gate table
/// launch, an up table launch and `swiglu`, for every format, for one and
/// two tokens per matrix, with the gate and up matrices in separate
/// buffers at unrelated offsets, and with matrices asked of L2 ahead.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn glu_table_matvec_equals_three_launches() {
    let g = gpu();
    for (fi, &fmt) in FORMATS.iter().enumerate() {
        for max_tok in [1usize, 2] {
            // 320 columns: a partial round; k-quant (Q6_K, Q4_K, Q5_K)
            // rows are whole super-blocks of 256.
            let cols = if fmt.row_bytes(320).is_some() {
                320
            } else {
                512
            };
            let (rows, experts) = (77usize, 4usize);
            let mut r = rng(300 + 10 * fi as u64 + max_tok as u64);
            let rb = fmt.row_bytes(cols).unwrap();
            let slot = (rows * rb).next_multiple_of(256) + 512;
            // Gate matrices in one buffer, up matrices in another.
            let mut sides = Vec::new();
            for side in 0..2 {
                let ws: Vec<_> = (0..experts)
                    .map(|_| random_weights(&mut r, fmt, rows, cols))
                    .collect();
                let mut bytes = vec![0u8; slot * experts + 256 * side];
                let mut scales = Vec::new();
                let mut scale_at = Vec::new();
                for (e, w) in ws.iter().enumerate() {
                    let at = e * slot + 256 * side;
                    bytes[at..at + rows * rb].copy_from_slice(&w.bytes);
                    scale_at.push(scales.len());
                    scales.extend_from_slice(&w.scales);
                }
                let dw = upload(&bytes);
                let ds = upload(&if scales.is_empty() {
                    vec![0.0f32]
                } else {
                    scales
                });
                let w_ptrs: Vec<u64> = (0..experts)
                    .map(|e| dw.as_view().device_ptr() + (e * slot + 256 * side) as u64)
                    .collect();
                let s_ptrs: Vec<u64> = (0..experts)
                    .map(|e| ds.as_view().device_ptr() + 4 * scale_at[e] as u64)
                    .collect();
                let (dp, dsp) = (upload(&w_ptrs), upload(&s_ptrs));
                sides.push((dw, ds, dp, dsp, ws[0].block));
            }
            let counts: Vec<usize> = (0..experts).map(|e| 1 + (e % max_tok)).collect();
            let total: usize = counts.iter().sum();
            let offs: Vec<u32> = counts
                .iter()
                .scan(0u32, |at, &c| {
                    let o = *at;
                    *at += c as u32;
                    Some(o)
                })
                .collect();
            let x = nonzero(&mut r, total * cols, 0.1, 1.0);
            let dx = upload(&x);
            let (doff, dcnt) = (
                upload(&offs),
                upload(&counts.iter().map(|&c| c as u32).collect::<Vec<_>>()),
            );
            let fp8 = fmt == WeightFormat::F8E4M3;
            let table = |side: usize| MatvecTable {
                format: fmt,
                rows,
                cols,
                matrices: experts,
                w_ptrs: sides[side].2.as_view(),
                scale_ptrs: fp8.then(|| (sides[side].3.as_view(), sides[side].4)),
                x: dx.as_view(),
                x_tok_stride: cols,
                x_rows: None,
                tok_off: doff.as_view(),
                tok_cnt: dcnt.as_view(),
                max_tok,
                y_tok_stride: rows,
            };
            let (mut yg, mut yu, mut want, mut got) = (
                poisoned(total * rows),
                poisoned(total * rows),
                poisoned(total * rows),
                poisoned(total * rows),
            );
            // SAFETY: every pointer is a matrix (and scale grid) of the
            // table's shape inside live buffers; token ranges are disjoint.
            unsafe {
                g.k.matvec_table(&g.dev, &table(0), yg.as_mut()).unwrap();
                g.k.matvec_table(&g.dev, &table(1), yu.as_mut()).unwrap();
                g.k.matvec_table_glu(
                    &g.dev,
                    &table(0),
                    (sides[1].2.as_view(), fp8.then(|| sides[1].3.as_view())),
                    None,
                    got.as_mut(),
                )
                .unwrap();
            }
            g.k.swiglu(
                &g.dev,
                yg.as_view(),
                yu.as_view(),
                want.as_mut(),
                total,
                rows,
            )
            .unwrap();
            // The same tokens read where they lie: x stored with its rows
            // shuffled (and one spare row), found through x_rows.
            let mut perm: Vec<u32> = (0..total as u32).collect();
            perm.shuffle(&mut r);
            let mut xs = nonzero(&mut r, (total + 1) * cols, 0.1, 1.0);
            for (p, &row) in perm.iter().enumerate() {
                let row = row as usize;
                xs[row * cols..(row + 1) * cols].copy_from_slice(&x[p * cols..(p + 1) * cols]);
            }
            let (dxs, dperm) = (upload(&xs), upload(&perm));
            let mut got_rows = poisoned(total * rows);
            let mut by_rows = table(0);
            by_rows.x = dxs.as_view();
            by_rows.x_rows = Some((dperm.as_view(), 0));
            // SAFETY: as above; perm names rows inside xs.
            unsafe {
                g.k.matvec_table_glu(
                    &g.dev,
                    &by_rows,
                    (sides[1].2.as_view(), fp8.then(|| sides[1].3.as_view())),
                    // The gate matrices asked of L2 ahead (a hint: the
                    // same bits).
                    Some((sides[0].2.as_view(), rows * rb)),
                    got_rows.as_mut(),
                )
                .unwrap();
            }
            let (got, want, got_rows) = (
                g.dev.download(got.as_view()).unwrap(),
                g.dev.download(want.as_view()).unwrap(),
                g.dev.download(got_rows.as_view()).unwrap(),
            );
            for (i, (a, b)) in got_rows.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{fmt:?} t{max_tok} x_rows element {i}"
                );
            }
            assert!(
                want.iter().all(|v| v.is_finite()),
                "{fmt:?}: reference incomplete"
            );
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{fmt:?} t{max_tok} element {i}");
            }
            // More tokens than the fused kernel takes are refused.
            let mut big = table(0);
            big.max_tok = colibri_cuda::GLU_MAX_TOK + 1;
            // SAFETY: refused before any launch.
            let refused = unsafe {
                g.k.matvec_table_glu(
                    &g.dev,
                    &big,
                    (sides[1].2.as_view(), fp8.then(|| sides[1].3.as_view())),
                    None,
                    got_buf(total * rows).as_mut(),
                )
            };
            assert!(refused.is_err());
        }
    }
}

fn got_buf(n: usize) -> colibri_cuda::DeviceBuffer<f32> {
    poisoned(n)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn row_kernels_equal_their_definitions() {
    let g = gpu();
    let mut r = rng(7);
    let (rows, cols) = (5usize, 300usize);
    let a = nonzero(&mut r, rows * cols, 0.1, 2.0);
    let b = nonzero(&mut r, rows * cols, 0.1, 2.0);
    let bias = nonzero(&mut r, cols, 0.1, 2.0);
    let mut y = upload(&a);
    g.k.add_inplace(&g.dev, y.as_mut(), upload(&b).as_view())
        .unwrap();
    let got = g.dev.download(y.as_view()).unwrap();
    for i in 0..a.len() {
        assert_eq!(got[i].to_bits(), (a[i] + b[i]).to_bits());
    }
    let db = upload(&bias);
    g.k.add_bias(&g.dev, y.as_mut(), db.as_view(), rows)
        .unwrap();
    let got2 = g.dev.download(y.as_view()).unwrap();
    for i in 0..a.len() {
        assert_eq!(got2[i].to_bits(), (got[i] + bias[i % cols]).to_bits());
    }
    g.k.clamp_inplace(&g.dev, y.as_mut(), 1.5).unwrap();
    let got3 = g.dev.download(y.as_view()).unwrap();
    for i in 0..a.len() {
        assert_eq!(got3[i], got2[i].clamp(-1.5, 1.5));
    }
    let idx: Vec<u32> = (0..7).map(|_| r.random_range(0..rows as u32)).collect();
    let di = upload(&idx);
    let mut dst = poisoned(7 * cols);
    // SAFETY: every index is below `rows`.
    unsafe {
        g.k.gather_rows(
            &g.dev,
            y.as_view(),
            cols,
            rows,
            di.as_view(),
            dst.as_mut(),
            cols,
            cols,
        )
        .unwrap()
    };
    let got4 = g.dev.download(dst.as_view()).unwrap();
    for (j, &i) in idx.iter().enumerate() {
        assert_eq!(
            &got4[j * cols..(j + 1) * cols],
            &got3[i as usize * cols..(i as usize + 1) * cols]
        );
    }
    // A column slice, strided both ways.
    let mut dst = poisoned(rows * 40);
    g.k.copy_2d(
        &g.dev,
        y.view(17..rows * cols).unwrap(),
        cols,
        dst.as_mut(),
        40,
        rows,
        33,
    )
    .unwrap();
    let got5 = g.dev.download(dst.as_view()).unwrap();
    for t in 0..rows {
        assert_eq!(
            &got5[t * 40..t * 40 + 33],
            &got3[t * cols + 17..t * cols + 50]
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn mapped_host_memory_is_read_and_written_in_place() {
    let g = gpu();
    let n = 10_000usize;
    let mut r = rng(9);
    let a = nonzero(&mut r, n, 0.1, 1.0);
    let mut host = g.dev.alloc_host(4 * n).unwrap();
    host.typed_mut::<f32>().copy_from_slice(&a);
    // A kernel adds device data into the mapped host buffer in place.
    let b = nonzero(&mut r, n, 0.1, 1.0);
    let db = upload(&b);
    g.k.add_inplace(&g.dev, host.device_view_mut::<f32>(), db.as_view())
        .unwrap();
    g.dev.synchronize().unwrap();
    for i in 0..n {
        assert_eq!(host.typed::<f32>()[i].to_bits(), (a[i] + b[i]).to_bits());
    }
    // Async upload from it and download into another, on the compute stream.
    let mut d = g.dev.alloc::<f32>(n).unwrap();
    let mut back = g.dev.alloc_host(4 * n).unwrap();
    // SAFETY: neither host buffer is touched until the synchronize.
    unsafe {
        g.dev.upload_async(host.typed::<f32>(), d.as_mut()).unwrap();
        g.dev
            .download_async(d.as_view(), back.typed_mut::<f32>())
            .unwrap();
    }
    g.dev.synchronize().unwrap();
    assert_eq!(back.typed::<f32>(), host.typed::<f32>());
    // And a copy-stream copy from it, ordered by its event.
    let mut d2 = g.dev.alloc::<u8>(4 * n).unwrap();
    // SAFETY: `host` is not written until the event completed.
    let ev = unsafe {
        g.dev
            .copy_host_ptr_async(host.as_slice().as_ptr(), d2.as_mut())
            .unwrap()
    };
    g.dev.compute_wait(&ev).unwrap();
    let got = g.dev.download(d2.as_view()).unwrap();
    assert_eq!(&got[..], host.as_slice());
}
