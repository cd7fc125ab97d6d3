//! `POST /v1/chat/completions` and `POST /v1/completions`.

use std::sync::Arc;

use axum::Json;
use axum::response::{IntoResponse, Response};
use colibri_model::Tokenizer;
use colibri_model::chat::RenderOptions;
use colibri_sched::scheduler::{Event, Usage};
use colibri_sched::{FinishReason, TokenEvent};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::generate;
use crate::openai::{self, ChatRequest, CompletionRequest, Prompt, Settings};
use crate::state::Ready;
use crate::stream::{Framer, sse_response};

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn request_id(prefix: &str) -> String {
    let n: u64 = rand::random();
    format!("{prefix}-{n:016x}")
}

pub fn fingerprint() -> String {
    format!("colibri-{}", env!("CARGO_PKG_VERSION"))
}

fn check_model(ready: &Ready, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if !m.is_empty() && m != &ready.model.name => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

fn finish_str(f: Option<FinishReason>) -> &'static str {
    match f {
        Some(FinishReason::Length) => "length",
        _ => "stop",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens})
}

/// The text of one token for logprobs (lossy for partial UTF-8, as the
/// `bytes` field then shows).
fn token_text(tok: Option<&Tokenizer>, id: u32) -> String {
    tok.and_then(|t| t.decode(&[id], false).ok())
        .unwrap_or_else(|| format!("<{id}>"))
}

fn chat_logprob(tok: Option<&Tokenizer>, ev: &TokenEvent) -> Value {
    let entry = |id: u32, lp: f64| {
        let t = token_text(tok, id);
        json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
    };
    let mut v = entry(ev.token, ev.logprob);
    v["top_logprobs"] = ev
        .top_logprobs
        .iter()
        .map(|a| entry(a.token, a.logprob))
        .collect();
    v
}

// ---------------------------------------------------------------- chat

pub async fn chat(ready: Arc<Ready>, body: axum::body::Bytes) -> Result<Response, ApiError> {
    let (common, req): (_, ChatRequest) = openai::parse(&body)?;
    check_model(&ready, &common.model)?;
    let settings = common.settings()?;
    let want_logprobs = req.logprobs.unwrap_or(false);
    let top = req.top_logprobs.unwrap_or(0);
    if top > openai::MAX_TOP_LOGPROBS {
        return Err(ApiError::bad_param(
            "top_logprobs",
            format!(
                "`top_logprobs` must be at most {}",
                openai::MAX_TOP_LOGPROBS
            ),
        ));
    }
    if top > 0 && !want_logprobs {
        return Err(ApiError::bad_param(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        ));
    }
    let tok = ready.model.tokenizer.clone().ok_or_else(|| {
        ApiError::bad_request("this model has no tokenizer: use /v1/completions with token ids")
    })?;
    let messages = Value::Array(openai::normalize_messages(&req.messages)?);
    let opts = RenderOptions {
        add_generation_prompt: true,
        tools: req.tools.clone().filter(|t| !t.is_null()),
        extra: req.chat_template_kwargs.clone().unwrap_or_default(),
    };
    let tok2 = tok.clone();
    let prompt = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        let template = tok2.chat_template().ok_or_else(|| {
            ApiError::bad_request(
                "this model's tokenizer has no chat template: use /v1/completions",
            )
        })?;
        let text = template.render(&messages, &opts)?;
        Ok(tok2.encode(&text, false)?)
    })
    .await
    .map_err(|e| ApiError::internal(format!("prompt rendering task failed: {e}")))??;

    let rx = generate::start(
        &ready,
        prompt,
        &settings,
        want_logprobs.then_some(top as usize),
    )?;
    let id = request_id("chatcmpl");
    let created = now_unix();
    let model = ready.model.name.clone();
    if settings.stream {
        let framer = ChatFramer {
            id,
            created,
            model,
            tok: Some(tok),
            logprobs: want_logprobs,
            settings,
            sent_role: false,
        };
        return Ok(sse_response(rx, framer));
    }
    let (text, lps, usage) = collect(rx, Some(&tok), want_logprobs, chat_logprob).await?;
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": fingerprint(),
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": if want_logprobs { json!({"content": lps}) } else { Value::Null },
            "finish_reason": finish_str(usage.finish_reason),
        }],
        "usage": usage_json(&usage),
    }))
    .into_response())
}

