//! Teacher-forced scoring (perplexity).

use colibri_model::sampling::log_softmax;
use colibri_model::{KvCache, Logits, ModelError, SeqInput};
use serde::Serialize;

use crate::Engine;

/// Tokens fed per forward pass while scoring (bounds the logits buffer to
/// `SCORE_CHUNK × vocab` floats).
const SCORE_CHUNK: usize = 128;

#[derive(Clone, Debug, Serialize)]
pub struct ScoreReport {
    /// Negative log-likelihood of every predicted position, in order.
    pub nll: Vec<f64>,
    pub mean_nll: f64,
    pub ppl: f64,
    pub tokens_scored: usize,
    /// Windows the text was split into (a new window restarts the context
    /// and its first token is not scored).
    pub windows: usize,
}

impl Engine {
    /// Scores `tokens`: the NLL of each token given those before it. Texts
    /// longer than the context are split into windows of the context length.
    pub fn score(
        &self,
        tokens: &[u32],
        mut on_progress: impl FnMut(usize, usize),
    ) -> Result<ScoreReport, ModelError> {
        if tokens.len() < 2 {
            return Err(ModelError::Invalid(format!(
                "scoring needs at least 2 tokens, got {}",
                tokens.len()
            )));
        }
        let ctx = self.context_len();
        let vocab = self.model.spec.vocab_size;
        let mut nll = Vec::with_capacity(tokens.len());
        let mut windows = 0;
        for window in tokens.chunks(ctx) {
            if window.len() < 2 {
                continue;
            }
            windows += 1;
            let mut cache = KvCache::new(&self.model.spec, ctx);
            // Predict window[i+1] from the logits after window[i].
            let inputs = &window[..window.len() - 1];
            for (c, chunk) in inputs.chunks(SCORE_CHUNK).enumerate() {
                let out = self.forward(&mut [SeqInput {
                    cache: &mut cache,
                    tokens: chunk,
                    logits: Logits::All,
                }])?;
                for (i, row) in out[0].chunks_exact(vocab).enumerate() {
                    let target = window[c * SCORE_CHUNK + i + 1] as usize;
                    nll.push(-log_softmax(row)[target]);
                }
                on_progress(nll.len(), tokens.len() - 1);
            }
        }
        let mean = nll.iter().sum::<f64>() / nll.len() as f64;
        Ok(ScoreReport {
            tokens_scored: nll.len(),
            mean_nll: mean,
            ppl: mean.exp(),
            nll,
            windows,
        })
    }
}
