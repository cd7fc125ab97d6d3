//! Typed launch helpers: one method of [`KernelSet`] per kernel. Each
//! checks that its views, sizes and strides fit together (every pointer
//! range a kernel may touch lies inside its view; 32-bit kernel arguments
//! fit) and launches on the device's compute stream with the kernel's fixed
//! block size — the block size is part of each kernel's reduction order, so
//! no caller can change it.
//!
//! Kernel arguments are passed as 8-byte slots: pointers and `u64`s fill
//! one, a `u32`/`f32` its low half (little-endian), which is what the driver
//! reads for a 4-byte parameter.

use std::ffi::c_void;

use cudarc::driver::{result, sys};

use crate::device::{BufMut, BufView, CudaDevice};
use crate::error::{CudaError, DriverResultExt, Result};
use crate::kernels::KernelSet;

/// How the rows of a weight matrix are stored (the CPU tier's formats).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    Bf16,
    /// FP8 e4m3fn with one f32 scale per `block × block` tile.
    F8E4M3,
    /// ggml Q8_0: 32 × i8 + f16 scale per 34-byte block.
    Q8_0,
    /// ggml Q4_0: 32 × 4 bit + f16 scale per 18-byte block.
    Q4_0,
    /// Q4_0 storage whose products quantize their input to 8-bit blocks and
    /// sum integers: the CPU tier's default arithmetic (`dot_q4_0_q8` of
    /// colibri-model), bit for bit; `Q4_0` is the exact dequantized product.
    Q4_0Q8,
    /// Q8_0 storage with the CPU tier's default arithmetic (`dot_q8_0_q8`
    /// of colibri-model), as `Q4_0Q8` is for Q4_0.
    Q8_0Q8,
    /// ggml Q6_K: super-blocks of 256 elements in 210 bytes (llama.cpp's
    /// output matrices), the exact dequantized product.
    Q6K,
    /// Q6_K storage with the CPU tier's default arithmetic (`dot_q6_k_q8`
    /// of colibri-model).
    Q6KQ8,
    /// ggml Q4_K: super-blocks of 256 elements in 144 bytes (8 sub-blocks
    /// of 32 with 6-bit scales and mins; llama.cpp's Q4_K_M files), the
    /// exact dequantized product.
    Q4K,
    /// Q4_K storage with the CPU tier's default arithmetic (`dot_q4_k_q8`
    /// of colibri-model).
    Q4KQ8,
    /// ggml Q5_K: Q4_K with a fifth bit per element, 176 bytes per
    /// super-block, the exact dequantized product.
    Q5K,
    /// Q5_K storage with the CPU tier's default arithmetic (`dot_q5_k_q8`
    /// of colibri-model).
    Q5KQ8,
    /// ggml Q4_1: 32 × 4 bit, f16 scale and min per 20-byte block, the exact
    /// dequantized product (llama.cpp's fallback for rows that are not whole
    /// 256-element super-blocks, and older files).
    Q4_1,
    /// ggml Q5_0: 32 × 5 bit and an f16 scale per 22-byte block, exact.
    Q5_0,
    /// ggml Q5_1: 32 × 5 bit, f16 scale and min per 24-byte block, exact.
    Q5_1,
    /// ggml Q2_K: super-blocks of 256 elements in 84 bytes (2-bit codes,
    /// 4-bit scales and mins per 16; llama.cpp's Q2_K files), exact.
    Q2K,
    /// ggml Q3_K: super-blocks of 256 elements in 110 bytes (3-bit codes,
    /// 6-bit scales per 16; llama.cpp's Q3_K_S/M/L files), exact.
    Q3K,
    /// ggml IQ4_NL: 32 4-bit indices into a fixed table of 16 values and an
    /// f16 scale per 18-byte block, exact.
    Iq4Nl,
    /// ggml IQ4_XS: IQ4_NL's table in super-blocks of 256 elements (136
    /// bytes, a 6-bit scale per 32), exact.
    Iq4Xs,
    /// ggml Q4_1 storage with the CPU tier's default arithmetic (`dot_q4_1_q8`
    /// of colibri-model).
    Q4_1Q8,
    /// ggml Q5_0 storage with the CPU tier's default arithmetic (`dot_q5_0_q8`
    /// of colibri-model).
    Q5_0Q8,
    /// ggml Q5_1 storage with the CPU tier's default arithmetic (`dot_q5_1_q8`
    /// of colibri-model).
    Q5_1Q8,
    /// ggml Q2_K storage with the CPU tier's default arithmetic (`dot_q2_k_q8`
    /// of colibri-model).
    Q2KQ8,
    /// ggml Q3_K storage with the CPU tier's default arithmetic (`dot_q3_k_q8`
    /// of colibri-model).
    Q3KQ8,
    /// ggml IQ4_NL storage with the CPU tier's default arithmetic (`dot_iq4_nl_q8`
    /// of colibri-model).
    Iq4NlQ8,
    /// ggml IQ4_XS storage with the CPU tier's default arithmetic (`dot_iq4_xs_q8`
    /// of colibri-model).
    Iq4XsQ8,
}

