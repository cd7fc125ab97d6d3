//! The KV cache of one sequence: per layer, the keys and values of every
//! past position (grouped-query attention), or the compressed latent and the
//! shared rotary key (multi-head latent attention, ~1/50 of the size).

use crate::config::{AttentionSpec, ModelSpec};
use crate::error::{ModelError, Result};

#[derive(Clone, Debug)]
pub(crate) enum LayerCache {
    /// `k`, `v`: one vector per KV head, `[pos][head_dim]` each, so that
    /// the heads attending with one KV head read its keys and values as
    /// one stream (interleaved, a long context's decode step ran ~20%
    /// slower: docs/benchmarks.md).
    Gqa { k: Vec<Vec<f32>>, v: Vec<Vec<f32>> },
    /// `latent`: `[pos][kv_lora_rank]` (normed); `k_pe`: `[pos][rope_dim]` (rotated).
    Mla { latent: Vec<f32>, k_pe: Vec<f32> },
}

/// Keys and values a compute tier other than the CPU keeps for a cache
/// (the GPU tier's, in device or mapped memory). It moves with the cache
/// and is dropped with it; a clone does not carry it, and a clone of such a
/// cache refuses to run (its positions are nowhere the clone can reach).
#[derive(Default)]
pub struct TierState(Option<Box<dyn std::any::Any + Send + Sync>>);

impl Clone for TierState {
    fn clone(&self) -> Self {
        TierState(None)
    }
}

impl std::fmt::Debug for TierState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "TierState(attached)"
        } else {
            "TierState(none)"
        })
    }
}

#[derive(Clone, Debug)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    len: usize,
    capacity: usize,
    /// Set once a tier other than the CPU has appended positions: from
    /// then on the positions live in `tier`, not in `layers`.
    external: bool,
    tier: TierState,
}

impl KvCache {
    /// An empty cache for `spec` holding at most `capacity` positions
    /// (memory grows with use, not with capacity).
    pub fn new(spec: &ModelSpec, capacity: usize) -> KvCache {
        let layers = (0..spec.num_layers())
            .map(|_| match spec.attention {
                AttentionSpec::Gqa { num_kv_heads, .. } => LayerCache::Gqa {
                    k: vec![Vec::new(); num_kv_heads],
                    v: vec![Vec::new(); num_kv_heads],
                },
                AttentionSpec::Mla { .. } => LayerCache::Mla {
                    latent: Vec::new(),
                    k_pe: Vec::new(),
                },
            })
            .collect();
        KvCache {
            layers,
            len: 0,
            capacity: capacity.min(spec.max_position_embeddings),
            external: false,
            tier: TierState::default(),
        }
    }

    /// Positions already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Checks that `more` positions fit.
    pub fn check_room(&self, more: usize) -> Result<()> {
        if self.len + more > self.capacity {
            return Err(ModelError::ContextExceeded {
                needed: self.len + more,
                context: self.capacity,
            });
        }
        Ok(())
    }

    /// Forgets every position from `len` on (to reuse a shared prefix).
    pub fn truncate(&mut self, len: usize, spec: &ModelSpec) {
        if len >= self.len {
            return;
        }
        let per_pos = |which: usize| -> usize {
            match &spec.attention {
                // Per KV head's vector.
                AttentionSpec::Gqa { head_dim, .. } => *head_dim,
                AttentionSpec::Mla {
                    kv_lora_rank,
                    qk_rope_head_dim,
                    ..
                } => {
                    if which == 0 {
                        *kv_lora_rank
                    } else {
                        *qk_rope_head_dim
                    }
                }
            }
        };
        for l in &mut self.layers {
            match l {
                LayerCache::Gqa { k, v } => {
                    for x in k.iter_mut().chain(v.iter_mut()) {
                        x.truncate(len * per_pos(0));
                    }
                }
                LayerCache::Mla { latent, k_pe } => {
                    latent.truncate(len * per_pos(0));
                    k_pe.truncate(len * per_pos(1));
                }
            }
        }
        self.len = len;
        if len == 0 && self.tier.0.is_none() {
            self.external = false;
        }
    }

    pub fn clear(&mut self, spec: &ModelSpec) {
        self.truncate(0, spec);
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// The state of the tier that keeps this cache's positions outside
    /// `layers` (the GPU tier's), if any.
    pub fn tier_state(&mut self) -> &mut Option<Box<dyn std::any::Any + Send + Sync>> {
        &mut self.tier.0
    }

    /// Whether another tier has appended positions to this cache.
    pub fn is_external(&self) -> bool {
        self.external
    }

    /// Records that another tier appended `n` positions (kept in its
    /// [`Self::tier_state`]); fails if they do not fit or if the CPU tier
    /// already holds positions here.
    pub fn append_external(&mut self, n: usize) -> Result<()> {
        self.check_room(n)?;
        if self.len > 0 && !self.external {
            return Err(ModelError::Invalid(
                "this KV cache's positions were computed by the CPU tier; another tier cannot                  extend it"
                    .into(),
            ));
        }
        self.external = true;
        self.len += n;
        Ok(())
    }

    /// Fails if this cache's positions live in another tier (the CPU tier
    /// cannot read them).
    pub fn check_host(&self) -> Result<()> {
        if self.external && self.len > 0 {
            return Err(ModelError::Invalid(format!(
                "this KV cache's {} positions live in the GPU tier (or were cloned from                  such a cache); the CPU tier cannot read them",
                self.len
            )));
        }
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Gqa { k, v } => k.iter().chain(v).map(Vec::len).sum::<usize>() * 4,
                LayerCache::Mla { latent, k_pe } => (latent.len() + k_pe.len()) * 4,
            })
            .sum()
    }
}
