//! `colibri perplexity`: teacher-forced scoring of a text or token file.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;

use crate::common::{ModelArgs, load, parse_token_ids};

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text to score (needs the model's tokenizer).
    #[arg(long, conflicts_with = "token_file")]
    pub text_file: Option<PathBuf>,
    /// Token ids to score, separated by whitespace and/or commas.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Print one JSON object (ppl, mean_nll, tokens_scored).
    #[arg(long)]
    pub json: bool,
    /// Also report the NLL of every predicted position.
    #[arg(long)]
    pub per_token: bool,
}

pub fn main(args: PerplexityArgs) -> Result<()> {
    if args.token_file.is_none() && args.text_file.is_none() {
        bail!("give --text-file F or --token-file F");
    }
    let loaded = load(&args.model)?;
    let tokens = match (&args.token_file, &args.text_file) {
        (Some(f), _) => {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            parse_token_ids(&text).with_context(|| format!("parsing {}", f.display()))?
        }
        (None, Some(f)) => {
            let tok = loaded.require_tokenizer("score a --token-file instead")?;
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            tok.encode(&text, true)?
        }
        (None, None) => bail!("give --text-file F or --token-file F"),
    };
    let engine = &loaded.engine;
    let t0 = std::time::Instant::now();
    let rep = engine.score(&tokens, |done, total| {
        tracing::debug!("scored {done}/{total}")
    })?;
    let secs = t0.elapsed().as_secs_f64();
    if args.json {
        let mut v = json!({
            "ppl": rep.ppl,
            "mean_nll": rep.mean_nll,
            "tokens_scored": rep.tokens_scored,
            "windows": rep.windows,
            "tok_s": (rep.tokens_scored + rep.windows) as f64 / secs,
        });
        if args.per_token {
            v["nll"] = json!(rep.nll);
        }
        println!("{v}");
    } else {
        if args.per_token {
            for (i, n) in rep.nll.iter().enumerate() {
                println!("{i}\t{n:.6}");
            }
        }
        println!(
            "perplexity {:.4} (mean NLL {:.6}) over {} predicted tokens in {} window(s)",
            rep.ppl, rep.mean_nll, rep.tokens_scored, rep.windows
        );
    }
    Ok(())
}