impl WeightFormat {
    /// Bytes of one row of `cols` elements; `None` for a block format whose
    /// rows are not whole blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        match self {
            WeightFormat::F32 => cols.checked_mul(4),
            WeightFormat::F16 | WeightFormat::Bf16 => cols.checked_mul(2),
            WeightFormat::F8E4M3 => Some(cols),
            WeightFormat::Q8_0 | WeightFormat::Q8_0Q8 => {
                cols.is_multiple_of(32).then(|| cols / 32 * 34)
            }
            WeightFormat::Q4_0 | WeightFormat::Q4_0Q8 => {
                cols.is_multiple_of(32).then(|| cols / 32 * 18)
            }
            WeightFormat::Q6K | WeightFormat::Q6KQ8 => {
                cols.is_multiple_of(256).then(|| cols / 256 * 210)
            }
            WeightFormat::Q4K | WeightFormat::Q4KQ8 => {
                cols.is_multiple_of(256).then(|| cols / 256 * 144)
            }
            WeightFormat::Q5K | WeightFormat::Q5KQ8 => {
                cols.is_multiple_of(256).then(|| cols / 256 * 176)
            }
            WeightFormat::Q4_1 | WeightFormat::Q4_1Q8 => {
                cols.is_multiple_of(32).then(|| cols / 32 * 20)
            }
            WeightFormat::Q5_0 | WeightFormat::Q5_0Q8 => {
                cols.is_multiple_of(32).then(|| cols / 32 * 22)
            }
            WeightFormat::Q5_1 | WeightFormat::Q5_1Q8 => {
                cols.is_multiple_of(32).then(|| cols / 32 * 24)
            }
            WeightFormat::Q2K | WeightFormat::Q2KQ8 => {
                cols.is_multiple_of(256).then(|| cols / 256 * 84)
            }
            WeightFormat::Q3K | WeightFormat::Q3KQ8 => {
                cols.is_multiple_of(256).then(|| cols / 256 * 110)
            }
            WeightFormat::Iq4Nl | WeightFormat::Iq4NlQ8 => {
                cols.is_multiple_of(32).then(|| cols / 32 * 18)
            }
            WeightFormat::Iq4Xs | WeightFormat::Iq4XsQ8 => {
                cols.is_multiple_of(256).then(|| cols / 256 * 136)
            }
        }
    }

    /// The format of the same bytes whose products are the exact
    /// dequantized ones (kernels that read single elements, as
    /// `mla_absorb`, know only those).
    pub fn storage(self) -> WeightFormat {
        match self {
            WeightFormat::Q4_0Q8 => WeightFormat::Q4_0,
            WeightFormat::Q8_0Q8 => WeightFormat::Q8_0,
            WeightFormat::Q6KQ8 => WeightFormat::Q6K,
            WeightFormat::Q4KQ8 => WeightFormat::Q4K,
            WeightFormat::Q5KQ8 => WeightFormat::Q5K,
            WeightFormat::Q4_1Q8 => WeightFormat::Q4_1,
            WeightFormat::Q5_0Q8 => WeightFormat::Q5_0,
            WeightFormat::Q5_1Q8 => WeightFormat::Q5_1,
            WeightFormat::Q2KQ8 => WeightFormat::Q2K,
            WeightFormat::Q3KQ8 => WeightFormat::Q3K,
            WeightFormat::Iq4NlQ8 => WeightFormat::Iq4Nl,
            WeightFormat::Iq4XsQ8 => WeightFormat::Iq4Xs,
            f => f,
        }
    }

    /// The FMT_* code of kernels/common.cuh.
    pub(crate) fn code(self) -> u32 {
        match self {
            WeightFormat::F32 => 0,
            WeightFormat::F16 => 1,
            WeightFormat::Bf16 => 2,
            WeightFormat::F8E4M3 => 3,
            WeightFormat::Q8_0 => 4,
            WeightFormat::Q4_0 => 5,
            WeightFormat::Q4_0Q8 => 6,
            WeightFormat::Q8_0Q8 => 7,
            WeightFormat::Q6K => 8,
            WeightFormat::Q6KQ8 => 9,
            WeightFormat::Q4K => 10,
            WeightFormat::Q4KQ8 => 11,
            WeightFormat::Q5K => 12,
            WeightFormat::Q5KQ8 => 13,
            WeightFormat::Q4_1 => 14,
            WeightFormat::Q5_0 => 15,
            WeightFormat::Q5_1 => 16,
            WeightFormat::Q2K => 17,
            WeightFormat::Q3K => 18,
            WeightFormat::Iq4Nl => 19,
            WeightFormat::Iq4Xs => 20,
            WeightFormat::Q4_1Q8 => 21,
            WeightFormat::Q5_0Q8 => 22,
            WeightFormat::Q5_1Q8 => 23,
            WeightFormat::Q2KQ8 => 24,
            WeightFormat::Q3KQ8 => 25,
            WeightFormat::Iq4NlQ8 => 26,
            WeightFormat::Iq4XsQ8 => 27,
        }
    }

    /// The alignment, in bytes, a matrix of this format must start at.
    pub fn alignment(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::F8E4M3 => 1,
            _ => 2,
        }
    }

    fn matvec_kernels(self) -> [&'static str; 4] {
        match self {
            WeightFormat::F32 => [
                "matvec_f32_t1",
                "matvec_f32_t2",
                "matvec_f32_t4",
                "matvec_f32_t8",
            ],
            WeightFormat::F16 => [
                "matvec_f16_t1",
                "matvec_f16_t2",
                "matvec_f16_t4",
                "matvec_f16_t8",
            ],
            WeightFormat::Bf16 => [
                "matvec_bf16_t1",
                "matvec_bf16_t2",
                "matvec_bf16_t4",
                "matvec_bf16_t8",
            ],
            WeightFormat::F8E4M3 => [
                "matvec_f8e4m3_t1",
                "matvec_f8e4m3_t2",
                "matvec_f8e4m3_t4",
                "matvec_f8e4m3_t8",
            ],
            WeightFormat::Q8_0 => [
                "matvec_q8_0_t1",
                "matvec_q8_0_t2",
                "matvec_q8_0_t4",
                "matvec_q8_0_t8",
            ],
            WeightFormat::Q4_0 => [
                "matvec_q4_0_t1",
                "matvec_q4_0_t2",
                "matvec_q4_0_t4",
                "matvec_q4_0_t8",
            ],
            WeightFormat::Q4_0Q8 => [
                "matvec_q4_0q8_t1",
                "matvec_q4_0q8_t2",
                "matvec_q4_0q8_t4",
                "matvec_q4_0q8_t8",
            ],
            WeightFormat::Q8_0Q8 => [
                "matvec_q8_0q8_t1",
                "matvec_q8_0q8_t2",
                "matvec_q8_0q8_t4",
                "matvec_q8_0q8_t8",
            ],
            WeightFormat::Q6K => [
                "matvec_q6_k_t1",
                "matvec_q6_k_t2",
                "matvec_q6_k_t4",
                "matvec_q6_k_t8",
            ],
            WeightFormat::Q6KQ8 => [
                "matvec_q6_kq8_t1",
                "matvec_q6_kq8_t2",
                "matvec_q6_kq8_t4",
                "matvec_q6_kq8_t8",
            ],
            WeightFormat::Q4K => [
                "matvec_q4_k_t1",
                "matvec_q4_k_t2",
                "matvec_q4_k_t4",
                "matvec_q4_k_t8",
            ],
            WeightFormat::Q4KQ8 => [
                "matvec_q4_kq8_t1",
                "matvec_q4_kq8_t2",
                "matvec_q4_kq8_t4",
                "matvec_q4_kq8_t8",
            ],
            WeightFormat::Q5K => [
                "matvec_q5_k_t1",
                "matvec_q5_k_t2",
                "matvec_q5_k_t4",
                "matvec_q5_k_t8",
            ],
            WeightFormat::Q5KQ8 => [
                "matvec_q5_kq8_t1",
                "matvec_q5_kq8_t2",
                "matvec_q5_kq8_t4",
                "matvec_q5_kq8_t8",
            ],
            WeightFormat::Q4_1 => [
                "matvec_q4_1_t1",
                "matvec_q4_1_t2",
                "matvec_q4_1_t4",
                "matvec_q4_1_t8",
            ],
            WeightFormat::Q5_0 => [
                "matvec_q5_0_t1",
                "matvec_q5_0_t2",
                "matvec_q5_0_t4",
                "matvec_q5_0_t8",
            ],
            WeightFormat::Q5_1 => [
                "matvec_q5_1_t1",
                "matvec_q5_1_t2",
                "matvec_q5_1_t4",
                "matvec_q5_1_t8",
            ],
            WeightFormat::Q2K => [
                "matvec_q2_k_t1",
                "matvec_q2_k_t2",
                "matvec_q2_k_t4",
                "matvec_q2_k_t8",
            ],
            WeightFormat::Q3K => [
                "matvec_q3_k_t1",
                "matvec_q3_k_t2",
                "matvec_q3_k_t4",
                "matvec_q3_k_t8",
            ],
            WeightFormat::Iq4Nl => [
                "matvec_iq4_nl_t1",
                "matvec_iq4_nl_t2",
                "matvec_iq4_nl_t4",
                "matvec_iq4_nl_t8",
            ],
            WeightFormat::Iq4Xs => [
                "matvec_iq4_xs_t1",
                "matvec_iq4_xs_t2",
                "matvec_iq4_xs_t4",
                "matvec_iq4_xs_t8",
            ],
            WeightFormat::Q4_1Q8 => [
                "matvec_q4_1q8_t1",
                "matvec_q4_1q8_t2",
                "matvec_q4_1q8_t4",
                "matvec_q4_1q8_t8",
            ],
            WeightFormat::Q5_0Q8 => [
                "matvec_q5_0q8_t1",
                "matvec_q5_0q8_t2",
                "matvec_q5_0q8_t4",
                "matvec_q5_0q8_t8",
            ],
            WeightFormat::Q5_1Q8 => [
                "matvec_q5_1q8_t1",
                "matvec_q5_1q8_t2",
                "matvec_q5_1q8_t4",
                "matvec_q5_1q8_t8",
            ],
            WeightFormat::Q2KQ8 => [
                "matvec_q2_kq8_t1",
                "matvec_q2_kq8_t2",
                "matvec_q2_kq8_t4",
                "matvec_q2_kq8_t8",
            ],
            WeightFormat::Q3KQ8 => [
                "matvec_q3_kq8_t1",
                "matvec_q3_kq8_t2",
                "matvec_q3_kq8_t4",
                "matvec_q3_kq8_t8",
            ],
            WeightFormat::Iq4NlQ8 => [
                "matvec_iq4_nlq8_t1",
                "matvec_iq4_nlq8_t2",
                "matvec_iq4_nlq8_t4",
                "matvec_iq4_nlq8_t8",
            ],
            WeightFormat::Iq4XsQ8 => [
                "matvec_iq4_xsq8_t1",
                "matvec_iq4_xsq8_t2",
                "matvec_iq4_xsq8_t4",
                "matvec_iq4_xsq8_t8",
            ],
        }
    }
}

impl WeightFormat {
    /// The persistent one-token kernel for tall matrices of this format
    /// (`matvec_stream_body` in kernels/matvec.cu), if it has one.
    fn matvec_stream_kernel(self) -> Option<&'static str> {
        match self {
            WeightFormat::F16 => Some("matvec_f16_stream_t1"),
            WeightFormat::Bf16 => Some("matvec_bf16_stream_t1"),
            _ => None,
        }
    }

    /// The one-token kernel of [`KernelSet::matvec_seg`].
    fn matvec_seg_kernel(self) -> &'static str {
        match self {
            WeightFormat::F32 => "matvec_f32_seg_t1",
            WeightFormat::F16 => "matvec_f16_seg_t1",
            WeightFormat::Bf16 => "matvec_bf16_seg_t1",
            WeightFormat::F8E4M3 => "matvec_f8e4m3_seg_t1",
            WeightFormat::Q8_0 => "matvec_q8_0_seg_t1",
            WeightFormat::Q4_0 => "matvec_q4_0_seg_t1",
            WeightFormat::Q4_0Q8 => "matvec_q4_0q8_seg_t1",
            WeightFormat::Q8_0Q8 => "matvec_q8_0q8_seg_t1",
            WeightFormat::Q6K => "matvec_q6_k_seg_t1",
            WeightFormat::Q6KQ8 => "matvec_q6_kq8_seg_t1",
            WeightFormat::Q4K => "matvec_q4_k_seg_t1",
            WeightFormat::Q4KQ8 => "matvec_q4_kq8_seg_t1",
            WeightFormat::Q5K => "matvec_q5_k_seg_t1",
            WeightFormat::Q5KQ8 => "matvec_q5_kq8_seg_t1",
            WeightFormat::Q4_1 => "matvec_q4_1_seg_t1",
            WeightFormat::Q5_0 => "matvec_q5_0_seg_t1",
            WeightFormat::Q5_1 => "matvec_q5_1_seg_t1",
            WeightFormat::Q2K => "matvec_q2_k_seg_t1",
            WeightFormat::Q3K => "matvec_q3_k_seg_t1",
            WeightFormat::Iq4Nl => "matvec_iq4_nl_seg_t1",
            WeightFormat::Iq4Xs => "matvec_iq4_xs_seg_t1",
            WeightFormat::Q4_1Q8 => "matvec_q4_1q8_seg_t1",
            WeightFormat::Q5_0Q8 => "matvec_q5_0q8_seg_t1",
            WeightFormat::Q5_1Q8 => "matvec_q5_1q8_seg_t1",
            WeightFormat::Q2KQ8 => "matvec_q2_kq8_seg_t1",
            WeightFormat::Q3KQ8 => "matvec_q3_kq8_seg_t1",
            WeightFormat::Iq4NlQ8 => "matvec_iq4_nlq8_seg_t1",
            WeightFormat::Iq4XsQ8 => "matvec_iq4_xsq8_seg_t1",
        }
    }
}

/// The block scales of an FP8 matrix: `ceil(rows / block) × ceil(cols /
/// block)` f32s, row-major. `block` must be a multiple of 32. A view into a
/// larger matrix must start at a row that is a multiple of `block`.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Scales<'a> {
    pub scales: BufView<'a, f32>,
    pub block: usize,
}

/// A weight matrix in device memory.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    /// The rows, back to back (`format.row_bytes(cols)` each).
    pub data: BufView<'a, u8>,
    /// Required for (and only for) [`WeightFormat::F8E4M3`].
    pub fp8: Option<Fp8Scales<'a>>,
}

/// A matrix-vector product over a strided group of equally shaped matrices
/// (grid.z), each applied to its own `ntok` input rows: matrix z reads
/// `x[z·x_mat_stride + t·x_tok_stride ..][..cols]` and writes
/// `y[z·y_mat_stride + t·y_tok_stride ..][..rows]`.
#[derive(Clone, Copy, Debug)]
pub struct MatvecGroup<'a> {
    /// Matrix 0 (its `data` view must hold all `matrices`).
    pub w: WeightView<'a>,
    pub matrices: usize,
    /// Bytes from one matrix to the next.
    pub w_stride: usize,
    /// f32s from one matrix's FP8 scale grid to the next.
    pub scale_stride: usize,
    pub x: BufView<'a, f32>,
    pub x_tok_stride: usize,
    pub x_mat_stride: usize,
    pub ntok: usize,
    pub y_tok_stride: usize,
    pub y_mat_stride: usize,
}

