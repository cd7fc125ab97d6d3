//! Matvec throughput on expert-sized matrices against the device's own
//! memory bandwidth, measured in the same run (DESIGN.md principle 6).
//!
//!     cargo run --release -p colibri-cuda --example bench_kernels [-- --all]
//!
//! Ceiling: a large device-to-device copy, counting bytes read + written.
//! Matvec: an expert matrix of 768×2048 (gate/up of a 2048-hidden MoE) and
//! 2048×768 (down) in q4_0, q8_0, bf16 and fp8; enough experts back to back
//! that they are ≥ 4× the L2, so nothing is served from cache. Two ways:
//! one launch per expert (what a naive per-expert loop costs: launch
//! latency dominates such small matrices) and one grouped launch over all
//! experts (grid.z). GB/s counts weight bytes only (x and y are < 1% of
//! them). Timing with CUDA events after a warm-up, median of the repeats.

use colibri_cuda::{
    CudaDevice, Fp8Scales, KernelCache, KernelSet, MatvecGroup, WeightFormat, WeightView,
};

const REPEATS: usize = 15;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `f` with events around it: warm-up, then the median of REPEATS.
fn time_ms(
    dev: &CudaDevice,
    mut f: impl FnMut() -> colibri_cuda::Result<()>,
) -> colibri_cuda::Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..REPEATS {
        let a = dev.record_compute_timed()?;
        f()?;
        let b = dev.record_compute_timed()?;
        times.push(a.elapsed_ms(&b)? as f64);
    }
    dev.synchronize()?;
    Ok(median(times))
}

/// A cheap deterministic byte stream (xorshift), so no matrix is zeros.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

/// One expert matrix with valid, non-zero, finite elements.
fn expert(fmt: WeightFormat, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut b = bytes(fmt.row_bytes(cols).unwrap_or(0) * rows, seed);
    let scale = 0x2000u16.to_le_bytes(); // f16 ≈ 0.0078
    match fmt {
        WeightFormat::Q8_0 | WeightFormat::Q8_0Q8 => b
            .chunks_exact_mut(34)
            .for_each(|blk| blk[..2].copy_from_slice(&scale)),
        WeightFormat::Q4_0 | WeightFormat::Q4_0Q8 => b
            .chunks_exact_mut(18)
            .for_each(|blk| blk[..2].copy_from_slice(&scale)),
        WeightFormat::Q6K | WeightFormat::Q6KQ8 => b
            .chunks_exact_mut(210)
            .for_each(|blk| blk[208..].copy_from_slice(&scale)),
        // d and dmin (each sub-block's 6-bit scale and min come from the
        // random bytes).
        WeightFormat::Q4K | WeightFormat::Q4KQ8 => b.chunks_exact_mut(144).for_each(|blk| {
            blk[..2].copy_from_slice(&scale);
            blk[2..4].copy_from_slice(&scale);
        }),
        WeightFormat::Q5K | WeightFormat::Q5KQ8 => b.chunks_exact_mut(176).for_each(|blk| {
            blk[..2].copy_from_slice(&scale);
            blk[2..4].copy_from_slice(&scale);
        }),
        // d (and Q4_1/Q5_1's min).
        WeightFormat::Q4_1
        | WeightFormat::Q5_0
        | WeightFormat::Q5_1
        | WeightFormat::Q4_1Q8
        | WeightFormat::Q5_0Q8
        | WeightFormat::Q5_1Q8 => {
            let size = fmt.row_bytes(32).unwrap_or(32);
            b.chunks_exact_mut(size).for_each(|blk| {
                blk[..2].copy_from_slice(&scale);
                if !matches!(fmt, WeightFormat::Q5_0 | WeightFormat::Q5_0Q8) {
                    blk[2..4].copy_from_slice(&scale);
                }
            })
        }
        // d (Q2_K's dmin too); the codes and sub-block scales are random.
        WeightFormat::Q2K | WeightFormat::Q2KQ8 => b.chunks_exact_mut(84).for_each(|blk| {
            blk[80..82].copy_from_slice(&scale);
            blk[82..84].copy_from_slice(&scale);
        }),
        WeightFormat::Q3K | WeightFormat::Q3KQ8 => b
            .chunks_exact_mut(110)
            .for_each(|blk| blk[108..110].copy_from_slice(&scale)),
        WeightFormat::Iq4Nl | WeightFormat::Iq4NlQ8 => b
            .chunks_exact_mut(18)
            .for_each(|blk| blk[..2].copy_from_slice(&scale)),
        WeightFormat::Iq4Xs | WeightFormat::Iq4XsQ8 => b
            .chunks_exact_mut(136)
            .for_each(|blk| blk[..2].copy_from_slice(&scale)),
        // bf16 with exponent bits forced into [2^-8, 2^0): finite, non-zero.
        WeightFormat::Bf16 | WeightFormat::F16 => b
            .chunks_exact_mut(2)
            .for_each(|h| h[1] = (h[1] & 0x80) | 0x3c),
        WeightFormat::F8E4M3 => b.iter_mut().for_each(|v| *v = (*v & 0xb7) | 0x08),
        WeightFormat::F32 => b
            .chunks_exact_mut(4)
            .for_each(|f| f[3] = (f[3] & 0x80) | 0x3c),
    }
    b
}

