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
//! A decode that wants only the outputs' weighted sum (the MoE combine)
//! forms it in the down job ([`gated_products_summed`]): each task takes
//! the same rows of every down matrix and adds them up in the combine's
//! order, so the calling thread neither waits for nor reads the rows the
//! other cores wrote (11 µs a layer of its serial work on 16 cores,
//! docs/benchmarks.md).
//!
//! The bits are those of separate products: every row is one call of the
//! same kernel ([`super::rows_into`]) on the same prepared input, `act`
//! sees the same two values, and each down input is quantized once, whole,
//! as [`super::matvec`] quantizes.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

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
    let k = kernels();
    let (acts, down_q8) = gate_up_job(pool, mlps, x, act);
    let inputs = down_inputs(mlps, &acts, down_q8);
    let ws: Vec<&QMatrix> = mlps.iter().map(|m| m.down).collect();
    let xs: Vec<&Input<'_>> = inputs.iter().collect();
    let mut ys: Vec<Vec<f32>> = mlps.iter().map(|m| vec![0.0f32; m.down.rows]).collect();
    let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|v| v.as_mut_slice()).collect();
    prepared_matvecs(pool, k, &ws, &xs, &mut outs);
    drop(xs);
    let q8 = quantized_inputs(inputs);
    recycle(acts, q8);
    ys
}

