//! colibri-model: everything about a model that is not I/O or CUDA.
//!
//! - [`config`]: a Hugging Face `config.json` turned into a [`config::ModelSpec`],
//!   the architecture as data (five MoE families share one engine).
//! - [`source`]: weight sources (safetensors checkpoints, GGUF files,
//!   colibri's packed expert store) and where routed experts live on disk.
//! - [`convert`], [`synth`]: writing packed stores (and GGUF files) from
//!   any source, or from random weights of a real geometry.
//! - [`format`], [`quant`], [`tensor`], [`kernels`]: stored weight formats
//!   (incl. ggml's Q8_0/Q4_0 blocks) and the CPU kernels over them, each
//!   with a scalar reference.
//! - [`forward`]: the batched forward pass over a [`kv::KvCache`] per
//!   sequence, with routed experts fetched through an [`experts::ExpertSource`].
//! - [`tokenizer`], [`chat`]: `tokenizer.json` and chat templates.
//! - [`sampling`], [`stop`]: logits to tokens, and stop strings.
//! - [`demo`]: the bundled random-weight demo model.

pub mod attention;
pub mod chat;
pub mod config;
pub mod convert;
pub mod demo;
pub mod error;
pub mod experts;
pub mod format;
pub mod forward;
pub mod kernels;
pub mod kv;
pub mod moe;
pub mod ops;
pub mod quant;
pub mod rope;
pub mod sampling;
pub mod source;
pub mod stop;
pub mod synth;
pub mod tensor;
pub mod tokenizer;
pub mod weights;

pub use config::ModelSpec;
pub use error::{ModelError, Result};
pub use experts::{ExpertSource, ResidentExperts};
pub use forward::{Logits, Model, SeqInput};
pub use kernels::Pool;
pub use kv::KvCache;
pub use tokenizer::Tokenizer;