impl<'a> MatvecGroup<'a> {
    /// `ntok` contiguous rows of x (`[ntok][cols]`) through one matrix into
    /// contiguous rows of y (`[ntok][rows]`).
    pub fn one(w: WeightView<'a>, x: BufView<'a, f32>, ntok: usize) -> MatvecGroup<'a> {
        MatvecGroup {
            w,
            matrices: 1,
            w_stride: 0,
            scale_stride: 0,
            x,
            x_tok_stride: w.cols,
            x_mat_stride: 0,
            ntok,
            y_tok_stride: w.rows,
            y_mat_stride: 0,
        }
    }
}

/// Rotary tables: `cos`/`sin` hold `rot_dim / 2` values per position for
/// `positions` positions (YaRN's attention factor already multiplied in).
#[derive(Clone, Copy, Debug)]
pub struct RopeTable<'a> {
    pub cos: BufView<'a, f32>,
    pub sin: BufView<'a, f32>,
    pub rot_dim: usize,
    pub positions: usize,
    /// DeepSeek's interleaved pairs (written de-interleaved).
    pub interleaved: bool,
}

/// Where one part of the cached keys or values lies: element
/// `slot · slot_stride + kv_head · head_stride + d`.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    pub data: BufView<'a, f32>,
    pub slot_stride: usize,
    pub head_stride: usize,
}

/// Attention of `rows` query rows over a KV cache (see
/// kernels/attention.cu). Row i attends to cache slots
/// `slot0[i] + t` for t in `window_start ..= pos[i]`; the cache must hold
/// `capacity` slots in every view. GQA: `key_b = None`, `dim_b = 0`. MLA:
/// `key_a` = the latent cache, `key_b` = the rotary key cache, `value` =
/// the latent cache, `group = heads`.
#[derive(Clone, Copy, Debug)]
pub struct Attention<'a> {
    /// `[rows][heads][dim_a + dim_b]`.
    pub q: BufView<'a, f32>,
    pub rows: usize,
    pub heads: usize,
    pub dim_a: usize,
    pub dim_b: usize,
    pub dim_v: usize,
    /// Query heads per KV head.
    pub group: usize,
    pub key_a: KvView<'a>,
    pub key_b: Option<KvView<'a>>,
    pub value: KvView<'a>,
    pub capacity: usize,
    pub pos: BufView<'a, u32>,
    pub slot0: BufView<'a, u32>,
    pub window: Option<usize>,
    pub scale: f32,
}

/// Positions per attention chunk (`AT_CHUNK` in kernels/attention.cu):
/// the online softmax merges chunks aligned to position 0.
pub const ATTENTION_CHUNK: usize = 256;

/// Where [`KernelSet::attention_split`] keeps its chunk records.
pub struct AttentionSplit<'a> {
    /// Blocks per (row, head); block z forms chunks z, z + blocks, ….
    pub blocks: usize,
    /// Chunks a (row, head) may have (rows with more get NaN).
    pub chunk_cap: usize,
    /// At least [`attention_split_records`] floats.
    pub records: BufMut<'a, f32>,
    /// `rows·heads` counters, zero before and after each launch.
    pub counters: BufMut<'a, u32>,
    /// The output quantized as well: each row's `heads·dim_v` values as a
    /// Q8 row ([`q8_row_bytes`] apart; `dim_v` a multiple of 32), for the
    /// output projection to copy ([`KernelSet::matvec_from_q8`]).
    pub out_q8: Option<BufMut<'a, u8>>,
}

/// Floats of chunk records [`KernelSet::attention_split`] needs.
pub fn attention_split_records(
    rows: usize,
    heads: usize,
    dim_v: usize,
    chunk_cap: usize,
) -> Option<usize> {
    rows.checked_mul(heads)?
        .checked_mul(chunk_cap)?
        .checked_mul(dim_v.checked_add(2)?)
}

/// Bytes between consecutive Q8 rows: a row of `n` activations (a
/// multiple of 32) quantized once by the kernel that produces it, for the
/// 8-bit-activation products that read it (`q8_row_bytes` and the layout
/// in kernels/common.cuh): n/2 bytes of low quants, n/2 of high ones, n/32
/// f32 scales and n/32 i32 sums, padded to 16 bytes.
pub fn q8_row_bytes(n: usize) -> usize {
    (n + n / 4).next_multiple_of(16)
}

/// Checks a Q8 buffer for `rows` rows of `n` activations.
fn check_q8(kernel: &'static str, q: u64, len: usize, rows: usize, n: usize) -> Result<()> {
    if !n.is_multiple_of(32) {
        return Err(CudaError::invalid(
            kernel,
            format!("8-bit rows need whole blocks of 32, not {n} values"),
        ));
    }
    if !q.is_multiple_of(16) {
        return Err(CudaError::invalid(
            kernel,
            "8-bit rows must be 16-byte aligned",
        ));
    }
    need(
        kernel,
        "8-bit rows",
        span(kernel, &[(rows, q8_row_bytes(n))], 0)?,
        len,
    )
}

/// The kernels' block sizes (see the .cu files).
/// Rows a block of the strided-group matvec owns: 8 warps of 1 row for
/// one token (2 for f32), of 4 for more (MV_PLAIN_ROWS_PER_WARP in
/// kernels/matvec.cu).
fn mv_rows_per_block(format: WeightFormat, nt: usize) -> usize {
    8 * match (nt, format) {
        (1, WeightFormat::F32) => 2,
        (1, _) => 1,
        _ => 4,
    }
}
const MV_THREADS: u32 = 256;
/// The stream kernels' limits (MV_STREAM_MAX_COLS, MV_STREAM_BLOCKS_PER_SM
/// in kernels/matvec.cu).
const MV_STREAM_MAX_COLS: usize = 8192;
const MV_STREAM_BLOCKS_PER_SM: usize = 2;
/// A matrix streams when every warp of the persistent grid gets at least
/// this many rows; shorter ones (a router, a layer's projections) are
/// latency-bound and keep a block per 8 rows.
const MV_STREAM_MIN_ROWS_PER_WARP: usize = 4;
const RN_THREADS: u32 = 256;
const RP_THREADS: u32 = 64;
const RP_MAX_DIM: usize = 1024;
const EW_THREADS: u32 = 256;
const CB_MAX_K: usize = 64;
const AT_THREADS: u32 = 512;
const AT_MAX_DQ: usize = 640;
const AT_MAX_DV: usize = 512;
const AB_THREADS: u32 = 256;
const AB_MAX_DN: usize = 512;
const RT_MAX_E: usize = 1024;
const RT_MAX_K: usize = 64;
const MAX_GRID_YZ: usize = 65535;
const MAX_GRID_X: usize = i32::MAX as usize;

/// Kernel arguments as 8-byte slots (see the module docs).
pub(crate) struct Args {
    slots: [u64; 28],
    n: usize,
}

impl Args {
    pub(crate) fn new() -> Args {
        Args {
            slots: [0; 28],
            n: 0,
        }
    }
    fn push(&mut self, v: u64) -> &mut Args {
        self.slots[self.n] = v;
        self.n += 1;
        self
    }
    pub(crate) fn ptr(&mut self, p: u64) -> &mut Args {
        self.push(p)
    }
    pub(crate) fn u32(&mut self, v: u32) -> &mut Args {
        self.push(v as u64)
    }
    pub(crate) fn u64(&mut self, v: u64) -> &mut Args {
        self.push(v)
    }
    pub(crate) fn f32(&mut self, v: f32) -> &mut Args {
        self.push(v.to_bits() as u64)
    }
}

pub(crate) fn u32_arg(kernel: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v)
        .map_err(|_| CudaError::invalid(kernel, format!("{what} = {v} does not fit in 32 bits")))
}

/// `a·b + c` with overflow as an error.
pub(crate) fn span(kernel: &'static str, terms: &[(usize, usize)], plus: usize) -> Result<usize> {
    let mut total = plus;
    for &(a, b) in terms {
        total = a
            .checked_mul(b)
            .and_then(|p| p.checked_add(total))
            .ok_or_else(|| CudaError::invalid(kernel, "sizes overflow"))?;
    }
    Ok(total)
}

pub(crate) fn need(kernel: &'static str, what: &str, needed: usize, have: usize) -> Result<()> {
    if needed > have {
        return Err(CudaError::invalid(
            kernel,
            format!("{what} needs {needed} elements, its view has {have}"),
        ));
    }
    Ok(())
}

pub(crate) fn nonzero(kernel: &'static str, what: &str, v: usize) -> Result<()> {
    if v == 0 {
        return Err(CudaError::invalid(kernel, format!("{what} is 0")));
    }
    Ok(())
}

pub(crate) fn grid(kernel: &'static str, x: usize, y: usize, z: usize) -> Result<(u32, u32, u32)> {
    if x == 0 || y == 0 || z == 0 || x > MAX_GRID_X || y > MAX_GRID_YZ || z > MAX_GRID_YZ {
        return Err(CudaError::invalid(
            kernel,
            format!("grid ({x}, {y}, {z}) out of range"),
        ));
    }
    Ok((x as u32, y as u32, z as u32))
}

