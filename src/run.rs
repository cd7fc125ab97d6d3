//! `colibri run`: one prompt's continuation, or an interactive chat.

use std::io::Write;

use anyhow::{Context, Result, bail};
use clap::Args;
use colibri_model::sampling::SamplingParams;
use colibri_sched::{FinishReason, GenRequest, Sequence};
use serde_json::json;

use crate::common::{ModelArgs, load_engine, parse_token_ids};

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text (needs the model's tokenizer).
    #[arg(long, short = 'p', conflicts_with = "prompt_tokens")]
    pub prompt: Option<String>,
    /// Apply the model's chat template to the prompt (as one user message).
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// Prompt as token ids, e.g. 1,2,3.
    #[arg(long)]
    pub prompt_tokens: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, short = 'n', default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 = greedy (the default).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// 1 = off.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// 1 = off.
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Seed for sampling (same seed, same output).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text is generated (repeatable; not printed).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Never stop at end-of-sequence tokens: generate exactly --max-tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object with the generated tokens and text.
    #[arg(long)]
    pub json: bool,
}

impl RunArgs {
    fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed: self.seed,
        }
    }
}

pub fn main(args: RunArgs) -> Result<()> {
    let sampling = args.sampling();
    sampling.validate().context("sampling flags")?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let engine = load_engine(&args.model)?;
    let prompt = match (&args.prompt_tokens, &args.prompt) {
        (Some(t), _) => parse_token_ids(t)?,
        (None, Some(_)) => bail!(
            "{} has no tokenizer.json, and text needs a tokenizer: pass the prompt as ids with --prompt-tokens",
            args.model.model.display()
        ),
        (None, None) => bail!("give --prompt TEXT or --prompt-tokens IDS"),
    };
    let eos = engine.model.spec.eos_token_ids.clone();
    let req = GenRequest {
        prompt,
        max_tokens: args.max_tokens,
        sampling,
        stop: args.stop.clone(),
        eos,
        ignore_eos: args.ignore_eos,
        top_logprobs: None,
    };
    let prompt_len = req.prompt.len();
    let mut seq = Sequence::new(&engine.model, req, engine.context_len(), None)?;
    let t0 = std::time::Instant::now();
    let mut first: Option<f64> = None;
    let mut finish = None;
    let mut tokens = Vec::new();
    let stdout = std::io::stdout();
    engine.generate(&mut seq, |ev| {
        first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        tokens.push(ev.token);
        finish = ev.finish;
        if !args.json {
            let mut out = stdout.lock();
            let _ = write!(
                out,
                "{}{}",
                if tokens.len() > 1 { " " } else { "" },
                ev.token
            );
            let _ = out.flush();
        }
        true
    })?;
    let total = t0.elapsed().as_secs_f64();
    let ttft = first.unwrap_or(total);
    let decode_tps = if tokens.len() > 1 {
        (tokens.len() - 1) as f64 / (total - ttft).max(1e-9)
    } else {
        0.0
    };
    if args.json {
        let v = json!({
            "tokens": tokens,
            "prompt_tokens": prompt_len,
            "completion_tokens": tokens.len(),
            "finish_reason": finish.unwrap_or(FinishReason::Length),
            "ttft_s": ttft,
            "decode_tok_s": decode_tps,
        });
        println!("{v}");
    } else {
        println!();
        tracing::info!(
            "{} prompt tokens, {} generated; first token after {:.3}s, then {:.2} tok/s",
            prompt_len,
            tokens.len(),
            ttft,
            decode_tps
        );
    }
    Ok(())
}
