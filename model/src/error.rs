//! Typed errors of the model layer. Every variant names what failed (file,
//! tensor, field) so a user can act on the message without a debugger.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("config.json: {0}")]
    Config(String),
    #[error(
        "unsupported model_type `{0}` (supported: qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3)"
    )]
    UnsupportedArchitecture(String),
    #[error("{file}: not a valid safetensors file: {reason}")]
    Safetensors { file: PathBuf, reason: String },
    #[error("{file}: not a valid GGUF model: {reason}")]
    Gguf { file: PathBuf, reason: String },
    #[error("{file}: not a valid packed expert store: {reason}")]
    Packed { file: PathBuf, reason: String },
    /// Bytes read back do not hash to what the store's manifest recorded:
    /// the file is corrupt (or was changed after it was written).
    #[error(
        "{file}: {what}: checksum mismatch (xxh3 {got:016x}, the manifest says {expected:016x}): the data is corrupt; convert the model again"
    )]
    Checksum {
        file: PathBuf,
        /// `layer L expert E` or `tensor NAME`.
        what: String,
        expected: u64,
        got: u64,
    },
    /// A conversion stopped on purpose before it finished (the test hook
    /// `ConvertOptions::stop_after_layers`); running it again resumes.
    #[error("stopped after {0} layers as asked; run the same command again to resume")]
    Interrupted(usize),
    #[error("tensor `{0}` is missing from the checkpoint")]
    MissingTensor(String),
    #[error("tensor `{name}` has unsupported dtype {dtype} (supported: {supported})")]
    UnsupportedDtype {
        name: String,
        dtype: String,
        supported: &'static str,
    },
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    Shape {
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error(
        "context length exceeded: {needed} positions needed, the context holds {context} (max_position_embeddings or --ctx)"
    )]
    ContextExceeded { needed: usize, context: usize },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("expert source: layer {layer} expert {expert}: {reason}")]
    Expert {
        layer: usize,
        expert: usize,
        reason: String,
    },
    #[error("KV cache: cannot grow to {bytes} bytes: {source}")]
    KvMemory {
        bytes: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}
