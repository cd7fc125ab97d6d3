//! Matrix–vector kernels against the memory-bandwidth roofline, measured in
//! the same run on the same machine.
//!
//! `cargo bench --bench kernels [-- --threads N --mib M --format q4_0 --batches 1,4,8]`
//!
//! For each weight format: a matrix of about `M` MiB (so it does not sit in
//! the caches) is multiplied by a vector repeatedly; we report the weight
//! bytes streamed per second and their ratio to the bandwidth of a plain
//! parallel read of a buffer of the same size. Q4_0 also runs in the CPU's
//! tiles, bf16 and f16 in quads (the layouts the engine gives them where
//! their kernels run). Batches of 4 and 32 vectors
//! (batched decode, prefill) also report the weight bytes per second times
//! the batch: what a token-at-a-time product would have to stream to keep
//! up.
//!
//! `-- --pages` instead compares the same matrices held in 4 KiB pages and
//! in transparent huge pages (as the engine holds owned weights), rounds
//! interleaved so that drifting memory bandwidth hits both alike.
//!
//! `-- --quads` compares bf16 and f16 matrices row-major and in quads at
//! several batch sizes, rounds interleaved (medians, the ratio per round);
//! with `--prefetch D,...` instead one token at several prefetch
//! distances of the quads kernel.
//!
//! `-- --tiling` measures rearranging Q4_0 rows into tiles and back (what
//! the RAM tier does on its installer thread to every expert it reads).
//!
//! `-- --experts N` streams decode-shaped products: per layer, 8 experts
//! picked at random from a pool of `N` (Qwen3-30B-A3B's shapes, tiled
//! Q4_0: gate and up 768 × 2048, down 2048 × 768, one token), as the CPU
//! tier's decode runs them (one pool job for the gates and ups, one for
//! the downs). Many short matrices, not one long one: what the hardware
//! prefetchers see in a real decode. GB/s of expert weights against a
//! read pass measured after each stretch; `--prefetch P,...` compares the
//! tile kernels' prefetch settings (`4096/l2`, `1536/l1`,
//! `4096/l2+1152/l1`, `0`; default: the default against none), slices of
//! layers taking turns.
//!
//! `-- --pool` times the thread pool's job round trip: jobs of empty
//! tasks (one per thread, and 128), and jobs of 128 in-cache sums against
//! the same sums on one thread divided by the thread count.
//!
//! `-- --more-tokens` times the row kernels of Q4_1, Q5_0, Q5_1, IQ4_NL,
//! Q2_K, Q3_K and IQ4_XS (`dot_more_q8`, one token) against their
//! several-token form (`dot_more_q8_multi`, 1 to 4 tokens per call) on 32
//! rows of 2048 columns held in L1, one thread, for the CPU's own kernel
//! set and AVX2's: ns per row and token, best of 15.
//!
//! `-- --tile-tokens` times the several-token Q4_0 tile kernel on one tile
//! held in L1 (one thread): tokens 8 per call, against the same tokens as
//! calls of 4 and of 1, and token counts that are not multiples of 8 split
//! as `tile_passes` splits them, rounds taking turns; ns per block and
//! token (a block: 16 rows × 32 columns, 8 `vpdpbusd` per token with
//! AVX-512).
//!
//! `-- --panel-tokens` times the Q2_K to Q6_K panel kernels
//! ([`colibri_model::kernels::k_panels`]) on one panel of 16 rows × 2048
//! columns held in L1, one thread, 1 to 8 tokens per call (and the AVX2
//! set's where the CPU's own set is another), against the row kernel
//! called per row and token (and, for Q2_K, Q3_K and IQ4_XS, the several-token
//! row kernel 4 tokens a call): ns per panel super-block (16 rows × 256
//! columns) and token, best of 5.
//!
//! `-- --expert-tiles N` is the prefill's shape of the same kernel: 96
//! expert matrices (81 MiB, read from memory), each tile against `N`
//! tokens in the passes `tile_passes` makes, one thread; with and without
//! asking L2 for the next tile during a tile's first pass, against the
//! same work on one tile that stays in L1; where the CPU has AMX, the AMX
//! kernel the same three ways, in the passes a prompt gives it.
//!
//! `-- --attention` times one decode step's attention over one layer's KV
//! cache (Qwen3-30B-A3B's 32 query heads on 4 KV heads of 128) at several
//! context lengths: a task per query head, each re-reading its KV head's
//! keys and values, against a task per KV head (`attend_heads` with the
//! group), which reads them once; and the grouped tasks again with the
//! cache flushed from every cache level first (`cold`), as a decode step
//! finds it once the weights have streamed through. GB/s counts the
//! cache's bytes once.

use std::time::Instant;

use colibri_model::Pool;
use colibri_model::format::WeightFormat;
use colibri_model::kernels::{
    kernels, matmul, matvec, matvecs, q4_0_tiles, q4_0_tiles_run_here, quads16, quads16_run_here,
    read_bandwidth,
};
use colibri_model::quant::{
    Q2_K_D, Q3_K_D, QK, QK_K, quantize_q4_0, quantize_q4_k, quantize_q5_k, quantize_q6_k,
    quantize_q8_0,
};
use colibri_model::tensor::{Bytes, QMatrix};
use rand::{Rng, SeedableRng};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn matrix(format: WeightFormat, rows: usize, cols: usize, rng: &mut impl Rng) -> QMatrix {
    let vals: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let data = match format {
        WeightFormat::F32 => Bytes::from_f32(vals),
        WeightFormat::Bf16 => Bytes::from_u16(
            vals.iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect(),
        ),
        WeightFormat::F16 => Bytes::from_u16(
            vals.iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect(),
        ),
        WeightFormat::Q8_0 => Bytes::from_vec(quantize_q8_0(&vals).expect("cols % 32 == 0")),
        WeightFormat::Q4_0 => Bytes::from_vec(quantize_q4_0(&vals).expect("cols % 32 == 0")),
        WeightFormat::Q6K => Bytes::from_vec(quantize_q6_k(&vals).expect("cols % 256 == 0")),
        WeightFormat::Q4K => Bytes::from_vec(quantize_q4_k(&vals).expect("cols % 256 == 0")),
        WeightFormat::Q5K => Bytes::from_vec(quantize_q5_k(&vals).expect("cols % 256 == 0")),
        // Read-only formats (no quantizer): random blocks with small
        // finite f16 scales (and mins).
        WeightFormat::Q4_1
        | WeightFormat::Q5_0
        | WeightFormat::Q5_1
        | WeightFormat::Q2K
        | WeightFormat::Q3K
        | WeightFormat::Iq4Nl
        | WeightFormat::Iq4Xs => random_blocks(format, rows, cols, rng),
        other => panic!("bench does not build {other:?}"),
    };
    QMatrix::new("bench", rows, cols, format, data, None).expect("matrix")
}