/// Waits for a whole generation.
async fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    tok: Option<&Arc<Tokenizer>>,
    want_logprobs: bool,
    lp: fn(Option<&Tokenizer>, &TokenEvent) -> Value,
) -> Result<(String, Vec<Value>, Usage), ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token(t) => {
                text.push_str(&t.text);
                if want_logprobs {
                    lps.push(lp(tok.map(|t| t.as_ref()), &t));
                }
            }
            Event::Done(u) => return Ok((text, lps, u)),
            Event::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    Err(ApiError::unavailable("the server is shutting down"))
}

struct ChatFramer {
    id: String,
    created: u64,
    model: String,
    tok: Option<Arc<Tokenizer>>,
    logprobs: bool,
    settings: Settings,
    sent_role: bool,
}

impl ChatFramer {
    fn chunk(&self, delta: Value, logprobs: Value, finish: Value) -> String {
        let mut v = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "system_fingerprint": fingerprint(),
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.settings.include_usage {
            v["usage"] = Value::Null;
        }
        v.to_string()
    }
}

impl Framer for ChatFramer {
    fn frame(&mut self, ev: Event) -> Vec<String> {
        let mut out = Vec::new();
        if !self.sent_role {
            self.sent_role = true;
            out.push(self.chunk(
                json!({"role": "assistant", "content": ""}),
                Value::Null,
                Value::Null,
            ));
        }
        match ev {
            Event::Token(t) => {
                if !t.text.is_empty() || self.logprobs {
                    let lp = if self.logprobs {
                        json!({"content": [chat_logprob(self.tok.as_deref(), &t)]})
                    } else {
                        Value::Null
                    };
                    out.push(self.chunk(json!({"content": t.text}), lp, Value::Null));
                }
            }
            Event::Done(u) => {
                out.push(self.chunk(json!({}), Value::Null, json!(finish_str(u.finish_reason))));
                if self.settings.include_usage {
                    out.push(
                        json!({
                            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                            "model": self.model, "system_fingerprint": fingerprint(),
                            "choices": [], "usage": usage_json(&u),
                        })
                        .to_string(),
                    );
                }
            }
            Event::Error(e) => out.push(ApiError::internal(e).body().to_string()),
        }
        out
    }
}

// ---------------------------------------------------------- completions

fn completion_logprob(tok: Option<&Tokenizer>, ev: &TokenEvent) -> Value {
    let mut top = serde_json::Map::new();
    for a in &ev.top_logprobs {
        top.insert(token_text(tok, a.token), json!(a.logprob));
    }
    json!({"token": token_text(tok, ev.token), "logprob": ev.logprob, "top": top})
}

