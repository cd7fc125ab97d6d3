//! Decode speed of the GPU tier against its physical limits, measured in
//! one run on one machine:
//!
//! * the device's copy bandwidth (1 GiB device-to-device, bytes read +
//!   written) and the decode tok/s that bandwidth allows for the bytes a
//!   decode token touches (dense blocks + top-k experts per MoE layer);
//! * the host-to-device bandwidth from pinned, registered memory (1 GiB)
//!   and the host-to-device rate the decode reached while copying experts
//!   and dense blocks that are not in VRAM.
//!
//! ```text
//! cargo run --release -p colibri-sched --example gpu_decode -- MODEL_DIR \
//!     [--vram-budget BYTES] [--ram-budget BYTES] [--tokens 64] [--warmup 16] \
//!     [--devices 0,1] [--ring-slots 8] [--ahead N] \
//!     [--prompt 16] [--exact-quant] [--no-in-place] [--temperature 0] [--top-p 1]
//! ```
//!
//! With several devices the layers are split between them; the HBM figure
//! is then one device's (each token's bytes are read on one device or the
//! other, one after the other).
//!
//! Prints a table and, last, one JSON line.

use std::path::PathBuf;
use std::time::Instant;

use colibri_cuda::CudaDevice;
use colibri_model::sampling::SamplingParams;
use colibri_sched::gpu::{DeviceChoice, GpuOptions, attach};
use colibri_sched::tier::{ByteSize, TierOptions, UsageMode};
use colibri_sched::{Engine, EngineOptions, GenRequest, Sequence};

fn arg<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
}

fn size_arg(args: &[String], name: &str) -> Option<u64> {
    arg::<ByteSize>(args, name).map(ByteSize::bytes)
}

