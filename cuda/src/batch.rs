//! Launch helpers for the engine's batched layer: the pointer-table matvec
//! over the experts of a layer wherever their slots are (kernels/matvec.cu),
//! and the row plumbing around it (kernels/rows.cu): residual adds, biases,
//! clamps, row gathers and strided copies.
//!
//! The row kernels do one rounded f32 operation per element (or none), so
//! they never change a value's bits; the table matvec runs the very
//! arithmetic of [`KernelSet::matvec`] (one shared device function), so an
//! expert gives the same bits whichever slot it sits in and whichever
//! experts share its launch.

use crate::device::{BufMut, BufView, CudaDevice};
use crate::error::{CudaError, Result};
use crate::kernels::KernelSet;
use crate::ops::{Args, WeightFormat, grid, need, nonzero, span, u32_arg};

/// Rows a block of the table kernel owns: 8 warps of 1 row for one token
/// (2 for f32, Q4_0Q8 and Q8_0Q8), of 2 for more (MV_TABLE_ROWS_PER_WARP in
/// kernels/matvec.cu).
fn table_rows_per_block(format: WeightFormat, nt: usize) -> usize {
    8 * match (nt, format) {
        (1, WeightFormat::F32 | WeightFormat::Q4_0Q8 | WeightFormat::Q8_0Q8) => 2,
        (1, _) => 1,
        _ => 2,
    }
}
/// The most tokens per matrix a [`KernelSet::matvec_table_glu`] launch
/// takes (MATVEC_FORMAT in kernels/matvec.cu: more would spill registers).
pub const GLU_MAX_TOK: usize = 2;
/// Rows a block of the GLU table kernel owns: 8 warps of 2 rows for
/// Q4_0Q8, of 1 otherwise (MV_GLU_ROWS_PER_WARP).
fn glu_rows_per_block(format: WeightFormat) -> usize {
    8 * match format {
        WeightFormat::Q4_0Q8 => 2,
        _ => 1,
    }
}
const MV_THREADS: u32 = 256;
const RW_THREADS: u32 = 256;
const MAX_GRID_YZ: usize = 65535;

