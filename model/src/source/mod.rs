//! Weight sources. Today: Hugging Face safetensors checkpoints, any number
//! of shards, memory-mapped.

pub mod safetensors;

pub use self::safetensors::{Checkpoint, TensorEntry, TensorLocation};