/// The legacy completions logprobs object from per-token entries.
fn legacy_logprobs(entries: &[Value], offset0: usize) -> Value {
    let mut offset = offset0;
    let mut offsets = Vec::new();
    for e in entries {
        offsets.push(offset);
        offset += e["token"].as_str().map_or(0, str::len);
    }
    json!({
        "tokens": entries.iter().map(|e| e["token"].clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e["logprob"].clone()).collect::<Vec<_>>(),
        "top_logprobs": entries.iter().map(|e| e["top"].clone()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

pub async fn completion(ready: Arc<Ready>, body: axum::body::Bytes) -> Result<Response, ApiError> {
    let (common, req): (_, CompletionRequest) = openai::parse(&body)?;
    check_model(&ready, &common.model)?;
    let settings = common.settings()?;
    let lp_n = req.logprobs;
    if lp_n.is_some_and(|n| n > 5) {
        return Err(ApiError::bad_param(
            "logprobs",
            "`logprobs` must be between 0 and 5",
        ));
    }
    let tok = ready.model.tokenizer.clone();
    let (prompt, prompt_text) = match req.prompt {
        Prompt::Tokens(t) => (t, None),
        Prompt::TokenLists(mut l) if l.len() == 1 => (l.remove(0), None),
        Prompt::Text(s) => (encode_prompt(tok.as_ref(), s.clone()).await?, Some(s)),
        Prompt::Texts(mut l) if l.len() == 1 => {
            let s = l.remove(0);
            (encode_prompt(tok.as_ref(), s.clone()).await?, Some(s))
        }
        _ => {
            return Err(ApiError::bad_param(
                "prompt",
                "exactly one prompt per request is supported",
            ));
        }
    };
    let vocab = ready.model.engine.model.spec.vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_param(
            "prompt",
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        ));
    }
    let echo_text = if req.echo.unwrap_or(false) {
        Some(match (&prompt_text, &tok) {
            (Some(s), _) => s.clone(),
            (None, Some(t)) => t.decode(&prompt, false)?,
            (None, None) => {
                return Err(ApiError::bad_param(
                    "echo",
                    "echo of token prompts needs a tokenizer",
                ));
            }
        })
    } else {
        None
    };
    let rx = generate::start(&ready, prompt, &settings, lp_n.map(|n| n as usize))?;
    let id = request_id("cmpl");
    let created = now_unix();
    let model = ready.model.name.clone();
    if settings.stream {
        let framer = CompletionFramer {
            id,
            created,
            model,
            tok,
            logprobs: lp_n.is_some(),
            settings,
            echo: echo_text,
            offset: 0,
        };
        return Ok(sse_response(rx, framer));
    }
    let (text, lps, usage) = collect(rx, tok.as_ref(), lp_n.is_some(), completion_logprob).await?;
    let prefix = echo_text.unwrap_or_default();
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "system_fingerprint": fingerprint(),
        "choices": [{
            "index": 0,
            "text": format!("{prefix}{text}"),
            "logprobs": if lp_n.is_some() { legacy_logprobs(&lps, prefix.len()) } else { Value::Null },
            "finish_reason": finish_str(usage.finish_reason),
        }],
        "usage": usage_json(&usage),
    }))
    .into_response())
}

async fn encode_prompt(tok: Option<&Arc<Tokenizer>>, text: String) -> Result<Vec<u32>, ApiError> {
    let tok = tok.cloned().ok_or_else(|| {
        ApiError::bad_param("prompt", "this model has no tokenizer: send token ids")
    })?;
    tokio::task::spawn_blocking(move || tok.encode(&text, true))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
        .map_err(ApiError::from)
}

struct CompletionFramer {
    id: String,
    created: u64,
    model: String,
    tok: Option<Arc<Tokenizer>>,
    logprobs: bool,
    settings: Settings,
    echo: Option<String>,
    offset: usize,
}

impl CompletionFramer {
    fn chunk(&self, text: &str, logprobs: Value, finish: Value) -> String {
        let mut v = json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "system_fingerprint": fingerprint(),
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.settings.include_usage {
            v["usage"] = Value::Null;
        }
        v.to_string()
    }
}

impl Framer for CompletionFramer {
    fn frame(&mut self, ev: Event) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(e) = self.echo.take() {
            self.offset = e.len();
            out.push(self.chunk(&e, Value::Null, Value::Null));
        }
        match ev {
            Event::Token(t) => {
                if !t.text.is_empty() || self.logprobs {
                    let lp = if self.logprobs {
                        let entry = completion_logprob(self.tok.as_deref(), &t);
                        legacy_logprobs(std::slice::from_ref(&entry), self.offset)
                    } else {
                        Value::Null
                    };
                    self.offset += t.text.len();
                    out.push(self.chunk(&t.text, lp, Value::Null));
                }
            }
            Event::Done(u) => {
                out.push(self.chunk("", Value::Null, json!(finish_str(u.finish_reason))));
                if self.settings.include_usage {
                    out.push(
                        json!({
                            "id": self.id, "object": "text_completion", "created": self.created,
                            "model": self.model, "system_fingerprint": fingerprint(),
                            "choices": [], "usage": usage_json(&u),
                        })
                        .to_string(),
                    );
                }
            }
            Event::Error(e) => out.push(ApiError::internal(e).body().to_string()),
        }
        out
    }
}
