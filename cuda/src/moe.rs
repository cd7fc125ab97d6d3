//! Launch helpers of kernels/moe.cu: a MoE layer's routing and expert
//! launch plan computed on the device (for layers whose experts are all in
//! VRAM, so the host has nothing to fetch and need not see the routing),
//! and the KV append that reads its slot from the device-side positions.

use crate::device::{BufMut, BufView, CudaDevice};
use crate::error::{CudaError, Result};
use crate::kernels::KernelSet;
use crate::ops::{Args, grid, need, nonzero, span, u32_arg};

const MR_THREADS: u32 = 256;
/// Experts per layer the routing kernel handles (its shared scratch).
pub const MOE_ROUTE_MAX_EXPERTS: usize = 256;
/// Rows × choices the routing kernel plans at once (its shared scratch).
pub const MOE_ROUTE_MAX_PAIRS: usize = 2048;
/// Choices per row the routing kernel handles.
pub const MOE_ROUTE_MAX_K: usize = 64;
const KA_THREADS: u32 = 256;

/// How a layer routes (the GPU tier's portable routing, see kernels/moe.cu
/// and sched/src/gpu/route.rs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DeviceRouter {
    /// Softmax over the logits, top-k of the probabilities, (norm) the
    /// chosen probabilities over their sum.
    Softmax { norm: bool },
    /// DeepSeek-V3: sigmoid scores, per-expert selection bias, top
    /// `topk_group` of `n_group` groups (≤ 32 groups of ≥ 2 experts).
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        norm: bool,
        scaling: f32,
    },
}

/// One MoE layer's device-side routing and launch plan for `rows` rows.
#[derive(Debug)]
pub struct MoeRoutePlan<'a> {
    /// `[rows][experts]` router logits.
    pub logits: BufView<'a, f32>,
    pub rows: usize,
    pub experts: usize,
    pub k: usize,
    pub router: DeviceRouter,
    /// Sigmoid router: the per-expert selection bias (`experts` floats).
    pub bias: Option<BufView<'a, f32>>,
    /// `[experts][6]` device addresses of each expert's gate, up, down and
    /// their FP8 scales (0 where none), this layer's.
    pub expert_ptrs: BufView<'a, u64>,
    /// Out: `[rows][k]` chosen experts and their weights.
    pub ids: BufMut<'a, u32>,
    pub weights: BufMut<'a, f32>,
    /// Out: six pointer tables of `ptr_stride` entries each.
    pub ptrs: BufMut<'a, u64>,
    pub ptr_stride: usize,
    /// Out: `table_len` token offsets and counts per launch index.
    pub tok_off: BufMut<'a, u32>,
    pub tok_cnt: BufMut<'a, u32>,
    pub table_len: usize,
    /// Out: `[rows·k]` pair row → token row, and (row, slot) → pair row.
    pub pairs: BufMut<'a, u32>,
    pub pair_of: BufMut<'a, u32>,
}

