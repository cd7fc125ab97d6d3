//! The routers of every MoE layer, held by the prefetcher to guess a later
//! layer's experts from an earlier layer's input.
//!
//! A guess applies layer T's router (and DeepSeek's selection bias) to the
//! hidden state that exists now, with exactly the routing rule of the
//! forward pass ([`colibri_model::moe::route`]), and takes the union over
//! the step's rows, most likely first ([`likely_first`]): the experts T
//! would choose if its input were this one.
//! The router matrices are views of the loaded dense weights (cloning a
//! [`QMatrix`] shares its bytes), so holding them costs no memory.

use colibri_model::config::MoeSpec;
use colibri_model::kernels::{Pool, matmul};
use colibri_model::moe::{Routing, route};
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
    /// `h` (`rows × hidden`), their union most likely first
    /// ([`likely_first`]).
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
        let routings: Vec<Routing> = logits
            .chunks_exact(e)
            .map(|row| route(&self.moe, row, layer.selection_bias.as_deref()))
            .collect();
        Ok(likely_first(&routings, e))
    }
}

/// The experts chosen by `rows` (routings over `experts` experts), those
/// chosen by more rows first, then by their best rank in a row's choice,
/// then by id: the order in which to read or copy guesses ahead when only
/// some of them can be.
pub fn likely_first(rows: &[Routing], experts: usize) -> Vec<usize> {
    let mut score = vec![(0usize, usize::MAX); experts];
    for r in rows {
        for (rank, &e) in r.experts.iter().enumerate() {
            if let Some(s) = score.get_mut(e) {
                s.0 += 1;
                s.1 = s.1.min(rank);
            }
        }
    }
    let mut ids: Vec<usize> = (0..experts).filter(|&e| score[e].0 > 0).collect();
    ids.sort_by_key(|&e| (std::cmp::Reverse(score[e].0), score[e].1, e));
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(experts: &[usize]) -> Routing {
        Routing {
            experts: experts.to_vec(),
            weights: vec![1.0 / experts.len() as f32; experts.len()],
        }
    }

    #[test]
    fn likely_first_orders_by_rows_then_rank() {
        // One row: its choices in their order.
        assert_eq!(likely_first(&[routed(&[5, 2, 7])], 8), vec![5, 2, 7]);
        // Chosen by two rows first; ties by the best rank, then the id.
        let rows = [routed(&[3, 1, 6]), routed(&[6, 0, 3]), routed(&[4, 2, 7])];
        assert_eq!(likely_first(&rows, 8), vec![3, 6, 4, 0, 1, 2, 7]);
        // Out-of-range ids are ignored, not a panic.
        assert_eq!(likely_first(&[routed(&[9, 1])], 4), vec![1]);
        assert!(likely_first(&[], 4).is_empty());
    }
}