fn main() -> colibri_cuda::Result<()> {
    let dev = CudaDevice::open(0)?;
    let info = dev.info().clone();
    let kernels = KernelSet::load(&dev, &KernelCache::user_default())?;
    println!(
        "device: {} ({}), {} SMs, L2 {} MiB, {} GiB, driver CUDA {}.{}",
        info.name,
        info.arch,
        info.multiprocessors,
        info.l2_bytes >> 20,
        info.total_mem >> 30,
        info.driver_version.0,
        info.driver_version.1
    );

    // The ceiling: device-to-device copy.
    let copy_bytes = (1usize << 30).min(info.total_mem / 8);
    let src = dev.upload(&bytes(copy_bytes, 7))?;
    let mut dst = dev.alloc::<u8>(copy_bytes)?;
    let ms = time_ms(&dev, || dev.copy(src.as_view(), dst.as_mut()))?;
    let copy_gbs = 2.0 * copy_bytes as f64 / (ms * 1e-3) / 1e9;
    println!(
        "d2d copy of {} MiB: {ms:.3} ms, {copy_gbs:.0} GB/s (read + write)",
        copy_bytes >> 20
    );
    drop((src, dst));

    println!(
        "\n{:<8} {:>10} {:>8} {:>5} {:>9} {:>11} {:>9} {:>8}",
        "format", "shape", "mode", "ntok", "experts", "us/expert", "GB/s", "of copy"
    );
    // `--all`: every format, the k-quants and llama.cpp's fallbacks too.
    let mut formats = vec![
        WeightFormat::Q4_0,
        WeightFormat::Q4_0Q8,
        WeightFormat::Q8_0,
        WeightFormat::Q8_0Q8,
        WeightFormat::Bf16,
        WeightFormat::F8E4M3,
    ];
    if std::env::args().any(|a| a == "--all") {
        formats.extend([
            WeightFormat::Q6K,
            WeightFormat::Q6KQ8,
            WeightFormat::Q4K,
            WeightFormat::Q4KQ8,
            WeightFormat::Q5K,
            WeightFormat::Q5KQ8,
            WeightFormat::Q4_1,
            WeightFormat::Q5_0,
            WeightFormat::Q5_1,
            WeightFormat::Q2K,
            WeightFormat::Q3K,
            WeightFormat::Iq4Nl,
            WeightFormat::Iq4Xs,
            WeightFormat::Q4_1Q8,
            WeightFormat::Q5_0Q8,
            WeightFormat::Q5_1Q8,
            WeightFormat::Q2KQ8,
            WeightFormat::Q3KQ8,
            WeightFormat::Iq4NlQ8,
            WeightFormat::Iq4XsQ8,
        ]);
    }
    for (rows, cols) in [(768usize, 2048usize), (2048, 768)] {
        for &fmt in &formats {
            let Some(rb) = fmt.row_bytes(cols) else {
                continue;
            };
            let mat = rows * rb;
            let n = (4 * info.l2_bytes as usize).div_ceil(mat).clamp(8, 4096);
            let mut all = Vec::with_capacity(n * mat);
            for e in 0..n {
                all.extend_from_slice(&expert(fmt, rows, cols, e as u64 + 1));
            }
            let wb = dev.upload(&all)?;
            drop(all);
            let block = 128;
            let grid = rows.div_ceil(block) * cols.div_ceil(block);
            let scales = dev.upload(&vec![0.01f32; grid * n])?;
            let ntok_max = 8;
            let xs: Vec<f32> = bytes(n * ntok_max * cols * 4, 3)
                .chunks_exact(4)
                .map(|c| (c[0] as f32 - 127.5) / 128.0)
                .collect();
            let xb = dev.upload(&xs)?;
            let mut yb = dev.alloc::<f32>(n * ntok_max * rows)?;
            let view = |z: usize| -> colibri_cuda::Result<WeightView<'_>> {
                Ok(WeightView {
                    format: fmt,
                    rows,
                    cols,
                    data: wb.view(z * mat..(z + 1) * mat)?,
                    fp8: (fmt == WeightFormat::F8E4M3)
                        .then(|| {
                            scales
                                .view(z * grid..(z + 1) * grid)
                                .map(|s| Fp8Scales { scales: s, block })
                        })
                        .transpose()?,
                })
            };
            let label = format!("{rows}x{cols}");
            let report = |mode: &str, ntok: usize, ms: f64| {
                let gbs = (n * mat) as f64 / (ms * 1e-3) / 1e9;
                println!(
                    "{:<8} {:>10} {:>8} {:>5} {:>9} {:>11.2} {:>9.0} {:>7.0}%",
                    format!("{fmt:?}").to_lowercase(),
                    label,
                    mode,
                    ntok,
                    n,
                    ms * 1e3 / n as f64,
                    gbs,
                    100.0 * gbs / copy_gbs
                );
            };
            let ms = time_ms(&dev, || {
                for z in 0..n {
                    let x = xb.view(z * cols..(z + 1) * cols)?;
                    let y = yb.view_mut(z * rows..(z + 1) * rows)?;
                    kernels.matvec(&dev, &view(z)?, x, 1, y)?;
                }
                Ok(())
            })?;
            report("single", 1, ms);
            for ntok in [1usize, 8] {
                let ms = time_ms(&dev, || {
                    // Matrix 0's view must reach over all n for the group.
                    let w = WeightView {
                        data: wb.as_view(),
                        fp8: view(0)?.fp8.map(|s| Fp8Scales {
                            scales: scales.as_view(),
                            ..s
                        }),
                        ..view(0)?
                    };
                    let g = MatvecGroup {
                        w,
                        matrices: n,
                        w_stride: mat,
                        scale_stride: grid,
                        x: xb.as_view(),
                        x_tok_stride: cols,
                        x_mat_stride: ntok_max * cols,
                        ntok,
                        y_tok_stride: rows,
                        y_mat_stride: ntok_max * rows,
                    };
                    kernels.matvec_group(&dev, &g, yb.as_mut())
                })?;
                report("grouped", ntok, ms);
            }
        }
    }

    // An LM head (Qwen3-30B-A3B's: 151,936 × 2048 bf16) for one token: the
    // persistent stream kernel, unless COLIBRI_MV_STREAM=0 (the plain
    // launch, a block per 8 rows).
    let (rows, cols) = (151_936usize, 2048usize);
    let fmt = WeightFormat::Bf16;
    let wb = dev.upload(&expert(fmt, rows, cols, 99))?;
    let xs: Vec<f32> = bytes(cols * 4, 5)
        .chunks_exact(4)
        .map(|c| (c[0] as f32 - 127.5) / 128.0)
        .collect();
    let xb = dev.upload(&xs)?;
    let mut yb = dev.alloc::<f32>(rows)?;
    let view = WeightView {
        format: fmt,
        rows,
        cols,
        data: wb.as_view(),
        fp8: None,
    };
    let ms = time_ms(&dev, || {
        kernels.matvec(&dev, &view, xb.as_view(), 1, yb.as_mut())
    })?;
    let gbs = wb.len() as f64 / (ms * 1e-3) / 1e9;
    println!(
        "\nLM head {rows}x{cols} bf16, one token, {} kernel: {:.1} us, {gbs:.0} GB/s, {:.0}% of copy",
        if kernels.matvec_streams(&dev, &view, 1) {
            "stream"
        } else {
            "plain"
        },
        ms * 1e3,
        100.0 * gbs / copy_gbs
    );
    Ok(())
}
