//! Text in and out of the engine through a model's tokenizer: the stream
//! detokenizer sequences use, and the EOS ids a tokenizer adds.

use std::sync::Arc;

use colibri_model::tokenizer::{StreamDecoder, Tokenizer};
use colibri_model::{ModelError, ModelSpec};

use crate::sequence::Detokenizer;

/// A [`Detokenizer`] over a shared tokenizer (special tokens skipped, as
/// OpenAI-compatible servers return text).
pub struct StreamDetokenizer {
    tokenizer: Arc<Tokenizer>,
    decoder: StreamDecoder,
}

impl StreamDetokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        StreamDetokenizer {
            tokenizer,
            decoder: StreamDecoder::new(true),
        }
    }

    pub fn boxed(tokenizer: &Arc<Tokenizer>) -> Box<dyn Detokenizer> {
        Box::new(StreamDetokenizer::new(tokenizer.clone()))
    }
}

impl Detokenizer for StreamDetokenizer {
    fn push(&mut self, token: u32) -> Result<String, ModelError> {
        self.decoder.push(&self.tokenizer, token)
    }

    fn finish(&mut self) -> Result<String, ModelError> {
        self.decoder.flush(&self.tokenizer)
    }
}

/// End-of-sequence ids: the model config's and generation config's, plus
/// the tokenizer's `eos_token` (chat models often end turns with it).
pub fn eos_ids(spec: &ModelSpec, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
    let mut ids = spec.eos_token_ids.clone();
    if let Some(t) = tokenizer {
        for id in t.eos_token_ids() {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}