/// Checks a [`MatvecGroup`] launch against its views (every range a kernel
/// may touch lies inside them, outputs do not overlap) and returns the FP8
/// scale pointer, scale block and scale columns (0, 1, 0 without scales).
fn check_group(g: &MatvecGroup<'_>, y: &BufMut<'_, f32>) -> Result<(u64, usize, usize)> {
    const K: &str = "matvec";
    let w = &g.w;
    nonzero(K, "rows", w.rows)?;
    nonzero(K, "cols", w.cols)?;
    nonzero(K, "ntok", g.ntok)?;
    nonzero(K, "matrices", g.matrices)?;
    let rb = w.format.row_bytes(w.cols).ok_or_else(|| {
        CudaError::invalid(
            K,
            format!(
                "{:?} rows of {} columns are not whole 32-blocks",
                w.format, w.cols
            ),
        )
    })?;
    let mat_bytes = span(K, &[(w.rows, rb)], 0)?;
    need(
        K,
        "weights",
        span(K, &[(g.matrices - 1, g.w_stride)], mat_bytes)?,
        w.data.len(),
    )?;
    let align = w.format.alignment() as u64;
    if !w.data.device_ptr().is_multiple_of(align)
        || (g.matrices > 1 && !(g.w_stride as u64).is_multiple_of(align))
    {
        return Err(CudaError::invalid(
            K,
            format!("{:?} weights must be {align}-byte aligned", w.format),
        ));
    }
    let scales = match (w.format, &w.fp8) {
        (WeightFormat::F8E4M3, Some(s)) => {
            if s.block == 0 || !s.block.is_multiple_of(32) {
                return Err(CudaError::invalid(
                    K,
                    format!("fp8 block {} is not a multiple of 32", s.block),
                ));
            }
            let (sr, sc) = (w.rows.div_ceil(s.block), w.cols.div_ceil(s.block));
            need(
                K,
                "fp8 scales",
                span(K, &[(g.matrices - 1, g.scale_stride), (sr, sc)], 0)?,
                s.scales.len(),
            )?;
            (s.scales.device_ptr(), s.block, sc)
        }
        (WeightFormat::F8E4M3, None) => {
            return Err(CudaError::invalid(K, "fp8 weights need their scales"));
        }
        (_, Some(_)) => return Err(CudaError::invalid(K, "scales given for a non-fp8 format")),
        (_, None) => (0, 1, 0),
    };
    need(
        K,
        "x",
        span(
            K,
            &[
                (g.matrices - 1, g.x_mat_stride),
                (g.ntok - 1, g.x_tok_stride),
            ],
            w.cols,
        )?,
        g.x.len(),
    )?;
    need(
        K,
        "y",
        span(
            K,
            &[
                (g.matrices - 1, g.y_mat_stride),
                (g.ntok - 1, g.y_tok_stride),
            ],
            w.rows,
        )?,
        y.len(),
    )?;
    // Outputs must not overlap: one of the two strides nests the other.
    let tok_span = span(K, &[(g.ntok - 1, g.y_tok_stride)], w.rows)?;
    let mat_span = span(K, &[(g.matrices - 1, g.y_mat_stride)], w.rows)?;
    let disjoint = (g.ntok == 1 || g.y_tok_stride >= w.rows)
        && (g.matrices == 1 || g.y_mat_stride >= tok_span || g.y_tok_stride >= mat_span);
    if !disjoint {
        return Err(CudaError::invalid(K, "y strides make outputs overlap"));
    }
    Ok(scales)
}

/// The arguments `attention` and `attention_split` share (all but `out`,
/// which is checked), after checking `at`.
fn attention_args(kernel: &'static str, at: &Attention<'_>, out: &BufMut<'_, f32>) -> Result<Args> {
    nonzero(kernel, "rows", at.rows)?;
    nonzero(kernel, "heads", at.heads)?;
    nonzero(kernel, "dim_a", at.dim_a)?;
    nonzero(kernel, "dim_v", at.dim_v)?;
    nonzero(kernel, "group", at.group)?;
    nonzero(kernel, "capacity", at.capacity)?;
    if !at.heads.is_multiple_of(at.group) {
        return Err(CudaError::invalid(
            kernel,
            format!("{} heads in groups of {}", at.heads, at.group),
        ));
    }
    let dq = at.dim_a + at.dim_b;
    if dq > AT_MAX_DQ || at.dim_v > AT_MAX_DV {
        return Err(CudaError::invalid(
            kernel,
            format!("query dim {dq} > {AT_MAX_DQ} or value dim > {AT_MAX_DV}"),
        ));
    }
    if (at.dim_b == 0) != at.key_b.is_none() {
        return Err(CudaError::invalid(
            kernel,
            "key_b must be given exactly when dim_b > 0",
        ));
    }
    need(
        kernel,
        "q",
        span(kernel, &[(at.rows, at.heads), (0, 0)], 0)
            .and_then(|rh| span(kernel, &[(rh, dq)], 0))?,
        at.q.len(),
    )?;
    let kv_heads = at.heads / at.group;
    let check_kv = |what: &str, v: &KvView<'_>, dim: usize| -> Result<()> {
        need(
            kernel,
            what,
            span(
                kernel,
                &[
                    (at.capacity - 1, v.slot_stride),
                    (kv_heads - 1, v.head_stride),
                ],
                dim,
            )?,
            v.data.len(),
        )
    };
    check_kv("key_a", &at.key_a, at.dim_a)?;
    if let Some(kb) = &at.key_b {
        check_kv("key_b", kb, at.dim_b)?;
    }
    check_kv("value", &at.value, at.dim_v)?;
    need(kernel, "pos", at.rows, at.pos.len())?;
    need(kernel, "slot0", at.rows, at.slot0.len())?;
    need(
        kernel,
        "out",
        span(kernel, &[(at.rows, at.heads), (0, 0)], 0)
            .and_then(|rh| span(kernel, &[(rh, at.dim_v)], 0))?,
        out.len(),
    )?;
    let kb = at.key_b.unwrap_or(KvView {
        data: at.key_a.data,
        slot_stride: 0,
        head_stride: 0,
    });
    let mut a = Args::new();
    a.ptr(at.q.device_ptr())
        .u32(u32_arg(kernel, "heads", at.heads)?)
        .u32(at.dim_a as u32)
        .u32(at.dim_b as u32)
        .ptr(at.key_a.data.device_ptr())
        .u32(u32_arg(kernel, "key_a slot stride", at.key_a.slot_stride)?)
        .u32(u32_arg(kernel, "key_a head stride", at.key_a.head_stride)?)
        .ptr(kb.data.device_ptr())
        .u32(u32_arg(kernel, "key_b slot stride", kb.slot_stride)?)
        .u32(u32_arg(kernel, "key_b head stride", kb.head_stride)?)
        .ptr(at.value.data.device_ptr())
        .u32(u32_arg(kernel, "value slot stride", at.value.slot_stride)?)
        .u32(u32_arg(kernel, "value head stride", at.value.head_stride)?)
        .u32(at.dim_v as u32)
        .u32(u32_arg(kernel, "group", at.group)?)
        .ptr(at.pos.device_ptr())
        .ptr(at.slot0.device_ptr())
        .u32(u32_arg(kernel, "capacity", at.capacity)?)
        .u32(u32_arg(kernel, "window", at.window.unwrap_or(0))?)
        .f32(at.scale);
    Ok(a)
}

