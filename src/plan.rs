//! `colibri plan`: where every byte of a model will live at the given
//! budgets (RAM tier, and the GPU tier's VRAM placement when a GPU is
//! there), and what a decode token is expected to read from disk. Loads no
//! expert.

use anyhow::{Context, Result};
use clap::Args;
use colibri_model::Model;
use colibri_sched::gpu::{DeviceChoice, DeviceMemory, VramPlan, open_device};
use colibri_sched::tier::{ExpertLayout, plan_checkpoint};

use crate::common::ModelArgs;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print the plan as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn main(args: PlanArgs) -> Result<()> {
    let options = args.model.tier_options();
    let (path, _) = args.model.resolve()?;
    let report = plan_checkpoint(&path, args.model.ctx, &options)
        .with_context(|| format!("planning {}", path.display()))?;
    // Where the threads would run (the engine makes the same choice).
    let topo = colibri_io::topology::Topology::detect();
    let placement = topo.placement(topo.drive_node(&path), args.model.threads);
    let gpu = gpu_plan(
        &args.model,
        &path,
        &report.layout,
        report.plan.holds_every_expert(),
    )?;
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["placement"] = serde_json::to_value(&placement)?;
        v["gpu"] = match &gpu {
            GpuPlacement::Plan(p) if p.len() == 1 => serde_json::to_value(&p[0])?,
            GpuPlacement::Plan(p) => serde_json::json!({ "devices": p }),
            GpuPlacement::None(why) => serde_json::json!({ "none": why }),
        };
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", report.render());
        println!("{}", placement.render());
        match &gpu {
            GpuPlacement::Plan(plans) => {
                for p in plans {
                    print!("{}", p.render());
                }
            }
            GpuPlacement::None(why) => println!("GPU tier: none ({why})"),
        }
    }
    Ok(())
}

enum GpuPlacement {
    /// One plan per device, in layer order.
    Plan(Vec<VramPlan>),
    None(String),
}

/// The GPU tier's placement on the device `--device`/`--devices` name, or
/// why there is none (`--device cuda` without a usable GPU is an error).
fn gpu_plan(
    args: &ModelArgs,
    path: &std::path::Path,
    layout: &ExpertLayout,
    ram_holds_all: bool,
) -> Result<GpuPlacement> {
    let opts = args.gpu_options();
    if opts.device == DeviceChoice::Cpu {
        return Ok(GpuPlacement::None("--device cpu".into()));
    }
    let mut devices = Vec::new();
    for ordinal in colibri_sched::gpu::ordinals(&opts) {
        let (dev, _kernels) = match open_device(ordinal) {
            Ok(d) => d,
            Err(e) if opts.device == DeviceChoice::Auto => {
                return Ok(GpuPlacement::None(format!(
                    "{e}; the CPU tier runs the model"
                )));
            }
            Err(e) => return Err(e).context("--device cuda"),
        };
        let (free, total) = dev.mem_info()?;
        let info = dev.info();
        devices.push(DeviceMemory {
            name: format!("{} (GPU {}, {})", info.name, info.ordinal, info.arch),
            free: free as u64,
            total: total as u64,
        });
    }
    let (model, _) = Model::load(path)?;
    let ctx = args.ctx;
    match colibri_sched::gpu::plans_for(&model, layout, ctx, &opts, &devices, ram_holds_all) {
        Ok(p) => Ok(GpuPlacement::Plan(p)),
        Err(e) if opts.device == DeviceChoice::Auto => Ok(GpuPlacement::None(format!(
            "{e}; the CPU tier runs the model"
        ))),
        Err(e) => Err(e).context("--device cuda"),
    }
}