/// Random blocks of a format colibri reads but does not write, every f16
/// scale (and min) small and finite.
fn random_blocks(format: WeightFormat, rows: usize, cols: usize, rng: &mut impl Rng) -> Bytes {
    let (elems, scales): (usize, &[usize]) = match format {
        WeightFormat::Q5_0 | WeightFormat::Iq4Nl => (QK, &[0]),
        WeightFormat::Q4_1 | WeightFormat::Q5_1 => (QK, &[0, 2]),
        WeightFormat::Q2K => (QK_K, &[Q2_K_D, Q2_K_D + 2]),
        WeightFormat::Q3K => (QK_K, &[Q3_K_D]),
        WeightFormat::Iq4Xs => (QK_K, &[0]),
        other => panic!("{other:?} has a quantizer"),
    };
    let block = format.row_bytes(elems).expect("one block");
    let mut bytes: Vec<u8> = (0..rows * cols / elems * block)
        .map(|_| rng.random())
        .collect();
    for b in bytes.chunks_exact_mut(block) {
        for &at in scales {
            let v = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
            b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    Bytes::from_vec(bytes)
}

/// `w` (row-major Q4_0) rearranged into tiles.
fn tile(w: QMatrix) -> QMatrix {
    let blocks = w.cols / 32;
    let mut bytes = w.data().as_slice().to_vec();
    q4_0_tiles::tile_in_place(&mut bytes, w.rows, blocks, &mut Vec::new());
    QMatrix::new(
        "bench",
        w.rows,
        w.cols,
        w.format,
        Bytes::from_vec(bytes),
        None,
    )
    .and_then(QMatrix::tiled_q4_0)
    .expect("tiled matrix")
}

/// `w` (row-major bf16 or f16) with its rows in quads.
fn quads(w: QMatrix) -> QMatrix {
    let mut words: Vec<u16> = w
        .data()
        .as_slice()
        .chunks_exact(2)
        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
        .collect();
    quads16::to_quads(&mut words, w.rows, w.cols, &mut Vec::new());
    QMatrix::new(
        "bench",
        w.rows,
        w.cols,
        w.format,
        Bytes::from_u16(words),
        None,
    )
    .and_then(QMatrix::quads16)
    .expect("matrix in quads")
}

/// A copy of `w`'s bytes in fresh anonymous memory, in huge pages or
/// (`huge == false`) explicitly in 4 KiB pages.
fn in_pages(w: &QMatrix, huge: bool) -> QMatrix {
    let src = w.data().as_slice();
    let mut map = memmap2::MmapMut::map_anon(src.len()).expect("anonymous map");
    let advice = if huge {
        memmap2::Advice::HugePage
    } else {
        memmap2::Advice::NoHugePage
    };
    map.advise(advice).expect("madvise");
    map.copy_from_slice(src);
    let map = map.make_read_only().expect("read-only");
    let bytes = Bytes::new(std::sync::Arc::new(map), 0, src.len()).expect("bytes");
    let m = QMatrix::new("bench", w.rows, w.cols, w.format, bytes, None).expect("matrix");
    if w.is_tiled() {
        m.tiled_q4_0().expect("tiled")
    } else {
        m
    }
}

fn anon_huge_kib() -> u64 {
    std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("AnonHugePages:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// A copy of `m` in its own allocation.
fn copy(m: &QMatrix) -> QMatrix {
    let c = QMatrix::new(
        "bench",
        m.rows,
        m.cols,
        m.format,
        Bytes::from_vec(m.data().as_slice().to_vec()),
        None,
    )
    .expect("matrix");
    if m.is_tiled() {
        c.tiled_q4_0().expect("tiled")
    } else {
        c
    }
}

/// `--experts N`: see the module notes.
fn experts(pool: &Pool, n: usize, threads: usize) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let (hidden, inter) = (2048usize, 768usize);
    let mut gate = matrix(WeightFormat::Q4_0, inter, hidden, &mut rng);
    let mut down = matrix(WeightFormat::Q4_0, hidden, inter, &mut rng);
    if q4_0_tiles_run_here() {
        gate = tile(gate);
        down = tile(down);
    }
    // [gate, up, down] per expert, each in its own allocation.
    let pool_m: Vec<[QMatrix; 3]> = (0..n.max(8))
        .map(|_| [copy(&gate), copy(&gate), copy(&down)])
        .collect();
    let x: Vec<f32> = (0..hidden)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let xd: Vec<f32> = (0..inter).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut up_out = vec![vec![0.0f32; inter]; 16];
    let mut down_out = vec![vec![0.0f32; hidden]; 8];
    let layer_bytes = 8 * (2 * gate.stored_bytes() + down.stored_bytes());
    println!(
        "kernels: {}, threads: {threads}, {} experts of {:.2} MiB (tiled: {})",
        kernels().name,
        pool_m.len(),
        (layer_bytes / 8) as f64 / (1 << 20) as f64,
        gate.is_tiled()
    );
    // Prefetch distances of the tile kernels, compared in slices of a few
    // layers taken in turn, so that drifting memory bandwidth (a shared
    // VM's) hits every distance alike.
    let dists: Vec<q4_0_tiles::TilePrefetch> = match arg_str("--prefetch") {
        Some(list) => list
            .split(',')
            .map(|p| p.parse().unwrap_or_else(|e| panic!("--prefetch: {e}")))
            .collect(),
        None => vec![q4_0_tiles::DEFAULT_PREFETCH, q4_0_tiles::TilePrefetch::NONE],
    };
    let (slices, layers) = (40, 12);
    let mut secs = vec![0.0f64; dists.len()];
    for slice in 1..=slices {
        for (d, &dist) in dists.iter().enumerate() {
            q4_0_tiles::set_prefetch(dist);
            let t = Instant::now();
            for _ in 0..layers {
                let pick: Vec<usize> = (0..8).map(|_| rng.random_range(0..pool_m.len())).collect();
                let ws: Vec<&QMatrix> = pick
                    .iter()
                    .flat_map(|&e| [&pool_m[e][0], &pool_m[e][1]])
                    .collect();
                let mut ys: Vec<&mut [f32]> = up_out.iter_mut().map(|y| &mut y[..]).collect();
                matvecs(pool, &ws, &[&x[..]; 16], &mut ys);
                let ws: Vec<&QMatrix> = pick.iter().map(|&e| &pool_m[e][2]).collect();
                let mut ys: Vec<&mut [f32]> = down_out.iter_mut().map(|y| &mut y[..]).collect();
                matvecs(pool, &ws, &[&xd[..]; 8], &mut ys);
            }
            secs[d] += t.elapsed().as_secs_f64();
            std::hint::black_box((&up_out, &down_out));
        }
        if slice % 10 == 0 {
            let bw = read_bandwidth(pool, 256 << 20);
            let rates: Vec<String> = dists
                .iter()
                .zip(&secs)
                .map(|(d, s)| {
                    let gbs = (layer_bytes * layers * slice) as f64 / s / 1e9;
                    format!("prefetch {d}: {gbs:.2} GB/s ({:.0}%)", 100.0 * gbs / bw)
                })
                .collect();
            println!(
                "{} layers each: {}; read pass: {bw:.2} GB/s",
                layers * slice,
                rates.join(", ")
            );
        }
    }
    q4_0_tiles::set_prefetch(q4_0_tiles::DEFAULT_PREFETCH);
}

/// A comma-separated list of numbers after `name`.
fn args_list(name: &str) -> Option<Vec<usize>> {
    arg_str(name)?.split(',').map(|x| x.parse().ok()).collect()
}

/// The argument after `name`.
fn arg_str(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.get(args.iter().position(|a| a == name)? + 1).cloned()
}

/// `--pages`: batch-1 products from 4 KiB pages and from huge pages,
/// alternating for `rounds` rounds.
fn compare_pages(pool: &Pool, mib: usize, rng: &mut impl Rng) {
    let cols = 2048;
    let rounds = arg("--rounds", 8);
    let mut cases = vec![(WeightFormat::Bf16, false)];
    if q4_0_tiles_run_here() {
        cases.push((WeightFormat::Q4_0, true));
    }
    cases.push((WeightFormat::Q4_0, false));
    for (format, tiled) in cases {
        let rows = ((mib << 20) / format.row_bytes(cols).expect("row bytes")).max(64);
        let mut w = matrix(format, rows, cols, rng);
        if tiled {
            w = tile(w);
        }
        let before = anon_huge_kib();
        let small = in_pages(&w, false);
        let huge = in_pages(&w, true);
        drop(w);
        let name = if tiled { "q4_0 tiled" } else { format.name() };
        println!(
            "{name} {rows}x{cols}: {} MiB of the huge-page copy in huge pages",
            anon_huge_kib().saturating_sub(before) >> 10
        );
        let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut y = vec![0.0f32; rows];
        let mut rate = |m: &QMatrix| {
            matvec(pool, m, &x, &mut y);
            let iters = 5;
            let t = Instant::now();
            for _ in 0..iters {
                matvec(pool, m, &x, &mut y);
            }
            m.stored_bytes() as f64 * iters as f64 / t.elapsed().as_secs_f64() / 1e9
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            a.push(rate(&small));
            b.push(rate(&huge));
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let bw = read_bandwidth(pool, mib << 20);
        println!(
            "  4 KiB pages: median {:.2} GB/s (min {:.2}, max {:.2}); huge pages: median {:.2} GB/s (min {:.2}, max {:.2}); read pass after: {bw:.2} GB/s",
            median(&mut a),
            a[0],
            a[a.len() - 1],
            median(&mut b),
            b[0],
            b[b.len() - 1],
        );
    }
}

/// `--quads`: see the module notes.
fn compare_quads(pool: &Pool, mib: usize, rng: &mut impl Rng) {
    if !quads16_run_here() {
        println!("no quads kernel on this CPU");
        return;
    }
    let cols = 2048;
    let rounds = arg("--rounds", 8);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for format in [WeightFormat::Bf16, WeightFormat::F16] {
        let rows = (mib << 20) / format.row_bytes(cols).expect("row bytes") / 4 * 4;
        let w = matrix(format, rows, cols, rng);
        let q = quads(copy(&w));
        println!(
            "{} {rows}x{cols}: GB/s of weights × batch, medians of {rounds} rounds",
            format.name()
        );
        let cases: Vec<(usize, usize)> = match args_list("--prefetch") {
            Some(d) => d.iter().map(|&d| (1, d)).collect(),
            None => [1usize, 2, 4, 8, 16, 32, 128]
                .iter()
                .map(|&b| (b, quads16::DEFAULT_PREFETCH_AHEAD))
                .collect(),
        };
        for (batch, distance) in cases {
            let x: Vec<f32> = (0..batch * cols)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let mut y = vec![0.0f32; batch * rows];
            let mut rate = |m: &QMatrix| {
                matmul(pool, m, &x, batch, &mut y);
                let iters = (64 / batch).clamp(2, 8);
                let t = Instant::now();
                for _ in 0..iters {
                    matmul(pool, m, &x, batch, &mut y);
                }
                (m.stored_bytes() * iters * batch) as f64 / t.elapsed().as_secs_f64() / 1e9
            };
            let (mut a, mut b, mut r) = (Vec::new(), Vec::new(), Vec::new());
            quads16::set_prefetch_ahead(distance);
            for _ in 0..rounds {
                let (ra, rb) = (rate(&w), rate(&q));
                a.push(ra);
                b.push(rb);
                r.push(rb / ra);
            }
            println!(
                "  batch {batch:>3}, prefetch {distance:>5}: row-major {:7.2}, quads {:7.2}, quads / row-major per round: median {:.3} (min {:.3}, max {:.3})",
                median(&mut a),
                median(&mut b),
                median(&mut r),
                r[0],
                r[r.len() - 1]
            );
        }
    }
    quads16::set_prefetch_ahead(quads16::DEFAULT_PREFETCH_AHEAD);
    let bw = read_bandwidth(pool, mib << 20);
    println!("read pass after: {bw:.2} GB/s");
}

/// What one pool job costs beyond its tasks: the round trip of jobs whose
/// tasks do nothing (one per thread, and 128 as a decode's products take),
/// and of jobs of 128 tasks that each read 64 KiB already in cache, against
/// the same reads on the calling thread alone divided by the thread count.
fn pool_jobs(pool: &Pool, threads: usize) {
    let jobs = 20_000usize;
    println!("pool: {threads} threads, {jobs} jobs per figure");
    let time = |tasks: usize, f: &(dyn Fn(usize) + Sync)| -> f64 {
        for _ in 0..jobs / 10 {
            pool.run(tasks, f);
        }
        let t = Instant::now();
        for _ in 0..jobs {
            pool.run(tasks, f);
        }
        t.elapsed().as_secs_f64() / jobs as f64 * 1e6
    };
    for tasks in [threads, 128] {
        let us = time(tasks, &|i| {
            std::hint::black_box(i);
        });
        println!("  {tasks:>4} empty tasks: {us:6.2} µs per job");
    }
    // Each thread's own 64 KiB (in L2), summed by every task it claims.
    let words = 64 << 10 >> 3;
    let data: Vec<u64> = (0..(words * 128) as u64).collect();
    let sum = |i: usize| -> u64 { data[i * words..(i + 1) * words].iter().sum() };
    let us = time(128, &|i| {
        std::hint::black_box(sum(i));
    });
    let t = Instant::now();
    for _ in 0..200 {
        for i in 0..128 {
            std::hint::black_box(sum(i));
        }
    }
    let alone = t.elapsed().as_secs_f64() / 200.0 * 1e6;
    println!(
        "  128 tasks of 64 KiB sums: {us:6.2} µs per job; alone {alone:.1} µs, / {threads} = {:.2} µs",
        alone / threads as f64
    );
}

fn main() {
    let threads = arg(
        "--threads",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let mib = arg("--mib", 256);
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--format")
        .and_then(|i| args.get(i + 1).cloned());
    let pool = Pool::new(threads).expect("pool");
    if args.iter().any(|a| a == "--tiling") {
        let cols = 2048;
        let rows = ((mib << 20) / WeightFormat::Q4_0.row_bytes(cols).expect("row bytes")) / 16 * 16;
        let w = matrix(
            WeightFormat::Q4_0,
            rows,
            cols,
            &mut rand_chacha::ChaCha8Rng::seed_from_u64(1),
        );
        let mut bytes = w.data().as_slice().to_vec();
        let mut scratch = Vec::new();
        for round in 0..3 {
            let t = Instant::now();
            q4_0_tiles::tile_in_place(&mut bytes, rows, cols / 32, &mut scratch);
            let tiled = t.elapsed().as_secs_f64();
            let t = Instant::now();
            q4_0_tiles::untile_in_place(&mut bytes, rows, cols / 32, &mut scratch);
            let untiled = t.elapsed().as_secs_f64();
            assert!(bytes == w.data().as_slice(), "tiling round trip");
            println!(
                "round {round}: tiling {:.2} GB/s, untiling {:.2} GB/s ({} MiB, one thread)",
                bytes.len() as f64 / tiled / 1e9,
                bytes.len() as f64 / untiled / 1e9,
                bytes.len() >> 20
            );
        }
        return;
    }
    if args.iter().any(|a| a == "--expert-tiles") {
        expert_tiles(
            &mut rand_chacha::ChaCha8Rng::seed_from_u64(1),
            arg("--expert-tiles", 16),
        );
        return;
    }
    if args.iter().any(|a| a == "--tile-tokens") {
        tile_tokens(&mut rand_chacha::ChaCha8Rng::seed_from_u64(1));
        return;
    }
    if args.iter().any(|a| a == "--more-tokens") {
        more_tokens(&mut rand_chacha::ChaCha8Rng::seed_from_u64(1));
        return;
    }
    if args.iter().any(|a| a == "--panel-tokens") {
        panel_tokens(&mut rand_chacha::ChaCha8Rng::seed_from_u64(1));
        return;
    }
    if args.iter().any(|a| a == "--attention") {
        attention(&pool, mib, threads);
        return;
    }
    if args.iter().any(|a| a == "--pool") {
        pool_jobs(&pool, threads);
        return;
    }
    if args.iter().any(|a| a == "--experts") {
        experts(&pool, arg("--experts", 640), threads);
        return;
    }
    if args.iter().any(|a| a == "--quads") {
        println!("kernels: {}, threads: {threads}", kernels().name);
        compare_quads(&pool, mib, &mut rand_chacha::ChaCha8Rng::seed_from_u64(1));
        return;
    }
    if args.iter().any(|a| a == "--pages") {
        println!("kernels: {}, threads: {threads}", kernels().name);
        compare_pages(&pool, mib, &mut rand_chacha::ChaCha8Rng::seed_from_u64(1));
        return;
    }
    let bw = read_bandwidth(&pool, mib << 20);
    println!("kernels: {}, threads: {threads}", kernels().name);
    println!("memory read bandwidth ({mib} MiB, {threads} threads): {bw:.2} GB/s\n");
    println!(
        "{:<10} {:>12} {:>6} {:>10} {:>10} {:>9} {:>14}",
        "format", "shape", "batch", "ms/iter", "GB/s", "of read", "GB/s × batch"
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let cols = 2048;
    // Q4_0 twice: row-major (as GGUF files store it) and in the tiles the
    // RAM tier gives experts where a tile kernel runs; bf16 and f16 twice:
    // row-major and in the quads the engine gives its dense matrices.
    let tiles = q4_0_tiles_run_here();
    let quads_here = quads16_run_here();
    for (format, laid_out) in [
        (WeightFormat::F32, false),
        (WeightFormat::Bf16, false),
        (WeightFormat::Bf16, true),
        (WeightFormat::F16, false),
        (WeightFormat::F16, true),
        (WeightFormat::Q8_0, false),
        (WeightFormat::Q4_0, false),
        (WeightFormat::Q4_0, true),
        (WeightFormat::Q6K, false),
        (WeightFormat::Q4K, false),
        (WeightFormat::Q5K, false),
        (WeightFormat::Q4_1, false),
        (WeightFormat::Q5_0, false),
        (WeightFormat::Q5_1, false),
        (WeightFormat::Q2K, false),
        (WeightFormat::Q3K, false),
        (WeightFormat::Iq4Nl, false),
        (WeightFormat::Iq4Xs, false),
    ] {
        let here = if format == WeightFormat::Q4_0 {
            tiles
        } else {
            quads_here
        };
        if only.as_deref().is_some_and(|f| f != format.name()) || (laid_out && !here) {
            continue;
        }
        let row_bytes = format.row_bytes(cols).expect("row bytes");
        let rows = ((mib << 20) / row_bytes).max(64);
        let mut w = matrix(format, rows, cols, &mut rng);
        let name = match (laid_out, format) {
            (false, f) => f.name().to_string(),
            (true, WeightFormat::Q4_0) => {
                w = tile(w);
                "q4_0 tiled".into()
            }
            (true, f) => {
                w = quads(w);
                format!("{} quads", f.name())
            }
        };
        let batches = args_list("--batches").unwrap_or_else(|| vec![1, 4, 8, 16, 32, 128]);
        for &batch in &batches {
            let x: Vec<f32> = (0..batch * cols)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let mut y = vec![0.0f32; batch * rows];
            let run = |y: &mut [f32]| {
                if batch == 1 {
                    matvec(&pool, &w, &x, y)
                } else {
                    matmul(&pool, &w, &x, batch, y)
                }
            };
            run(&mut y);
            let iters = 5;
            let t = Instant::now();
            for _ in 0..iters {
                run(&mut y);
            }
            let secs = t.elapsed().as_secs_f64() / iters as f64;
            let gbs = w.stored_bytes() as f64 / secs / 1e9;
            println!(
                "{:<10} {:>12} {:>6} {:>10.2} {:>10.2} {:>8.0}% {:>14.1}",
                name,
                format!("{rows}x{cols}"),
                batch,
                secs * 1e3,
                gbs,
                100.0 * gbs / bw,
                gbs * batch as f64
            );
            std::hint::black_box(&y);
        }
    }
}

/// `--attention`: see the module notes.
fn attention(pool: &Pool, mib: usize, threads: usize) {
    use colibri_model::attention::attend_heads;
    let (heads, kv_heads, hd) = (32usize, 4usize, 128usize);
    let group = heads / kv_heads;
    // Each KV head's positions side by side, as the KV cache keeps them.
    let stride = kv_heads * hd;
    let scale = (hd as f32).powf(-0.5);
    let bw = read_bandwidth(pool, mib << 20);
    println!("kernels: {}, threads: {threads}", kernels().name);
    println!("memory read bandwidth ({mib} MiB, {threads} threads): {bw:.2} GB/s\n");
    println!(
        "{:>8} {:>10} {:>12} {:>9} {:>12} {:>9} {:>12} {:>9}",
        "context", "MB", "per head ms", "GB/s", "grouped ms", "GB/s", "cold ms", "GB/s"
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    for len in [1000usize, 4000, 16000] {
        let keys: Vec<f32> = (0..len * stride)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let values: Vec<f32> = (0..len * stride)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let q: Vec<f32> = (0..heads * hd)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let bytes = (2 * len * stride * 4) as f64;
        let run = |per: usize| {
            let mut out = vec![0.0f32; heads * hd];
            let t = Instant::now();
            pool.for_each_chunk_mut(&mut out, per * hd, |idx, o| {
                let h0 = idx * per;
                let kvh = h0 / group;
                attend_heads(
                    &q[h0 * hd..(h0 + per) * hd],
                    hd,
                    &keys[kvh * len * hd..],
                    &values[kvh * len * hd..],
                    hd,
                    len,
                    scale,
                    o,
                    true,
                );
            });
            (t.elapsed().as_secs_f64(), out)
        };
        let (mut one, mut grouped, mut cold) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..5 {
            let (a, x) = run(1);
            let (b, y) = run(group);
            assert!(x == y, "grouping changed a result");
            one.push(a);
            grouped.push(b);
            // As a decode finds a layer's cache: in memory only (the
            // weights streamed since have evicted it).
            evict(&keys);
            evict(&values);
            let (c, z) = run(group);
            assert!(z == y, "a cold cache changed a result");
            cold.push(c);
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (a, b, c) = (med(&mut one), med(&mut grouped), med(&mut cold));
        println!(
            "{len:>8} {:>10.1} {:>12.3} {:>9.2} {:>12.3} {:>9.2} {:>12.3} {:>9.2}",
            bytes / 1e6,
            a * 1e3,
            bytes / a / 1e9,
            b * 1e3,
            bytes / b / 1e9,
            c * 1e3,
            bytes / c / 1e9
        );
    }
}

/// Writes `data`'s cache lines back and drops them from every cache level
/// (x86; elsewhere a no-op, so "cold" equals the grouped figure there).
fn evict(data: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in data.chunks(16) {
        // SAFETY: `clflush` of an address inside `data`: it only moves the
        // line out of the caches.
        unsafe { std::arch::x86_64::_mm_clflush(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// `--expert-tiles N`: see the module notes.
fn expert_tiles(rng: &mut impl Rng, tokens: usize) {
    use colibri_model::kernels::{Q8Activation, tile_passes};
    let k = kernels();
    let Some(dots) = k.dot_q4_0_tiles else {
        println!("kernels: {}: no several-token tile kernel here", k.name);
        return;
    };
    // 96 gate matrices of Qwen3-30B-A3B (768 × 2048, 864 KiB each): 81
    // MiB, more than a last-level cache.
    let (rows, cols, count) = (768usize, 2048usize, 96usize);
    let blocks = cols / 32;
    let one = tile(matrix(WeightFormat::Q4_0, rows, cols, rng));
    let experts: Vec<Vec<u8>> = (0..count)
        .map(|i| {
            let mut v = one.data().as_slice().to_vec();
            v[i] ^= 1; // distinct pages, same work
            v
        })
        .collect();
    let acts: Vec<Q8Activation> = (0..tokens * 4)
        .map(|_| {
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            Q8Activation::quantize(&x)
        })
        .collect();
    let tb = q4_0_tiles::tile_bytes(blocks);
    let plan: Vec<usize> = tile_passes(tokens).collect();
    println!(
        "kernels: {}, one thread, {count} matrices {rows} x {cols} (tiled Q4_0), {tokens} tokens each, passes {plan:?}",
        k.name
    );
    let modes = [
        "one tile in L1",
        "streamed, no hint",
        "streamed, next tile asked of L2",
    ];
    let mut best = [f64::INFINITY; 3];
    let mut out = [[0.0f32; 16]; colibri_model::kernels::TILE_TOKENS];
    for _ in 0..5 {
        for (mode, best) in best.iter_mut().enumerate() {
            let t0 = Instant::now();
            for (e, w) in experts.iter().enumerate() {
                let xs: Vec<&Q8Activation> = acts[e % 4 * tokens..][..tokens].iter().collect();
                for i in 0..rows / 16 {
                    let t = if mode == 0 {
                        &experts[0][..tb]
                    } else {
                        &w[i * tb..][..tb]
                    };
                    let mut next = match w.get((i + 1) * tb..(i + 2) * tb) {
                        Some(n) if mode == 2 => n,
                        _ => &[][..],
                    };
                    let mut j0 = 0;
                    for &size in &plan {
                        dots(t, blocks, &xs[j0..j0 + size], &mut out[..size], next);
                        next = &[];
                        j0 += size;
                    }
                    std::hint::black_box(&out);
                }
            }
            let ns =
                t0.elapsed().as_secs_f64() * 1e9 / (count * rows / 16 * blocks * tokens) as f64;
            *best = best.min(ns);
        }
    }
    for (mode, ns) in modes.iter().zip(best) {
        println!("  {mode}: {ns:.3} ns per block and token (best of 5)");
    }
    // AMX: the passes `tiled_rows` gives it (full passes of 16, a rest of
    // at least AMX_MIN_TOKENS), the tokens packed once per activation set.
    let Some(amx) = k.amx_q4_0_tiles else {
        return;
    };
    use colibri_model::kernels::{AMX_MIN_TOKENS, q4_0_amx};
    let (full, rest) = (tokens / q4_0_amx::TOKENS, tokens % q4_0_amx::TOKENS);
    let mut plan = vec![q4_0_amx::TOKENS; full];
    if rest >= AMX_MIN_TOKENS {
        plan.push(rest);
    }
    let n: usize = plan.iter().sum();
    if n == 0 {
        return;
    }
    let sets: Vec<Vec<q4_0_amx::Tokens>> = (0..4)
        .map(|s| {
            let xs: Vec<&Q8Activation> = acts[s * tokens..][..n].iter().collect();
            let mut t0 = 0;
            plan.iter()
                .map(|&size| {
                    let mut p = q4_0_amx::Tokens::default();
                    p.pack(&xs[t0..t0 + size], blocks);
                    t0 += size;
                    p
                })
                .collect()
        })
        .collect();
    let mut scratch = q4_0_amx::Scratch::default();
    let mut out = vec![[0.0f32; 16]; n];
    let mut best = [f64::INFINITY; 3];
    for _ in 0..5 {
        for (mode, best) in best.iter_mut().enumerate() {
            let t0 = Instant::now();
            for (e, w) in experts.iter().enumerate() {
                for i in 0..rows / 16 {
                    let t = if mode == 0 {
                        &experts[0][..tb]
                    } else {
                        &w[i * tb..][..tb]
                    };
                    let next = match w.get((i + 1) * tb..(i + 2) * tb) {
                        Some(n) if mode == 2 => n,
                        _ => &[][..],
                    };
                    amx(t, blocks, &sets[e % 4], &mut scratch, &mut out, next);
                    std::hint::black_box(&out);
                }
            }
            let ns = t0.elapsed().as_secs_f64() * 1e9 / (count * rows / 16 * blocks * n) as f64;
            *best = best.min(ns);
        }
    }
    for (mode, ns) in modes.iter().zip(best) {
        println!(
            "  AMX, {n} tokens in passes {plan:?}, {mode}: {ns:.3} ns per block and token (best of 5)"
        );
    }
}

/// `--more-tokens`: see the module notes.
fn more_tokens(rng: &mut impl Rng) {
    use colibri_model::kernels::{KernelSet, Q8Activation};
    let mut sets: Vec<KernelSet> = vec![*kernels()];
    #[cfg(target_arch = "x86_64")]
    if kernels().name != colibri_model::kernels::AVX2.name
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        sets.push(colibri_model::kernels::AVX2);
    }
    let (rows, cols) = (32usize, 2048usize);
    for format in [
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Iq4Nl,
        WeightFormat::Q2K,
        WeightFormat::Q3K,
        WeightFormat::Iq4Xs,
    ] {
        let w = matrix(format, rows, cols, rng);
        let bytes = w.data().as_slice();
        let rb = bytes.len() / rows;
        let acts: Vec<Q8Activation> = (0..4)
            .map(|_| {
                let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                Q8Activation::quantize(&x)
            })
            .collect();
        let xs: Vec<&Q8Activation> = acts.iter().collect();
        let reps = 2000usize;
        // Best of 15 timings of `reps` passes over the rows, per row and
        // token.
        let best = |tokens: usize, pass: &mut dyn FnMut()| {
            let mut best = f64::INFINITY;
            for _ in 0..15 {
                let t0 = Instant::now();
                for _ in 0..reps {
                    pass();
                }
                best = best.min(t0.elapsed().as_secs_f64() * 1e9 / (reps * rows * tokens) as f64);
            }
            best
        };
        for k in &sets {
            let one = best(1, &mut || {
                for row in bytes.chunks_exact(rb) {
                    std::hint::black_box((k.dot_more_q8)(format, row, xs[0]));
                }
            });
            let mut line = format!(
                "{:<7} {:<34} ns per row and token: one-token kernel {one:.1}",
                format.name(),
                k.name
            );
            if let Some(multi) = k.dot_more_q8_multi {
                line += "; several-token kernel";
                for n in 1..=4 {
                    let mut out = [0.0f32; 4];
                    let t = best(n, &mut || {
                        for row in bytes.chunks_exact(rb) {
                            multi(format, row, &xs[..n], &mut out[..n]);
                            std::hint::black_box(&out);
                        }
                    });
                    line += &format!(" {n} tok {t:.1}");
                }
            }
            println!("{line}");
        }
    }
}

/// `--panel-tokens`: see the module notes.
fn panel_tokens(rng: &mut impl Rng) {
    use colibri_model::kernels::{KernelSet, Q8Activation, k_panels};
    let mut sets: Vec<KernelSet> = vec![*kernels()];
    #[cfg(target_arch = "x86_64")]
    if kernels().name != colibri_model::kernels::AVX2.name {
        sets.push(colibri_model::kernels::AVX2);
    }
    let cols = 2048usize;
    let supers = cols / 256;
    for format in [
        WeightFormat::Q2K,
        WeightFormat::Q3K,
        WeightFormat::Iq4Xs,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
    ] {
        let w = matrix(format, 16, cols, rng);
        let rows = w.data().as_slice();
        let rb = rows.len() / 16;
        let mut panel = vec![0u8; rows.len()];
        k_panels::pack_format(format, rows, rb, &mut panel);
        let acts: Vec<Q8Activation> = (0..8)
            .map(|_| {
                let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                Q8Activation::quantize(&x)
            })
            .collect();
        let xs: Vec<&Q8Activation> = acts.iter().collect();
        let reps = 20_000usize;
        for k in &sets {
            let row_dot = |row: &[u8], x: &Q8Activation| match format {
                WeightFormat::Q4K => (k.dot_q4_k_q8)(row, x),
                WeightFormat::Q5K => (k.dot_q5_k_q8)(row, x),
                WeightFormat::Q6K => (k.dot_q6_k_q8)(row, x),
                other => (k.dot_more_q8)(other, row, x),
            };
            let panel_dot = match format {
                WeightFormat::Q4K | WeightFormat::Q5K => k.dot_k_panels,
                WeightFormat::Q6K => k.dot_q6_k_panels,
                WeightFormat::Iq4Xs => k.dot_iq4_xs_panels,
                _ => k.dot_low_k_panels,
            };
            let mut line = format!(
                "{format:?} {:<34} ns per panel super-block and token:",
                k.name
            );
            for n in [1usize, 2, 3, 4, 8] {
                let mut out = [[0.0f32; 16]; 8];
                let mut best = f64::INFINITY;
                for _ in 0..5 {
                    let t0 = Instant::now();
                    for _ in 0..reps {
                        match panel_dot {
                            Some(dot) => dot(format, &panel, supers, &xs[..n], &mut out[..n]),
                            None => {
                                for (t, x) in xs[..n].iter().enumerate() {
                                    for (r, row) in rows.chunks_exact(rb).enumerate() {
                                        out[t][r] = row_dot(row, x);
                                    }
                                }
                            }
                        }
                        std::hint::black_box(&out);
                    }
                    best = best.min(t0.elapsed().as_secs_f64() * 1e9 / (reps * supers * n) as f64);
                }
                line += &format!(" {n} tok {best:.1}");
            }
            // The row kernel on the same 16 rows, a token at a time.
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let t0 = Instant::now();
                for _ in 0..reps / 8 {
                    for x in &xs {
                        for row in rows.chunks_exact(rb) {
                            std::hint::black_box(row_dot(row, x));
                        }
                    }
                }
                best = best.min(t0.elapsed().as_secs_f64() * 1e9 / (reps / 8 * supers * 8) as f64);
            }
            line += &format!("; row kernel {best:.1}");
            // What the engine ran before panels for Q2_K, Q3_K and IQ4_XS: the
            // several-token row kernel, 4 tokens a call.
            if let Some(multi) = k.dot_more_q8_multi.filter(|_| {
                matches!(
                    format,
                    WeightFormat::Q2K | WeightFormat::Q3K | WeightFormat::Iq4Xs
                )
            }) {
                let mut best = f64::INFINITY;
                let mut res = [0.0f32; 4];
                for _ in 0..5 {
                    let t0 = Instant::now();
                    for _ in 0..reps / 8 {
                        for group in xs.chunks(4) {
                            for row in rows.chunks_exact(rb) {
                                multi(format, row, group, &mut res);
                                std::hint::black_box(&res);
                            }
                        }
                    }
                    best =
                        best.min(t0.elapsed().as_secs_f64() * 1e9 / (reps / 8 * supers * 8) as f64);
                }
                line += &format!(", 4 tokens a call {best:.1}");
            }
            println!("{line}");
        }
    }
}

/// `--tile-tokens`: see the module notes.
fn tile_tokens(rng: &mut impl Rng) {
    use colibri_model::kernels::Q8Activation;
    let k = kernels();
    let Some(dots) = k.dot_q4_0_tiles else {
        println!("kernels: {}: no several-token tile kernel here", k.name);
        return;
    };
    let most = colibri_model::kernels::TILE_TOKENS;
    println!(
        "kernels: {}, one thread, tokens per call at most {most}",
        k.name
    );
    for cols in [2048usize, 768] {
        let blocks = cols / 32;
        let w = tile(matrix(WeightFormat::Q4_0, 16, cols, rng));
        let t = w.data().as_slice();
        let acts: Vec<Q8Activation> = (0..48)
            .map(|_| {
                let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                Q8Activation::quantize(&x)
            })
            .collect();
        let xs: Vec<&Q8Activation> = acts.iter().collect();
        let mut out = [[0.0f32; 16]; 48];
        let reps = 20_000usize;
        // A plan: the tokens per call, in order, over the first of `xs`.
        let mut time = |plan: &[usize]| {
            let n: usize = plan.iter().sum();
            let t0 = Instant::now();
            for _ in 0..reps {
                let mut j0 = 0;
                for &size in plan {
                    dots(t, blocks, &xs[j0..j0 + size], &mut out[j0..j0 + size], &[]);
                    j0 += size;
                }
                std::hint::black_box(&out);
            }
            t0.elapsed().as_secs_f64() * 1e9 / (reps * blocks * n) as f64
        };
        let even = |n: usize| colibri_model::kernels::tile_passes(n).collect::<Vec<_>>();
        let by = |n: usize, size: usize| {
            let mut v = vec![size.min(most); n / size.min(most)];
            if !n.is_multiple_of(size.min(most)) {
                v.push(n % size.min(most));
            }
            v
        };
        let plans: Vec<(String, Vec<usize>)> = vec![
            (format!("48 tokens, {most} per call"), by(48, most)),
            ("48 tokens, 4 per call".into(), by(48, 4)),
            ("48 tokens, 1 per call".into(), by(48, 1)),
            (
                format!("36 tokens, {most} per call and the rest"),
                by(36, most),
            ),
            ("36 tokens, even passes (tile_passes)".into(), even(36)),
            (
                format!("33 tokens, {most} per call and the rest"),
                by(33, most),
            ),
            ("33 tokens, even passes (tile_passes)".into(), even(33)),
        ];
        let mut best = vec![f64::INFINITY; plans.len()];
        for _ in 0..7 {
            for (i, (_, plan)) in plans.iter().enumerate() {
                best[i] = best[i].min(time(plan));
            }
        }
        for ((name, plan), ns) in plans.iter().zip(&best) {
            let shown = if plan.len() <= 8 {
                format!(" {plan:?}")
            } else {
                String::new()
            };
            println!(
                "{cols:>5} columns, {name}{shown}: {ns:.3} ns per block and token (best of 7)"
            );
        }
        let Some(amx) = k.amx_q4_0_tiles else {
            continue;
        };
        // AMX: tokens packed once (as `tiled_rows` packs them for all of
        // a task's tiles), in passes of up to 16, all of them per call.
        let mut scratch = colibri_model::kernels::q4_0_amx::Scratch::default();
        let mut amx_time = |plan: &[usize]| {
            let mut j0 = 0;
            let packed: Vec<colibri_model::kernels::q4_0_amx::Tokens> = plan
                .iter()
                .map(|&size| {
                    let mut p = colibri_model::kernels::q4_0_amx::Tokens::default();
                    p.pack(&xs[j0..j0 + size], blocks);
                    j0 += size;
                    p
                })
                .collect();
            let n: usize = plan.iter().sum();
            let t0 = Instant::now();
            for _ in 0..reps {
                amx(t, blocks, &packed, &mut scratch, &mut out[..n], &[]);
                std::hint::black_box(&out);
            }
            t0.elapsed().as_secs_f64() * 1e9 / (reps * blocks * n) as f64
        };
        let amx_plans: Vec<(String, Vec<usize>)> = vec![
            ("48 tokens, 16 a pass".into(), vec![16; 3]),
            ("16 tokens".into(), vec![16]),
            ("12 tokens".into(), vec![12]),
            ("8 tokens".into(), vec![8]),
            ("4 tokens".into(), vec![4]),
            ("33 tokens, even passes".into(), vec![11; 3]),
        ];
        let mut best = vec![f64::INFINITY; amx_plans.len()];
        for _ in 0..7 {
            for (i, (_, plan)) in amx_plans.iter().enumerate() {
                best[i] = best[i].min(amx_time(plan));
            }
        }
        for ((name, _), ns) in amx_plans.iter().zip(&best) {
            println!("{cols:>5} columns, AMX, {name}: {ns:.3} ns per block and token (best of 7)");
        }
    }
}
