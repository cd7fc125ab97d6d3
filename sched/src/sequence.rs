//! One generating sequence: its KV cache, tokens, sampler and stop rules.
//!
//! A sequence is driven in steps: [`Sequence::next_input`] says which
//! tokens to feed (a prompt chunk, or the last sampled token), the caller
//! runs them through the model — alone or batched with other sequences —
//! and hands the logits back to [`Sequence::accept`], which samples, checks
//! EOS, stop strings and length, and reports the new token.

use colibri_model::sampling::{Sampler, SamplingParams, log_softmax};
use colibri_model::stop::StopMatcher;
use colibri_model::{KvCache, Logits, Model, ModelError};
use serde::Serialize;

/// Turns token ids into text incrementally (the tokenizer's stream decoder).
pub trait Detokenizer: Send {
    /// Text made final by `token` (possibly empty).
    fn push(&mut self, token: u32) -> Result<String, ModelError>;
    /// Whatever is still held at the end.
    fn finish(&mut self) -> Result<String, ModelError>;
}

#[derive(Clone, Debug)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Tokens that end generation (EOS ids).
    pub eos: Vec<u32>,
    /// Mask the EOS tokens so generation runs to `max_tokens`.
    pub ignore_eos: bool,
    /// Return this many top alternatives' log-probabilities per token.
    pub top_logprobs: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

#[derive(Clone, Debug, Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f64,
}

/// A newly generated token.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    pub token: u32,
    /// Text that became final with this token (stop strings held back).
    pub text: String,
    pub logprob: f64,
    pub top_logprobs: Vec<TokenLogprob>,
    pub finish: Option<FinishReason>,
}

pub struct Sequence {
    pub cache: KvCache,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Index of the first token not yet in the cache.
    fed: usize,
    req: GenRequest,
    sampler: Sampler,
    stop: StopMatcher,
    detok: Option<Box<dyn Detokenizer>>,
    finished: Option<FinishReason>,
}

impl Sequence {
    /// A sequence for `req` with room for `context` positions. Fails if the
    /// prompt alone does not fit, naming both numbers.
    pub fn new(
        model: &Model,
        req: GenRequest,
        context: usize,
        detok: Option<Box<dyn Detokenizer>>,
    ) -> Result<Sequence, ModelError> {
        req.sampling.validate()?;
        if req.prompt.is_empty() {
            return Err(ModelError::Invalid("the prompt is empty".into()));
        }
        if req.prompt.len() >= context {
            return Err(ModelError::ContextExceeded {
                needed: req.prompt.len() + 1,
                context,
            });
        }
        if let Some(&bad) = req
            .prompt
            .iter()
            .find(|&&t| t as usize >= model.spec.vocab_size)
        {
            return Err(ModelError::TokenOutOfRange {
                id: bad,
                vocab: model.spec.vocab_size,
            });
        }
        Ok(Sequence {
            cache: KvCache::new(&model.spec, context),
            tokens: req.prompt.clone(),
            prompt_len: req.prompt.len(),
            fed: 0,
            sampler: Sampler::new(req.sampling.clone()),
            stop: StopMatcher::new(req.stop.clone()),
            req,
            detok,
            finished: None,
        })
    }