/// Up to `matrices` equally shaped matrices anywhere in device memory, each
/// applied to its own packed token rows: matrix z (at `w_ptrs[z]`, FP8
/// scales at `scale_ptrs[z]`) reads rows `tok_off[z] .. tok_off[z] +
/// tok_cnt[z]` of x (`x_tok_stride` floats apart) and writes the same rows
/// of y (`y_tok_stride` apart). The tables live on the device, so the host
/// cannot check them: see [`KernelSet::matvec_table`]'s safety contract.
#[derive(Clone, Copy, Debug)]
pub struct MatvecTable<'a> {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub matrices: usize,
    pub w_ptrs: BufView<'a, u64>,
    /// FP8 only: per-matrix scale-grid pointers and the scale block.
    pub scale_ptrs: Option<(BufView<'a, u64>, usize)>,
    pub x: BufView<'a, f32>,
    pub x_tok_stride: usize,
    /// Where the tokens are, when they are not packed by expert: the token
    /// of pair row p is row `rows[p − first]` of x, for the pair rows
    /// `first ..` of this launch (`(rows, first)`).
    pub x_rows: Option<(BufView<'a, u32>, usize)>,
    pub tok_off: BufView<'a, u32>,
    pub tok_cnt: BufView<'a, u32>,
    /// The largest `tok_cnt[z]` (sizes the grid).
    pub max_tok: usize,
    pub y_tok_stride: usize,
}

fn table_kernel(format: WeightFormat, nt: usize, glu: bool) -> &'static str {
    const NAMES: [[&str; 4]; 28] = [
        [
            "matvec_f32_table_t1",
            "matvec_f32_table_t2",
            "matvec_f32_table_t4",
            "matvec_f32_table_t8",
        ],
        [
            "matvec_f16_table_t1",
            "matvec_f16_table_t2",
            "matvec_f16_table_t4",
            "matvec_f16_table_t8",
        ],
        [
            "matvec_bf16_table_t1",
            "matvec_bf16_table_t2",
            "matvec_bf16_table_t4",
            "matvec_bf16_table_t8",
        ],
        [
            "matvec_f8e4m3_table_t1",
            "matvec_f8e4m3_table_t2",
            "matvec_f8e4m3_table_t4",
            "matvec_f8e4m3_table_t8",
        ],
        [
            "matvec_q8_0_table_t1",
            "matvec_q8_0_table_t2",
            "matvec_q8_0_table_t4",
            "matvec_q8_0_table_t8",
        ],
        [
            "matvec_q4_0_table_t1",
            "matvec_q4_0_table_t2",
            "matvec_q4_0_table_t4",
            "matvec_q4_0_table_t8",
        ],
        [
            "matvec_q4_0q8_table_t1",
            "matvec_q4_0q8_table_t2",
            "matvec_q4_0q8_table_t4",
            "matvec_q4_0q8_table_t8",
        ],
        [
            "matvec_q8_0q8_table_t1",
            "matvec_q8_0q8_table_t2",
            "matvec_q8_0q8_table_t4",
            "matvec_q8_0q8_table_t8",
        ],
        [
            "matvec_q6_k_table_t1",
            "matvec_q6_k_table_t2",
            "matvec_q6_k_table_t4",
            "matvec_q6_k_table_t8",
        ],
        [
            "matvec_q6_kq8_table_t1",
            "matvec_q6_kq8_table_t2",
            "matvec_q6_kq8_table_t4",
            "matvec_q6_kq8_table_t8",
        ],
        [
            "matvec_q4_k_table_t1",
            "matvec_q4_k_table_t2",
            "matvec_q4_k_table_t4",
            "matvec_q4_k_table_t8",
        ],
        [
            "matvec_q4_kq8_table_t1",
            "matvec_q4_kq8_table_t2",
            "matvec_q4_kq8_table_t4",
            "matvec_q4_kq8_table_t8",
        ],
        [
            "matvec_q5_k_table_t1",
            "matvec_q5_k_table_t2",
            "matvec_q5_k_table_t4",
            "matvec_q5_k_table_t8",
        ],
        [
            "matvec_q5_kq8_table_t1",
            "matvec_q5_kq8_table_t2",
            "matvec_q5_kq8_table_t4",
            "matvec_q5_kq8_table_t8",
        ],
        [
            "matvec_q4_1_table_t1",
            "matvec_q4_1_table_t2",
            "matvec_q4_1_table_t4",
            "matvec_q4_1_table_t8",
        ],
        [
            "matvec_q5_0_table_t1",
            "matvec_q5_0_table_t2",
            "matvec_q5_0_table_t4",
            "matvec_q5_0_table_t8",
        ],
        [
            "matvec_q5_1_table_t1",
            "matvec_q5_1_table_t2",
            "matvec_q5_1_table_t4",
            "matvec_q5_1_table_t8",
        ],
        [
            "matvec_q2_k_table_t1",
            "matvec_q2_k_table_t2",
            "matvec_q2_k_table_t4",
            "matvec_q2_k_table_t8",
        ],
        [
            "matvec_q3_k_table_t1",
            "matvec_q3_k_table_t2",
            "matvec_q3_k_table_t4",
            "matvec_q3_k_table_t8",
        ],
        [
            "matvec_iq4_nl_table_t1",
            "matvec_iq4_nl_table_t2",
            "matvec_iq4_nl_table_t4",
            "matvec_iq4_nl_table_t8",
        ],
        [
            "matvec_iq4_xs_table_t1",
            "matvec_iq4_xs_table_t2",
            "matvec_iq4_xs_table_t4",
            "matvec_iq4_xs_table_t8",
        ],
        [
            "matvec_q4_1q8_table_t1",
            "matvec_q4_1q8_table_t2",
            "matvec_q4_1q8_table_t4",
            "matvec_q4_1q8_table_t8",
        ],
        [
            "matvec_q5_0q8_table_t1",
            "matvec_q5_0q8_table_t2",
            "matvec_q5_0q8_table_t4",
            "matvec_q5_0q8_table_t8",
        ],
        [
            "matvec_q5_1q8_table_t1",
            "matvec_q5_1q8_table_t2",
            "matvec_q5_1q8_table_t4",
            "matvec_q5_1q8_table_t8",
        ],
        [
            "matvec_q2_kq8_table_t1",
            "matvec_q2_kq8_table_t2",
            "matvec_q2_kq8_table_t4",
            "matvec_q2_kq8_table_t8",
        ],
        [
            "matvec_q3_kq8_table_t1",
            "matvec_q3_kq8_table_t2",
            "matvec_q3_kq8_table_t4",
            "matvec_q3_kq8_table_t8",
        ],
        [
            "matvec_iq4_nlq8_table_t1",
            "matvec_iq4_nlq8_table_t2",
            "matvec_iq4_nlq8_table_t4",
            "matvec_iq4_nlq8_table_t8",
        ],
        [
            "matvec_iq4_xsq8_table_t1",
            "matvec_iq4_xsq8_table_t2",
            "matvec_iq4_xsq8_table_t4",
            "matvec_iq4_xsq8_table_t8",
        ],
    ];
    const GLU_NAMES: [[&str; 2]; 28] = [
        ["matvec_f32_table_glu_t1", "matvec_f32_table_glu_t2"],
        ["matvec_f16_table_glu_t1", "matvec_f16_table_glu_t2"],
        ["matvec_bf16_table_glu_t1", "matvec_bf16_table_glu_t2"],
        ["matvec_f8e4m3_table_glu_t1", "matvec_f8e4m3_table_glu_t2"],
        ["matvec_q8_0_table_glu_t1", "matvec_q8_0_table_glu_t2"],
        ["matvec_q4_0_table_glu_t1", "matvec_q4_0_table_glu_t2"],
        ["matvec_q4_0q8_table_glu_t1", "matvec_q4_0q8_table_glu_t2"],
        ["matvec_q8_0q8_table_glu_t1", "matvec_q8_0q8_table_glu_t2"],
        ["matvec_q6_k_table_glu_t1", "matvec_q6_k_table_glu_t2"],
        ["matvec_q6_kq8_table_glu_t1", "matvec_q6_kq8_table_glu_t2"],
        ["matvec_q4_k_table_glu_t1", "matvec_q4_k_table_glu_t2"],
        ["matvec_q4_kq8_table_glu_t1", "matvec_q4_kq8_table_glu_t2"],
        ["matvec_q5_k_table_glu_t1", "matvec_q5_k_table_glu_t2"],
        ["matvec_q5_kq8_table_glu_t1", "matvec_q5_kq8_table_glu_t2"],
        ["matvec_q4_1_table_glu_t1", "matvec_q4_1_table_glu_t2"],
        ["matvec_q5_0_table_glu_t1", "matvec_q5_0_table_glu_t2"],
        ["matvec_q5_1_table_glu_t1", "matvec_q5_1_table_glu_t2"],
        ["matvec_q2_k_table_glu_t1", "matvec_q2_k_table_glu_t2"],
        ["matvec_q3_k_table_glu_t1", "matvec_q3_k_table_glu_t2"],
        ["matvec_iq4_nl_table_glu_t1", "matvec_iq4_nl_table_glu_t2"],
        ["matvec_iq4_xs_table_glu_t1", "matvec_iq4_xs_table_glu_t2"],
        ["matvec_q4_1q8_table_glu_t1", "matvec_q4_1q8_table_glu_t2"],
        ["matvec_q5_0q8_table_glu_t1", "matvec_q5_0q8_table_glu_t2"],
        ["matvec_q5_1q8_table_glu_t1", "matvec_q5_1q8_table_glu_t2"],
        ["matvec_q2_kq8_table_glu_t1", "matvec_q2_kq8_table_glu_t2"],
        ["matvec_q3_kq8_table_glu_t1", "matvec_q3_kq8_table_glu_t2"],
        [
            "matvec_iq4_nlq8_table_glu_t1",
            "matvec_iq4_nlq8_table_glu_t2",
        ],
        [
            "matvec_iq4_xsq8_table_glu_t1",
            "matvec_iq4_xsq8_table_glu_t2",
        ],
    ];
    let i = match nt {
        1 => 0,
        2 => 1,
        4 => 2,
        _ => 3,
    };
    let f = format.code() as usize;
    if glu {
        GLU_NAMES[f][i.min(1)]
    } else {
        NAMES[f][i]
    }
}

