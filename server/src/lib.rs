//! colibri-server: the OpenAI-compatible HTTP API over the engine.
//!
//! axum on tokio serves requests; compute never runs on the async workers:
//! prompts are rendered and tokenized on blocking threads and generation
//! happens on the scheduler's own thread, which streams events back over
//! channels. The listener binds before the model loads, so `/health`
//! answers 503 while loading and 200 after.

pub mod completions;
pub mod error;
pub mod generate;
pub mod misc;
pub mod openai;
pub mod state;
pub mod stream;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use colibri_sched::scheduler::{Scheduler, SchedulerConfig};
use serde_json::json;

pub use error::ApiError;
pub use state::{AppState, Ready, ServedModel, ServerConfig, Shared};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("serving: {0}")]
    Serve(std::io::Error),
    #[error("loading the model: {0}")]
    Load(String),
}

/// A bound, not yet serving, server.
pub struct Server {
    listener: tokio::net::TcpListener,
    state: Shared,
}

impl Server {
    pub async fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        let addr = format!("{}:{}", config.host, config.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|source| ServerError::Bind { addr, source })?;
        let state = Arc::new(AppState {
            config,
            ready: OnceLock::new(),
            load_error: Mutex::new(None),
            http_requests: Default::default(),
            http_errors: Default::default(),
        });
        Ok(Server { listener, state })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    pub fn state(&self) -> Shared {
        self.state.clone()
    }

    /// Loads the model (on a blocking thread, while `/health` says 503) and
    /// serves until `shutdown` resolves; then running requests get
    /// `shutdown_grace` to finish before they are cancelled.
    pub async fn run<L, S>(self, load: L, shutdown: S) -> Result<(), ServerError>
    where
        L: FnOnce() -> Result<ServedModel, String> + Send + 'static,
        S: std::future::Future<Output = ()> + Send + 'static,
    {
        let state = self.state.clone();
        let loader = tokio::task::spawn_blocking(move || {
            let t0 = std::time::Instant::now();
            match load() {
                Ok(model) => {
                    let cfg = &state.config;
                    let scheduler = Scheduler::start(
                        model.engine.clone(),
                        SchedulerConfig {
                            max_batch: cfg.max_batch,
                            max_queue: cfg.max_queue,
                            step_tokens: cfg.step_tokens,
                        },
                    );
                    tracing::info!(
                        "serving `{}`{} — loaded in {:.2}s",
                        model.name,
                        if model.is_demo {
                            " (demo model: RANDOM WEIGHTS)"
                        } else {
                            ""
                        },
                        t0.elapsed().as_secs_f64()
                    );
                    let created_unix = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs())
                        .unwrap_or(0);
                    let _ = state.ready.set(Arc::new(Ready {
                        model,
                        scheduler,
                        started: std::time::Instant::now(),
                        created_unix,
                    }));
                    Ok(())
                }
                Err(e) => {
                    if let Ok(mut g) = state.load_error.lock() {
                        *g = Some(e.clone());
                    }
                    Err(e)
                }
            }
        });
        let app = router(self.state.clone());
        let state = self.state.clone();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let grace = state.config.shutdown_grace;
        let drain_state = state.clone();
        let signal = async move {
            tokio::select! {
                _ = shutdown => {}
                _ = stop_rx => {}
            }
            tracing::info!(
                "shutting down: no new requests; running ones get {:.0?} to finish",
                grace
            );
            if let Some(ready) = drain_state.ready.get().cloned() {
                // Cancel stragglers after the grace period so streams end
                // and the server can exit.
                tokio::task::spawn_blocking(move || ready.scheduler.shutdown(grace));
            }
        };
        let server = axum::serve(self.listener, app).with_graceful_shutdown(signal);
        let load_watch = async move {
            match loader.await {
                Ok(Ok(())) => std::future::pending::<Result<(), ServerError>>().await,
                Ok(Err(e)) => {
                    let _ = stop_tx.send(());
                    Err(ServerError::Load(e))
                }
                Err(e) => {
                    let _ = stop_tx.send(());
                    Err(ServerError::Load(e.to_string()))
                }
            }
        };
        tokio::pin!(load_watch);
        let mut load_result = None;
        let serve_fut = server.into_future();
        tokio::pin!(serve_fut);
        loop {
            tokio::select! {
                r = &mut serve_fut => {
                    r.map_err(ServerError::Serve)?;
                    break;
                }
                r = &mut load_watch, if load_result.is_none() => {
                    load_result = Some(r);
                }
            }
        }
        if let Some(ready) = state.ready.get() {
            ready.scheduler.shutdown(std::time::Duration::ZERO);
        }
        match load_result {
            Some(Err(e)) => Err(e),
            _ => Ok(()),
        }
    }
}