impl KernelSet {
    /// # Safety
    /// `args` must match the parameter list of kernel `name` in count, order
    /// and size, and every pointer in it must be valid for everything the
    /// kernel reads or writes through it.
    pub(crate) unsafe fn launch(
        &self,
        dev: &CudaDevice,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut Args,
    ) -> Result<()> {
        let f = self.function(name)?;
        dev.context().bind_to_thread().op("cuCtxSetCurrent")?;
        dev.count_launch();
        let mut params: Vec<*mut c_void> = args.slots[..args.n]
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        if self.pdl {
            // Programmatic dependent launch: every kernel waits for its
            // predecessor's completion itself (`pdl_entry()` in
            // kernels/common.cuh, checked for every kernel by
            // kernels::tests), so it may be scheduled while that predecessor
            // still runs.
            // SAFETY: a zeroed attribute value is a valid union (plain
            // integers and arrays); only the programmatic-serialization
            // field is read for this attribute id.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: 0,
                hStream: dev.compute_stream().cu_stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as for cuLaunchKernel below; `config` and `attr` live
            // across the call (the driver copies them).
            return unsafe {
                sys::cuLaunchKernelEx(
                    &config,
                    f.cu_function(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
            .op("cuLaunchKernelEx");
        }
        // SAFETY: the caller vouches for the arguments; `params` points into
        // `args`, which outlives the call (the driver copies the values at
        // launch).
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                grid,
                (block, 1, 1),
                0,
                dev.compute_stream().cu_stream(),
                &mut params,
            )
        }
        .op("cuLaunchKernel")
    }

    /// `y[t][r] = dot(W[r], x[t])` for `ntok` contiguous rows of x
    /// (`[ntok][cols]`) into y (`[ntok][rows]`).
    pub fn matvec(
        &self,
        dev: &CudaDevice,
        w: &WeightView<'_>,
        x: BufView<'_, f32>,
        ntok: usize,
        y: BufMut<'_, f32>,
    ) -> Result<()> {
        self.matvec_group(dev, &MatvecGroup::one(*w, x, ntok), y)
    }

    /// One token through one to three matrices of the same format and
    /// width (a layer's q, k and v projections) in one launch: each output
    /// gets exactly what [`KernelSet::matvec`] gives for its matrix (the
    /// same device function on the same block shape).
    pub fn matvec_seg(
        &self,
        dev: &CudaDevice,
        x: BufView<'_, f32>,
        mats: Vec<(WeightView<'_>, BufMut<'_, f32>)>,
    ) -> Result<()> {
        const K: &str = "matvec_seg";
        if mats.is_empty() || mats.len() > 3 {
            return Err(CudaError::invalid(K, "one to three matrices"));
        }
        let (format, cols) = (mats[0].0.format, mats[0].0.cols);
        let mut segs = [(0u64, 0u64, 0u64, 0usize); 3];
        let mut scale_geom = None;
        let mut ends = [0usize; 3];
        let mut blocks = 0usize;
        for (i, (w, y)) in mats.iter().enumerate() {
            if w.format != format || w.cols != cols {
                return Err(CudaError::invalid(K, "matrices differ in format or width"));
            }
            let g = MatvecGroup::one(*w, x, 1);
            let (sp, sb, sc) = check_group(&g, y)?;
            if scale_geom.is_some_and(|geom| geom != (sb, sc)) {
                return Err(CudaError::invalid(K, "matrices differ in fp8 scale block"));
            }
            scale_geom = Some((sb, sc));
            segs[i] = (w.data.device_ptr(), sp, y.device_ptr(), w.rows);
            blocks += w.rows.div_ceil(mv_rows_per_block(format, 1));
            ends[i] = blocks;
        }
        let (s_block, s_cols) = scale_geom.unwrap_or((1, 0));
        let n = mats.len();
        let mut a = Args::new();
        for &(w, sp, y, rows) in &segs {
            a.ptr(w).ptr(sp).ptr(y).u32(u32_arg(K, "rows", rows)?);
        }
        // Blocks [0, b1) serve matrix 0, [b1, b2) matrix 1, the rest matrix 2.
        a.u32(u32_arg(K, "blocks", ends[0])?)
            .u32(u32_arg(K, "blocks", if n > 1 { ends[1] } else { blocks })?)
            .u32(u32_arg(K, "fp8 block", s_block)?)
            .u32(u32_arg(K, "fp8 scale columns", s_cols)?)
            .ptr(x.device_ptr())
            .u32(u32_arg(K, "cols", cols)?);
        // SAFETY: 18 arguments in the order and sizes of MATVEC_SEG_KERNEL in
        // kernels/matvec.cu (3 × (ptr, ptr, ptr, u32), u32, u32, u32, u32,
        // ptr, u32); every matrix, its scales, x and its y were checked
        // above as a one-token matvec; absent matrices have no blocks.
        unsafe {
            self.launch(
                dev,
                format.matvec_seg_kernel(),
                grid(K, blocks, 1, 1)?,
                MV_THREADS,
                &mut a,
            )
        }
    }

    /// Whether a one-token product through `w` takes the persistent
    /// stream kernel (a tall f16/bf16 matrix such as an LM head) rather
    /// than the plain launch: the same bits either way.
    pub fn matvec_streams(&self, dev: &CudaDevice, w: &WeightView<'_>, ntok: usize) -> bool {
        let warps = dev.info().multiprocessors as usize * MV_STREAM_BLOCKS_PER_SM * 8;
        self.stream
            && w.format.matvec_stream_kernel().is_some()
            && ntok == 1
            && w.cols.is_multiple_of(32)
            && w.cols <= MV_STREAM_MAX_COLS
            && w.data.device_ptr().is_multiple_of(16)
            && warps > 0
            && w.rows >= warps * MV_STREAM_MIN_ROWS_PER_WARP
    }

    /// One token through `w`, as [`KernelSet::matvec`] gives it, with x's
    /// Q8 row (written by the kernel that produced x: `attention_split`'s
    /// `out_q8`), which the 8-bit-activation formats copy instead of
    /// quantizing x again in each block: the same bits. The caller vouches
    /// that `xq` is x's.
    pub fn matvec_from_q8(
        &self,
        dev: &CudaDevice,
        w: &WeightView<'_>,
        x: BufView<'_, f32>,
        xq: BufView<'_, u8>,
        y: BufMut<'_, f32>,
    ) -> Result<()> {
        check_q8("matvec", xq.device_ptr(), xq.len(), 1, w.cols)?;
        self.group_launch(dev, &MatvecGroup::one(*w, x, 1), Some(xq), y)
    }

    /// The grouped matrix-vector product of [`MatvecGroup`].
    pub fn matvec_group(
        &self,
        dev: &CudaDevice,
        g: &MatvecGroup<'_>,
        y: BufMut<'_, f32>,
    ) -> Result<()> {
        self.group_launch(dev, g, None, y)
    }

    /// `matvec_group`, with x's Q8 row for a one-token product of one
    /// matrix (checked by the caller).
    fn group_launch(
        &self,
        dev: &CudaDevice,
        g: &MatvecGroup<'_>,
        xq: Option<BufView<'_, u8>>,
        y: BufMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "matvec";
        if xq.is_some() && (g.ntok != 1 || g.matrices != 1) {
            return Err(CudaError::invalid(K, "a Q8 row is one token of one matrix"));
        }
        let w = &g.w;
        let (scales_ptr, s_block, s_cols) = check_group(g, &y)?;
        let streams = g.matrices == 1
            && g.x.device_ptr().is_multiple_of(16)
            && self.matvec_streams(dev, w, g.ntok);
        if let Some(name) = w.format.matvec_stream_kernel().filter(|_| streams) {
            let blocks = (dev.info().multiprocessors as usize * MV_STREAM_BLOCKS_PER_SM)
                .min(w.rows.div_ceil(8));
            let mut a = Args::new();
            a.ptr(w.data.device_ptr())
                .ptr(g.x.device_ptr())
                .ptr(y.device_ptr())
                .u32(u32_arg(K, "rows", w.rows)?)
                .u32(u32_arg(K, "cols", w.cols)?);
            // SAFETY: 5 arguments in the order and sizes of
            // MATVEC_STREAM_KERNEL in kernels/matvec.cu (ptr, ptr, ptr,
            // u32, u32); the weights, x and y were checked above as a
            // one-token product of one matrix; the kernel reads whole
            // 16-byte-aligned groups (cols % 32 == 0, the matrix and x
            // 16-byte aligned, checked here).
            return unsafe { self.launch(dev, name, grid(K, blocks, 1, 1)?, MV_THREADS, &mut a) };
        }
        let (nt, name) = match g.ntok {
            1 => (1, w.format.matvec_kernels()[0]),
            2 => (2, w.format.matvec_kernels()[1]),
            3 | 4 => (4, w.format.matvec_kernels()[2]),
            _ => (8, w.format.matvec_kernels()[3]),
        };
        let grid = grid(
            K,
            w.rows.div_ceil(mv_rows_per_block(w.format, nt)),
            g.ntok.div_ceil(nt),
            g.matrices,
        )?;
        let mut a = Args::new();
        a.ptr(w.data.device_ptr())
            .u64(g.w_stride as u64)
            .ptr(scales_ptr)
            .u64(g.scale_stride as u64)
            .u32(u32_arg(K, "fp8 block", s_block)?)
            .u32(u32_arg(K, "fp8 scale columns", s_cols)?)
            .ptr(g.x.device_ptr())
            .u64(g.x_mat_stride as u64)
            .u32(u32_arg(K, "x token stride", g.x_tok_stride)?)
            .ptr(y.device_ptr())
            .u64(g.y_mat_stride as u64)
            .u32(u32_arg(K, "y token stride", g.y_tok_stride)?)
            .u32(u32_arg(K, "rows", w.rows)?)
            .u32(u32_arg(K, "cols", w.cols)?)
            .u32(u32_arg(K, "ntok", g.ntok)?)
            .ptr(xq.map_or(0, |q| q.device_ptr()));
        // SAFETY: 16 arguments in the order and sizes of MATVEC_KERNEL in
        // kernels/matvec.cu (ptr, u64, ptr, u64, u32, u32, ptr, u64, u32,
        // ptr, u64, u32, u32, u32, u32, ptr); weights, scales, x and y
        // ranges were checked above against their views (weights may be
        // read up to 3 bytes past the view, inside the allocation's
        // padding), xq (one token of one matrix) by the caller.
        unsafe { self.launch(dev, name, grid, MV_THREADS, &mut a) }
    }

    /// RMSNorm of `rows` contiguous rows of `n` values: `y = w · x ·
    /// rsqrt(mean(x²) + eps)`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        dev: &CudaDevice,
        x: BufView<'_, f32>,
        w: BufView<'_, f32>,
        y: BufMut<'_, f32>,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<()> {
        // SAFETY (of the call): x and y are distinct views (`&` vs `&mut`).
        self.rms_norm_raw(
            dev,
            x.device_ptr(),
            x.len(),
            w,
            y.device_ptr(),
            y.len(),
            rows,
            n,
            eps,
        )
    }

    /// In-place RMSNorm (see [`Self::rms_norm`]).
    pub fn rms_norm_inplace(
        &self,
        dev: &CudaDevice,
        x: BufMut<'_, f32>,
        w: BufView<'_, f32>,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<()> {
        self.rms_norm_raw(
            dev,
            x.device_ptr(),
            x.len(),
            w,
            x.device_ptr(),
            x.len(),
            rows,
            n,
            eps,
        )
    }

    /// In-place RMSNorm of the first `n` values of `rows` rows that lie
    /// `stride` floats apart (a column slice, e.g. MLA's latent part of
    /// each `[latent | rope]` row).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_strided_inplace(
        &self,
        dev: &CudaDevice,
        x: BufMut<'_, f32>,
        stride: usize,
        w: BufView<'_, f32>,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<()> {
        const K: &str = "rms_norm";
        nonzero(K, "n", n)?;
        nonzero(K, "rows", rows)?;
        if stride < n {
            return Err(CudaError::invalid(K, "rows overlap (stride < n)"));
        }
        need(K, "x", span(K, &[(rows - 1, stride)], n)?, x.len())?;
        need(K, "weight", n, w.len())?;
        let s32 = u32_arg(K, "stride", stride)?;
        let mut a = Args::new();
        a.ptr(x.device_ptr())
            .u32(s32)
            .ptr(w.device_ptr())
            .ptr(x.device_ptr())
            .u32(s32)
            .u32(u32_arg(K, "n", n)?)
            .f32(eps);
        // SAFETY: 7 arguments as rms_norm in kernels/elementwise.cu (ptr,
        // u32, ptr, ptr, u32, u32, f32); rows rows of n elements `stride`
        // apart lie inside x (checked), n weights checked; x == y is allowed.
        unsafe { self.launch(dev, "rms_norm", grid(K, rows, 1, 1)?, RN_THREADS, &mut a) }
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_raw(
        &self,
        dev: &CudaDevice,
        x: u64,
        x_len: usize,
        w: BufView<'_, f32>,
        y: u64,
        y_len: usize,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<()> {
        const K: &str = "rms_norm";
        nonzero(K, "n", n)?;
        nonzero(K, "rows", rows)?;
        let total = span(K, &[(rows, n)], 0)?;
        need(K, "x", total, x_len)?;
        need(K, "y", total, y_len)?;
        need(K, "weight", n, w.len())?;
        let n32 = u32_arg(K, "n", n)?;
        let mut a = Args::new();
        a.ptr(x)
            .u32(n32)
            .ptr(w.device_ptr())
            .ptr(y)
            .u32(n32)
            .u32(n32)
            .f32(eps);
        // SAFETY: 7 arguments as rms_norm in kernels/elementwise.cu (ptr,
        // u32, ptr, ptr, u32, u32, f32); rows × n elements of x and y and n
        // of w were checked; x == y is allowed by the kernel.
        unsafe { self.launch(dev, "rms_norm", grid(K, rows, 1, 1)?, RN_THREADS, &mut a) }
    }

    /// `x += a`, then `y = RMSNorm(x)` with weight `w`, for `rows`
    /// contiguous rows of `n` (the residual add and the next norm in one
    /// pass; the same bits as [`Self::add_inplace`] then [`Self::rms_norm`]).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        dev: &CudaDevice,
        x: BufMut<'_, f32>,
        a: BufView<'_, f32>,
        w: BufView<'_, f32>,
        y: BufMut<'_, f32>,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<()> {
        const K: &str = "add_rms_norm";
        nonzero(K, "n", n)?;
        nonzero(K, "rows", rows)?;
        let total = span(K, &[(rows, n)], 0)?;
        need(K, "x", total, x.len())?;
        need(K, "a", total, a.len())?;
        need(K, "y", total, y.len())?;
        need(K, "weight", n, w.len())?;
        let mut args = Args::new();
        args.ptr(x.device_ptr())
            .ptr(a.device_ptr())
            .ptr(w.device_ptr())
            .ptr(y.device_ptr())
            .u32(u32_arg(K, "n", n)?)
            .f32(eps);
        // SAFETY: 6 arguments as add_rms_norm in kernels/elementwise.cu (4
        // pointers, u32, f32); rows × n elements of x, a, y and n weights
        // checked; x and y are exclusive views, so distinct from a and w.
        unsafe { self.launch(dev, K, grid(K, rows, 1, 1)?, RN_THREADS, &mut args) }
    }

