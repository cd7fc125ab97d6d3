//! Small element-wise operations of the forward pass, written to follow
//! transformers' float32 arithmetic step by step.

/// RMSNorm as transformers computes it: `w * (x * rsqrt(mean(x²) + eps))`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut ss = 0.0f64;
    for &v in x {
        ss += (v as f64) * (v as f64);
    }
    let var = (ss / x.len() as f64) as f32;
    let r = 1.0 / (var + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * r);
    }
}

/// In-place RMSNorm.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let mut ss = 0.0f64;
    for &v in x.iter() {
        ss += (v as f64) * (v as f64);
    }
    let var = (ss / x.len() as f64) as f32;
    let r = 1.0 / (var + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(w) {
        *v = g * (*v * r);
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Softmax in place (max-subtracted, f32 like torch's float softmax).
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower
/// index (a total order, so selection is deterministic).
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// `n` zeros for a buffer that is read before it is written (an
/// accumulator, `o += …`), written here, so that its pages are the
/// process's own before any thread reads them. `vec![0.0; n]` of a large `n` takes fresh pages from `calloc`, which
/// map the kernel's shared zero page until written: reading first maps
/// it, and the first write then costs a copy-on-write fault and a TLB
/// shootdown to every CPU running a thread of the process, once per
/// 4 KiB page (perf on a 512-token prefill: 8% of its samples in those
/// faults, for the attention output alone).
pub fn accumulator(n: usize) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    // Opaque to the optimizer, which could otherwise merge the allocation
    // and the fill below back into `calloc`.
    std::hint::black_box(v.as_mut_ptr());
    v.resize(n, 0.0);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_by_value_then_index() {
        assert_eq!(top_k(&[0.1, 0.5, 0.5, -1.0, 0.7], 3), vec![4, 1, 2]);
    }

    #[test]
    fn softmax_sums_to_one_and_is_shift_invariant() {
        let mut a = vec![1.0f32, 2.0, 3.0, -4.0];
        let mut b: Vec<f32> = a.iter().map(|v| v + 100.0).collect();
        softmax_inplace(&mut a);
        softmax_inplace(&mut b);
        assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-6);
        }
    }
}