impl KernelSet {
    /// The pointer-table matvec of [`MatvecTable`].
    ///
    /// # Safety
    /// For every z < `matrices`: `w_ptrs[z]` must point to `rows` rows of
    /// `format.row_bytes(cols)` bytes in live device memory, aligned to
    /// `format.alignment()` and readable 4 bytes past its end (colibri-cuda
    /// pads allocations); for FP8, `scale_ptrs[z]` to its
    /// `ceil(rows/block) × ceil(cols/block)` f32 scales;
    /// `tok_cnt[z] ≤ max_tok`; and rows `tok_off[z] .. + tok_cnt[z]` must
    /// lie inside x and y (checked here only against the largest offset the
    /// caller could mean: the views' lengths), with no two matrices
    /// writing the same row; with `x_rows`, every entry read (pair rows
    /// `tok_off[z] .. + tok_cnt[z]` minus `first`) must lie inside its view
    /// and name a row inside x. The tables must hold these values when the
    /// kernel runs (stream order).
    pub unsafe fn matvec_table(
        &self,
        dev: &CudaDevice,
        t: &MatvecTable<'_>,
        y: BufMut<'_, f32>,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.table_launch(dev, t, None, None, y) }
    }

    /// A gated MLP's first half for every matrix of a table at once:
    /// `y = silu(gate · x) * (up · x)` per row, where `t` describes the gate
    /// matrices and `up` (FP8: with its scale pointers) the up matrices of
    /// the same shape, matrix z of each belonging together. Each row's two
    /// sums are formed exactly as two [`KernelSet::matvec_table`] launches
    /// form them and combined with [`KernelSet::swiglu`]'s operations, so
    /// the result has the bits of those three launches.
    ///
    ///
    /// `ahead`: a table of `matrices` addresses and a byte count (matrix
    /// z's down projection, which the next launch reads). A one-token launch
    /// with 8-bit activations asks L2 for those bytes once its own weights
    /// are in, so they stream while it computes (unless
    /// `COLIBRI_DOWN_AHEAD=0`). A hint: the bits are the same without it.
    ///
    /// # Safety
    /// [`KernelSet::matvec_table`]'s contract, for the up matrices too; each
    /// `ahead` address must start that many bytes of live device memory.
    pub unsafe fn matvec_table_glu(
        &self,
        dev: &CudaDevice,
        t: &MatvecTable<'_>,
        up: (BufView<'_, u64>, Option<BufView<'_, u64>>),
        ahead: Option<(BufView<'_, u64>, usize)>,
        y: BufMut<'_, f32>,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.table_launch(dev, t, Some(up), ahead, y) }
    }

    unsafe fn table_launch(
        &self,
        dev: &CudaDevice,
        t: &MatvecTable<'_>,
        up: Option<(BufView<'_, u64>, Option<BufView<'_, u64>>)>,
        ahead: Option<(BufView<'_, u64>, usize)>,
        y: BufMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "matvec_table";
        nonzero(K, "rows", t.rows)?;
        nonzero(K, "cols", t.cols)?;
        nonzero(K, "matrices", t.matrices)?;
        if t.max_tok == 0 {
            return Ok(());
        }
        t.format.row_bytes(t.cols).ok_or_else(|| {
            CudaError::invalid(K, format!("{:?} rows of {} columns", t.format, t.cols))
        })?;
        need(K, "w_ptrs", t.matrices, t.w_ptrs.len())?;
        need(K, "tok_off", t.matrices, t.tok_off.len())?;
        need(K, "tok_cnt", t.matrices, t.tok_cnt.len())?;
        if t.x_tok_stride < t.cols || t.y_tok_stride < t.rows {
            return Err(CudaError::invalid(K, "token rows overlap"));
        }
        need(K, "x", span(K, &[(0, 0)], t.cols)?, t.x.len())?;
        need(K, "y", span(K, &[(0, 0)], t.rows)?, y.len())?;
        let (s_ptrs, s_block, s_cols) = match (t.format, &t.scale_ptrs) {
            (WeightFormat::F8E4M3, Some((p, block))) => {
                if *block == 0 || !block.is_multiple_of(32) {
                    return Err(CudaError::invalid(
                        K,
                        format!("fp8 block {block} is not a multiple of 32"),
                    ));
                }
                need(K, "scale pointers", t.matrices, p.len())?;
                (p.device_ptr(), *block, t.cols.div_ceil(*block))
            }
            (WeightFormat::F8E4M3, None) => {
                return Err(CudaError::invalid(K, "fp8 weights need their scales"));
            }
            (_, Some(_)) => return Err(CudaError::invalid(K, "scales given for a non-fp8 format")),
            (_, None) => (0, 1, 0),
        };
        let nt = match t.max_tok {
            1 => 1,
            2 => 2,
            3 | 4 => 4,
            _ => 8,
        };
        let gy = t.max_tok.div_ceil(nt);
        if gy > MAX_GRID_YZ || t.matrices > MAX_GRID_YZ {
            return Err(CudaError::invalid(K, "too many tokens or matrices"));
        }
        let (w2_ptrs, s2_ptrs) = match &up {
            None => (0, 0),
            Some((w2, s2)) => {
                need(K, "up w_ptrs", t.matrices, w2.len())?;
                let s2 = match (t.format, s2) {
                    (WeightFormat::F8E4M3, Some(p)) => {
                        need(K, "up scale pointers", t.matrices, p.len())?;
                        p.device_ptr()
                    }
                    (WeightFormat::F8E4M3, None) => {
                        return Err(CudaError::invalid(K, "fp8 up weights need their scales"));
                    }
                    (_, Some(_)) => {
                        return Err(CudaError::invalid(K, "scales given for a non-fp8 format"));
                    }
                    (_, None) => 0,
                };
                (w2.device_ptr(), s2)
            }
        };
        let glu = up.is_some();
        if glu && t.max_tok > GLU_MAX_TOK {
            return Err(CudaError::invalid(
                K,
                format!("a GLU launch takes at most {GLU_MAX_TOK} tokens per matrix"),
            ));
        }
        let (ahead_ptrs, ahead_bytes) = match ahead {
            Some((p, bytes)) if self.down_ahead => {
                need(K, "ahead pointers", t.matrices, p.len())?;
                (p.device_ptr(), bytes as u64)
            }
            _ => (0, 0),
        };
        let mut a = Args::new();
        a.ptr(t.w_ptrs.device_ptr())
            .ptr(s_ptrs)
            .ptr(w2_ptrs)
            .ptr(s2_ptrs)
            .u32(u32_arg(K, "fp8 block", s_block)?)
            .u32(u32_arg(K, "fp8 scale columns", s_cols)?)
            .ptr(t.x.device_ptr())
            .u32(u32_arg(K, "x token stride", t.x_tok_stride)?)
            .ptr(t.x_rows.map_or(0, |(r, _)| r.device_ptr()))
            .u32(u32_arg(
                K,
                "first pair row",
                t.x_rows.map_or(0, |(_, f)| f),
            )?)
            .ptr(t.tok_off.device_ptr())
            .ptr(t.tok_cnt.device_ptr())
            .ptr(y.device_ptr())
            .u32(u32_arg(K, "y token stride", t.y_tok_stride)?)
            .u32(u32_arg(K, "rows", t.rows)?)
            .u32(u32_arg(K, "cols", t.cols)?)
            .ptr(ahead_ptrs)
            .u64(ahead_bytes);
        // SAFETY: 18 arguments in the order and sizes of
        // MATVEC_TABLE_KERNEL in kernels/matvec.cu (ptr, ptr, ptr, ptr, u32,
        // u32, ptr, u32, ptr, u32, ptr, ptr, ptr, u32, u32, u32, ptr, u64);
        // the tables' contents, the token rows and the ahead addresses are
        // the caller's contract (see above).
        unsafe {
            self.launch(
                dev,
                table_kernel(t.format, nt, glu),
                grid(
                    K,
                    t.rows.div_ceil(if glu {
                        glu_rows_per_block(t.format)
                    } else {
                        table_rows_per_block(t.format, nt)
                    }),
                    gy,
                    t.matrices,
                )?,
                MV_THREADS,
                &mut a,
            )
        }
    }

    /// `y += a` elementwise (equal lengths).
    pub fn add_inplace(
        &self,
        dev: &CudaDevice,
        y: BufMut<'_, f32>,
        a: BufView<'_, f32>,
    ) -> Result<()> {
        const K: &str = "add_inplace";
        if y.len() != a.len() {
            return Err(CudaError::invalid(
                K,
                format!("{} += {} elements", y.len(), a.len()),
            ));
        }
        if y.is_empty() {
            return Ok(());
        }
        let mut args = Args::new();
        args.ptr(y.device_ptr())
            .ptr(a.device_ptr())
            .u64(y.len() as u64);
        // SAFETY: 3 arguments as add_inplace in kernels/rows.cu (ptr, ptr,
        // u64); both views hold n elements and are distinct (`&mut`/`&`).
        unsafe {
            self.launch(
                dev,
                "add_inplace",
                grid(K, y.len().div_ceil(RW_THREADS as usize), 1, 1)?,
                RW_THREADS,
                &mut args,
            )
        }
    }

    /// `y[t][i] += b[i]` for `rows` contiguous rows of `b.len()` values.
    pub fn add_bias(
        &self,
        dev: &CudaDevice,
        y: BufMut<'_, f32>,
        b: BufView<'_, f32>,
        rows: usize,
    ) -> Result<()> {
        const K: &str = "add_bias";
        nonzero(K, "rows", rows)?;
        nonzero(K, "cols", b.len())?;
        need(K, "y", span(K, &[(rows, b.len())], 0)?, y.len())?;
        let mut args = Args::new();
        args.ptr(y.device_ptr())
            .ptr(b.device_ptr())
            .u32(u32_arg(K, "cols", b.len())?);
        // SAFETY: 3 arguments as add_bias in kernels/rows.cu (ptr, ptr,
        // u32); rows × cols of y and cols of b checked.
        unsafe {
            self.launch(
                dev,
                "add_bias",
                grid(K, b.len().div_ceil(RW_THREADS as usize), rows, 1)?,
                RW_THREADS,
                &mut args,
            )
        }
    }

    /// `y = clamp(y, -c, c)` elementwise.
    pub fn clamp_inplace(&self, dev: &CudaDevice, y: BufMut<'_, f32>, c: f32) -> Result<()> {
        const K: &str = "clamp_inplace";
        if y.is_empty() {
            return Ok(());
        }
        let mut args = Args::new();
        args.ptr(y.device_ptr()).u64(y.len() as u64).f32(c);
        // SAFETY: 3 arguments as clamp_inplace in kernels/rows.cu (ptr,
        // u64, f32); n elements of y.
        unsafe {
            self.launch(
                dev,
                "clamp_inplace",
                grid(K, y.len().div_ceil(RW_THREADS as usize), 1, 1)?,
                RW_THREADS,
                &mut args,
            )
        }
    }

    /// `dst[r][..cols] = src[idx[r]][..cols]` for every r < `idx.len()`,
    /// row strides in floats.
    ///
    /// # Safety
    /// The device's `idx` must hold values below `src_rows` when the
    /// kernel runs.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gather_rows(
        &self,
        dev: &CudaDevice,
        src: BufView<'_, f32>,
        src_stride: usize,
        src_rows: usize,
        idx: BufView<'_, u32>,
        dst: BufMut<'_, f32>,
        dst_stride: usize,
        cols: usize,
    ) -> Result<()> {
        const K: &str = "gather_rows";
        let rows = idx.len();
        if rows == 0 {
            return Ok(());
        }
        nonzero(K, "cols", cols)?;
        nonzero(K, "src rows", src_rows)?;
        if src_stride < cols || dst_stride < cols {
            return Err(CudaError::invalid(K, "rows overlap (stride < cols)"));
        }
        need(
            K,
            "src",
            span(K, &[(src_rows - 1, src_stride)], cols)?,
            src.len(),
        )?;
        need(
            K,
            "dst",
            span(K, &[(rows - 1, dst_stride)], cols)?,
            dst.len(),
        )?;
        let mut args = Args::new();
        args.ptr(src.device_ptr())
            .u32(u32_arg(K, "src stride", src_stride)?)
            .ptr(idx.device_ptr())
            .ptr(dst.device_ptr())
            .u32(u32_arg(K, "dst stride", dst_stride)?)
            .u32(u32_arg(K, "cols", cols)?);
        // SAFETY: 6 arguments as gather_rows in kernels/rows.cu (ptr, u32,
        // ptr, ptr, u32, u32); dst rows checked, src rows below src_rows
        // checked, indices below src_rows by the caller's contract.
        unsafe {
            self.launch(
                dev,
                "gather_rows",
                grid(K, cols.div_ceil(RW_THREADS as usize), rows, 1)?,
                RW_THREADS,
                &mut args,
            )
        }
    }

    /// `dst[r][..cols] = src[r][..cols]` for `rows` rows, row strides in
    /// floats (views start at the first element copied).
    #[allow(clippy::too_many_arguments)]
    pub fn copy_2d(
        &self,
        dev: &CudaDevice,
        src: BufView<'_, f32>,
        src_stride: usize,
        dst: BufMut<'_, f32>,
        dst_stride: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const K: &str = "copy_2d";
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        if rows > 1 && (dst_stride < cols || src_stride < cols) {
            return Err(CudaError::invalid(K, "rows overlap (stride < cols)"));
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
            span(K, &[(rows - 1, dst_stride)], cols)?,
            dst.len(),
        )?;
        let mut args = Args::new();
        args.ptr(src.device_ptr())
            .u32(u32_arg(K, "src stride", src_stride)?)
            .ptr(dst.device_ptr())
            .u32(u32_arg(K, "dst stride", dst_stride)?)
            .u32(u32_arg(K, "cols", cols)?);
        // SAFETY: 5 arguments as copy_2d in kernels/rows.cu (ptr, u32, ptr,
        // u32, u32); both row ranges checked against their views; the
        // views are distinct borrows (`&` and `&mut`).
        unsafe {
            self.launch(
                dev,
                "copy_2d",
                grid(K, cols.div_ceil(RW_THREADS as usize), rows, 1)?,
                RW_THREADS,
                &mut args,
            )
        }
    }
}