    /// Rotates dims `offset .. offset + rot_dim` of each of `heads` heads of
    /// `ntok` tokens in place: element (t, h, d) is at `t·tok_stride +
    /// h·head_stride + d`. `pos[t]` picks the table row; a position past
    /// the table makes that head's rotary dims NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        dev: &CudaDevice,
        x: BufMut<'_, f32>,
        ntok: usize,
        heads: usize,
        tok_stride: usize,
        head_stride: usize,
        offset: usize,
        table: &RopeTable<'_>,
        pos: BufView<'_, u32>,
    ) -> Result<()> {
        const K: &str = "rope";
        let rd = table.rot_dim;
        if rd == 0 || !rd.is_multiple_of(2) || rd > RP_MAX_DIM {
            return Err(CudaError::invalid(
                K,
                format!("rotary dim {rd} must be even, 2..={RP_MAX_DIM}"),
            ));
        }
        nonzero(K, "ntok", ntok)?;
        nonzero(K, "heads", heads)?;
        if heads > 1 && head_stride < offset + rd {
            return Err(CudaError::invalid(K, "heads overlap"));
        }
        if ntok > 1 && tok_stride < span(K, &[(heads - 1, head_stride)], offset + rd)? {
            return Err(CudaError::invalid(K, "tokens overlap"));
        }
        need(
            K,
            "x",
            span(
                K,
                &[(ntok - 1, tok_stride), (heads - 1, head_stride)],
                offset + rd,
            )?,
            x.len(),
        )?;
        let table_len = span(K, &[(table.positions, rd / 2)], 0)?;
        need(K, "cos table", table_len, table.cos.len())?;
        need(K, "sin table", table_len, table.sin.len())?;
        need(K, "positions", ntok, pos.len())?;
        let mut a = Args::new();
        a.ptr(x.device_ptr())
            .u32(u32_arg(K, "token stride", tok_stride)?)
            .u32(u32_arg(K, "head stride", head_stride)?)
            .u32(u32_arg(K, "offset", offset)?)
            .u32(rd as u32)
            .ptr(table.cos.device_ptr())
            .ptr(table.sin.device_ptr())
            .ptr(pos.device_ptr())
            .u32(u32_arg(K, "table rows", table.positions)?)
            .u32(table.interleaved as u32);
        // SAFETY: 10 arguments as rope in kernels/elementwise.cu (ptr, u32,
        // u32, u32, u32, ptr, ptr, ptr, u32, u32); every head's rotary range,
        // the tables and ntok positions were checked; the kernel never reads
        // a table row ≥ table rows.
        unsafe { self.launch(dev, "rope", grid(K, heads, ntok, 1)?, RP_THREADS, &mut a) }
    }

    /// GQA's per-head work in one launch (kernels/elementwise.cu
    /// `gqa_prep`): for `rows` tokens of `q` (`[rows][nh][hd]`), `k` and `v`
    /// (`[rows][nkv][hd]`), RMSNorm of each q and k head (when the weights
    /// are given), rotary embedding of dims `0..rot_dim` of each, then k and
    /// v appended to the caches (`capacity` slots of `nkv·hd`) at slot
    /// `slot0[r] + pos[r]`. The same bits as `rms_norm_inplace`, `rope` and
    /// `kv_append` one after the other.
    #[allow(clippy::too_many_arguments)]
    pub fn gqa_prep(
        &self,
        dev: &CudaDevice,
        q: BufMut<'_, f32>,
        k: BufMut<'_, f32>,
        v: BufView<'_, f32>,
        rows: usize,
        (nh, nkv, hd): (usize, usize, usize),
        q_norm: Option<BufView<'_, f32>>,
        k_norm: Option<BufView<'_, f32>>,
        eps: f32,
        table: &RopeTable<'_>,
        pos: BufView<'_, u32>,
        slot0: BufView<'_, u32>,
        k_cache: BufMut<'_, f32>,
        v_cache: BufMut<'_, f32>,
        capacity: usize,
    ) -> Result<()> {
        const K: &str = "gqa_prep";
        nonzero(K, "rows", rows)?;
        nonzero(K, "heads", nh)?;
        nonzero(K, "kv heads", nkv)?;
        nonzero(K, "head dim", hd)?;
        let rd = table.rot_dim;
        if rd == 0 || !rd.is_multiple_of(2) || rd > RP_MAX_DIM || rd > hd {
            return Err(CudaError::invalid(
                K,
                format!("rotary dim {rd} must be even, 2..={}", RP_MAX_DIM.min(hd)),
            ));
        }
        need(
            K,
            "q",
            span(K, &[(rows, nh), (0, 0)], 0).and_then(|r| span(K, &[(r, hd)], 0))?,
            q.len(),
        )?;
        let kvd = span(K, &[(nkv, hd)], 0)?;
        need(K, "k", span(K, &[(rows, kvd)], 0)?, k.len())?;
        need(K, "v", span(K, &[(rows, kvd)], 0)?, v.len())?;
        let (qw, kw) = match (&q_norm, &k_norm) {
            (Some(a), Some(b)) => {
                need(K, "q norm", hd, a.len())?;
                need(K, "k norm", hd, b.len())?;
                (a.device_ptr(), b.device_ptr())
            }
            (None, None) => (0, 0),
            _ => return Err(CudaError::invalid(K, "q and k norms go together")),
        };
        let table_len = span(K, &[(table.positions, rd / 2)], 0)?;
        need(K, "cos table", table_len, table.cos.len())?;
        need(K, "sin table", table_len, table.sin.len())?;
        need(K, "positions", rows, pos.len())?;
        need(K, "slot0", rows, slot0.len())?;
        let cache = span(K, &[(capacity, kvd)], 0)?;
        need(K, "key cache", cache, k_cache.len())?;
        need(K, "value cache", cache, v_cache.len())?;
        let blocks = span(K, &[(nkv, 2)], nh)?;
        let mut a = Args::new();
        a.ptr(q.device_ptr())
            .ptr(k.device_ptr())
            .ptr(v.device_ptr())
            .u32(u32_arg(K, "heads", nh)?)
            .u32(u32_arg(K, "kv heads", nkv)?)
            .u32(u32_arg(K, "head dim", hd)?)
            .ptr(qw)
            .ptr(kw)
            .f32(eps)
            .ptr(table.cos.device_ptr())
            .ptr(table.sin.device_ptr())
            .u32(u32_arg(K, "table rows", table.positions)?)
            .u32(rd as u32)
            .u32(table.interleaved as u32)
            .ptr(pos.device_ptr())
            .ptr(slot0.device_ptr())
            .ptr(k_cache.device_ptr())
            .ptr(v_cache.device_ptr())
            .u32(u32_arg(K, "capacity", capacity)?);
        // SAFETY: 19 arguments as gqa_prep in kernels/elementwise.cu; q, k,
        // v hold rows × heads × hd, the norms hd, the tables their
        // positions (the kernel reads no row ≥ table rows), pos and slot0
        // `rows` entries, the caches `capacity` slots (the kernel writes no
        // slot ≥ capacity); q, k and the caches are exclusive views.
        unsafe { self.launch(dev, K, grid(K, blocks, rows, 1)?, RN_THREADS, &mut a) }
    }

    /// `out = silu(gate) · up` over `rows × cols` contiguous elements.
    pub fn swiglu(
        &self,
        dev: &CudaDevice,
        gate: BufView<'_, f32>,
        up: BufView<'_, f32>,
        out: BufMut<'_, f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.swiglu_raw(
            dev,
            gate.device_ptr(),
            gate.len(),
            up,
            out.device_ptr(),
            out.len(),
            rows,
            cols,
        )
    }

    /// `gate = silu(gate) · up` in place.
    pub fn swiglu_inplace(
        &self,
        dev: &CudaDevice,
        gate: BufMut<'_, f32>,
        up: BufView<'_, f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.swiglu_raw(
            dev,
            gate.device_ptr(),
            gate.len(),
            up,
            gate.device_ptr(),
            gate.len(),
            rows,
            cols,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn swiglu_raw(
        &self,
        dev: &CudaDevice,
        gate: u64,
        gate_len: usize,
        up: BufView<'_, f32>,
        out: u64,
        out_len: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const K: &str = "swiglu";
        nonzero(K, "rows", rows)?;
        nonzero(K, "cols", cols)?;
        let total = span(K, &[(rows, cols)], 0)?;
        need(K, "gate", total, gate_len)?;
        need(K, "up", total, up.len())?;
        need(K, "out", total, out_len)?;
        let c = u32_arg(K, "cols", cols)?;
        let mut a = Args::new();
        a.ptr(gate)
            .u32(c)
            .ptr(up.device_ptr())
            .u32(c)
            .ptr(out)
            .u32(c)
            .u32(c);
        // SAFETY: 7 arguments as swiglu in kernels/elementwise.cu (ptr, u32,
        // ptr, u32, ptr, u32, u32); rows × cols elements of each checked;
        // out == gate is allowed (each thread reads before it writes).
        unsafe {
            self.launch(
                dev,
                "swiglu",
                grid(K, cols.div_ceil(EW_THREADS as usize), rows, 1)?,
                EW_THREADS,
                &mut a,
            )
        }
    }

    /// The MoE output of `rows` rows: `slot_out` (`[rows][k][hidden]`)
    /// weighted by `weights` (`[rows][k]`), summed in ascending expert id
    /// (`experts`, `[rows][k]`), plus `shared` (`[rows][hidden]`) gated by
    /// sigmoid(`shared_gate[row]`) when given.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        dev: &CudaDevice,
        slot_out: BufView<'_, f32>,
        experts: BufView<'_, u32>,
        weights: BufView<'_, f32>,
        shared: Option<BufView<'_, f32>>,
        shared_gate: Option<BufView<'_, f32>>,
        out: BufMut<'_, f32>,
        rows: usize,
        k: usize,
        hidden: usize,
    ) -> Result<()> {
        self.moe_combine_into(
            dev,
            slot_out,
            experts,
            weights,
            shared,
            shared_gate,
            out,
            rows,
            k,
            hidden,
            false,
        )
    }

    /// [`Self::moe_combine`], adding the result to `out` when `accumulate`
    /// (`out += combined`: the residual add in the same pass, the same
    /// rounded addition as a separate `add_inplace`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine_into(
        &self,
        dev: &CudaDevice,
        slot_out: BufView<'_, f32>,
        experts: BufView<'_, u32>,
        weights: BufView<'_, f32>,
        shared: Option<BufView<'_, f32>>,
        shared_gate: Option<BufView<'_, f32>>,
        out: BufMut<'_, f32>,
        rows: usize,
        k: usize,
        hidden: usize,
        accumulate: bool,
    ) -> Result<()> {
        // SAFETY: without slot rows every read is checked below.
        unsafe {
            self.combine_launch(
                dev,
                slot_out,
                None,
                experts,
                weights,
                shared,
                shared_gate,
                out,
                (rows, k, hidden),
                accumulate,
            )
        }
    }

    /// [`Self::moe_combine_into`] reading slot s of row r from row
    /// `slot_rows[r·k + s]` of `slot_out` (the expert launches' outputs,
    /// packed by expert) instead of row `r·k + s`: the same sums, without
    /// gathering the slots first.
    ///
    /// # Safety
    /// Every entry of `slot_rows[..rows·k]` must be below `rows·k` when the
    /// kernel runs (stream order); `slot_out` is checked to hold that many
    /// rows.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn moe_combine_rows_into(
        &self,
        dev: &CudaDevice,
        slot_out: BufView<'_, f32>,
        slot_rows: BufView<'_, u32>,
        experts: BufView<'_, u32>,
        weights: BufView<'_, f32>,
        shared: Option<BufView<'_, f32>>,
        shared_gate: Option<BufView<'_, f32>>,
        out: BufMut<'_, f32>,
        rows: usize,
        k: usize,
        hidden: usize,
        accumulate: bool,
    ) -> Result<()> {
        need(
            "moe_combine",
            "slot rows",
            span("moe_combine", &[(rows, k)], 0)?,
            slot_rows.len(),
        )?;
        // SAFETY: the caller's contract on the slot rows, passed on.
        unsafe {
            self.combine_launch(
                dev,
                slot_out,
                Some(slot_rows),
                experts,
                weights,
                shared,
                shared_gate,
                out,
                (rows, k, hidden),
                accumulate,
            )
        }
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn combine_launch(
        &self,
        dev: &CudaDevice,
        slot_out: BufView<'_, f32>,
        slot_rows: Option<BufView<'_, u32>>,
        experts: BufView<'_, u32>,
        weights: BufView<'_, f32>,
        shared: Option<BufView<'_, f32>>,
        shared_gate: Option<BufView<'_, f32>>,
        out: BufMut<'_, f32>,
        (rows, k, hidden): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        const K: &str = "moe_combine";
        nonzero(K, "rows", rows)?;
        nonzero(K, "k", k)?;
        nonzero(K, "hidden", hidden)?;
        if k > CB_MAX_K {
            return Err(CudaError::invalid(K, format!("k = {k} > {CB_MAX_K}")));
        }
        need(
            K,
            "slot outputs",
            span(K, &[(rows, k), (0, 0)], 0).and_then(|rk| span(K, &[(rk, hidden)], 0))?,
            slot_out.len(),
        )?;
        need(K, "experts", span(K, &[(rows, k)], 0)?, experts.len())?;
        need(K, "weights", span(K, &[(rows, k)], 0)?, weights.len())?;
        let total = span(K, &[(rows, hidden)], 0)?;
        need(K, "out", total, out.len())?;
        if let Some(s) = &shared {
            need(K, "shared", total, s.len())?;
        }
        if let Some(g) = &shared_gate {
            if shared.is_none() {
                return Err(CudaError::invalid(
                    K,
                    "a shared gate without a shared expert",
                ));
            }
            need(K, "shared gate", rows, g.len())?;
        }
        let mut a = Args::new();
        a.ptr(slot_out.device_ptr())
            .ptr(slot_rows.map_or(0, |r| r.device_ptr()))
            .ptr(experts.device_ptr())
            .ptr(weights.device_ptr())
            .ptr(shared.map_or(0, |s| s.device_ptr()))
            .ptr(shared_gate.map_or(0, |s| s.device_ptr()))
            .ptr(out.device_ptr())
            .u32(k as u32)
            .u32(u32_arg(K, "hidden", hidden)?)
            .u32(accumulate as u32);
        // SAFETY: 10 arguments as moe_combine in kernels/elementwise.cu (7
        // pointers, u32 ×3); every range checked above (slot rows: the
        // caller's contract keeps them below rows·k); null pointers only for
        // the optional inputs, which the kernel tests; `out` is exclusive,
        // so no input aliases it.
        unsafe {
            self.launch(
                dev,
                "moe_combine",
                grid(K, hidden.div_ceil(EW_THREADS as usize), rows, 1)?,
                EW_THREADS,
                &mut a,
            )
        }
    }

    /// Attention over the KV cache (see [`Attention`]); `out` is
    /// `[rows][heads][dim_v]`.
    pub fn attention(
        &self,
        dev: &CudaDevice,
        at: &Attention<'_>,
        out: BufMut<'_, f32>,
    ) -> Result<()> {
        let mut a = attention_args("attention", at, &out)?;
        a.ptr(out.device_ptr());
        // SAFETY: 21 arguments as attention in kernels/attention.cu (ptr,
        // u32 ×3, ptr, u32 ×2, ptr, u32 ×2, ptr, u32 ×4, ptr, ptr, u32 ×2,
        // f32, ptr); every cache view holds `capacity` slots of every KV
        // head, and the kernel reads only slots below `capacity` (rows whose
        // slot0 + pos reach it get NaN).
        unsafe {
            self.launch(
                dev,
                "attention",
                grid("attention", at.heads, at.rows, 1)?,
                AT_THREADS,
                &mut a,
            )
        }
    }

    /// [`KernelSet::attention`] with each (row, head)'s chunks of
    /// [`ATTENTION_CHUNK`] positions spread over `split.blocks` blocks
    /// (flash-decoding): the same bits, for passes with too few rows to
    /// fill the device otherwise. `split.records` holds at least
    /// [`attention_split_records`] floats; `split.counters` `rows·heads`
    /// zeros, which the launch leaves zero again. A row with more than
    /// `split.chunk_cap` chunks is answered with NaN. `at.pos` and
    /// `at.slot0` are read before the launch waits for its predecessor
    /// (kernels/attention.cu): they must not be written by the kernel
    /// launched just before (an upload, or any earlier launch, is fine).
    pub fn attention_split(
        &self,
        dev: &CudaDevice,
        at: &Attention<'_>,
        split: AttentionSplit<'_>,
        out: BufMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "attention_split";
        let mut a = attention_args(K, at, &out)?;
        nonzero(K, "blocks", split.blocks)?;
        nonzero(K, "chunk_cap", split.chunk_cap)?;
        need(
            K,
            "records",
            attention_split_records(at.rows, at.heads, at.dim_v, split.chunk_cap)
                .ok_or_else(|| CudaError::invalid(K, "sizes overflow"))?,
            split.records.len(),
        )?;
        need(K, "counters", at.rows * at.heads, split.counters.len())?;
        if let Some(q) = &split.out_q8 {
            if !at.dim_v.is_multiple_of(32) {
                return Err(CudaError::invalid(
                    K,
                    "8-bit rows need heads of whole blocks of 32",
                ));
            }
            check_q8(K, q.device_ptr(), q.len(), at.rows, at.heads * at.dim_v)?;
        }
        a.ptr(out.device_ptr())
            .u32(u32_arg(K, "blocks", split.blocks)?)
            .u32(u32_arg(K, "chunk_cap", split.chunk_cap)?)
            .ptr(split.records.device_ptr())
            .ptr(split.counters.device_ptr())
            .ptr(split.out_q8.map_or(0, |q| q.device_ptr()));
        // SAFETY: attention's 21 arguments, then u32 ×2, ptr, ptr, ptr as
        // attention_split in kernels/attention.cu; the records hold
        // chunk_cap records of 2 + dim_v floats per (row, head) and the
        // kernel writes only below chunk_cap; one counter per (row, head);
        // out_q8 holds a Q8 row per row of the output (checked).
        unsafe {
            self.launch(
                dev,
                K,
                grid(K, at.heads, at.rows, split.blocks)?,
                AT_THREADS,
                &mut a,
            )
        }
    }

    /// MLA query absorption: `qa[row][head][c] = Σ_{j<dn} q[row][head][j] ·
    /// kv_b[head·(dn+dv) + j][c]`; q element (row, head, j) is at
    /// `row·q_row_stride + head·q_head_stride + j`, qa likewise.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_absorb(
        &self,
        dev: &CudaDevice,
        kv_b: &WeightView<'_>,
        heads: usize,
        dn: usize,
        dv: usize,
        q: BufView<'_, f32>,
        q_row_stride: usize,
        q_head_stride: usize,
        rows: usize,
        qa: BufMut<'_, f32>,
        qa_row_stride: usize,
        qa_head_stride: usize,
    ) -> Result<()> {
        const K: &str = "mla_absorb";
        nonzero(K, "heads", heads)?;
        nonzero(K, "dn", dn)?;
        nonzero(K, "rows", rows)?;
        if dn > AB_MAX_DN {
            return Err(CudaError::invalid(K, format!("dn = {dn} > {AB_MAX_DN}")));
        }
        let r = kv_b.cols;
        nonzero(K, "kv_lora_rank", r)?;
        let head_rows = dn + dv;
        need(
            K,
            "kv_b rows",
            span(K, &[(heads, head_rows)], 0)?,
            kv_b.rows,
        )?;
        let rb = kv_b
            .format
            .row_bytes(r)
            .ok_or_else(|| CudaError::invalid(K, "kv_b rows are not whole 32-blocks"))?;
        need(K, "kv_b", span(K, &[(kv_b.rows, rb)], 0)?, kv_b.data.len())?;
        if !kv_b
            .data
            .device_ptr()
            .is_multiple_of(kv_b.format.alignment() as u64)
        {
            return Err(CudaError::invalid(K, "kv_b is misaligned"));
        }
        let (sp, sb, sc) = match (kv_b.format, &kv_b.fp8) {
            (WeightFormat::F8E4M3, Some(s)) => {
                nonzero(K, "fp8 block", s.block)?;
                let sc = r.div_ceil(s.block);
                need(
                    K,
                    "fp8 scales",
                    span(K, &[(kv_b.rows.div_ceil(s.block), sc)], 0)?,
                    s.scales.len(),
                )?;
                (s.scales.device_ptr(), s.block, sc)
            }
            (WeightFormat::F8E4M3, None) => {
                return Err(CudaError::invalid(K, "fp8 weights need their scales"));
            }
            (_, Some(_)) => return Err(CudaError::invalid(K, "scales given for a non-fp8 format")),
            (_, None) => (0, 1, 0),
        };
        need(
            K,
            "q",
            span(
                K,
                &[(rows - 1, q_row_stride), (heads - 1, q_head_stride)],
                dn,
            )?,
            q.len(),
        )?;
        need(
            K,
            "qa",
            span(
                K,
                &[(rows - 1, qa_row_stride), (heads - 1, qa_head_stride)],
                r,
            )?,
            qa.len(),
        )?;
        if (heads > 1 && qa_head_stride < r)
            || (rows > 1 && qa_row_stride < span(K, &[(heads - 1, qa_head_stride)], r)?)
        {
            return Err(CudaError::invalid(K, "qa strides make outputs overlap"));
        }
        let mut a = Args::new();
        a.ptr(kv_b.data.device_ptr())
            .u32(kv_b.format.storage().code())
            .u32(u32_arg(K, "kv_lora_rank", r)?)
            .ptr(sp)
            .u32(u32_arg(K, "fp8 block", sb)?)
            .u32(u32_arg(K, "fp8 scale columns", sc)?)
            .u32(u32_arg(K, "rows per head", head_rows)?)
            .u32(dn as u32)
            .ptr(q.device_ptr())
            .u32(u32_arg(K, "q head stride", q_head_stride)?)
            .u32(u32_arg(K, "q row stride", q_row_stride)?)
            .ptr(qa.device_ptr())
            .u32(u32_arg(K, "qa head stride", qa_head_stride)?)
            .u32(u32_arg(K, "qa row stride", qa_row_stride)?);
        // SAFETY: 14 arguments as mla_absorb in kernels/attention.cu (ptr,
        // u32 ×2, ptr, u32 ×4, ptr, u32 ×2, ptr, u32 ×2); the head rows of
        // kv_b, its scales, q and qa ranges were checked above.
        unsafe {
            self.launch(
                dev,
                "mla_absorb",
                grid(K, r.div_ceil(AB_THREADS as usize), heads, rows)?,
                AB_THREADS,
                &mut a,
            )
        }
    }

    /// Softmax router: for each of `rows` rows of `experts` logits, the top
    /// `k` experts (ids into `idx`, probabilities — renormalised over the k
    /// when `norm` — into `weights`), largest first.
    #[allow(clippy::too_many_arguments)]
    pub fn router_softmax_topk(
        &self,
        dev: &CudaDevice,
        logits: BufView<'_, f32>,
        rows: usize,
        experts: usize,
        k: usize,
        norm: bool,
        idx: BufMut<'_, u32>,
        weights: BufMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "router_softmax_topk";
        check_router(K, logits, rows, experts, k, &idx, &weights)?;
        let mut a = Args::new();
        a.ptr(logits.device_ptr())
            .u32(experts as u32)
            .u32(k as u32)
            .u32(norm as u32)
            .ptr(idx.device_ptr())
            .ptr(weights.device_ptr());
        // SAFETY: 6 arguments as router_softmax_topk in kernels/router.cu
        // (ptr, u32 ×3, ptr, ptr); rows × experts logits and rows × k outputs
        // checked; experts ≤ RT_MAX_E and k ≤ RT_MAX_K fit its shared arrays.
        unsafe { self.launch(dev, "router_softmax_topk", grid(K, rows, 1, 1)?, 32, &mut a) }
    }

    /// DeepSeek-V3's sigmoid router with group-limited selection (see
    /// kernels/router.cu); `bias` is the per-expert selection bias.
    #[allow(clippy::too_many_arguments)]
    pub fn router_sigmoid_grouped_topk(
        &self,
        dev: &CudaDevice,
        logits: BufView<'_, f32>,
        bias: Option<BufView<'_, f32>>,
        rows: usize,
        experts: usize,
        n_group: usize,
        topk_group: usize,
        k: usize,
        norm: bool,
        scaling: f32,
        idx: BufMut<'_, u32>,
        weights: BufMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "router_sigmoid_grouped_topk";
        check_router(K, logits, rows, experts, k, &idx, &weights)?;
        if n_group == 0 || n_group > 32 || !experts.is_multiple_of(n_group) || experts / n_group < 2
        {
            return Err(CudaError::invalid(
                K,
                format!("{experts} experts in {n_group} groups (need ≤ 32 groups of ≥ 2)"),
            ));
        }
        if topk_group == 0 || topk_group > n_group {
            return Err(CudaError::invalid(
                K,
                format!("topk_group {topk_group} of {n_group} groups"),
            ));
        }
        if let Some(b) = &bias {
            need(K, "bias", experts, b.len())?;
        }
        let mut a = Args::new();
        a.ptr(logits.device_ptr())
            .ptr(bias.map_or(0, |b| b.device_ptr()))
            .u32(experts as u32)
            .u32(n_group as u32)
            .u32(topk_group as u32)
            .u32(k as u32)
            .u32(norm as u32)
            .f32(scaling)
            .ptr(idx.device_ptr())
            .ptr(weights.device_ptr());
        // SAFETY: 10 arguments as router_sigmoid_grouped_topk in
        // kernels/router.cu (ptr, ptr, u32 ×5, f32, ptr, ptr); sizes checked
        // above and against the kernel's shared arrays; bias may be null.
        unsafe {
            self.launch(
                dev,
                "router_sigmoid_grouped_topk",
                grid(K, rows, 1, 1)?,
                32,
                &mut a,
            )
        }
    }
}

