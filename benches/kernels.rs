//! Matrix–vector kernels against the memory-bandwidth roofline, measured in
//! the same run on the same machine.
//!
//! `cargo bench --bench kernels [-- --threads N --mib M --format q4_0]`
//!
//! For each weight format: a matrix of about `M` MiB (so it does not sit in
//! the caches) is multiplied by a vector repeatedly; we report the weight
//! bytes streamed per second and their ratio to the bandwidth of a plain
//! parallel read of a buffer of the same size. Batches of 4 and 32 vectors
//! (batched decode, prefill) also report the weight bytes per second times
//! the batch: what a token-at-a-time product would have to stream to keep
//! up.

use std::time::Instant;

use colibri_model::Pool;
use colibri_model::format::WeightFormat;
use colibri_model::kernels::{
    kernels, matmul, matvec, q4_0_tiles, q4_0_tiles_run_here, read_bandwidth,
};
use colibri_model::quant::{quantize_q4_0, quantize_q8_0};
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
        other => panic!("bench does not build {other:?}"),
    };
    QMatrix::new("bench", rows, cols, format, data, None).expect("matrix")
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
    // RAM tier gives experts where a tile kernel runs.
    let tiles = q4_0_tiles_run_here();
    for (format, tiled) in [
        (WeightFormat::F32, false),
        (WeightFormat::Bf16, false),
        (WeightFormat::F16, false),
        (WeightFormat::Q8_0, false),
        (WeightFormat::Q4_0, false),
        (WeightFormat::Q4_0, true),
    ] {
        if only.as_deref().is_some_and(|f| f != format.name()) || (tiled && !tiles) {
            continue;
        }
        let row_bytes = format.row_bytes(cols).expect("row bytes");
        let rows = ((mib << 20) / row_bytes).max(64);
        let mut w = matrix(format, rows, cols, &mut rng);
        if tiled {
            w = tile(w);
        }
        let name = if tiled { "q4_0 tiled" } else { format.name() };
        for batch in [1usize, 4, 8, 16, 32] {
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
