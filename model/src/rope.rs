//! Rotary position embeddings: inverse frequencies for the default, linear,
//! YaRN and Llama-3 variants, computed as transformers computes them (f32
//! frequencies, cos/sin scaled by the YaRN attention factor), and the two
//! rotation layouts (halves, and DeepSeek's interleaved pairs).

use crate::config::{RopeScaling, RopeSpec};

/// The rotation of one position: cos and sin per rotary pair.
pub struct Angles {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor, else 1).
    attention_factor: f32,
    interleaved: bool,
}

fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The softmax-scale multiplier DeepSeek applies with YaRN
/// (`mscale(factor, mscale_all_dim)²`, when `mscale_all_dim` is set).
pub fn mla_softmax_scale_factor(spec: &RopeSpec) -> f64 {
    match &spec.scaling {
        RopeScaling::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } if *m != 0.0 => {
            let s = yarn_mscale(*factor, *m);
            s * s
        }
        _ => 1.0,
    }
}

impl Rope {
    pub fn new(spec: &RopeSpec, dim: usize, interleaved: bool) -> Rope {
        let base = spec.theta;
        let half = dim / 2;
        // pos_freqs = base ** (arange(0, dim, 2) / dim), in f32 as torch does.
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| (base as f32).powf((2 * i) as f32 / dim as f32))
            .collect();
        let default: Vec<f32> = pos_freqs.iter().map(|p| 1.0 / p).collect();
        let (inv_freq, attention_factor) = match &spec.scaling {
            RopeScaling::None => (default, 1.0),
            RopeScaling::Linear { factor } => {
                (default.iter().map(|f| f / *factor as f32).collect(), 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let af = match attention_factor {
                    Some(a) => *a,
                    None => match (mscale, mscale_all_dim) {
                        (Some(m), Some(ma)) if *m != 0.0 && *ma != 0.0 => {
                            yarn_mscale(*factor, *m) / yarn_mscale(*factor, *ma)
                        }
                        _ => yarn_mscale(*factor, 1.0),
                    },
                };
                let d = dim as f64;
                let corr = |rot: f64| {
                    (d * (original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI))
                        .ln())
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (corr(*beta_fast), corr(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(d - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                let inv: Vec<f32> = (0..half)
                    .map(|i| {
                        let ramp =
                            ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                        let extrap = 1.0 - ramp;
                        let interp = 1.0 / (*factor as f32 * pos_freqs[i]);
                        interp * (1.0 - extrap) + default[i] * extrap
                    })
                    .collect();
                (inv, af as f32)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = *original_max_position_embeddings;
                let low_wl = old / low_freq_factor;
                let high_wl = old / high_freq_factor;
                let inv = default
                    .iter()
                    .map(|&f| {
                        let wl = 2.0 * std::f64::consts::PI / f as f64;
                        let scaled = if wl > low_wl { f / *factor as f32 } else { f };
                        if wl < high_wl || wl > low_wl {
                            scaled
                        } else {
                            let smooth = ((old / wl - low_freq_factor)
                                / (high_freq_factor - low_freq_factor))
                                as f32;
                            (1.0 - smooth) * scaled / *factor as f32 + smooth * scaled
                        }
                    })
                    .collect();
                (inv, 1.0)
            }
        };
        Rope {
            inv_freq,
            attention_factor,
            interleaved,
        }
    }

    pub fn dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// [`Rope::cos_sin`] for `pos`, owned: a forward pass forms each
    /// row's once for all its layers.
    pub fn angles(&self, pos: usize) -> Angles {
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        self.cos_sin(pos, &mut cos, &mut sin);
        Angles { cos, sin }
    }

    /// cos and sin for position `pos`, one per rotary pair.
    pub fn cos_sin(&self, pos: usize, cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
        cos.clear();
        sin.clear();
        for &f in &self.inv_freq {
            let angle = pos as f32 * f;
            cos.push((angle as f64).cos() as f32 * self.attention_factor);
            sin.push((angle as f64).sin() as f32 * self.attention_factor);
        }
    }

    /// Rotates one head `x` (length `dim`) in place.
    ///
    /// Halves layout: pair j is (x[j], x[j + d/2]). Interleaved layout: pair
    /// j is (x[2j], x[2j+1]) and the result is written de-interleaved
    /// (first the rotated evens, then the rotated odds), as transformers
    /// does; q and k get the same permutation, so dot products are the same.
    pub fn apply(&self, x: &mut [f32], cos: &[f32], sin: &[f32], tmp: &mut Vec<f32>) {
        let half = self.inv_freq.len();
        tmp.clear();
        tmp.extend_from_slice(x);
        for j in 0..half {
            let (a, b) = if self.interleaved {
                (tmp[2 * j], tmp[2 * j + 1])
            } else {
                (tmp[j], tmp[j + half])
            };
            x[j] = a * cos[j] - b * sin[j];
            x[j + half] = b * cos[j] + a * sin[j];
        }
    }
}