fn check_router(
    k_name: &'static str,
    logits: BufView<'_, f32>,
    rows: usize,
    experts: usize,
    k: usize,
    idx: &BufMut<'_, u32>,
    weights: &BufMut<'_, f32>,
) -> Result<()> {
    nonzero(k_name, "rows", rows)?;
    nonzero(k_name, "experts", experts)?;
    nonzero(k_name, "k", k)?;
    if experts > RT_MAX_E || k > RT_MAX_K || k > experts {
        return Err(CudaError::invalid(
            k_name,
            format!("{experts} experts, top {k} (limits: {RT_MAX_E} experts, k ≤ {RT_MAX_K})"),
        ));
    }
    need(
        k_name,
        "logits",
        span(k_name, &[(rows, experts)], 0)?,
        logits.len(),
    )?;
    let out = span(k_name, &[(rows, k)], 0)?;
    need(k_name, "ids", out, idx.len())?;
    need(k_name, "weights", out, weights.len())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_follow_the_formats() {
        assert_eq!(WeightFormat::F32.row_bytes(7), Some(28));
        assert_eq!(WeightFormat::Bf16.row_bytes(7), Some(14));
        assert_eq!(WeightFormat::F8E4M3.row_bytes(7), Some(7));
        assert_eq!(WeightFormat::Q8_0.row_bytes(64), Some(68));
        assert_eq!(WeightFormat::Q8_0Q8.row_bytes(64), Some(68));
        assert_eq!(WeightFormat::Q8_0Q8.row_bytes(48), None);
        assert_eq!(WeightFormat::Q4_0.row_bytes(64), Some(36));
        assert_eq!(WeightFormat::Q4_0.row_bytes(48), None);
        assert_eq!(WeightFormat::Q4K.row_bytes(512), Some(288));
        assert_eq!(WeightFormat::Q4KQ8.row_bytes(320), None);
        assert_eq!(WeightFormat::Q5K.row_bytes(512), Some(352));
        assert_eq!(WeightFormat::Q5KQ8.row_bytes(256), Some(176));
        assert_eq!(WeightFormat::F32.row_bytes(usize::MAX), None);
    }

    #[test]
    fn four_byte_arguments_sit_in_the_low_half() {
        let mut a = Args::new();
        a.u32(7).f32(1.5).u64(u64::MAX).ptr(0x1000);
        assert_eq!(a.n, 4);
        // What the driver reads for a 4-byte parameter: the first 4 bytes.
        let first4 = |s: u64| u32::from_le_bytes(s.to_le_bytes()[..4].try_into().unwrap());
        assert_eq!(first4(a.slots[0]), 7);
        assert_eq!(f32::from_bits(first4(a.slots[1])), 1.5);
        assert_eq!(a.slots[2], u64::MAX);
    }

    #[test]
    fn sizes_overflow_into_errors_not_wraps() {
        assert!(span("t", &[(usize::MAX, 2)], 0).is_err());
        assert!(span("t", &[(3, 4), (5, 6)], 7).is_ok_and(|v| v == 49));
        assert!(grid("t", 1, 65536, 1).is_err());
        assert!(grid("t", 0, 1, 1).is_err());
        assert!(u32_arg("t", "x", 1 << 32).is_err());
    }
}
