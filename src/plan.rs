//! `colibri plan`: where every byte of a model will live at the given
//! budgets, and what a decode token is expected to read from disk. Loads no
//! expert.

use anyhow::{Context, Result};
use clap::Args;
use colibri_sched::tier::plan_checkpoint;

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
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["placement"] = serde_json::to_value(&placement)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", report.render());
        println!("{}", placement.render());
    }
    Ok(())
}