/// (device copy GB/s counting read + write, host-to-device GB/s from
/// registered memory).
fn bandwidths() -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let dev = CudaDevice::open(0)?;
    let n = 1usize << 30;
    let a = dev.alloc::<u8>(n)?;
    let mut b = dev.alloc::<u8>(n)?;
    let mut best_d2d = 0.0f64;
    for _ in 0..5 {
        let t0 = dev.record_compute_timed()?;
        dev.copy(a.as_view(), b.as_mut())?;
        let t1 = dev.record_compute_timed()?;
        let ms = t0.elapsed_ms(&t1)? as f64;
        best_d2d = best_d2d.max(2.0 * n as f64 / (ms * 1e-3) / 1e9);
    }
    let mut host = dev.alloc_host(n)?;
    for (i, v) in host.as_mut_slice().iter_mut().enumerate() {
        *v = i as u8;
    }
    let mut best_h2d = 0.0f64;
    for _ in 0..5 {
        let t0 = dev.record_copy_timed()?;
        // SAFETY: `host` is not written while the copy runs and outlives
        // the synchronize below; `b` is read by nothing else.
        let done = unsafe { dev.copy_host_ptr_async(host.as_slice().as_ptr(), b.as_mut())? };
        let t1 = dev.record_copy_timed()?;
        done.synchronize()?;
        let ms = t0.elapsed_ms(&t1)? as f64;
        best_h2d = best_h2d.max(n as f64 / (ms * 1e-3) / 1e9);
    }
    // Copies the size of one expert matrix and of one whole expert of the
    // 30B-A3B geometry, back to back (what staging issues), from distinct
    // places of the buffer.
    for piece in [884_736usize, 3 * 884_736] {
        let count = n / piece;
        let mut best = 0.0f64;
        for _ in 0..3 {
            let t0 = dev.record_copy_timed()?;
            let mut last = None;
            for i in 0..count {
                let src = &host.as_slice()[i * piece..(i + 1) * piece];
                // SAFETY: as above.
                last = Some(unsafe {
                    dev.copy_host_ptr_async(src.as_ptr(), b.view_mut(i * piece..(i + 1) * piece)?)?
                });
            }
            let t1 = dev.record_copy_timed()?;
            if let Some(l) = last {
                l.synchronize()?;
            }
            let ms = t0.elapsed_ms(&t1)? as f64;
            best = best.max((count * piece) as f64 / (ms * 1e-3) / 1e9);
        }
        eprintln!("host-to-device in {piece}-byte copies: {best:.1} GB/s");
    }
    dev.synchronize()?;
    Ok((best_d2d, best_h2d))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    colibri_model::kernels::set_exact_quant(args.iter().any(|a| a == "--exact-quant"));
    let dir = PathBuf::from(args.get(1).ok_or("usage: gpu_decode MODEL_DIR [options]")?);
    let vram_budget = size_arg(&args, "--vram-budget");
    let devices: Vec<usize> = match arg::<String>(&args, "--devices") {
        Some(list) => list
            .split(',')
            .map(|d| d.trim().parse::<usize>())
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let ram_budget = size_arg(&args, "--ram-budget");
    let tokens: usize = arg(&args, "--tokens").unwrap_or(64);
    let warmup: usize = arg(&args, "--warmup").unwrap_or(16);
    let no_warm = args.iter().any(|a| a == "--no-warm-ram");

    let (d2d, h2d) = bandwidths()?;
    eprintln!("device copy {d2d:.0} GB/s (read + write), host-to-device {h2d:.1} GB/s");

    let t0 = Instant::now();
    let mut engine = Engine::load(
        &dir,
        &EngineOptions {
            threads: 0,
            ctx: 4096,
            tier: TierOptions {
                ram_budget,
                pin_budget: Some(0),
                usage: UsageMode::Off,
                ..TierOptions::default()
            },
            ..EngineOptions::default()
        },
    )?;
    // Every routed expert into RAM first (when the RAM tier can hold them
    // all), so the decode measures the GPU and the bus, not the disk.
    if !no_warm && let Some(tier) = &engine.tier {
        let plan = tier.plan();
        let layout = tier.layout();
        if plan.cache_slots() + plan.pinned.len() >= layout.len() {
            let t = Instant::now();
            let ids: Vec<usize> = (0..layout.experts_per_layer).collect();
            for (layer, base) in layout.base.iter().enumerate() {
                if base.is_none() {
                    continue;
                }
                for chunk in ids.chunks(32) {
                    tier.fetch_with_prefetch(layer, chunk, &[], &mut |_, _| Ok(()))?;
                }
            }
            eprintln!(
                "{} experts read into RAM in {:.1}s",
                layout.len(),
                t.elapsed().as_secs_f64()
            );
        } else {
            eprintln!("the RAM tier cannot hold every expert: not warmed");
        }
    }
    let summary = match attach(
        &mut engine,
        &GpuOptions {
            device: DeviceChoice::Cuda,
            vram_budget,
            devices: devices.clone(),
            ring_slots: arg::<usize>(&args, "--ring-slots")
                .unwrap_or(colibri_sched::gpu::plan::DEFAULT_RING_SLOTS),
            ahead: arg::<usize>(&args, "--ahead").unwrap_or(colibri_sched::gpu::DEFAULT_AHEAD),
            in_place: !args.iter().any(|a| a == "--no-in-place"),
            ..GpuOptions::default()
        },
    )? {
        colibri_sched::gpu::Attached::Gpu(s) => s,
        colibri_sched::gpu::Attached::Cpu { .. } => return Err("no GPU tier".into()),
    };
    eprintln!("{summary} (loaded in {:.1}s)", t0.elapsed().as_secs_f64());
    let gpu = engine.gpu.clone().ok_or("no GPU tier")?;
    for p in gpu.plans() {
        eprint!("{}", p.render());
    }

    // Bytes a decode token touches: every dense block once, top-k experts
    // of every MoE layer (their stored bytes), the embedding row aside.
    let spec = &engine.model.spec;
    let top_k = spec.moe.as_ref().map_or(0, |m| m.top_k);
    let (expert_bytes, moe_layers) = match &engine.tier {
        Some(t) => {
            let l = t.layout();
            let n = l.records.len().max(1);
            let avg = l
                .records
                .iter()
                .map(|r| r.location.stored_bytes())
                .sum::<u64>()
                / n as u64;
            (avg, l.moe_layers().count())
        }
        None => (0, 0),
    };
    let dense: u64 = gpu
        .plans()
        .iter()
        .map(|p| p.dense_resident_bytes + p.dense_streamed_bytes)
        .sum();
    let active = dense + (moe_layers * top_k) as u64 * expert_bytes;

    let vocab = spec.vocab_size as u32;
    let prompt_len = arg::<u32>(&args, "--prompt").unwrap_or(16).max(1);
    let prompt: Vec<u32> = (1..=prompt_len).map(|t| t % vocab.max(1)).collect();
    let mut seq = Sequence::new(
        &engine.model,
        GenRequest {
            prompt,
            max_tokens: warmup + tokens + 1,
            // Greedy by default; a temperature puts the sampler's host
            // time between steps into the figure, as a server's requests do.
            sampling: SamplingParams {
                temperature: arg::<f32>(&args, "--temperature").unwrap_or(0.0),
                top_p: arg::<f32>(&args, "--top-p").unwrap_or(1.0),
                seed: Some(7),
                ..SamplingParams::default()
            },
            stop: vec![],
            eos: vec![],
            ignore_eos: true,
            top_logprobs: None,
        },
        engine.context_len(),
        None,
    )?;
    let mut count = 0usize;
    let began = Instant::now();
    let mut prefill_s = 0.0f64;
    let mut start: Option<(Instant, colibri_sched::gpu::GpuStats)> = None;
    let mut end: Option<(Instant, colibri_sched::gpu::GpuStats)> = None;
    engine.generate(&mut seq, |_| {
        count += 1;
        if count == 1 {
            // The prompt's pass and the first token's sampling.
            prefill_s = began.elapsed().as_secs_f64();
        }
        if count == warmup + 1 {
            gpu.reset_profile();
            start = Some((Instant::now(), gpu.stats()));
        }
        if count == warmup + tokens + 1 {
            end = Some((Instant::now(), gpu.stats()));
        }
        true
    })?;
    let ((t_a, s_a), (t_b, s_b)) = (start.ok_or("no start")?, end.ok_or("no end")?);
    let secs = t_b.duration_since(t_a).as_secs_f64();
    let tok_s = tokens as f64 / secs;
    let h2d_bytes =
        (s_b.expert_h2d_bytes - s_a.expert_h2d_bytes) + (s_b.dense_h2d_bytes - s_a.dense_h2d_bytes);
    let h2d_rate = h2d_bytes as f64 / secs / 1e9;
    let per_tok = |a: u64, b: u64| (b - a) as f64 / tokens as f64;
    let launches = per_tok(s_a.launches, s_b.launches);
    let graphs = per_tok(s_a.graph_launches, s_b.graph_launches);
    let waits = per_tok(s_a.host_waits, s_b.host_waits);
    let copies = per_tok(s_a.copies, s_b.copies);
    // The device's share of a step: the replayed graphs' GPU time against
    // the wall time per token (the rest is the host between steps).
    let graph_ms = per_tok(s_a.graph_gpu_us, s_b.graph_gpu_us) / 1e3;
    let step_ms = 1e3 * secs / tokens as f64;
    // Experts the kernels read in place from pinned RAM cross the bus too.
    let in_place_bytes = s_b.in_place_bytes - s_a.in_place_bytes;
    let in_place_reads = per_tok(s_a.in_place_reads, s_b.in_place_reads);
    let bus_rate = (h2d_bytes + in_place_bytes) as f64 / secs / 1e9;
    let hits = s_b.cache.hits - s_a.cache.hits;
    let misses = s_b.cache.misses - s_a.cache.misses;
    let roofline = d2d * 1e9 / active.max(1) as f64;
    println!("model                 {}", dir.display());
    println!("placement             {summary}");
    println!(
        "bytes per decode token {} (dense {}, {} MoE layers x top-{} x {})",
        ByteSize(active),
        ByteSize(dense),
        moe_layers,
        top_k,
        ByteSize(expert_bytes)
    );
    println!(
        "prefill               {prompt_len} tokens in {prefill_s:.3} s ({:.0} tok/s)",
        prompt_len as f64 / prefill_s
    );
    println!("decode                {tok_s:.1} tok/s over {tokens} tokens ({secs:.3} s)");
    println!(
        "HBM roofline          {roofline:.0} tok/s at {d2d:.0} GB/s copy bandwidth: {:.1}% of it",
        100.0 * tok_s / roofline
    );
    println!(
        "VRAM expert hits      {hits} of {} ({:.1}%)",
        hits + misses,
        100.0 * hits as f64 / (hits + misses).max(1) as f64
    );
    let experts_moved =
        (s_b.experts_copied - s_a.experts_copied) + (s_b.ahead_copied - s_a.ahead_copied);
    println!(
        "host-to-device        {} per token, {h2d_rate:.1} GB/s during decode vs {h2d:.1} GB/s \
         measured ({:.0}%); {:.2} copies per expert copied",
        ByteSize(h2d_bytes / tokens.max(1) as u64),
        100.0 * h2d_rate / h2d,
        (s_b.expert_h2d_copies - s_a.expert_h2d_copies) as f64 / experts_moved.max(1) as f64
    );
    println!(
        "read in place         {in_place_reads:.1} experts per token ({} per token) in {} of {tokens} \
         steps ({} route switches); bus {bus_rate:.1} GB/s with the copies ({:.0}% of measured)",
        ByteSize(in_place_bytes / tokens.max(1) as u64),
        s_b.in_place_passes - s_a.in_place_passes,
        s_b.route_switches - s_a.route_switches,
        100.0 * bus_rate / h2d
    );
    let ahead_copied = s_b.ahead_copied - s_a.ahead_copied;
    let ahead_used = s_b.ahead_used - s_a.ahead_used;
    let ahead_bytes = s_b.ahead_bytes - s_a.ahead_bytes;
    // Bytes copied ahead and never used: the bus carried them for nothing.
    let ahead_wasted = ahead_bytes
        .saturating_mul(ahead_copied.saturating_sub(ahead_used))
        .checked_div(ahead_copied)
        .unwrap_or(0);
    let useful_rate = (h2d_bytes - ahead_wasted.min(h2d_bytes)) as f64 / secs / 1e9;
    println!(
        "copied ahead          {:.1} experts per token, {:.1}% of them used; bytes used          {useful_rate:.1} GB/s ({:.0}% of measured)",
        ahead_copied as f64 / tokens as f64,
        100.0 * ahead_used as f64 / ahead_copied.max(1) as f64,
        100.0 * useful_rate / h2d
    );
    println!(
        "per token             {launches:.1} kernel launches, {graphs:.2} graph replays, \
         {waits:.1} host waits, {copies:.1} host-device copies ({} layers)",
        spec.num_layers()
    );
    println!(
        "device busy           {graph_ms:.3} ms of GPU time per token in graphs, of {step_ms:.3} ms \
         per token ({:.1}%)",
        100.0 * graph_ms / step_ms
    );
    let profile = gpu.profile();
    if let Some(p) = &profile {
        let per_layer = 1e3 / p.layers.max(1) as f64;
        let per_pass = 1.0 / p.passes.max(1) as f64;
        println!(
            "profile               {} passes, {} layers (COLIBRI_GPU_PROFILE=1: no graphs, a timed \
             event between phases; the measured tokens only)",
            p.passes, p.layers
        );
        println!("  phase       GPU ms/pass  GPU us/layer  host ms/pass  host us/layer");
        for (name, g, h) in &p.phases {
            println!(
                "  {name:<10} {:>12.3} {:>13.1} {:>13.3} {:>14.1}",
                g * per_pass,
                g * per_layer,
                h * per_pass,
                h * per_layer
            );
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "launches_per_token": launches,
            "graph_launches_per_token": graphs,
            "host_waits_per_token": waits,
            "copies_per_token": copies,
            "graph_gpu_ms_per_token": graph_ms,
            "profile": profile,
            "model": dir.display().to_string(),
            "vram_budget": vram_budget,
            "ram_budget": ram_budget,
            "tokens": tokens,
            "decode_tok_s": tok_s,
            "prompt_tokens": prompt_len,
            "prefill_s": prefill_s,
            "bytes_per_token": active,
            "d2d_copy_gb_s": d2d,
            "hbm_roofline_tok_s": roofline,
            "h2d_measured_gb_s": h2d,
            "h2d_decode_gb_s": h2d_rate,
            "h2d_bytes_per_token": h2d_bytes as f64 / tokens as f64,
            "h2d_used_gb_s": useful_rate,
            "in_place_reads_per_token": in_place_reads,
            "in_place_bytes_per_token": in_place_bytes as f64 / tokens as f64,
            "bus_gb_s": bus_rate,
            "ahead_copied": ahead_copied,
            "ahead_used": ahead_used,
            "vram_hits": hits,
            "vram_misses": misses,
            "stats": s_b,
        })
    );
    Ok(())
}
