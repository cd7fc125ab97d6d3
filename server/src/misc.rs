//! The small endpoints: models, health, metrics, and llama-server's
//! tokenize / detokenize / apply-template.

use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::response::{IntoResponse, Response};
use colibri_model::chat::RenderOptions;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::openai;
use crate::state::{AppState, Ready};

pub fn models(ready: &Ready) -> Response {
    let m = &ready.model;
    let mut entry = json!({
        "id": m.name, "object": "model", "created": ready.created_unix,
        "owned_by": if m.is_demo { "colibri (demo model: RANDOM WEIGHTS)" } else { "colibri" },
        "max_model_len": m.engine.context_len(),
        "architecture": m.engine.model.spec.family.model_type(),
    });
    if m.is_demo {
        entry["description"] = json!(
            "The bundled colibri demo model: random weights, it produces noise. Start colibri serve --model PATH to serve a real model."
        );
    }
    Json(json!({"object": "list", "data": [entry]})).into_response()
}

pub fn metrics(state: &AppState) -> String {
    let mut s = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(
            s,
            "# HELP colibri_{name} {help}\n# TYPE colibri_{name} {kind}\ncolibri_{name} {value}"
        );
    };
    metric(
        "http_requests_total",
        "counter",
        "HTTP requests received.",
        state.http_requests.load(Ordering::Relaxed) as f64,
    );
    metric(
        "http_errors_total",
        "counter",
        "HTTP requests answered with an error.",
        state.http_errors.load(Ordering::Relaxed) as f64,
    );
    let Some(ready) = state.ready.get() else {
        metric("ready", "gauge", "1 once the model has loaded.", 0.0);
        return s;
    };
    metric("ready", "gauge", "1 once the model has loaded.", 1.0);
    let st = ready.scheduler.stats();
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    metric(
        "requests_total",
        "counter",
        "Generation requests accepted.",
        get(&st.requests_total),
    );
    metric(
        "requests_cancelled_total",
        "counter",
        "Generations cancelled by a client that went away.",
        get(&st.requests_cancelled),
    );
    metric(
        "requests_failed_total",
        "counter",
        "Generations that failed.",
        get(&st.requests_failed),
    );
    metric(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens processed.",
        get(&st.prompt_tokens_total),
    );
    metric(
        "generated_tokens_total",
        "counter",
        "Tokens generated.",
        get(&st.generated_tokens_total),
    );
    let busy = get(&st.busy_us) / 1e6;
    metric(
        "busy_seconds_total",
        "counter",
        "Seconds spent in forward passes.",
        busy,
    );
    metric(
        "generated_tokens_per_busy_second",
        "gauge",
        "Generated tokens per second of forward-pass time.",
        if busy > 0.0 {
            get(&st.generated_tokens_total) / busy
        } else {
            0.0
        },
    );
    let up = ready.started.elapsed().as_secs_f64();
    metric(
        "generated_tokens_per_second",
        "gauge",
        "Generated tokens per second since start.",
        get(&st.generated_tokens_total) / up.max(1e-9),
    );
    metric(
        "queue_depth",
        "gauge",
        "Requests waiting for a batch place.",
        st.waiting.load(Ordering::Relaxed) as f64,
    );
    metric(
        "running",
        "gauge",
        "Sequences in the running batch.",
        st.running.load(Ordering::Relaxed) as f64,
    );
    metric(
        "steps_total",
        "counter",
        "Scheduler steps (forward passes).",
        get(&st.steps_total),
    );
    metric(
        "batch_rows_total",
        "counter",
        "Token rows fed through the model.",
        get(&st.rows_total),
    );
    let ec = ready.model.engine.expert_counters.snapshot();
    metric(
        "expert_fetch_calls_total",
        "counter",
        "Expert fetches (one per MoE layer per step).",
        ec.fetch_calls as f64,
    );
    metric(
        "experts_fetched_total",
        "counter",
        "Distinct experts fetched, summed over fetches.",
        ec.experts_fetched as f64,
    );
    let es = ready.model.engine.experts.stats();
    let rate = |h: u64, m: u64| {
        if h + m > 0 {
            h as f64 / (h + m) as f64
        } else {
            0.0
        }
    };
    let _ = writeln!(
        s,
        "# HELP colibri_cache_hit_rate Share of expert requests served from a tier's cache.\n# TYPE colibri_cache_hit_rate gauge\ncolibri_cache_hit_rate{{tier=\"ram\"}} {}\ncolibri_cache_hit_rate{{tier=\"vram\"}} {}",
        rate(es.ram_hits, es.ram_misses),
        rate(es.vram_hits, es.vram_misses)
    );
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(
            s,
            "# HELP colibri_{name} {help}\n# TYPE colibri_{name} {kind}\ncolibri_{name} {value}"
        );
    };
    metric(
        "disk_bytes_read_total",
        "counter",
        "Bytes of experts read from disk.",
        es.disk_bytes_read as f64,
    );
    metric(
        "prefetch_recall",
        "gauge",
        "Share of demand misses a prefetch had already covered or started.",
        rate(es.prefetch_covered_misses, es.uncovered_misses),
    );
    s
}

#[derive(Deserialize)]
struct TokenizeReq {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

pub async fn tokenize(ready: Arc<Ready>, body: axum::body::Bytes) -> Result<Response, ApiError> {
    let req: TokenizeReq = openai::from_value(&openai::parse_value(&body)?)?;
    let tok = ready
        .model
        .tokenizer
        .clone()
        .ok_or_else(|| ApiError::bad_request("this model has no tokenizer"))?;
    let ids = tok.encode(&req.content, req.add_special)?;
    let tokens: Vec<Value> = if req.with_pieces {
        ids.iter()
            .map(|&id| json!({"id": id, "piece": tok.decode(&[id], false).unwrap_or_default()}))
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(Json(json!({"tokens": tokens})).into_response())
}

#[derive(Deserialize)]
struct DetokenizeReq {
    tokens: Vec<u32>,
}

pub async fn detokenize(ready: Arc<Ready>, body: axum::body::Bytes) -> Result<Response, ApiError> {
    let req: DetokenizeReq = openai::from_value(&openai::parse_value(&body)?)?;
    let tok = ready
        .model
        .tokenizer
        .clone()
        .ok_or_else(|| ApiError::bad_request("this model has no tokenizer"))?;
    let text = tok.decode(&req.tokens, false)?;
    Ok(Json(json!({"content": text})).into_response())
}

#[derive(Deserialize)]
struct ApplyTemplateReq {
    messages: Vec<Value>,
    tools: Option<Value>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

pub async fn apply_template(
    ready: Arc<Ready>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let req: ApplyTemplateReq = openai::from_value(&openai::parse_value(&body)?)?;
    let tok = ready
        .model
        .tokenizer
        .clone()
        .ok_or_else(|| ApiError::bad_request("this model has no tokenizer"))?;
    let template = tok
        .chat_template()
        .ok_or_else(|| ApiError::bad_request("this model has no chat template"))?;
    let messages = Value::Array(openai::normalize_messages(&req.messages)?);
    let opts = RenderOptions {
        add_generation_prompt: true,
        tools: req.tools.filter(|t| !t.is_null()),
        extra: req.chat_template_kwargs.unwrap_or_default(),
    };
    let prompt = template.render(&messages, &opts)?;
    Ok(Json(json!({"prompt": prompt})).into_response())
}
