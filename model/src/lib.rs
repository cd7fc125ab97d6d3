//! colibri-model: everything about a model that is not I/O or CUDA.
//!
//! - [`config`]: a Hugging Face `config.json` turned into a [`config::ModelSpec`],
//!   the architecture as data (five MoE families share one engine).
//! - [`source`]: weight sources (safetensors checkpoints today).
//! - [`format`], [`tensor`], [`kernels`]: stored weight formats and the CPU
//!   kernels over them, each with a scalar reference.
//! - [`forward`]: the batched forward pass over a [`kv::KvCache`] per
//!   sequence, with routed experts fetched through an [`experts::ExpertSource`].
//! - [`tokenizer`], [`chat`]: `tokenizer.json` and chat templates.
//! - [`sampling`]: logits to tokens.

pub mod chat;
pub mod error;
pub mod format;
pub mod kernels;
pub mod tensor;
pub mod tokenizer;

pub use error::{ModelError, Result};
