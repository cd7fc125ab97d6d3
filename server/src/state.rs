//! What the handlers share: the configuration, and the served model once it
//! has loaded (until then every model endpoint answers 503).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use colibri_model::Tokenizer;
use colibri_sched::Engine;
use colibri_sched::scheduler::Scheduler;

/// A loaded model ready to serve.
pub struct ServedModel {
    pub engine: Arc<Engine>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// The id clients use (`model` field); requests may omit it.
    pub name: String,
    pub path: PathBuf,
    /// The bundled random-weight demo model.
    pub is_demo: bool,
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    /// Requests that may wait beyond the running batch (429 past that).
    pub max_queue: usize,
    /// Sequences decoding together.
    pub max_batch: usize,
    /// Tokens one scheduler step may feed.
    pub step_tokens: usize,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// On SIGINT/SIGTERM, how long running requests may finish.
    pub shutdown_grace: std::time::Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            max_queue: 64,
            max_batch: 16,
            step_tokens: 512,
            max_body_bytes: 8 << 20,
            shutdown_grace: std::time::Duration::from_secs(10),
        }
    }
}

pub struct Ready {
    pub model: ServedModel,
    pub scheduler: Scheduler,
    pub started: std::time::Instant,
    pub created_unix: u64,
}

pub struct AppState {
    pub config: ServerConfig,
    pub ready: OnceLock<Arc<Ready>>,
    pub load_error: Mutex<Option<String>>,
    pub http_requests: std::sync::atomic::AtomicU64,
    pub http_errors: std::sync::atomic::AtomicU64,
}

pub type Shared = Arc<AppState>;