    /// Continues from `cache`, which holds `cached` (e.g. the previous turns
    /// of a chat): the longest common prefix with the new prompt is kept and
    /// only the rest is fed.
    pub fn resume(
        model: &Model,
        req: GenRequest,
        mut cache: KvCache,
        cached: &[u32],
        detok: Option<Box<dyn Detokenizer>>,
    ) -> Result<Sequence, ModelError> {
        let context = cache.capacity();
        let mut seq = Sequence::new(model, req, context, detok)?;
        let mut keep = cached
            .iter()
            .zip(&seq.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        // Feed at least one token so there are logits to sample from.
        keep = keep.min(seq.tokens.len() - 1).min(cache.len());
        cache.truncate(keep, &model.spec);
        seq.cache = cache;
        seq.fed = keep;
        Ok(seq)
    }

    /// The cache and the tokens it holds, for a later [`Sequence::resume`].
    pub fn into_cache(self) -> (KvCache, Vec<u32>) {
        let mut tokens = self.tokens;
        tokens.truncate(self.fed);
        (self.cache, tokens)
    }

    /// The cache and the tokens to feed next (at most `chunk` of the
    /// prompt, else the last sampled token), with the logits to ask for.
    /// No tokens once finished.
    pub fn input(&mut self, chunk: usize) -> (&mut KvCache, &[u32], Logits) {
        if self.finished.is_some() {
            return (&mut self.cache, &[], Logits::None);
        }
        let end = (self.fed + chunk.max(1)).min(self.tokens.len());
        let logits = if end == self.tokens.len() {
            Logits::Last
        } else {
            Logits::None
        };
        (&mut self.cache, &self.tokens[self.fed..end], logits)
    }

    /// After a forward pass over `fed` tokens: samples from `logits` when
    /// they were asked for and returns the new token.
    pub fn accept(
        &mut self,
        fed: usize,
        logits: &mut [f32],
    ) -> Result<Option<TokenEvent>, ModelError> {
        self.fed += fed;
        if self.fed < self.tokens.len() || logits.is_empty() {
            return Ok(None);
        }
        let banned: &[u32] = if self.req.ignore_eos {
            &self.req.eos
        } else {
            &[]
        };
        // Log-probabilities of the model's own distribution (before
        // penalties and filtering), as the OpenAI API reports them.
        let lp = self.req.top_logprobs.map(|_| log_softmax(logits));
        let token = self.sampler.sample(logits, &self.tokens, banned);
        let (logprob, top_logprobs) = match (&lp, self.req.top_logprobs) {
            (Some(lp), Some(n)) => (lp[token as usize], top_n(lp, n)),
            _ => (0.0, Vec::new()),
        };
        self.tokens.push(token);
        let generated = self.tokens.len() - self.prompt_len;

        let is_eos = !self.req.ignore_eos && self.req.eos.contains(&token);
        let mut text = String::new();
        let mut stop_string = false;
        if !is_eos && let Some(d) = &mut self.detok {
            let o = self.stop.push(&d.push(token)?);
            text = o.emit;
            stop_string = o.stopped;
        }
        let finish = if is_eos || stop_string {
            Some(FinishReason::Stop)
        } else if generated >= self.req.max_tokens || self.tokens.len() >= self.cache.capacity() {
            Some(FinishReason::Length)
        } else {
            None
        };
        if finish.is_some() && !stop_string {
            // Ended by EOS or length: release the text still held back.
            if let Some(d) = &mut self.detok {
                let o = self.stop.push(&d.finish()?);
                text.push_str(&o.emit);
                if !o.stopped {
                    text.push_str(&self.stop.finish());
                }
            }
        }
        self.finished = finish;
        Ok(Some(TokenEvent {
            token,
            text,
            logprob,
            top_logprobs,
            finish,
        }))
    }

    /// Tokens not yet fed to the model (more than 1 while prefilling).
    pub fn pending(&self) -> usize {
        if self.finished.is_some() {
            0
        } else {
            self.tokens.len() - self.fed
        }
    }

    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    /// Ends the sequence early (client gone, server shutting down).
    pub fn cancel(&mut self) {
        if self.finished.is_none() {
            self.finished = Some(FinishReason::Stop);
        }
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Generated token ids so far.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

/// The `n` most probable tokens, most probable first (ties: lower id).
fn top_n(lp: &[f64], n: usize) -> Vec<TokenLogprob> {
    let n = n.min(lp.len());
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..lp.len()).collect();
    let order = |a: &usize, b: &usize| lp[*b].total_cmp(&lp[*a]).then(a.cmp(b));
    idx.select_nth_unstable_by(n - 1, order);
    idx.truncate(n);
    idx.sort_by(order);
    idx.into_iter()
        .map(|i| TokenLogprob {
            token: i as u32,
            logprob: lp[i],
        })
        .collect()
}