/// [`gated_products`] whose outputs are wanted only weighted and summed:
/// `y[r] += w · down_i(…)[r]` for each `(i, w)` of `sum`, in that order
/// (a decode's routed experts in the MoE combine's order, onto its zeroed
/// accumulator). The down products and the sum run in one pool job whose
/// tasks each take the same rows of every down matrix, so no thread reads
/// rows another core wrote and no MLP's output is kept. Each element gets
/// the operations, in the order, of the sum over [`gated_products`]'
/// outputs, so the bits are the same. `None` (nothing computed) where the
/// down matrices do not share one row layout or length, or `y` is not
/// that long.
pub fn gated_products_summed(
    pool: &Pool,
    mlps: &[Gated<'_>],
    x: &[f32],
    act: impl Fn(&mut [f32], &[f32]) + Sync,
    sum: &[(usize, f32)],
    y: &mut [f32],
) -> Option<()> {
    let first = mlps.first()?.down;
    let layout = |w: &QMatrix| {
        (
            w.rows,
            w.format,
            w.is_tiled(),
            w.is_quads(),
            w.is_k_panels(),
        )
    };
    if y.len() != first.rows
        || mlps.iter().any(|m| layout(m.down) != layout(first))
        || sum.iter().any(|&(i, _)| i >= mlps.len())
    {
        return None;
    }
    let k = kernels();
    let (acts, down_q8) = gate_up_job(pool, mlps, x, act);
    let inputs = down_inputs(mlps, &acts, down_q8);
    let chunk = pool.vec_task_rows(first);
    pool.for_each_chunk_mut(y, chunk, |c, ys| {
        let r0 = c * chunk;
        let mut stack = [0.0f32; MAX_VEC_TASK_ROWS];
        let mut heap = Vec::new();
        let d = if ys.len() <= MAX_VEC_TASK_ROWS {
            &mut stack[..ys.len()]
        } else {
            heap.resize(ys.len(), 0.0);
            &mut heap[..]
        };
        for &(i, w) in sum {
            rows_into(k, mlps[i].down, &inputs[i], r0, d);
            for (yv, dv) in ys.iter_mut().zip(d.iter()) {
                *yv += dv * w;
            }
        }
    });
    let q8 = quantized_inputs(inputs);
    recycle(acts, q8);
    Some(())
}

thread_local! {
    /// The activations and quantized down inputs of this thread's last
    /// call, for the next call to overwrite. Made afresh, each call zeroed
    /// an activation per MLP, and freed here the down inputs the workers
    /// had quantized (into their own malloc arenas): on a decode's calling
    /// thread, while the workers waited (docs/benchmarks.md).
    static REUSE: RefCell<(Vec<Vec<f32>>, Vec<Q8Activation>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Buffers [`REUSE`] keeps of each kind, at most (a call takes one per
/// MLP: a decode's routed experts).
const REUSE_MAX: usize = 32;

/// The quantized vectors among `inputs`.
fn quantized_inputs(inputs: Vec<Input<'_>>) -> Vec<Q8Activation> {
    inputs
        .into_iter()
        .filter_map(|x| match x {
            Input::Q8(q) => Some(q),
            Input::F32(_) => None,
        })
        .collect()
}

/// Gives a call's activations and quantized down inputs back to
/// [`REUSE`].
fn recycle(acts: Vec<Vec<f32>>, q8: Vec<Q8Activation>) {
    REUSE.with_borrow_mut(|(a, q)| {
        a.extend(acts.into_iter().take(REUSE_MAX.saturating_sub(a.len())));
        q.extend(q8.into_iter().take(REUSE_MAX.saturating_sub(q.len())));
    });
}

/// The activation of each MLP (`act(gate x, up x)`) in one pool job, and
/// where its down matrix takes 8-bit inputs, the activation quantized by
/// the task that finished it.
fn gate_up_job(
    pool: &Pool,
    mlps: &[Gated<'_>],
    x: &[f32],
    act: impl Fn(&mut [f32], &[f32]) + Sync,
) -> (Vec<Vec<f32>>, Vec<Option<Q8Activation>>) {
    for m in mlps {
        assert!(
            m.gate.cols == x.len() && m.up.cols == x.len(),
            "gated product input length"
        );
        assert_eq!(m.gate.rows, m.up.rows, "gate and up rows");
        assert_eq!(m.down.cols, m.gate.rows, "down product input length");
    }
    let k = kernels();
    // Last call's buffers where there are: every activation row is
    // written by a task below before anything reads it, and a vector is
    // quantized whole (`quantize_from` resets it).
    let (mut spare_acts, mut spare_q8) = REUSE.with_borrow_mut(std::mem::take);
    // x prepared once per input kind (as it is, or quantized).
    let (plain, quantized) = (
        Input::F32(x),
        mlps.iter()
            .any(|m| Input::quantizes(k, m.gate) || Input::quantizes(k, m.up))
            .then(|| {
                let mut q = spare_q8.pop().unwrap_or_default();
                q.quantize_from(x);
                Input::Q8(q)
            }),
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
        .map(|m| {
            let mut a = spare_acts.pop().unwrap_or_default();
            a.resize(m.gate.rows, 0.0);
            Mutex::new(a)
        })
        .collect();
    let down_q8: Vec<Mutex<Q8Activation>> = mlps
        .iter()
        .map(|_| Mutex::new(spare_q8.pop().unwrap_or_default()))
        .collect();
    REUSE.with_borrow_mut(|r| *r = (spare_acts, spare_q8));
    let down_done: Vec<AtomicBool> = mlps.iter().map(|_| AtomicBool::new(false)).collect();
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
            // Only the last task reaches here, once per MLP.
            lock(&down_q8[i]).quantize_from(&lock(&acts[i]));
            down_done[i].store(true, Ordering::Release);
        }
    });

    let acts: Vec<Vec<f32>> = acts.into_iter().map(into_inner).collect();
    let mut unused = quantized_inputs(quantized.into_iter().collect());
    let down_q8 = down_q8
        .into_iter()
        .zip(&down_done)
        .map(|(q, done)| {
            let q = into_inner(q);
            if done.load(Ordering::Acquire) {
                Some(q)
            } else {
                unused.push(q);
                None
            }
        })
        .collect();
    REUSE.with_borrow_mut(|(_, q)| {
        q.extend(unused.into_iter().take(REUSE_MAX.saturating_sub(q.len())))
    });
    (acts, down_q8)
}

/// Each MLP's down input: the job's quantized activation, else the
/// activation prepared as the down matrix takes it.
fn down_inputs<'a>(
    mlps: &[Gated<'_>],
    acts: &'a [Vec<f32>],
    down_q8: Vec<Option<Q8Activation>>,
) -> Vec<Input<'a>> {
    let k = kernels();
    down_q8
        .into_iter()
        .zip(acts)
        .zip(mlps)
        .map(|((q, a), m)| match q {
            Some(q) => Input::Q8(q),
            // Not quantized by the job: the down matrix takes f32 inputs
            // (or the MLP had no rows).
            None => Input::prepare(k, m.down, a),
        })
        .collect()
}

/// An activation's (or a down input's) lock; poisoned only if a task
/// panicked while holding it, and the pool then resumes that panic on the
/// calling thread before anything reads the value.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// [`lock`]'s value, taken out.
fn into_inner<T>(m: Mutex<T>) -> T {
    m.into_inner().unwrap_or_else(|p| p.into_inner())
}
