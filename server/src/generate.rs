//! From a validated request to a running sequence: prompt limits, the
//! sequence itself, submission to the scheduler, and the channel its events
//! come back on.

use colibri_sched::scheduler::{Event, SubmitError};
use colibri_sched::text::{StreamDetokenizer, eos_ids};
use colibri_sched::{GenRequest, Sequence};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::error::ApiError;
use crate::openai::Settings;
use crate::state::Ready;

/// Starts generating; the receiver yields the sequence's events. Dropping
/// the receiver (client gone) cancels the sequence within one step.
pub fn start(
    ready: &Ready,
    prompt: Vec<u32>,
    settings: &Settings,
    top_logprobs: Option<usize>,
) -> Result<UnboundedReceiver<Event>, ApiError> {
    let engine = &ready.model.engine;
    let ctx = engine.context_len();
    if prompt.is_empty() {
        return Err(ApiError::bad_param("prompt", "the prompt is empty"));
    }
    if prompt.len() >= ctx {
        return Err(ApiError::bad_request(format!(
            "This model's context holds {ctx} tokens, but the prompt has {} tokens (at least one more is needed to generate)",
            prompt.len()
        )));
    }
    let room = ctx - prompt.len();
    let max_tokens = settings.max_tokens.unwrap_or(room).min(room);
    let tokenizer = ready.model.tokenizer.as_ref();
    let req = GenRequest {
        prompt,
        max_tokens,
        sampling: settings.sampling.clone(),
        stop: settings.stop.clone(),
        eos: eos_ids(&engine.model.spec, tokenizer.map(|t| t.as_ref())),
        ignore_eos: settings.ignore_eos,
        top_logprobs,
    };
    let detok = tokenizer.map(StreamDetokenizer::boxed);
    let seq = Sequence::new(&engine.model, req, ctx, detok)?;
    let (tx, rx) = unbounded_channel();
    let sink = move |ev: Event| tx.send(ev).is_ok();
    ready
        .scheduler
        .submit(seq, Box::new(sink))
        .map_err(|e| match e {
            SubmitError::QueueFull => ApiError::overloaded(),
            SubmitError::ShuttingDown => ApiError::unavailable("the server is shutting down"),
        })?;
    Ok(rx)
}