impl KernelSet {
    /// Routes `p.rows` rows on the device and writes the expert launch plan
    /// (see kernels/moe.cu).
    ///
    /// # Safety
    /// Every non-zero entry of `p.expert_ptrs` must be the address of a
    /// device matrix that the kernels later launched from the written
    /// tables may read (the caller's resident expert slots); the kernel
    /// only copies them.
    pub unsafe fn moe_route_plan(&self, dev: &CudaDevice, p: MoeRoutePlan<'_>) -> Result<()> {
        const K: &str = "moe_route_plan";
        nonzero(K, "rows", p.rows)?;
        nonzero(K, "experts", p.experts)?;
        nonzero(K, "k", p.k)?;
        if p.experts > MOE_ROUTE_MAX_EXPERTS || p.k > MOE_ROUTE_MAX_K || p.k > p.experts {
            return Err(CudaError::invalid(
                K,
                format!(
                    "top-{} of {} experts (at most top-{MOE_ROUTE_MAX_K} of \
                     {MOE_ROUTE_MAX_EXPERTS})",
                    p.k, p.experts
                ),
            ));
        }
        let nk = span(K, &[(p.rows, p.k)], 0)?;
        if nk > MOE_ROUTE_MAX_PAIRS {
            return Err(CudaError::invalid(
                K,
                format!("{} rows × top-{} exceed {MOE_ROUTE_MAX_PAIRS}", p.rows, p.k),
            ));
        }
        need(
            K,
            "logits",
            span(K, &[(p.rows, p.experts)], 0)?,
            p.logits.len(),
        )?;
        need(
            K,
            "expert pointers",
            span(K, &[(p.experts, 6)], 0)?,
            p.expert_ptrs.len(),
        )?;
        need(K, "ids", nk, p.ids.len())?;
        need(K, "weights", nk, p.weights.len())?;
        need(K, "pairs", nk, p.pairs.len())?;
        need(K, "pair_of", nk, p.pair_of.len())?;
        // Every used expert needs a launch index: at most min(experts, nk).
        need(K, "table", p.experts.min(nk), p.table_len)?;
        need(K, "table", p.table_len, p.ptr_stride)?;
        need(
            K,
            "pointer tables",
            span(K, &[(6, p.ptr_stride)], 0)?,
            p.ptrs.len(),
        )?;
        need(K, "tok_off", p.table_len, p.tok_off.len())?;
        need(K, "tok_cnt", p.table_len, p.tok_cnt.len())?;
        let (kind, norm, n_group, topk_group, scaling) = match p.router {
            DeviceRouter::Softmax { norm } => (0u32, norm, 1usize, 1usize, 1.0f32),
            DeviceRouter::SigmoidGrouped {
                n_group,
                topk_group,
                norm,
                scaling,
            } => {
                if n_group == 0
                    || n_group > 32
                    || !p.experts.is_multiple_of(n_group)
                    || p.experts / n_group < 2
                    || topk_group == 0
                    || topk_group > n_group
                {
                    return Err(CudaError::invalid(
                        K,
                        format!(
                            "{} experts in {n_group} groups, top {topk_group} groups",
                            p.experts
                        ),
                    ));
                }
                (1, norm, n_group, topk_group, scaling)
            }
        };
        let bias = match (&p.router, &p.bias) {
            (DeviceRouter::SigmoidGrouped { .. }, Some(b)) => {
                need(K, "bias", p.experts, b.len())?;
                b.device_ptr()
            }
            (DeviceRouter::SigmoidGrouped { .. }, None) => 0,
            (DeviceRouter::Softmax { .. }, Some(_)) => {
                return Err(CudaError::invalid(K, "the softmax router takes no bias"));
            }
            (DeviceRouter::Softmax { .. }, None) => 0,
        };
        let mut a = Args::new();
        a.ptr(p.logits.device_ptr())
            .u32(u32_arg(K, "rows", p.rows)?)
            .u32(u32_arg(K, "experts", p.experts)?)
            .u32(u32_arg(K, "k", p.k)?)
            .u32(kind)
            .u32(norm as u32)
            .ptr(bias)
            .u32(n_group as u32)
            .u32(topk_group as u32)
            .f32(scaling)
            .ptr(p.expert_ptrs.device_ptr())
            .ptr(p.ids.device_ptr())
            .ptr(p.weights.device_ptr())
            .ptr(p.ptrs.device_ptr())
            .u32(u32_arg(K, "pointer stride", p.ptr_stride)?)
            .ptr(p.tok_off.device_ptr())
            .ptr(p.tok_cnt.device_ptr())
            .u32(u32_arg(K, "table length", p.table_len)?)
            .ptr(p.pairs.device_ptr())
            .ptr(p.pair_of.device_ptr());
        // SAFETY: 20 arguments in the order and sizes of moe_route_plan in
        // kernels/moe.cu; every buffer the kernel indexes was checked
        // above against rows, experts, k and the table sizes; the pointers
        // it copies are the caller's contract.
        unsafe { self.launch(dev, K, grid(K, 1, 1, 1)?, MR_THREADS, &mut a) }
    }

    /// Appends `rows` rows of `cols` floats (`src_stride` apart) to a KV
    /// part whose slots are `dst_stride` floats apart: row r goes to slot
    /// `slot0[r] + pos[r]` if that is below `capacity`.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append(
        &self,
        dev: &CudaDevice,
        src: BufView<'_, f32>,
        src_stride: usize,
        dst: BufMut<'_, f32>,
        dst_stride: usize,
        capacity: usize,
        rows: usize,
        cols: usize,
        pos: BufView<'_, u32>,
        slot0: BufView<'_, u32>,
    ) -> Result<()> {
        const K: &str = "kv_append";
        nonzero(K, "rows", rows)?;
        nonzero(K, "cols", cols)?;
        if src_stride < cols || dst_stride < cols {
            return Err(CudaError::invalid(K, "rows overlap"));
        }
        need(
            K,
            "src",
            span(K, &[(rows - 1, src_stride)], cols)?,
            src.len(),
        )?;
        need(
            K,
            "dst",
            span(K, &[(capacity.max(1) - 1, dst_stride)], cols)?,
            dst.len(),
        )?;
        need(K, "pos", rows, pos.len())?;
        need(K, "slot0", rows, slot0.len())?;
        let mut a = Args::new();
        a.ptr(src.device_ptr())
            .u32(u32_arg(K, "src stride", src_stride)?)
            .ptr(dst.device_ptr())
            .u32(u32_arg(K, "dst stride", dst_stride)?)
            .u32(u32_arg(K, "cols", cols)?)
            .ptr(pos.device_ptr())
            .ptr(slot0.device_ptr())
            .u32(u32_arg(K, "capacity", capacity)?);
        // SAFETY: 8 arguments as kv_append in kernels/moe.cu; src holds the
        // rows, dst holds `capacity` slots and the kernel writes none past
        // it (checked on the device against the positions it reads).
        unsafe {
            self.launch(
                dev,
                K,
                grid(K, cols.div_ceil(KA_THREADS as usize), rows, 1)?,
                KA_THREADS,
                &mut a,
            )
        }
    }
}