fn router(state: Shared) -> Router {
    let limit = state.config.max_body_bytes;
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completion))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .fallback(fallback)
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Counts requests, checks the API key (every endpoint but /health) and
/// turns framework rejections into OpenAI-shaped errors.
async fn guard(State(state): State<Shared>, req: Request, next: Next) -> Response {
    state.http_requests.fetch_add(1, Ordering::Relaxed);
    if let Some(key) = &state.config.api_key
        && req.uri().path() != "/health"
    {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|k| constant_time_eq(k.trim().as_bytes(), key.as_bytes()));
        if !ok {
            state.http_errors.fetch_add(1, Ordering::Relaxed);
            return ApiError::unauthorized().into_response();
        }
    }
    let resp = next.run(req).await;
    let status = resp.status();
    if status.is_client_error() || status.is_server_error() {
        state.http_errors.fetch_add(1, Ordering::Relaxed);
        // Rejections from extractors and the router come as plain text.
        let is_json = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        if !is_json {
            let msg = match status {
                StatusCode::PAYLOAD_TOO_LARGE => {
                    format!(
                        "the request body is larger than {} bytes",
                        state.config.max_body_bytes
                    )
                }
                StatusCode::METHOD_NOT_ALLOWED => "method not allowed on this endpoint".to_string(),
                s => s.canonical_reason().unwrap_or("error").to_string(),
            };
            let err = ApiError {
                status,
                ..ApiError::bad_request(msg)
            };
            return err.into_response();
        }
    }
    resp
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn ready(state: &AppState) -> Result<Arc<Ready>, ApiError> {
    if let Some(r) = state.ready.get() {
        if r.scheduler.is_draining() {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        return Ok(r.clone());
    }
    let err = state.load_error.lock().ok().and_then(|g| g.clone());
    Err(ApiError::unavailable(match err {
        Some(e) => format!("the model failed to load: {e}"),
        None => "the model is loading".to_string(),
    }))
}

async fn health(State(state): State<Shared>) -> Response {
    match ready(&state) {
        Ok(r) => axum::Json(json!({"status": "ok", "model": r.model.name})).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "unavailable", "error": e.message})),
        )
            .into_response(),
    }
}

async fn models(State(state): State<Shared>) -> Result<Response, ApiError> {
    Ok(misc::models(&*ready(&state)?))
}

async fn metrics(State(state): State<Shared>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        misc::metrics(&state),
    )
        .into_response()
}

async fn chat(State(state): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    completions::chat(ready(&state)?, body).await
}

async fn completion(State(state): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    completions::completion(ready(&state)?, body).await
}

async fn tokenize(State(state): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    misc::tokenize(ready(&state)?, body).await
}

async fn detokenize(State(state): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    misc::detokenize(ready(&state)?, body).await
}

async fn apply_template(State(state): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    misc::apply_template(ready(&state)?, body).await
}

async fn fallback(method: Method, uri: axum::http::Uri) -> ApiError {
    let _ = method;
    ApiError::not_found(uri.path())
}
