//! `colibri run`: one prompt's continuation, or an interactive chat.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::{Context, Result, bail};
use clap::Args;
use colibri_model::chat::RenderOptions;
use colibri_model::sampling::SamplingParams;
use colibri_model::{KvCache, Tokenizer};
use colibri_sched::text::{StreamDetokenizer, eos_ids};
use colibri_sched::{FinishReason, GenRequest, Sequence};
use serde_json::json;

use crate::common::{Loaded, ModelArgs, load, parse_token_ids};

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text (needs the model's tokenizer). Without --prompt and
    /// --prompt-tokens: an interactive chat on a terminal, else the prompt
    /// is read from stdin.
    #[arg(long, short = 'p', conflicts_with = "prompt_tokens")]
    pub prompt: Option<String>,
    /// Apply the model's chat template to the prompt (as one user message).
    #[arg(long)]
    pub chat: bool,
    /// System prompt for --chat and interactive chat.
    #[arg(long)]
    pub system: Option<String>,
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

    fn request(&self, prompt: Vec<u32>, loaded: &Loaded) -> GenRequest {
        GenRequest {
            prompt,
            max_tokens: self.max_tokens,
            sampling: self.sampling(),
            stop: self.stop.clone(),
            eos: eos_ids(&loaded.engine.model.spec, loaded.tokenizer.as_deref()),
            ignore_eos: self.ignore_eos,
            top_logprobs: None,
        }
    }
}

/// Renders `messages` with the model's chat template, ready to generate.
fn render_chat(tok: &Tokenizer, messages: &serde_json::Value) -> Result<Vec<u32>> {
    let template = tok
        .chat_template()
        .context("the tokenizer has no chat template (use --prompt without --chat)")?;
    let text = template.render(
        messages,
        &RenderOptions {
            add_generation_prompt: true,
            ..Default::default()
        },
    )?;
    // The template writes the special tokens itself.
    Ok(tok.encode(&text, false)?)
}

pub fn main(args: RunArgs) -> Result<()> {
    args.sampling().validate().context("sampling flags")?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let loaded = load(&args.model)?;
    let interactive =
        args.prompt.is_none() && args.prompt_tokens.is_none() && std::io::stdin().is_terminal();
    if interactive {
        return chat_loop(&args, &loaded);
    }
    let prompt = match (&args.prompt_tokens, &args.prompt) {
        (Some(t), _) => parse_token_ids(t)?,
        (None, text) => {
            let tok = loaded.require_tokenizer("pass the prompt as ids with --prompt-tokens")?;
            let text = match text {
                Some(t) => t.clone(),
                None => {
                    let mut s = String::new();
                    std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                        .context("reading the prompt from stdin")?;
                    s
                }
            };
            if args.chat {
                let mut messages = Vec::new();
                if let Some(sys) = &args.system {
                    messages.push(json!({"role": "system", "content": sys}));
                }
                messages.push(json!({"role": "user", "content": text}));
                render_chat(tok, &serde_json::Value::Array(messages))?
            } else {
                tok.encode(&text, true)?
            }
        }
    };
    let engine = &loaded.engine;
    let prompt_len = prompt.len();
    let detok = loaded.tokenizer.as_ref().map(StreamDetokenizer::boxed);
    let mut seq = Sequence::new(
        &engine.model,
        args.request(prompt, &loaded),
        engine.context_len(),
        detok,
    )?;
    let t0 = std::time::Instant::now();
    let mut first: Option<f64> = None;
    let mut finish = None;
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut stdout = std::io::stdout().lock();
    engine.generate(&mut seq, |ev| {
        first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        tokens.push(ev.token);
        finish = ev.finish;
        text.push_str(&ev.text);
        if !args.json {
            let piece = if loaded.tokenizer.is_some() {
                ev.text.clone()
            } else {
                format!("{}{}", if tokens.len() > 1 { " " } else { "" }, ev.token)
            };
            // A closed stdout (`| head`) ends generation quietly.
            return write!(stdout, "{piece}")
                .and_then(|_| stdout.flush())
                .is_ok();
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
        let mut v = json!({
            "tokens": tokens,
            "prompt_tokens": prompt_len,
            "completion_tokens": tokens.len(),
            "finish_reason": finish.unwrap_or(FinishReason::Length),
            "ttft_s": ttft,
            "decode_tok_s": decode_tps,
        });
        if loaded.tokenizer.is_some() {
            v["text"] = json!(text);
        }
        writeln!(stdout, "{v}")?;
    } else {
        let _ = writeln!(stdout);
        tracing::info!(
            "{prompt_len} prompt tokens, {} generated; first token after {ttft:.3}s, then {decode_tps:.2} tok/s",
            tokens.len()
        );
    }
    Ok(())
}

/// Interactive multi-turn chat; each turn reuses the KV cache of the last.
fn chat_loop(args: &RunArgs, loaded: &Loaded) -> Result<()> {
    let tok = loaded.require_tokenizer("interactive chat needs text")?;
    let engine = &loaded.engine;
    let mut messages = Vec::new();
    if let Some(sys) = &args.system {
        messages.push(json!({"role": "system", "content": sys}));
    }
    let mut cache = KvCache::new(&engine.model.spec, engine.context_len());
    let mut cached: Vec<u32> = Vec::new();
    eprintln!(
        "colibri chat — {} (/exit or Ctrl-D to quit, /reset to start over)",
        loaded.path.display()
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin")?;
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.retain(|m: &serde_json::Value| m["role"] == "system");
                cache.clear(&engine.model.spec);
                cached.clear();
                continue;
            }
            _ => {}
        }
        messages.push(json!({"role": "user", "content": line}));
        let prompt = render_chat(tok, &serde_json::Value::Array(messages.clone()))?;
        let mut seq = match Sequence::resume(
            &engine.model,
            args.request(prompt, loaded),
            std::mem::replace(
                &mut cache,
                KvCache::new(&engine.model.spec, engine.context_len()),
            ),
            &cached,
            Some(StreamDetokenizer::boxed(tok)),
        ) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("error: {e} (use /reset)");
                messages.pop();
                continue;
            }
        };
        let mut reply = String::new();
        let mut out = std::io::stdout().lock();
        engine.generate(&mut seq, |ev| {
            reply.push_str(&ev.text);
            write!(out, "{}", ev.text).and_then(|_| out.flush()).is_ok()
        })?;
        writeln!(out)?;
        messages.push(json!({"role": "assistant", "content": reply}));
        (cache, cached) = seq.into_cache();
    }
    Ok(())
}
