//! colibri-sched: the engine. It owns a model, the source of its routed
//! experts and the compute threads, and runs sequences through them:
//! generation ([`sequence::Sequence`], one step at a time so several
//! sequences can share each forward pass) and scoring ([`score`]). Routed
//! experts stream from disk through the RAM tier ([`tier`]), with the
//! coming layers' experts read ahead by the router-aware [`prefetch`]er.

//! With a GPU, the forward pass runs on it with VRAM as one more tier
//! ([`gpu`]).

pub mod counting;
pub mod engine;
pub mod gpu;
pub mod prefetch;
pub mod scheduler;
pub mod score;
pub mod sequence;
pub mod text;
pub mod tier;

pub use engine::{Engine, EngineOptions};
pub use sequence::{Detokenizer, FinishReason, GenRequest, Sequence, TokenEvent};
