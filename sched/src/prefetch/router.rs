//! The routers of every MoE layer, held by the prefetcher to guess a later
//! layer's experts from an earlier layer's input.
//!
//! A guess applies layer T's router (and DeepSeek's selection bias) to the
//! hidden state that exists now, with exactly the routing rule of the
//! forward pass ([`colibri_model::moe::route`]), and takes the union over
//! the step's rows: the experts T would choose if its input were this one.
//! The router matrices are views of the loaded dense weights (cloning a
//! [`QMatrix`] shares its bytes), so holding them costs no memory.

use colibri_model::config::MoeSpec;
use colibri_model::kernels::{Pool, matmul};
use colibri_model::moe::route;
use colibri_model::tensor::QMatrix;
use colibri_model::weights::FfnWeights;
use colibri_model::{Model, ModelError};

struct LayerRouter {
    router: QMatrix,
    selection_bias: Option<Vec<f32>>,
}

/// Every MoE layer's router.
pub struct RouterSet {
    moe: MoeSpec,
    hidden: usize,
    layers: Vec<Option<LayerRouter>>,
}

impl RouterSet {
    /// The routers of `model`; `None` for a model without routed experts.
    pub fn of(model: &Model) -> Option<RouterSet> {
        let moe = model.spec.moe.clone()?;
        let layers = model
            .weights
            .layers
            .iter()
            .map(|lw| match &lw.ffn {
                FfnWeights::Moe(w) => Some(LayerRouter {
                    router: w.router.clone(),
                    selection_bias: w.selection_bias.clone(),
                }),
                FfnWeights::Dense(_) => None,
            })
            .collect();
        Some(RouterSet {
            moe,
            hidden: model.spec.hidden_size,
            layers,
        })
    }

    /// MoE layers, ascending.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.layers.len())
            .filter(|&l| self.layers[l].is_some())
            .collect()
    }

    /// Layers of the model.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The experts layer `target`'s router chooses for the `rows` rows of
    /// `h` (`rows × hidden`), as an ascending union.
    pub fn guess(
        &self,
        pool: &Pool,
        target: usize,
        h: &[f32],
        rows: usize,
    ) -> Result<Vec<usize>, ModelError> {
        let Some(Some(layer)) = self.layers.get(target) else {
            return Err(ModelError::Invalid(format!(
                "layer {target} has no router to predict with"
            )));
        };
        if rows == 0 || h.len() != rows * self.hidden {
            return Err(ModelError::Invalid(format!(
                "MoE input of {} floats for {rows} rows of {}",
                h.len(),
                self.hidden
            )));
        }
        let e = self.moe.num_experts;
        let mut logits = vec![0.0f32; rows * e];
        matmul(pool, &layer.router, h, rows, &mut logits);
        let mut chosen = vec![false; e];
        for row in logits.chunks_exact(e) {
            for x in route(&self.moe, row, layer.selection_bias.as_deref()).experts {
                if let Some(c) = chosen.get_mut(x) {
                    *c = true;
                }
            }
        }
        Ok((0..e).filter(|&x| chosen[x]).collect())
    }
}
