//! Gated MLPs for one token: `down(act(gate x, up x))` for several MLPs
//! that share their input (the routed experts of a decode step), in two
//! pool jobs.
//!
//! The first job multiplies gate and up. Each task takes the same rows of
//! both matrices of one MLP and applies `act` to them elementwise, so the
//! gated activation is formed inside the job. The task that finishes an
//! MLP's last rows quantizes its activation for the down product (where
//! the down matrix takes 8-bit inputs). The second job multiplies the
//! down matrices.
//!
//! Done on the calling thread between the two jobs, the activation and
//! the down inputs' quantization took 4.3–4.4% of that thread's samples
//! in a warm decode on 2 cores, with the other core waiting
//! (docs/benchmarks.md).
//!
//! The bits are those of separate products: every row is one call of the
//! same kernel ([`super::rows_into`]) on the same prepared input, `act`
//! sees the same two values, and each down input is quantized once, whole,
//! as [`super::matvec`] quantizes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::{Input, MAX_VEC_TASK_ROWS, Pool, Q8Activation, kernels, prepared_matvecs, rows_into};
use crate::tensor::QMatrix;

/// The three matrices of one gated MLP.
#[derive(Clone, Copy)]
pub struct Gated<'a> {
    pub gate: &'a QMatrix,
    pub up: &'a QMatrix,
    pub down: &'a QMatrix,
}

/// `down_i(act(gate_i x, up_i x))` for each of `mlps`, one output vector
/// per MLP. `act(g, u)` forms the activation elementwise in place of `g`
/// (SwiGLU's `g[j] = silu(g[j]) · u[j]`, say), on a task's rows at a time.
pub fn gated_products(
    pool: &Pool,
    mlps: &[Gated<'_>],
    x: &[f32],
    act: impl Fn(&mut [f32], &[f32]) + Sync,
) -> Vec<Vec<f32>> {
    for m in mlps {
        assert!(
            m.gate.cols == x.len() && m.up.cols == x.len(),
            "gated product input length"
        );
        assert_eq!(m.gate.rows, m.up.rows, "gate and up rows");
        assert_eq!(m.down.cols, m.gate.rows, "down product input length");
    }
    let k = kernels();
    // x prepared once per input kind (as it is, or quantized).
    let (plain, quantized) = (
        Input::F32(x),
        mlps.iter()
            .any(|m| Input::quantizes(k, m.gate) || Input::quantizes(k, m.up))
            .then(|| Input::Q8(Q8Activation::quantize(x))),
    );
    let input = |w: &QMatrix| match &quantized {
        Some(q) if Input::quantizes(k, w) => q,
        _ => &plain,
    };

    // Tasks: (MLP, first row, rows), rows cut so that both matrices take
    // whole tiles or quads.
    let mut tasks = Vec::new();
    let mut left = Vec::with_capacity(mlps.len());
    for (i, m) in mlps.iter().enumerate() {
        let chunk = pool.vec_task_rows(m.gate).max(pool.vec_task_rows(m.up));
        let before = tasks.len();
        for r0 in (0..m.gate.rows).step_by(chunk) {
            tasks.push((i, r0, chunk.min(m.gate.rows - r0)));
        }
        left.push(AtomicUsize::new(tasks.len() - before));
    }
    let acts: Vec<Mutex<Vec<f32>>> = mlps
        .iter()
        .map(|m| Mutex::new(vec![0.0f32; m.gate.rows]))
        .collect();
    let down_q8: Vec<OnceLock<Q8Activation>> = mlps.iter().map(|_| OnceLock::new()).collect();
    pool.run(tasks.len(), &|t| {
        let (i, r0, len) = tasks[t];
        let m = &mlps[i];
        // A task's products on the stack: they cost the allocator nothing.
        let mut stack = [0.0f32; 2 * MAX_VEC_TASK_ROWS];
        let mut heap = Vec::new();
        let gu = if len <= MAX_VEC_TASK_ROWS {
            &mut stack[..2 * len]
        } else {
            heap.resize(2 * len, 0.0);
            &mut heap[..]
        };
        let (g, u) = gu.split_at_mut(len);
        rows_into(k, m.gate, input(m.gate), r0, g);
        rows_into(k, m.up, input(m.up), r0, u);
        act(g, u);
        lock(&acts[i])[r0..r0 + len].copy_from_slice(g);
        // The last of this MLP's tasks: every row of its activation was
        // written under the lock before the other tasks' decrements.
        if left[i].fetch_sub(1, Ordering::AcqRel) == 1 && Input::quantizes(k, m.down) {
            let q = Q8Activation::quantize(&lock(&acts[i]));
            // Only the last task reaches here, once per MLP.
            let _ = down_q8[i].set(q);
        }
    });

    let acts: Vec<Vec<f32>> = acts
        .into_iter()
        .map(|a| a.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect();
    let inputs: Vec<Input<'_>> = down_q8
        .into_iter()
        .zip(&acts)
        .zip(mlps)
        .map(|((q, a), m)| match q.into_inner() {
            Some(q) => Input::Q8(q),
            // Not quantized by the job: the down matrix takes f32 inputs
            // (or the MLP had no rows).
            None => Input::prepare(k, m.down, a),
        })
        .collect();
    let ws: Vec<&QMatrix> = mlps.iter().map(|m| m.down).collect();
    let xs: Vec<&Input<'_>> = inputs.iter().collect();
    let mut ys: Vec<Vec<f32>> = mlps.iter().map(|m| vec![0.0f32; m.down.rows]).collect();
    let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|v| v.as_mut_slice()).collect();
    prepared_matvecs(pool, k, &ws, &xs, &mut outs);
    ys
}

/// The activation's lock; poisoned only if a task panicked while holding
/// it, and plain floats stay valid either way.
fn lock(m: &Mutex<Vec<f32>>) -> MutexGuard<'_, Vec<f32>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
