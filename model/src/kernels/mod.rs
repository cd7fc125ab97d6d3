//! CPU kernels: row dot products over every weight format, and the
//! row-partitioned matrix-vector / matrix-matrix products built on them.
//!
//! Determinism: each output element `y[t][r] = dot(W[r], x[t])` is computed
//! by one call of one dot function, whatever the batch size or the thread
//! count. Threads only decide *which* rows they compute, never how, so
//! results are bit-identical across `--threads` and across batching.
//!
//! SIMD is chosen once at run time; `scalar` holds the reference of every
//! kernel.

pub mod dequant;
pub mod gated;
pub mod k_panels;
pub mod legacy_q8;
pub mod low_k;
#[cfg(target_arch = "aarch64")]
pub mod neon;
pub mod pool;
pub mod q4_0;
pub mod q4_0_amx;
pub mod q4_0_tiles;
pub mod q4_k;
pub mod q6_k;
pub mod q8act;
pub mod quads16;
pub mod read_pass;
pub mod scalar;
#[cfg(target_arch = "x86_64")]
pub mod x86;

pub use gated::{Gated, gated_products, gated_products_summed};
pub use pool::Pool;
pub use q4_0::{Q8Tiles, RowScratch};
pub use q8act::Q8Activation;

use std::sync::OnceLock;

use crate::format::{WeightFormat, bf16_to_f32, f16_to_f32, fp8_e4m3_to_f32};
use crate::quant::{self, Q4_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK};
use crate::tensor::QMatrix;

/// One quantized row against up to [`q8act::MULTI`] activations.
pub type MultiDot = fn(&[u8], &[&Q8Activation], &mut [f32]);

/// `(w0, w1, xs, out)`: two Q8_0 rows of the same length against up to
/// [`q8act::avx512::PAIR_TOKENS`] activations, `out[t] = [w0 · xs[t], w1
/// · xs[t]]`, each `dot_q8_0_q8`'s bits.
pub type PairDot = fn(&[u8], &[u8], &[&Q8Activation], &mut [[f32; 2]]);

/// `(format, row, xs, out)`: one row of a [`KernelSet::dot_more_q8`]
/// format against up to [`q8act::MULTI`] activations, `out[t]` for
/// `xs[t]`.
pub type MoreMultiDot = fn(WeightFormat, &[u8], &[&Q8Activation], &mut [f32]);

/// `(tile, blocks, x, out)`: the 16 rows of a Q4_0 tile (see
/// [`q4_0_tiles`]) against one activation, each result identical to
/// `dot_q4_0_q8`'s for that row.
pub type TileDot = fn(&[u8], usize, &Q8Activation, &mut [f32; q4_0_tiles::TILE_ROWS]);

/// `(tile, blocks, xs, out, next)`: a Q4_0 tile against up to
/// [`TILE_TOKENS`] activations at once, `out[t]` exactly what the
/// [`TileDot`] kernel gives for `xs[t]`. `next` (possibly empty): bytes
/// the caller reads next, asked of L2 during the call (a hint; the
/// following tile, on a tile's first pass).
pub type TilesDot = fn(&[u8], usize, &[&Q8Activation], &mut [[f32; q4_0_tiles::TILE_ROWS]], &[u8]);

/// `(tile, blocks, passes, scratch, out, next)`: a tile of 16 Q4_0 rows
/// (or IQ4_NL rows tiled as Q4_0's) against passes of up to
/// [`q4_0_amx::TOKENS`] activations packed for AMX
/// ([`q4_0_amx::Tokens`]), token after token into `out`: `out[t]` exactly
/// what the row kernel gives each row for token `t`. `next` as for
/// [`TilesDot`].
pub type PackedTilesDot = fn(
    &[u8],
    usize,
    &[q4_0_amx::Tokens],
    &mut q4_0_amx::Scratch,
    &mut [[f32; q4_0_tiles::TILE_ROWS]],
    &[u8],
);

/// `(w, x, out)`: consecutive rows of a 16-bit matrix against one vector.
pub type RowsDot16 = fn(&[u16], &[f32], &mut [f32]);

/// `(w, xs, out)`: consecutive rows of a 16-bit matrix (`w.len() / n`
/// rows of `n = xs[t].len()`) against several vectors, `out[r ×
/// xs.len() + t]` for row `r` and vector `t`.
pub type MultiDot16 = fn(&[u16], &[&[f32]], &mut [f32]);

/// The most activations a [`TilesDot`] kernel takes.
pub const TILE_TOKENS: usize = 8;

/// How [`tiled_rows`] splits `n` tokens into passes over a tile: as few
/// passes as [`TILE_TOKENS`] allows, their sizes differing by at most one
/// (36 tokens: 8, 7, 7, 7, 7, not 8, 8, 8, 8, 4), so that no pass is left
/// with the few tokens a several-token kernel runs slowest. Which tokens
/// share a pass changes no result (each token's sums are its own).
pub fn tile_passes(n: usize) -> impl Iterator<Item = usize> {
    passes_of(n, TILE_TOKENS)
}

/// [`tile_passes`] for a kernel that takes at most `most` tokens a pass.
pub fn passes_of(n: usize, most: usize) -> impl Iterator<Item = usize> {
    let passes = n.div_ceil(most);
    let base = n.checked_div(passes).unwrap_or(0);
    let extra = n.checked_rem(passes).unwrap_or(0);
    (0..passes).map(move |p| base + usize::from(p < extra))
}

/// `(qs, g, k, stride, out, ahead)`: `g` queries against the same rows
/// (see [`KernelSet::dot_f32_rows_group`]); `ahead`: the rows come from
/// memory, so the kernel asks for those ahead of the ones it reads (a
/// decode's KV cache; a prompt's rows were just written).
pub type GroupDot = fn(&[f32], usize, &[f32], usize, &mut [f32], bool);

/// `(o, g, s, s_stride, rows, v, v_stride, ahead)`: `weighted_rows` for
/// `g` heads over the same value rows (see
/// [`KernelSet::weighted_rows_group`]); `ahead` as [`GroupDot`]'s.
pub type GroupWeighted = fn(&mut [f32], usize, &[f32], usize, usize, &[f32], usize, bool);

/// The dot kernels chosen for this CPU.
#[derive(Clone, Copy)]
pub struct KernelSet {
    pub name: &'static str,
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    pub dot_bf16: fn(&[u16], &[f32]) -> f32,
    /// Consecutive rows of a bf16 matrix against one vector, `(w, x,
    /// out)`, each result identical to `dot_bf16`'s for its row; `None`:
    /// a row at a time.
    pub dot_bf16_rows: Option<RowsDot16>,
    /// The same for f16 rows and `dot_f16`.
    pub dot_f16_rows: Option<RowsDot16>,
    /// `dot_bf16_rows` over rows in quads ([`quads16`]; `w` from a quad
    /// boundary, columns a multiple of 16), the same bits; `None`: this
    /// CPU keeps 16-bit rows row-major (see [`quads16_run_here`]).
    pub dot_bf16_quads: Option<RowsDot16>,
    /// The same for f16 rows and `dot_f16`.
    pub dot_f16_quads: Option<RowsDot16>,
    /// `dot_bf16_multi` over rows in quads, the same bits.
    pub dot_bf16_quads_multi: Option<MultiDot16>,
    /// The same for f16 rows and `dot_f16`.
    pub dot_f16_quads_multi: Option<MultiDot16>,
    /// Consecutive bf16 rows against several vectors, `(w, xs, out)`
    /// ([`MultiDot16`]), each result identical to `dot_bf16`'s for its row
    /// and vector (prefill, batched decode); `None`: a row and a vector at
    /// a time.
    pub dot_bf16_multi: Option<MultiDot16>,
    /// The same for f16 rows and `dot_f16`.
    pub dot_f16_multi: Option<MultiDot16>,
    pub dot_f16: fn(&[u16], &[f32]) -> f32,
    pub dot_fp8: fn(&[u8], &[f32], &[f32], usize) -> f32,
    pub dot_q8_0: fn(&[u8], &[f32]) -> f32,
    pub dot_q4_0: fn(&[u8], &[f32]) -> f32,
    /// `dot_f32` of one vector with many rows (attention's scores), each
    /// result identical to a `dot_f32` call.
    pub dot_f32_rows: fn(&[f32], &[f32], usize, &mut [f32]),
    /// `dot_f32_rows` of `g` queries against the same rows (the heads of a
    /// KV group): `(qs, g, k, stride, out)`, `out[j·rows + t]` identical
    /// to `dot_f32_rows`'s result for query `j`. `None`: a query at a
    /// time.
    pub dot_f32_rows_group: Option<GroupDot>,
    /// Attention's weighted sum of value rows, accumulated onto `o`
    /// (bit-identical at every level: [`scalar::weighted_rows`]).
    pub weighted_rows: fn(&mut [f32], &[f32], &[f32], usize),
    /// `weighted_rows` for the `g` heads of a KV group over the same value
    /// rows: `(o, g, s, s_stride, rows, v, v_stride)`, head `j` taking the
    /// weights `s[j·s_stride..][..rows]` onto `o[j·n..(j + 1)·n]` (`n =
    /// o.len() / g`), each head's bits those of `weighted_rows` alone.
    /// `None`: a head at a time.
    pub weighted_rows_group: Option<GroupWeighted>,
    pub dot_q8_0_q8: fn(&[u8], &Q8Activation) -> f32,
    pub dot_q4_0_q8: fn(&[u8], &Q8Activation) -> f32,
    /// A Q6_K row against one activation ([`q6_k`]).
    pub dot_q6_k_q8: fn(&[u8], &Q8Activation) -> f32,
    /// A Q4_K row against one activation ([`q4_k`]).
    pub dot_q4_k_q8: fn(&[u8], &Q8Activation) -> f32,
    /// A Q5_K row against one activation ([`q4_k`]).
    pub dot_q5_k_q8: fn(&[u8], &Q8Activation) -> f32,
    /// A row of a format without a field of its own above (Q4_1, Q5_0,
    /// Q5_1, IQ4_NL: [`legacy_q8`]; Q2_K, Q3_K, IQ4_XS: [`low_k`]) against
    /// one activation: `(format, row, x)`.
    pub dot_more_q8: fn(WeightFormat, &[u8], &Q8Activation) -> f32,
    /// One row of a `dot_more_q8` format against up to [`q8act::MULTI`]
    /// activations (prefill, batched decode: each block's codes decoded
    /// once for every token), each result identical to `dot_more_q8`'s;
    /// `None` computes token by token.
    pub dot_more_q8_multi: Option<MoreMultiDot>,
    /// One Q8_0 row against up to [`q8act::MULTI`] activations, each
    /// result identical to the single-token kernel's.
    pub dot_q8_0_q8_multi: MultiDot,
    /// Two consecutive Q8_0 rows against up to
    /// `q8act::avx512::PAIR_TOKENS` activations (prefill, batched decode),
    /// each result identical to `dot_q8_0_q8`'s; `None`: a row at a time
    /// through `dot_q8_0_q8_multi`.
    pub dot_q8_0_q8_pair: Option<PairDot>,
    /// One Q4_0 row against up to [`q8act::MULTI`] activations (batched
    /// decode below the matrix–matrix kernel's size), each result identical
    /// to `dot_q4_0_q8`'s; `None` computes token by token.
    pub dot_q4_0_q8_multi: Option<MultiDot>,
    /// Q4_0 rows against many tokens (prefill, batched decode), each result
    /// identical to `dot_q4_0_q8`'s; `None` computes token by token.
    pub gemm_q4_0_q8: Option<GemmQ4>,
    /// Q4_0 tiles against one token; `None`: this CPU keeps Q4_0 rows
    /// row-major (see [`q4_0_tiles_run_here`]).
    pub dot_q4_0_tile: Option<TileDot>,
    /// Q4_0 tiles against several tokens at once (prefill), each result
    /// identical to `dot_q4_0_tile`'s; `None` takes the tokens one by one
    /// (`COLIBRI_TILE_TOKENS=1` forces that).
    pub dot_q4_0_tiles: Option<TilesDot>,
    /// IQ4_NL rows tiled as Q4_0's (the blocks have the same 18 bytes)
    /// against several tokens at once (prefill, batched decode), each
    /// result identical to `dot_more_q8`'s for IQ4_NL; `None`: the row
    /// kernels. The rows are tiled per product ([`iq4_nl_tiled_rows`]).
    pub dot_iq4_nl_tiles: Option<TilesDot>,
    /// Q4_0 tiles against many tokens on AMX ([`q4_0_amx`]; prefill),
    /// each result identical to `dot_q4_0_tile`'s, from
    /// [`AMX_MIN_TOKENS`] tokens on; `None` without AMX or with
    /// `COLIBRI_NO_AMX=1`.
    pub amx_q4_0_tiles: Option<PackedTilesDot>,
    /// The same for IQ4_NL rows tiled as Q4_0's.
    pub amx_iq4_nl_tiles: Option<PackedTilesDot>,
    /// Panels of 16 Q4_K or Q5_K rows against several tokens at once
    /// (prefill, batched decode; [`k_panels`]), each result identical to
    /// the row kernel's; `None` takes the tokens one by one.
    pub dot_k_panels: Option<k_panels::PanelDot>,
    /// The same for panels of 16 Q6_K rows (llama.cpp's Q4_K_M and Q5_K_M
    /// files have their down projections in Q6_K in a third of the
    /// layers, some all of them).
    pub dot_q6_k_panels: Option<k_panels::PanelDot>,
    /// The same for panels of 16 Q2_K or Q3_K rows (the Q2_K and
    /// Q3_K_S/M/L files' experts).
    pub dot_low_k_panels: Option<k_panels::PanelDot>,
    /// The same for panels of 16 IQ4_XS rows.
    pub dot_iq4_xs_panels: Option<k_panels::PanelDot>,
    /// Matrix products over block-quantized weights (every ggml format)
    /// quantize their input to 8-bit blocks and use the integer kernels
    /// (the default); false keeps the exact dequantize-then-multiply
    /// kernels (`COLIBRI_EXACT_QUANT=1`).
    pub int_activations: bool,
    /// Activations are quantized with the AVX2 quantizer (same results as
    /// the scalar one).
    pub vector_quantize: bool,
}

/// What the matrix–matrix kernels' safety contract asks of their
/// arguments: whole rows of the tiles' length, tiles of the kernel's width,
/// room for every row's results.
#[cfg(target_arch = "x86_64")]
fn check_gemm_args(w: &[u8], t: &Q8Tiles, out: &[f32], width: usize) {
    let rb = t.blocks * Q4_0_BLOCK_BYTES;
    assert!(rb > 0 && w.len().is_multiple_of(rb), "whole Q4_0 rows");
    assert_eq!(t.width, width, "tiles built for this kernel");
    assert!(
        out.len() >= w.len() / rb * t.row_stride(),
        "room for the results"
    );
}

/// What the tile kernels' safety contract asks of their arguments: one
/// whole tile, an activation of its length.
#[cfg(target_arch = "x86_64")]
fn check_tile_args(tile: &[u8], blocks: usize, x: &Q8Activation) {
    assert_eq!(tile.len(), q4_0_tiles::tile_bytes(blocks), "one whole tile");
    assert!(
        x.quants.len() >= blocks * QK && x.scales.len() >= blocks && x.bsums8.len() >= blocks,
        "an activation of the tile's length"
    );
}

/// What the several-token tile kernels' safety contract asks of their
/// arguments: [`check_tile_args`] for every activation, at most
/// [`TILE_TOKENS`] of them, an output for each.
#[cfg(target_arch = "x86_64")]
fn check_tiles_args(tile: &[u8], blocks: usize, xs: &[&Q8Activation], out: &[[f32; 16]]) {
    assert!(xs.len() <= TILE_TOKENS && out.len() >= xs.len(), "tokens");
    xs.iter().for_each(|x| check_tile_args(tile, blocks, x));
}

/// What the panel kernels' safety contract asks of their arguments: a
/// panel format, whole super-blocks, at most [`k_panels::PANEL_TOKENS`]
/// activations of the rows' length, an output for each.
#[cfg(target_arch = "x86_64")]
fn check_panel_args(
    format: WeightFormat,
    panel: &[u8],
    supers: usize,
    xs: &[&Q8Activation],
    out: &[[f32; 16]],
) {
    let size = k_panels::super_bytes(format).expect("a panel format");
    assert_eq!(
        panel.len(),
        k_panels::PANEL_ROWS * supers * size,
        "whole super-blocks"
    );
    assert!(
        xs.len() <= k_panels::PANEL_TOKENS && out.len() >= xs.len(),
        "tokens"
    );
    let n = supers * quant::QK_K;
    for x in xs {
        assert!(
            x.quants.len() >= n
                && x.scales.len() >= n / 32
                && x.bsums8.len() >= n / 32
                && x.bsums16.len() >= n / 16,
            "an activation of the rows' length"
        );
    }
}

/// What the one-row, several-vector 16-bit kernels' safety contract asks
/// of their arguments: vectors of the row's length, an output for each.
#[cfg(target_arch = "x86_64")]
fn check_multi16_args(w: &[u16], xs: &[&[f32]], out: &[f32]) {
    let Some(n) = xs.first().map(|x| x.len()) else {
        return;
    };
    assert!(
        n > 0 && xs.iter().all(|x| x.len() == n),
        "non-empty vectors of one length"
    );
    assert!(w.len().is_multiple_of(n), "whole rows");
    assert!(
        out.len() >= w.len() / n * xs.len(),
        "an output per row and vector"
    );
}

/// What the quads kernels' safety contract asks of their arguments: whole
/// groups of columns, one output per row.
#[cfg(target_arch = "x86_64")]
fn check_quads16_args(w: &[u16], x: &[f32], out: &[f32]) {
    check_quads16_cols(std::slice::from_ref(&x));
    assert_eq!(w.len(), out.len() * x.len(), "whole rows, one output each");
}

/// Vectors of whole groups of a quad's columns.
#[cfg(target_arch = "x86_64")]
fn check_quads16_cols(xs: &[&[f32]]) {
    assert!(
        xs.iter()
            .all(|x| x.len().is_multiple_of(quads16::GROUP_COLS)),
        "whole groups of columns"
    );
}

/// What the grouped weighted sums' safety contract asks of their arguments.
#[cfg(target_arch = "x86_64")]
fn check_weighted_rows_group(
    o: &[f32],
    g: usize,
    s: &[f32],
    s_stride: usize,
    rows: usize,
    v: &[f32],
    v_stride: usize,
) {
    assert!(g > 0 && o.len().is_multiple_of(g), "g whole heads");
    assert!(
        s.len() >= (g - 1) * s_stride + rows,
        "every head's weights in bounds"
    );
    if let Some(last) = rows.checked_sub(1) {
        assert!(
            v.len() >= last * v_stride + o.len() / g,
            "value rows in bounds"
        );
    }
}

/// What `dot_f32_rows_group`'s safety contract asks of its arguments.
#[cfg(target_arch = "x86_64")]
fn check_rows_group(qs: &[f32], g: usize, k: &[f32], stride: usize, out: &[f32]) {
    assert!(
        g > 0 && qs.len().is_multiple_of(g) && out.len().is_multiple_of(g),
        "g whole queries"
    );
    let (d, rows) = (qs.len() / g, out.len() / g);
    assert!(
        rows == 0 || k.len() >= (rows - 1) * stride + d,
        "room for every row"
    );
}

/// A matrix–matrix Q4_0 kernel and the token-group width its
/// [`Q8Tiles`] are built with: `run(rows, tiles, scratch, out)` multiplies
/// whole rows into every token, row `r`'s results at `out[r ·
/// tiles.row_stride()..]`. Below `min_tokens` the few-token kernel (or a
/// token at a time) is faster; the results are the same either way.
/// Measured with `cargo bench --bench kernels -- --format q4_0`
/// (docs/benchmarks.md), GB/s of weights × tokens: AVX-512, 4 tokens 30
/// a token at a time against 15–20 in the kernel, 8 tokens 31 against
/// 42–44; AVX2, 4 tokens 33 in the few-token kernel against 22–25, 8
/// tokens 32 against 45–50.
#[derive(Clone, Copy)]
pub struct GemmQ4 {
    pub width: usize,
    /// Fewest tokens for which it beats a token at a time.
    pub min_tokens: usize,
    pub run: fn(&[u8], &Q8Tiles, &mut RowScratch, &mut [f32]),
}

pub const SCALAR: KernelSet = KernelSet {
    name: "scalar",
    dot_f32: scalar::dot_f32,
    dot_bf16: scalar::dot_bf16,
    dot_bf16_rows: None,
    dot_f16_rows: None,
    dot_bf16_quads: None,
    dot_f16_quads: None,
    dot_bf16_quads_multi: None,
    dot_f16_quads_multi: None,
    dot_bf16_multi: None,
    dot_f16_multi: None,
    dot_f16: scalar::dot_f16,
    dot_fp8: scalar::dot_fp8,
    dot_q8_0: scalar::dot_q8_0,
    dot_q4_0: scalar::dot_q4_0,
    dot_f32_rows: scalar::dot_f32_rows,
    dot_f32_rows_group: None,
    weighted_rows: scalar::weighted_rows,
    weighted_rows_group: None,
    dot_q8_0_q8: q8act::dot_q8_0_q8,
    dot_q4_0_q8: q4_0::dot_q4_0_q8,
    dot_q6_k_q8: q6_k::dot_q6_k_q8,
    dot_q4_k_q8: q4_k::dot_q4_k_q8,
    dot_q5_k_q8: q4_k::dot_q5_k_q8,
    dot_more_q8,
    dot_more_q8_multi: None,
    dot_q8_0_q8_multi: q8act::dot_q8_0_q8_multi,
    dot_q8_0_q8_pair: None,
    dot_q4_0_q8_multi: None,
    gemm_q4_0_q8: None,
    dot_q4_0_tile: None,
    dot_q4_0_tiles: None,
    dot_iq4_nl_tiles: None,
    amx_q4_0_tiles: None,
    amx_iq4_nl_tiles: None,
    dot_k_panels: None,
    dot_q6_k_panels: None,
    dot_low_k_panels: None,
    dot_iq4_xs_panels: None,
    int_activations: true,
    vector_quantize: false,
};

#[cfg(target_arch = "x86_64")]
mod avx2_wrappers {
    // SAFETY (all of them): these wrappers are only installed by `select` after
    // `is_x86_feature_detected!` confirmed avx2, fma and f16c.
    pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
        unsafe { super::x86::dot_f32(w, x) }
    }
    pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
        unsafe { super::x86::dot_bf16(w, x) }
    }
    pub fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
        unsafe { super::x86::dot_f16(w, x) }
    }
    pub fn dot_fp8(w: &[u8], x: &[f32], s: &[f32], block: usize) -> f32 {
        if !block.is_multiple_of(8) {
            return super::scalar::dot_fp8(w, x, s, block);
        }
        unsafe { super::x86::dot_fp8(w, x, s, block) }
    }
    pub fn dot_q8_0(w: &[u8], x: &[f32]) -> f32 {
        unsafe { super::x86::dot_q8_0(w, x) }
    }
    pub fn dot_q4_0(w: &[u8], x: &[f32]) -> f32 {
        unsafe { super::x86::dot_q4_0(w, x) }
    }
    /// Also checks the rows' extent, which the kernel's contract asks for.
    pub fn dot_f32_rows(q: &[f32], k: &[f32], stride: usize, out: &mut [f32]) {
        if let Some(last) = out.len().checked_sub(1) {
            assert!(k.len() >= last * stride + q.len(), "key rows in bounds");
        }
        unsafe { super::x86::dot_f32_rows(q, k, stride, out) }
    }
    /// Also checks the lengths its safety contract asks for.
    pub fn dot_f32_rows_group(
        qs: &[f32],
        g: usize,
        k: &[f32],
        stride: usize,
        out: &mut [f32],
        ahead: bool,
    ) {
        super::check_rows_group(qs, g, k, stride, out);
        unsafe { super::x86::dot_f32_rows_group(qs, g, k, stride, out, ahead) }
    }
    /// Also checks the rows' extent, which the kernel's contract asks for.
    pub fn weighted_rows(o: &mut [f32], s: &[f32], v: &[f32], stride: usize) {
        if let Some(last) = s.len().checked_sub(1) {
            assert!(v.len() >= last * stride + o.len(), "value rows in bounds");
        }
        unsafe { super::x86::weighted_rows(o, s, v, stride) }
    }
    /// Also checks the extents its safety contract asks for.
    #[allow(clippy::too_many_arguments)]
    pub fn weighted_rows_group(
        o: &mut [f32],
        g: usize,
        s: &[f32],
        s_stride: usize,
        rows: usize,
        v: &[f32],
        v_stride: usize,
        ahead: bool,
    ) {
        super::check_weighted_rows_group(o, g, s, s_stride, rows, v, v_stride);
        unsafe { super::x86::weighted_rows_group_avx2(o, g, s, s_stride, rows, v, v_stride, ahead) }
    }
    pub fn dot_q8_0_q8(w: &[u8], x: &super::Q8Activation) -> f32 {
        unsafe { super::q8act::avx2::dot_q8_0_q8(w, x) }
    }
    pub fn dot_q4_0_q8(w: &[u8], x: &super::Q8Activation) -> f32 {
        unsafe { super::q4_0::avx2::dot_q4_0_q8(w, x) }
    }
    /// Also checks the lengths the kernel's contract asks for.
    pub fn dot_q6_k_q8(w: &[u8], x: &super::Q8Activation) -> f32 {
        q6_k_lengths(w, x);
        unsafe { super::q6_k::avx2::dot_q6_k_q8(w, x) }
    }
    /// The lengths the Q6_K row kernels' contract asks for.
    pub(super) fn q6_k_lengths(w: &[u8], x: &super::Q8Activation) {
        let supers = w.len() / crate::quant::Q6_K_BLOCK_BYTES;
        assert!(
            x.quants.len() >= supers * crate::quant::QK_K
                && x.scales.len() >= supers * crate::quant::QK_K / crate::quant::QK
                && x.bsums16.len() >= supers * crate::quant::QK_K / 16,
            "an activation of the row's length"
        );
    }
    /// Also checks the lengths the kernels' contract asks for.
    pub fn dot_q4_k_q8(w: &[u8], x: &super::Q8Activation) -> f32 {
        k4_lengths(w.len() / crate::quant::Q4_K_BLOCK_BYTES, x);
        unsafe { super::q4_k::avx2::dot_q4_k_q8(w, x) }
    }
    pub fn dot_q5_k_q8(w: &[u8], x: &super::Q8Activation) -> f32 {
        k4_lengths(w.len() / crate::quant::Q5_K_BLOCK_BYTES, x);
        unsafe { super::q4_k::avx2::dot_q5_k_q8(w, x) }
    }
    /// Also checks that `w` is whole blocks and `x` of its length (its
    /// split quants included), which the kernels' contract asks for.
    pub fn dot_more_q8(f: super::WeightFormat, w: &[u8], x: &super::Q8Activation) -> f32 {
        use super::WeightFormat;
        use super::{legacy_q8::avx2 as legacy, low_k::avx2 as low};
        more_q8_lengths(f, w, x);
        unsafe {
            match f {
                WeightFormat::Q4_1 => legacy::dot_q4_1_q8(w, x),
                WeightFormat::Q5_0 => legacy::dot_q5_0_q8(w, x),
                WeightFormat::Q5_1 => legacy::dot_q5_1_q8(w, x),
                WeightFormat::Iq4Nl => legacy::dot_iq4_nl_q8(w, x),
                WeightFormat::Q2K => low::dot_q2_k_q8(w, x),
                WeightFormat::Q3K => low::dot_q3_k_q8(w, x),
                WeightFormat::Iq4Xs => low::dot_iq4_xs_q8(w, x),
                other => panic!("{other:?} has a kernel of its own"),
            }
        }
    }
    /// Up to `MULTI` activations against one row; also checks that `w`
    /// is whole blocks, every activation of its length (split quants
    /// included) and an output for each, which the kernels' contract asks
    /// for.
    pub fn dot_more_q8_multi(
        f: super::WeightFormat,
        w: &[u8],
        xs: &[&super::Q8Activation],
        out: &mut [f32],
    ) {
        use super::WeightFormat;
        use super::{legacy_q8::avx2 as legacy, low_k::avx2 as low};
        more_q8_multi_lengths(f, w, xs, out);
        // SAFETY: `select` installs this set only on a CPU with AVX2, FMA
        // and F16C; the lengths were checked.
        unsafe {
            match f {
                WeightFormat::Q4_1 => legacy::dot_q4_1_q8_multi(w, xs, out),
                WeightFormat::Q5_0 => legacy::dot_q5_0_q8_multi(w, xs, out),
                WeightFormat::Q5_1 => legacy::dot_q5_1_q8_multi(w, xs, out),
                WeightFormat::Iq4Nl => legacy::dot_iq4_nl_q8_multi(w, xs, out),
                WeightFormat::Q2K => low::dot_q2_k_q8_multi(w, xs, out),
                WeightFormat::Q3K => low::dot_q3_k_q8_multi(w, xs, out),
                WeightFormat::Iq4Xs => low::dot_iq4_xs_q8_multi(w, xs, out),
                other => panic!("{other:?} has a kernel of its own"),
            }
        }
    }
    /// [`more_q8_lengths`] for every activation, at most `MULTI` of them,
    /// and an output for each.
    pub(super) fn more_q8_multi_lengths(
        f: super::WeightFormat,
        w: &[u8],
        xs: &[&super::Q8Activation],
        out: &[f32],
    ) {
        assert!(
            xs.len() <= super::q8act::MULTI && out.len() >= xs.len(),
            "at most MULTI activations, an output for each"
        );
        let blocks = more_q8_blocks(f, w);
        for x in xs {
            activation_lengths(blocks, x);
        }
    }
    /// Checks that `w` is whole blocks of `f` and `x` of its length (its
    /// split quants included), which the kernels' contract asks for.
    pub(super) fn more_q8_lengths(f: super::WeightFormat, w: &[u8], x: &super::Q8Activation) {
        activation_lengths(more_q8_blocks(f, w), x);
    }
    /// The blocks of 32 elements in `w`, checked to be whole blocks of `f`.
    fn more_q8_blocks(f: super::WeightFormat, w: &[u8]) -> usize {
        let (elements, bytes) = super::more_q8_block(f);
        assert!(w.len().is_multiple_of(bytes), "whole blocks");
        w.len() / bytes * elements / crate::quant::QK
    }
    /// Checks that `x` has `blocks` blocks of quants, scales, sums (of 32
    /// and of 16) and split quants.
    fn activation_lengths(blocks: usize, x: &super::Q8Activation) {
        assert!(
            x.quants.len() >= blocks * crate::quant::QK
                && x.scales.len() >= blocks
                && x.bsums8.len() >= blocks
                && x.bsums16.len() >= 2 * blocks
                && x.split.len() >= blocks.div_ceil(4) * 128,
            "an activation of the row's length"
        );
    }
    fn k4_lengths(supers: usize, x: &super::Q8Activation) {
        let blocks = supers * crate::quant::QK_K / crate::quant::QK;
        assert!(
            x.quants.len() >= blocks * crate::quant::QK
                && x.scales.len() >= blocks
                && x.bsums8.len() >= blocks,
            "an activation of the row's length"
        );
    }
    pub fn dot_q8_0_q8_multi(w: &[u8], xs: &[&super::Q8Activation], out: &mut [f32]) {
        unsafe { super::q8act::avx2::dot_q8_0_q8_multi(w, xs, out) }
    }
    pub fn dot_q4_0_q8_multi(w: &[u8], xs: &[&super::Q8Activation], out: &mut [f32]) {
        unsafe { super::q4_0::avx2::dot_q4_0_q8_multi(w, xs, out) }
    }
    /// Also checks the tiles' width and the output's length, which the
    /// kernel's safety contract asks for.
    pub fn gemm_q4_0_q8(
        w: &[u8],
        t: &super::Q8Tiles,
        row: &mut super::RowScratch,
        out: &mut [f32],
    ) {
        super::check_gemm_args(w, t, out, super::q4_0::avx2::WIDTH);
        unsafe { super::q4_0::avx2::gemm_q4_0_q8(w, t, row, out) }
    }
    /// Also checks the lengths, which the kernel's safety contract asks
    /// for.
    pub fn dot_bf16_rows(w: &[u16], x: &[f32], out: &mut [f32]) {
        assert_eq!(w.len(), out.len() * x.len(), "whole rows, one output each");
        unsafe { super::x86::dot_bf16_rows(w, x, out) }
    }
    /// Also checks the lengths, which the kernels' safety contract asks
    /// for.
    pub fn dot_bf16_multi(w: &[u16], xs: &[&[f32]], out: &mut [f32]) {
        super::check_multi16_args(w, xs, out);
        unsafe { super::x86::dot_bf16_multi(w, xs, out) }
    }
    pub fn dot_f16_multi(w: &[u16], xs: &[&[f32]], out: &mut [f32]) {
        super::check_multi16_args(w, xs, out);
        unsafe { super::x86::dot_f16_multi(w, xs, out) }
    }
    /// Also checks the lengths, which the kernel's safety contract asks
    /// for.
    pub fn dot_f16_rows(w: &[u16], x: &[f32], out: &mut [f32]) {
        assert_eq!(w.len(), out.len() * x.len(), "whole rows, one output each");
        unsafe { super::x86::dot_f16_rows(w, x, out) }
    }
    /// Also checks the lengths, which the kernel's safety contract asks
    /// for.
    pub fn dot_bf16_quads(w: &[u16], x: &[f32], out: &mut [f32]) {
        super::check_quads16_args(w, x, out);
        unsafe { super::x86::dot_bf16_quads(w, x, out) }
    }
    pub fn dot_f16_quads(w: &[u16], x: &[f32], out: &mut [f32]) {
        super::check_quads16_args(w, x, out);
        unsafe { super::x86::dot_f16_quads(w, x, out) }
    }
    /// Also checks the lengths, which the kernels' safety contract asks
    /// for.
    pub fn dot_bf16_quads_multi(w: &[u16], xs: &[&[f32]], out: &mut [f32]) {
        super::check_multi16_args(w, xs, out);
        super::check_quads16_cols(xs);
        unsafe { super::x86::dot_bf16_quads_multi(w, xs, out) }
    }
    pub fn dot_f16_quads_multi(w: &[u16], xs: &[&[f32]], out: &mut [f32]) {
        super::check_multi16_args(w, xs, out);
        super::check_quads16_cols(xs);
        unsafe { super::x86::dot_f16_quads_multi(w, xs, out) }
    }
    /// Also checks the tile's and the activation's lengths, which the
    /// kernel's safety contract asks for.
    pub fn dot_q4_0_tile(tile: &[u8], blocks: usize, x: &super::Q8Activation, out: &mut [f32; 16]) {
        super::check_tile_args(tile, blocks, x);
        unsafe { super::q4_0_tiles::avx2::dot_tile(tile, blocks, x, out) }
    }
    /// Also checks every activation's length and the output count.
    pub fn dot_q4_0_tiles(
        tile: &[u8],
        blocks: usize,
        xs: &[&super::Q8Activation],
        out: &mut [[f32; 16]],
        next: &[u8],
    ) {
        super::check_tiles_args(tile, blocks, xs, out);
        unsafe { super::q4_0_tiles::avx2::dot_tiles(tile, blocks, xs, out, next) }
    }
    /// Also checks the panel, every activation's length and the outputs.
    pub fn dot_k_panels(
        format: super::WeightFormat,
        panel: &[u8],
        supers: usize,
        xs: &[&super::Q8Activation],
        out: &mut [[f32; 16]],
    ) {
        super::check_panel_args(format, panel, supers, xs, out);
        unsafe { super::k_panels::avx2::dot_panel(format, panel, supers, xs, out) }
    }
    /// Also checks the panel, every activation's length and the outputs.
    pub fn dot_q6_k_panels(
        format: super::WeightFormat,
        panel: &[u8],
        supers: usize,
        xs: &[&super::Q8Activation],
        out: &mut [[f32; 16]],
    ) {
        super::check_panel_args(format, panel, supers, xs, out);
        assert_eq!(format, super::WeightFormat::Q6K, "a Q6_K panel");
        unsafe { super::k_panels::avx2_q6_k::dot_panel(format, panel, supers, xs, out) }
    }
    /// Also checks the panel, every activation's length (`bsums16`
    /// included) and the outputs.
    pub fn dot_low_k_panels(
        format: super::WeightFormat,
        panel: &[u8],
        supers: usize,
        xs: &[&super::Q8Activation],
        out: &mut [[f32; 16]],
    ) {
        super::check_panel_args(format, panel, supers, xs, out);
        unsafe { super::k_panels::low_k::avx2::dot_panel(format, panel, supers, xs, out) }
    }
}

#[cfg(target_arch = "x86_64")]
pub const AVX2: KernelSet = KernelSet {
    name: "avx2+fma",
    dot_f32: avx2_wrappers::dot_f32,
    dot_bf16: avx2_wrappers::dot_bf16,
    dot_bf16_rows: Some(avx2_wrappers::dot_bf16_rows),
    dot_f16_rows: Some(avx2_wrappers::dot_f16_rows),
    dot_bf16_quads: Some(avx2_wrappers::dot_bf16_quads),
    dot_f16_quads: Some(avx2_wrappers::dot_f16_quads),
    dot_bf16_quads_multi: Some(avx2_wrappers::dot_bf16_quads_multi),
    dot_f16_quads_multi: Some(avx2_wrappers::dot_f16_quads_multi),
    dot_bf16_multi: Some(avx2_wrappers::dot_bf16_multi),
    dot_f16_multi: Some(avx2_wrappers::dot_f16_multi),
    dot_f16: avx2_wrappers::dot_f16,
    dot_fp8: avx2_wrappers::dot_fp8,
    dot_q8_0: avx2_wrappers::dot_q8_0,
    dot_q4_0: avx2_wrappers::dot_q4_0,
    dot_f32_rows: avx2_wrappers::dot_f32_rows,
    dot_f32_rows_group: Some(avx2_wrappers::dot_f32_rows_group),
    weighted_rows: avx2_wrappers::weighted_rows,
    weighted_rows_group: Some(avx2_wrappers::weighted_rows_group),
    dot_q8_0_q8: avx2_wrappers::dot_q8_0_q8,
    dot_q4_0_q8: avx2_wrappers::dot_q4_0_q8,
    dot_q6_k_q8: avx2_wrappers::dot_q6_k_q8,
    dot_q4_k_q8: avx2_wrappers::dot_q4_k_q8,
    dot_q5_k_q8: avx2_wrappers::dot_q5_k_q8,
    dot_more_q8: avx2_wrappers::dot_more_q8,
    dot_more_q8_multi: Some(avx2_wrappers::dot_more_q8_multi),
    dot_q8_0_q8_multi: avx2_wrappers::dot_q8_0_q8_multi,
    dot_q8_0_q8_pair: None,
    dot_q4_0_q8_multi: Some(avx2_wrappers::dot_q4_0_q8_multi),
    gemm_q4_0_q8: Some(GemmQ4 {
        width: q4_0::avx2::WIDTH,
        min_tokens: 6,
        run: avx2_wrappers::gemm_q4_0_q8,
    }),
    dot_q4_0_tile: Some(avx2_wrappers::dot_q4_0_tile),
    dot_q4_0_tiles: Some(avx2_wrappers::dot_q4_0_tiles),
    dot_iq4_nl_tiles: None,
    amx_q4_0_tiles: None,
    amx_iq4_nl_tiles: None,
    dot_k_panels: Some(avx2_wrappers::dot_k_panels),
    dot_q6_k_panels: Some(avx2_wrappers::dot_q6_k_panels),
    dot_low_k_panels: Some(avx2_wrappers::dot_low_k_panels),
    dot_iq4_xs_panels: Some(avx2_wrappers::dot_low_k_panels),
    int_activations: true,
    vector_quantize: true,
};

#[cfg(target_arch = "x86_64")]
mod avx512_wrappers {
    // SAFETY (all of them): installed by `select` only after
    // `is_x86_feature_detected!` confirmed avx512f/bw/vl/vnni/vbmi, avx2,
    // fma and f16c.
    pub fn dot_q4_0_q8(w: &[u8], x: &super::Q8Activation) -> f32 {
        unsafe { super::q4_0::avx512::dot_q4_0_q8(w, x) }
    }
    /// After the length checks the kernel's contract asks for.
    pub fn dot_q6_k_q8(w: &[u8], x: &super::Q8Activation) -> f32 {
        super::avx2_wrappers::q6_k_lengths(w, x);
        unsafe { super::q6_k::avx512::dot_q6_k_q8(w, x) }
    }
    /// Q2_K, Q3_K (where the CPU has GFNI, as every AVX-512 VNNI CPU
    /// since Ice Lake and Zen 4 does) and IQ4_XS by their AVX-512 kernels, after the
    /// length checks their contract asks for; the other formats by AVX2's.
    pub fn dot_more_q8(f: super::WeightFormat, w: &[u8], x: &super::Q8Activation) -> f32 {
        use super::WeightFormat;
        use super::low_k::avx512 as low;
        match f {
            WeightFormat::Q2K => {
                super::avx2_wrappers::more_q8_lengths(f, w, x);
                // SAFETY: `select` installs this set only on a CPU with
                // everything the module asks for; the lengths were checked.
                unsafe { low::dot_q2_k_q8(w, x) }
            }
            WeightFormat::Q3K if is_x86_feature_detected!("gfni") => {
                super::avx2_wrappers::more_q8_lengths(f, w, x);
                // SAFETY: as for Q2_K, and the CPU has GFNI (checked here).
                unsafe { low::dot_q3_k_q8(w, x) }
            }
            WeightFormat::Iq4Xs => {
                super::avx2_wrappers::more_q8_lengths(f, w, x);
                // SAFETY: as for Q2_K.
                unsafe { low::dot_iq4_xs_q8(w, x) }
            }
            _ => super::avx2_wrappers::dot_more_q8(f, w, x),
        }
    }
    /// [`dot_more_q8`]'s choice of kernels for up to `MULTI` activations,
    /// after the length checks their contract asks for.
    pub fn dot_more_q8_multi(
        f: super::WeightFormat,
        w: &[u8],
        xs: &[&super::Q8Activation],
        out: &mut [f32],
    ) {
        use super::WeightFormat;
        use super::avx2_wrappers::more_q8_multi_lengths;
        use super::low_k::avx512 as low;
        match f {
            WeightFormat::Q2K => {
                more_q8_multi_lengths(f, w, xs, out);
                // SAFETY: `select` installs this set only on a CPU with
                // everything the module asks for; the lengths were checked.
                unsafe { low::dot_q2_k_q8_multi(w, xs, out) }
            }
            WeightFormat::Q3K if is_x86_feature_detected!("gfni") => {
                more_q8_multi_lengths(f, w, xs, out);
                // SAFETY: as for Q2_K, and the CPU has GFNI (checked here).
                unsafe { low::dot_q3_k_q8_multi(w, xs, out) }
            }
            WeightFormat::Iq4Xs => {
                more_q8_multi_lengths(f, w, xs, out);
                // SAFETY: as for Q2_K.
                unsafe { low::dot_iq4_xs_q8_multi(w, xs, out) }
            }
            _ => super::avx2_wrappers::dot_more_q8_multi(f, w, xs, out),
        }
    }
    /// Also checks the rows' and the activations' lengths and the token
    /// count, which the kernel's safety contract asks for.
    pub fn dot_q8_0_q8_pair(
        w0: &[u8],
        w1: &[u8],
        xs: &[&super::Q8Activation],
        out: &mut [[f32; 2]],
    ) {
        use super::q8act::avx512::PAIR_TOKENS;
        let blocks = w0.len() / super::Q8_0_BLOCK_BYTES;
        assert!(
            w1.len() == w0.len() && w0.len() == blocks * super::Q8_0_BLOCK_BYTES,
            "two whole Q8_0 rows of one length"
        );
        assert!(
            xs.len() <= PAIR_TOKENS && out.len() >= xs.len(),
            "at most {PAIR_TOKENS} tokens, a result pair for each"
        );
        for x in xs {
            assert!(
                x.quants.len() >= blocks * super::QK && x.scales.len() >= blocks,
                "an activation as long as the rows"
            );
        }
        unsafe { super::q8act::avx512::dot_q8_0_q8_pair(w0, w1, xs, out) }
    }
    /// Also checks the lengths its safety contract asks for.
    pub fn dot_f32_rows_group(
        qs: &[f32],
        g: usize,
        k: &[f32],
        stride: usize,
        out: &mut [f32],
        ahead: bool,
    ) {
        super::check_rows_group(qs, g, k, stride, out);
        unsafe { super::x86::dot_f32_rows_group_avx512(qs, g, k, stride, out, ahead) }
    }
    /// Also checks the rows' extent, which the kernel's contract asks for.
    pub fn weighted_rows(o: &mut [f32], s: &[f32], v: &[f32], stride: usize) {
        if let Some(last) = s.len().checked_sub(1) {
            assert!(v.len() >= last * stride + o.len(), "value rows in bounds");
        }
        unsafe { super::x86::weighted_rows_avx512(o, s, v, stride) }
    }
    /// Also checks the extents its safety contract asks for.
    #[allow(clippy::too_many_arguments)]
    pub fn weighted_rows_group(
        o: &mut [f32],
        g: usize,
        s: &[f32],
        s_stride: usize,
        rows: usize,
        v: &[f32],
        v_stride: usize,
        ahead: bool,
    ) {
        super::check_weighted_rows_group(o, g, s, s_stride, rows, v, v_stride);
        unsafe {
            super::x86::weighted_rows_group_avx512(o, g, s, s_stride, rows, v, v_stride, ahead)
        }
    }
    /// Also checks the tiles' width and the output's length, which the
    /// kernel's safety contract asks for.
    pub fn gemm_q4_0_q8(
        w: &[u8],
        t: &super::Q8Tiles,
        row: &mut super::RowScratch,
        out: &mut [f32],
    ) {
        super::check_gemm_args(w, t, out, super::q4_0::avx512::WIDTH);
        unsafe { super::q4_0::avx512::gemm_q4_0_q8(w, t, row, out) }
    }
    /// Also checks the tile's and the activation's lengths, which the
    /// kernel's safety contract asks for.
    pub fn dot_q4_0_tile(tile: &[u8], blocks: usize, x: &super::Q8Activation, out: &mut [f32; 16]) {
        super::check_tile_args(tile, blocks, x);
        unsafe { super::q4_0_tiles::avx512::dot_tile(tile, blocks, x, out) }
    }
    /// Also checks every activation's length and the output count.
    pub fn dot_q4_0_tiles(
        tile: &[u8],
        blocks: usize,
        xs: &[&super::Q8Activation],
        out: &mut [[f32; 16]],
        next: &[u8],
    ) {
        super::check_tiles_args(tile, blocks, xs, out);
        unsafe { super::q4_0_tiles::avx512::dot_tiles(tile, blocks, xs, out, next) }
    }
    /// Also checks every activation's length and the output count.
    pub fn dot_iq4_nl_tiles(
        tile: &[u8],
        blocks: usize,
        xs: &[&super::Q8Activation],
        out: &mut [[f32; 16]],
        next: &[u8],
    ) {
        super::check_tiles_args(tile, blocks, xs, out);
        unsafe { super::q4_0_tiles::avx512::dot_iq4_nl_tiles(tile, blocks, xs, out, next) }
    }
    /// Also checks the panel, every activation's length and the outputs.
    pub fn dot_k_panels(
        format: super::WeightFormat,
        panel: &[u8],
        supers: usize,
        xs: &[&super::Q8Activation],
        out: &mut [[f32; 16]],
    ) {
        super::check_panel_args(format, panel, supers, xs, out);
        unsafe { super::k_panels::avx512::dot_panel(format, panel, supers, xs, out) }
    }
    /// Also checks the panel, every activation's length and the outputs.
    pub fn dot_q6_k_panels(
        format: super::WeightFormat,
        panel: &[u8],
        supers: usize,
        xs: &[&super::Q8Activation],
        out: &mut [[f32; 16]],
    ) {
        super::check_panel_args(format, panel, supers, xs, out);
        assert_eq!(format, super::WeightFormat::Q6K, "a Q6_K panel");
        unsafe { super::k_panels::avx512_q6_k::dot_panel(format, panel, supers, xs, out) }
    }
    /// Also checks the panel, every activation's length (`bsums16`
    /// included) and the outputs.
    pub fn dot_low_k_panels(
        format: super::WeightFormat,
        panel: &[u8],
        supers: usize,
        xs: &[&super::Q8Activation],
        out: &mut [[f32; 16]],
    ) {
        super::check_panel_args(format, panel, supers, xs, out);
        unsafe { super::k_panels::low_k::avx512::dot_panel(format, panel, supers, xs, out) }
    }
}

/// AVX2 with the Q4_0 integer kernels on AVX-512 VNNI (Q8_0 already
/// reaches memory bandwidth with AVX2; docs/benchmarks.md), and Q2_K's
/// and Q3_K's (compute-bound with AVX2: [`low_k::avx512`]).
#[cfg(target_arch = "x86_64")]
pub const AVX512_VNNI: KernelSet = KernelSet {
    name: "avx512-vnni",
    dot_q4_0_q8: avx512_wrappers::dot_q4_0_q8,
    gemm_q4_0_q8: Some(GemmQ4 {
        width: q4_0::avx512::WIDTH,
        min_tokens: 6,
        run: avx512_wrappers::gemm_q4_0_q8,
    }),
    dot_q4_0_tile: Some(avx512_wrappers::dot_q4_0_tile),
    dot_q4_0_tiles: Some(avx512_wrappers::dot_q4_0_tiles),
    dot_iq4_nl_tiles: Some(avx512_wrappers::dot_iq4_nl_tiles),
    dot_k_panels: Some(avx512_wrappers::dot_k_panels),
    dot_q6_k_panels: Some(avx512_wrappers::dot_q6_k_panels),
    dot_low_k_panels: Some(avx512_wrappers::dot_low_k_panels),
    dot_iq4_xs_panels: Some(avx512_wrappers::dot_low_k_panels),
    dot_f32_rows_group: Some(avx512_wrappers::dot_f32_rows_group),
    weighted_rows: avx512_wrappers::weighted_rows,
    weighted_rows_group: Some(avx512_wrappers::weighted_rows_group),
    dot_q6_k_q8: avx512_wrappers::dot_q6_k_q8,
    dot_more_q8: avx512_wrappers::dot_more_q8,
    dot_more_q8_multi: Some(avx512_wrappers::dot_more_q8_multi),
    dot_q8_0_q8_pair: Some(avx512_wrappers::dot_q8_0_q8_pair),
    ..AVX2
};

/// [`AVX512_VNNI`] for CPUs that execute a 512-bit vector operation as
/// two 256-bit halves (AMD Zen 4, [`splits_512_bit`]): the one-token tile
/// kernel is AVX2's. On a Zen 4 VM it streamed a decode's experts 3–6%
/// faster than the AVX-512 one, on the H200 host's Xeon 2–4% slower
/// (`cargo bench --bench kernels -- --experts 640`, both in one run;
/// docs/benchmarks.md, "One-token tiles on Zen 4"). The several-token
/// kernels stay AVX-512 (on the same Zen 4, 3.2 against 5.8 ns per block
/// and token). The bits are the same: every tile kernel gives each row
/// exactly what [`q4_0::dot_q4_0_q8`] gives.
#[cfg(target_arch = "x86_64")]
pub const AVX512_VNNI_HALF_WIDTH: KernelSet = KernelSet {
    name: "avx512-vnni, avx2 one-token tiles",
    dot_q4_0_tile: Some(avx2_wrappers::dot_q4_0_tile),
    ..AVX512_VNNI
};

/// The family of an x86 CPU from CPUID leaf 1's EAX: the base family,
/// plus the extended family where the base is 0xF.
#[cfg(target_arch = "x86_64")]
fn x86_family(eax: u32) -> u32 {
    let base = (eax >> 8) & 0xf;
    if base == 0xf {
        base + ((eax >> 20) & 0xff)
    } else {
        base
    }
}

/// Whether this CPU executes 512-bit vector operations as two 256-bit
/// halves: AMD family 19h with AVX-512, that is Zen 4 (Zen 3, the same
/// family, has no AVX-512; Zen 5, family 1Ah, has full-width units).
#[cfg(target_arch = "x86_64")]
pub fn splits_512_bit() -> bool {
    use std::arch::x86_64::__cpuid;
    // CPUID leaves 0 (vendor) and 1 (family) exist on every x86-64 CPU.
    let (vendor, id) = (__cpuid(0), __cpuid(1));
    let amd = (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163);
    amd && x86_family(id.eax) == 0x19 && is_x86_feature_detected!("avx512f")
}

/// Whether this CPU runs [`AVX512_VNNI`].
#[cfg(target_arch = "x86_64")]
pub fn has_avx512_vnni() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vbmi")
}

#[cfg(target_arch = "x86_64")]
mod amx_wrappers {
    use super::q4_0_amx::{self, Scratch, Tokens};
    use super::q4_0_tiles::TILE_ROWS;

    /// `NL`: IQ4_NL rows tiled as Q4_0's. The kernel checks its tile,
    /// passes and output; AMX being here is checked here (a cached probe).
    pub fn dot_tiles<const NL: bool>(
        tile: &[u8],
        blocks: usize,
        passes: &[Tokens],
        scratch: &mut Scratch,
        out: &mut [[f32; TILE_ROWS]],
        next: &[u8],
    ) {
        assert!(q4_0_amx::available(), "AMX on this CPU");
        // SAFETY: AMX (with AVX-512, which `available` requires) checked
        // just above; the kernel checks its arguments.
        unsafe { q4_0_amx::x86::dot_tiles::<NL>(tile, blocks, passes, scratch, out, next) }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon_wrappers {
    // NEON is baseline on aarch64 (neon.rs asserts it at compile time) and
    // the kernels check the lengths they read, so every call is sound.
    use super::{Q8Activation, neon};

    pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::dot_f32(w, x) }
    }
    pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::dot_bf16(w, x) }
    }
    pub fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::dot_f16(w, x) }
    }
    pub fn dot_q8_0(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::dot_q8_0(w, x) }
    }
    pub fn dot_q4_0(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::dot_q4_0(w, x) }
    }
    pub fn dot_f32_rows(q: &[f32], k: &[f32], stride: usize, out: &mut [f32]) {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::dot_f32_rows(q, k, stride, out) }
    }
    pub fn weighted_rows(o: &mut [f32], s: &[f32], v: &[f32], stride: usize) {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::weighted_rows(o, s, v, stride) }
    }
    pub fn dot_q8_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::base::dot_q8_0_q8(w, x) }
    }
    pub fn dot_q4_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::base::dot_q4_0_q8(w, x) }
    }
    pub fn dot_q6_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::base::dot_q6_k_q8(w, x) }
    }
    pub fn dot_q4_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::base::dot_q4_k_q8(w, x) }
    }
    pub fn dot_q5_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::base::dot_q5_k_q8(w, x) }
    }
    /// Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K and IQ4_XS by format; the
    /// kernel checks the lengths as `avx2_wrappers::more_q8_lengths` does.
    pub fn dot_more_q8(f: super::WeightFormat, w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::base::dot_more_q8(f, w, x) }
    }
    /// [`dot_more_q8`]'s formats, up to `MULTI` activations; the kernel
    /// checks the lengths as `avx2_wrappers::more_q8_multi_lengths` does.
    pub fn dot_more_q8_multi(
        f: super::WeightFormat,
        w: &[u8],
        xs: &[&Q8Activation],
        out: &mut [f32],
    ) {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::base::dot_more_q8_multi(f, w, xs, out) }
    }
    pub fn dot_q8_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::base::dot_q8_0_q8_multi(w, xs, out) }
    }
    pub fn dot_q4_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::base::dot_q4_0_q8_multi(w, xs, out) }
    }
    pub fn dot_k_panels(
        format: super::WeightFormat,
        panel: &[u8],
        supers: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; 16]],
    ) {
        // SAFETY: NEON is present (baseline).
        unsafe { neon::base::dot_k_panels(format, panel, supers, xs, out) }
    }
}

/// NEON, baseline on aarch64. FP8 keeps the scalar kernel (NEON has no
/// gather for its 256-entry f32 table; a vector form is unwritten and
/// NEON speed is unmeasured); Q4_0 batches have no matrix–matrix kernel and
/// run the few-token kernel 4 tokens at a time.
#[cfg(target_arch = "aarch64")]
pub const NEON: KernelSet = KernelSet {
    name: "neon",
    dot_f32: neon_wrappers::dot_f32,
    dot_bf16: neon_wrappers::dot_bf16,
    dot_bf16_rows: None,
    dot_f16_rows: None,
    dot_bf16_quads: None,
    dot_f16_quads: None,
    dot_bf16_quads_multi: None,
    dot_f16_quads_multi: None,
    dot_bf16_multi: None,
    dot_f16_multi: None,
    dot_f16: neon_wrappers::dot_f16,
    dot_fp8: scalar::dot_fp8,
    dot_q8_0: neon_wrappers::dot_q8_0,
    dot_q4_0: neon_wrappers::dot_q4_0,
    dot_f32_rows: neon_wrappers::dot_f32_rows,
    dot_f32_rows_group: None,
    weighted_rows: neon_wrappers::weighted_rows,
    weighted_rows_group: None,
    dot_q8_0_q8: neon_wrappers::dot_q8_0_q8,
    dot_q4_0_q8: neon_wrappers::dot_q4_0_q8,
    dot_q6_k_q8: neon_wrappers::dot_q6_k_q8,
    dot_q4_k_q8: neon_wrappers::dot_q4_k_q8,
    dot_q5_k_q8: neon_wrappers::dot_q5_k_q8,
    dot_more_q8: neon_wrappers::dot_more_q8,
    dot_more_q8_multi: Some(neon_wrappers::dot_more_q8_multi),
    dot_q8_0_q8_multi: neon_wrappers::dot_q8_0_q8_multi,
    dot_q8_0_q8_pair: None,
    dot_q4_0_q8_multi: Some(neon_wrappers::dot_q4_0_q8_multi),
    gemm_q4_0_q8: None,
    dot_q4_0_tile: None,
    dot_q4_0_tiles: None,
    dot_iq4_nl_tiles: None,
    amx_q4_0_tiles: None,
    amx_iq4_nl_tiles: None,
    dot_k_panels: Some(neon_wrappers::dot_k_panels),
    dot_q6_k_panels: None,
    dot_low_k_panels: Some(neon_wrappers::dot_k_panels),
    dot_iq4_xs_panels: None,
    int_activations: true,
    vector_quantize: false,
};

#[cfg(target_arch = "aarch64")]
mod dotprod_wrappers {
    // Installed by `select` only after `has_neon_dotprod()`; the kernels
    // check the lengths they read.
    use super::{Q8Activation, neon};

    pub fn dot_q8_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: dotprod detected at run time (see above).
        unsafe { neon::dotprod::dot_q8_0_q8(w, x) }
    }
    pub fn dot_q4_0_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: dotprod detected at run time (see above).
        unsafe { neon::dotprod::dot_q4_0_q8(w, x) }
    }
    pub fn dot_q6_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: dotprod detected at run time (see above).
        unsafe { neon::dotprod::dot_q6_k_q8(w, x) }
    }
    pub fn dot_q4_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: dotprod detected at run time (see above).
        unsafe { neon::dotprod::dot_q4_k_q8(w, x) }
    }
    pub fn dot_q5_k_q8(w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: dotprod detected at run time (see above).
        unsafe { neon::dotprod::dot_q5_k_q8(w, x) }
    }
    pub fn dot_more_q8(f: super::WeightFormat, w: &[u8], x: &Q8Activation) -> f32 {
        // SAFETY: dotprod detected at run time (see above).
        unsafe { neon::dotprod::dot_more_q8(f, w, x) }
    }
    pub fn dot_more_q8_multi(
        f: super::WeightFormat,
        w: &[u8],
        xs: &[&Q8Activation],
        out: &mut [f32],
    ) {
        // SAFETY: dotprod detected at run time (see above).
        unsafe { neon::dotprod::dot_more_q8_multi(f, w, xs, out) }
    }
    pub fn dot_q8_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: dotprod detected at run time (see above).
        unsafe { neon::dotprod::dot_q8_0_q8_multi(w, xs, out) }
    }
    pub fn dot_q4_0_q8_multi(w: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        // SAFETY: dotprod detected at run time (see above).
        unsafe { neon::dotprod::dot_q4_0_q8_multi(w, xs, out) }
    }
    pub fn dot_k_panels(
        format: super::WeightFormat,
        panel: &[u8],
        supers: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; 16]],
    ) {
        // SAFETY: dotprod detected at run time (see above).
        unsafe { neon::dotprod::dot_k_panels(format, panel, supers, xs, out) }
    }
}

/// [`NEON`] with the integer kernels on SDOT (ARMv8.2 `dotprod`): the same
/// results.
#[cfg(target_arch = "aarch64")]
pub const NEON_DOTPROD: KernelSet = KernelSet {
    name: "neon+dotprod",
    dot_q8_0_q8: dotprod_wrappers::dot_q8_0_q8,
    dot_q4_0_q8: dotprod_wrappers::dot_q4_0_q8,
    dot_q6_k_q8: dotprod_wrappers::dot_q6_k_q8,
    dot_q4_k_q8: dotprod_wrappers::dot_q4_k_q8,
    dot_q5_k_q8: dotprod_wrappers::dot_q5_k_q8,
    dot_more_q8: dotprod_wrappers::dot_more_q8,
    dot_more_q8_multi: Some(dotprod_wrappers::dot_more_q8_multi),
    dot_q8_0_q8_multi: dotprod_wrappers::dot_q8_0_q8_multi,
    dot_q4_0_q8_multi: Some(dotprod_wrappers::dot_q4_0_q8_multi),
    dot_k_panels: Some(dotprod_wrappers::dot_k_panels),
    dot_low_k_panels: Some(dotprod_wrappers::dot_k_panels),
    ..NEON
};

/// Whether this CPU runs [`NEON_DOTPROD`].
#[cfg(target_arch = "aarch64")]
pub fn has_neon_dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

static EXACT_QUANT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes block-quantized matrix products dequantize exactly instead of
/// quantizing their input to 8-bit blocks (slower; bit-identical to the
/// dequantized f32 model). Call before the first kernel runs (the CLI's
/// `--exact-quant`); `COLIBRI_EXACT_QUANT=1` does the same.
pub fn set_exact_quant(exact: bool) {
    EXACT_QUANT.store(exact, std::sync::atomic::Ordering::SeqCst);
}

fn select() -> KernelSet {
    let exact = EXACT_QUANT.load(std::sync::atomic::Ordering::SeqCst)
        || std::env::var_os("COLIBRI_EXACT_QUANT").is_some_and(|v| v != "0");
    let simd = select_simd();
    let one_token_tiles = std::env::var_os("COLIBRI_TILE_TOKENS").is_some_and(|v| v == "1");
    let panels = std::env::var_os("COLIBRI_NO_PANELS").is_none_or(|v| v == "0");
    // AMX beside the AVX-512 kernels (its epilogue is theirs);
    // `COLIBRI_NO_AMX=1` leaves it out, to compare (the same bits).
    #[cfg(target_arch = "x86_64")]
    let amx = simd.dot_q4_0_tiles.is_some()
        && simd.dot_iq4_nl_tiles.is_some()
        && !one_token_tiles
        && std::env::var_os("COLIBRI_NO_AMX").is_none_or(|v| v == "0")
        && q4_0_amx::available();
    #[cfg(target_arch = "x86_64")]
    let (amx_q4_0_tiles, amx_iq4_nl_tiles): (Option<PackedTilesDot>, Option<PackedTilesDot>) =
        if amx {
            (
                Some(amx_wrappers::dot_tiles::<false>),
                Some(amx_wrappers::dot_tiles::<true>),
            )
        } else {
            (None, None)
        };
    #[cfg(not(target_arch = "x86_64"))]
    let (amx_q4_0_tiles, amx_iq4_nl_tiles) = (simd.amx_q4_0_tiles, simd.amx_iq4_nl_tiles);
    #[cfg(target_arch = "x86_64")]
    let name = if amx { "avx512-vnni+amx" } else { simd.name };
    #[cfg(not(target_arch = "x86_64"))]
    let name = simd.name;
    KernelSet {
        name,
        int_activations: !exact,
        amx_q4_0_tiles,
        amx_iq4_nl_tiles,
        dot_q4_0_tiles: simd.dot_q4_0_tiles.filter(|_| !one_token_tiles),
        // `COLIBRI_NO_PANELS=1`: k-quant products token by token (to
        // compare; the bits are the same).
        dot_k_panels: simd.dot_k_panels.filter(|_| panels),
        dot_q6_k_panels: simd.dot_q6_k_panels.filter(|_| panels),
        dot_low_k_panels: simd.dot_low_k_panels.filter(|_| panels),
        dot_iq4_xs_panels: simd.dot_iq4_xs_panels.filter(|_| panels),
        // `COLIBRI_NO_TILES=1` keeps IQ4_NL rows as they are too (to
        // compare; the same bits).
        dot_iq4_nl_tiles: simd
            .dot_iq4_nl_tiles
            .filter(|_| std::env::var_os("COLIBRI_NO_TILES").is_none_or(|v| v == "0")),
        // `COLIBRI_NO_Q8_PAIRS=1`: Q8_0 rows one at a time (to compare;
        // the same bits).
        dot_q8_0_q8_pair: simd
            .dot_q8_0_q8_pair
            .filter(|_| std::env::var_os("COLIBRI_NO_Q8_PAIRS").is_none_or(|v| v == "0")),
        ..simd
    }
}

fn select_simd() -> KernelSet {
    if std::env::var_os("COLIBRI_SCALAR_KERNELS").is_some() {
        return SCALAR;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512_vnni() && std::env::var_os("COLIBRI_NO_AVX512").is_none() {
            return if splits_512_bit() {
                AVX512_VNNI_HALF_WIDTH
            } else {
                AVX512_VNNI
            };
        }
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return AVX2;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if has_neon_dotprod() {
            NEON_DOTPROD
        } else {
            NEON
        }
    }
    #[cfg(not(target_arch = "aarch64"))]
    SCALAR
}

/// The kernels this process uses (chosen once).
pub fn kernels() -> &'static KernelSet {
    static K: OnceLock<KernelSet> = OnceLock::new();
    K.get_or_init(select)
}

/// Whether Q4_0 matrices computed on this CPU should be tiled
/// ([`q4_0_tiles`]): there is a tile kernel, products quantize their input
/// and `COLIBRI_NO_TILES` is unset. Tiled or not, every product gives the
/// same bits; tiles are the faster layout where this holds.
pub fn q4_0_tiles_run_here() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var_os("COLIBRI_NO_TILES").is_some_and(|v| v != "0"));
    let k = kernels();
    k.dot_q4_0_tile.is_some() && k.int_activations && !off
}

/// Whether 16-bit product matrices take quads here ([`quads16`]): there
/// is a quads kernel and `COLIBRI_NO_QUADS` is unset. Either layout gives
/// the same bits.
pub fn quads16_run_here() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var_os("COLIBRI_NO_QUADS").is_some_and(|v| v != "0"));
    kernels().dot_bf16_quads.is_some() && !off
}

/// `f(row)` with row `r` of a matrix in quads ([`quads16`]) in row-major
/// form (copied into a per-thread buffer): the slow path of one-row reads.
fn with_quads_row<T>(w: &QMatrix, r: usize, f: impl FnOnce(&[u16]) -> T) -> T {
    thread_local! {
        static ROW: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    ROW.with_borrow_mut(|row| {
        row.resize(w.cols, 0);
        let all: &[u16] = bytemuck::cast_slice(w.data().as_slice());
        quads16::row_of(all, w.rows, w.cols, r, row);
        f(row)
    })
}

/// Whether matrices of `format` take panels in place here
/// ([`k_panels::panels_in_place`], the RAM tier's experts): Q2_K, Q3_K,
/// Q4_K and Q5_K, whose one-token row kernels are slower per byte than a
/// core's share of DRAM on a small machine (~10–15 GB/s a Zen 4 core),
/// where the panel kernel with the next panel asked of L2 decodes 12–30%
/// faster on one thread; where their panel kernel and 8-bit activations
/// run (`COLIBRI_NO_PANELS` unset). IQ4_XS and Q6_K could lie in panels
/// as well ([`k_panels::in_place`]), but their row kernels already keep
/// up with DRAM and their decodes measured slower so (docs/benchmarks.md).
/// x86 only: the NEON panel kernels ask nothing ahead and are unmeasured.
/// Either layout gives the same bits.
pub fn panels_run_here(format: WeightFormat) -> bool {
    let k = kernels();
    cfg!(target_arch = "x86_64")
        && matches!(
            format,
            WeightFormat::Q2K | WeightFormat::Q3K | WeightFormat::Q4K | WeightFormat::Q5K
        )
        && k_panels::in_place(format)
        && panel_fn(k, format).is_some()
        && k.int_activations
}

/// `k`'s panel kernel for `format`, if any.
fn panel_fn(k: &KernelSet, format: WeightFormat) -> Option<k_panels::PanelDot> {
    match format {
        WeightFormat::Q4K | WeightFormat::Q5K => k.dot_k_panels,
        WeightFormat::Q6K => k.dot_q6_k_panels,
        WeightFormat::Q2K | WeightFormat::Q3K => k.dot_low_k_panels,
        WeightFormat::Iq4Xs => k.dot_iq4_xs_panels,
        _ => None,
    }
}

/// `f(row)` with row `r` of a matrix in panels in place, in row-major
/// form (copied into a per-thread buffer): the slow path of one-row reads.
fn with_panel_row<T>(w: &QMatrix, r: usize, f: impl FnOnce(&[u8]) -> T) -> T {
    thread_local! {
        static ROW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let rb = w.data().as_slice().len() / w.rows;
    ROW.with_borrow_mut(|row| {
        row.resize(rb, 0);
        k_panels::row_of_in_place(w.format, w.data().as_slice(), w.rows, rb, r, row);
        f(row)
    })
}

/// `f(row)` with row `r` of a tiled Q4_0 matrix in row-major form (copied
/// into a per-thread buffer): the slow path of one-row reads.
fn with_tiled_row<T>(w: &QMatrix, r: usize, f: impl FnOnce(&[u8]) -> T) -> T {
    thread_local! {
        static ROW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let blocks = w.cols / QK;
    ROW.with_borrow_mut(|row| {
        row.resize(blocks * Q4_0_BLOCK_BYTES, 0);
        q4_0_tiles::row_of(w.data().as_slice(), w.rows, blocks, r, row);
        f(row)
    })
}

/// Dot of row `r` of `w` with `x` (`x.len() == w.cols`).
#[inline]
pub fn dot_row(k: &KernelSet, w: &QMatrix, r: usize, x: &[f32]) -> f32 {
    if w.is_tiled() {
        return with_tiled_row(w, r, |row| (k.dot_q4_0)(row, x));
    }
    if w.is_quads() {
        let dot = if w.format == WeightFormat::Bf16 {
            k.dot_bf16
        } else {
            k.dot_f16
        };
        return with_quads_row(w, r, |row| dot(row, x));
    }
    let bytes = w.data().as_slice();
    let c = w.cols;
    match w.format {
        WeightFormat::F32 => {
            let all: &[f32] = bytemuck::cast_slice(bytes);
            (k.dot_f32)(&all[r * c..(r + 1) * c], x)
        }
        WeightFormat::Bf16 => {
            let all: &[u16] = bytemuck::cast_slice(bytes);
            (k.dot_bf16)(&all[r * c..(r + 1) * c], x)
        }
        WeightFormat::F16 => {
            let all: &[u16] = bytemuck::cast_slice(bytes);
            (k.dot_f16)(&all[r * c..(r + 1) * c], x)
        }
        WeightFormat::F8E4M3 => {
            let s = w.scales().expect("QMatrix::new checks fp8 scales");
            let g = (r / s.block) * s.grid_cols;
            (k.dot_fp8)(
                &bytes[r * c..(r + 1) * c],
                x,
                &s.scales[g..g + s.grid_cols],
                s.block,
            )
        }
        WeightFormat::Q8_0 => {
            let rb = c / QK * Q8_0_BLOCK_BYTES;
            (k.dot_q8_0)(&bytes[r * rb..(r + 1) * rb], x)
        }
        WeightFormat::Q4_0 => {
            let rb = c / QK * Q4_0_BLOCK_BYTES;
            (k.dot_q4_0)(&bytes[r * rb..(r + 1) * rb], x)
        }
        // The exact product is the dequantized row's (ggml's own
        // dequantization: every Q6_K, Q3_K or IQ4 element is exact in f32, a
        // Q4_K/Q5_K/Q2_K element one rounding, a Q4_1/Q5_1 element two),
        // through the f32 kernel.
        WeightFormat::Q6K
        | WeightFormat::Q4K
        | WeightFormat::Q5K
        | WeightFormat::Q4_1
        | WeightFormat::Q5_0
        | WeightFormat::Q5_1
        | WeightFormat::Q2K
        | WeightFormat::Q3K
        | WeightFormat::Iq4Nl
        | WeightFormat::Iq4Xs => DEQUANTIZED.with_borrow_mut(|row| {
            row.resize(c, 0.0);
            row_to_f32(w, r, row);
            (k.dot_f32)(row, x)
        }),
    }
}

/// Whether `dot_row` takes `w`'s exact product as its row dequantized
/// through `dot_f32` (the formats without an f32-input kernel).
fn dequantizes(w: &QMatrix) -> bool {
    !w.is_tiled()
        && !w.is_quads()
        && matches!(
            w.format,
            WeightFormat::Q6K
                | WeightFormat::Q4K
                | WeightFormat::Q5K
                | WeightFormat::Q4_1
                | WeightFormat::Q5_0
                | WeightFormat::Q5_1
                | WeightFormat::Q2K
                | WeightFormat::Q3K
                | WeightFormat::Iq4Nl
                | WeightFormat::Iq4Xs
        )
}

thread_local! {
    /// A row dequantized for the exact product of a format without an
    /// exact kernel.
    static DEQUANTIZED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Row `r` of `w` widened to f32 into `out` (exact).
pub fn row_to_f32(w: &QMatrix, r: usize, out: &mut [f32]) {
    if w.is_tiled() {
        return with_tiled_row(w, r, |row| quant::dequantize_q4_0(row, out));
    }
    if w.is_quads() {
        let widen = if w.format == WeightFormat::Bf16 {
            bf16_to_f32
        } else {
            f16_to_f32
        };
        return with_quads_row(w, r, |row| {
            for (o, &b) in out.iter_mut().zip(row) {
                *o = widen(b);
            }
        });
    }
    let bytes = w.data().as_slice();
    let c = w.cols;
    match w.format {
        WeightFormat::F32 => {
            let all: &[f32] = bytemuck::cast_slice(bytes);
            out.copy_from_slice(&all[r * c..(r + 1) * c]);
        }
        WeightFormat::Bf16 => {
            let all: &[u16] = bytemuck::cast_slice(bytes);
            for (o, &b) in out.iter_mut().zip(&all[r * c..(r + 1) * c]) {
                *o = bf16_to_f32(b);
            }
        }
        WeightFormat::F16 => {
            let all: &[u16] = bytemuck::cast_slice(bytes);
            for (o, &b) in out.iter_mut().zip(&all[r * c..(r + 1) * c]) {
                *o = f16_to_f32(b);
            }
        }
        WeightFormat::F8E4M3 => {
            let s = w.scales().expect("QMatrix::new checks fp8 scales");
            let g = (r / s.block) * s.grid_cols;
            for (j, (o, &b)) in out.iter_mut().zip(&bytes[r * c..(r + 1) * c]).enumerate() {
                *o = fp8_e4m3_to_f32(b) * s.scales[g + j / s.block];
            }
        }
        WeightFormat::Q8_0 => {
            let rb = c / QK * Q8_0_BLOCK_BYTES;
            quant::dequantize_q8_0(&bytes[r * rb..(r + 1) * rb], out);
        }
        WeightFormat::Q4_0 => {
            let rb = c / QK * Q4_0_BLOCK_BYTES;
            quant::dequantize_q4_0(&bytes[r * rb..(r + 1) * rb], out);
        }
        WeightFormat::Q6K
        | WeightFormat::Q4K
        | WeightFormat::Q5K
        | WeightFormat::Q4_1
        | WeightFormat::Q5_0
        | WeightFormat::Q5_1
        | WeightFormat::Q2K
        | WeightFormat::Q3K
        | WeightFormat::Iq4Nl
        | WeightFormat::Iq4Xs => {
            let dequantize = dequant::row_fn(w.format).expect("a format dequantized by rows");
            if w.is_k_panels() {
                return with_panel_row(w, r, |row| dequantize(row, out));
            }
            let rb = w.format.row_bytes(c).unwrap_or(0);
            let row = &bytes[r * rb..(r + 1) * rb];
            dequantize(row, out);
        }
    }
}

/// `out += alpha * W[r]`, with `W[r]` dequantized exactly as `row_to_f32`.
pub fn row_axpy(w: &QMatrix, r: usize, alpha: f32, out: &mut [f32], scratch: &mut Vec<f32>) {
    scratch.resize(w.cols, 0.0);
    row_to_f32(w, r, scratch);
    for (o, &v) in out.iter_mut().zip(scratch.iter()) {
        *o += alpha * v;
    }
}

/// The most rows one task of a several-token product takes (its results
/// go through a per-thread buffer of that many rows per token); a multiple
/// of the tile and quad heights, so rounding to them keeps a task within
/// it.
const MAX_TASK_ROWS: usize = 1024;

/// The same for a one-token product ([`Pool::vec_task_rows`]).
const MAX_VEC_TASK_ROWS: usize = 2048;

impl Pool {
    /// Rows per task of a several-token product: four tasks per thread,
    /// so that tasks even out between threads that run at different
    /// speeds.
    fn rows_per_task(&self, rows: usize) -> usize {
        (rows / (self.threads() * 4)).clamp(8, MAX_TASK_ROWS)
    }

    /// Rows per task of a one-token product: one task per thread. Every
    /// task boundary costs a one-token product time, more than the
    /// balancing of smaller tasks wins back: a warm decode ran 2–5% faster
    /// with one task per thread than with four, and 7–10% faster than with
    /// sixteen (docs/benchmarks.md). A job of several matrices (q, k and
    /// v; every expert's gate and up) still balances over its matrices.
    fn vec_rows_per_task(&self, rows: usize) -> usize {
        (rows / self.threads()).clamp(8, MAX_VEC_TASK_ROWS)
    }

    /// [`vec_rows_per_task`](Self::vec_rows_per_task) for `w`, rounded as
    /// [`task_rows`](Self::task_rows) rounds.
    pub(crate) fn vec_task_rows(&self, w: &QMatrix) -> usize {
        whole_units(w, self.vec_rows_per_task(w.rows))
    }

    /// [`rows_per_task`](Self::rows_per_task) for `w`, rounded to whole
    /// units of its layout ([`whole_units`]).
    fn task_rows(&self, w: &QMatrix) -> usize {
        whole_units(w, self.rows_per_task(w.rows))
    }
}

/// `chunk` rounded up to whole tiles, quads or panels where `w` is laid
/// out in them (every maximum above is a multiple of those heights).
fn whole_units(w: &QMatrix, chunk: usize) -> usize {
    if w.is_tiled() {
        chunk.next_multiple_of(q4_0_tiles::TILE_ROWS)
    } else if w.is_quads() {
        chunk.next_multiple_of(quads16::QUAD_ROWS)
    } else if k_panels::super_bytes(w.format).is_some() {
        chunk.next_multiple_of(k_panels::PANEL_ROWS)
    } else if w.format == WeightFormat::Iq4Nl && kernels().dot_iq4_nl_tiles.is_some() {
        // Whole groups of 16 rows for `iq4_nl_tiled_rows`.
        chunk.next_multiple_of(q4_0_tiles::TILE_ROWS)
    } else {
        chunk
    }
}

/// GB/s of a parallel read-only pass over `bytes` bytes of memory on
/// `pool`'s threads (best of five passes after one warm-up): the memory
/// bandwidth a decode that streams weights from RAM can reach, every
/// thread summing its own chunks as fast as the CPU reads
/// ([`read_pass`]). Use a size well above the last-level cache.
pub fn read_bandwidth(pool: &Pool, bytes: usize) -> f64 {
    BandwidthProbe::new(bytes).measure(pool, 5)
}

/// A buffer for repeated [`read_bandwidth`] passes (allocated and filled
/// once), so that a benchmark can measure the bandwidth beside each stretch
/// of work it bounds.
pub struct BandwidthProbe {
    store: Option<crate::tensor::AnonStorage>,
    fallback: Vec<u32>,
}

impl BandwidthProbe {
    pub fn new(bytes: usize) -> BandwidthProbe {
        // The weights it bounds live in huge pages where the kernel gives
        // them (`AnonStorage`), so the probe asks for them too.
        let mut store = crate::tensor::AnonStorage::zeroed(bytes / 4 * 4).ok();
        let mut fallback = Vec::new();
        let buf: &mut [u32] = match store.as_mut() {
            // A mapping is page-aligned, so its bytes are u32-aligned.
            Some(s) => bytemuck::cast_slice_mut(s.bytes_mut()),
            None => {
                fallback.resize(bytes / 4, 0u32);
                &mut fallback
            }
        };
        for (i, w) in buf.iter_mut().enumerate() {
            *w = (i % 7) as u32;
        }
        BandwidthProbe { store, fallback }
    }

    fn words(&self) -> &[u32] {
        match &self.store {
            Some(s) => bytemuck::cast_slice(crate::tensor::ByteStorage::bytes(s)),
            None => &self.fallback,
        }
    }

    /// GB/s of the best of `passes` passes after one warm-up pass.
    pub fn measure(&self, pool: &Pool, passes: usize) -> f64 {
        let buf = self.words();
        // Integer adds (float sums would be latency-bound) with the
        // widest loads, the bytes asked ahead ([`read_pass`]): how fast the
        // cores can pull bytes from memory.
        let chunk = 1 << 16;
        let pass = || {
            pool.map_collect(buf.len().div_ceil(chunk), |i| {
                read_pass::sum_words(&buf[i * chunk..((i + 1) * chunk).min(buf.len())])
            })
            .into_iter()
            .fold(0u32, u32::wrapping_add)
        };
        std::hint::black_box(pass());
        let mut best = f64::MAX;
        for _ in 0..passes.max(1) {
            let t = std::time::Instant::now();
            std::hint::black_box(pass());
            best = best.min(t.elapsed().as_secs_f64());
        }
        (buf.len() * 4) as f64 / best.max(1e-9) / 1e9
    }
}

/// A matrix product's input vector, prepared once for the weight format:
/// as it is, or quantized to 8-bit blocks for Q8_0/Q4_0 weights.
enum Input<'a> {
    F32(&'a [f32]),
    Q8(Q8Activation),
}

impl<'a> Input<'a> {
    fn prepare(k: &KernelSet, w: &QMatrix, x: &'a [f32]) -> Input<'a> {
        if Input::quantizes(k, w) {
            Input::Q8(Q8Activation::quantize(x))
        } else {
            Input::F32(x)
        }
    }

    /// Whether `w`'s products take the input quantized to 8-bit blocks.
    fn quantizes(k: &KernelSet, w: &QMatrix) -> bool {
        int_format(w.format) && k.int_activations
    }
}

/// Whether products over `f` take 8-bit activations (unless the exact
/// kernels were asked for).
fn int_format(f: WeightFormat) -> bool {
    matches!(
        f,
        WeightFormat::Q8_0
            | WeightFormat::Q4_0
            | WeightFormat::Q6K
            | WeightFormat::Q4K
            | WeightFormat::Q5K
    ) || more_q8(f)
}

/// Whether `f`'s integer products go through [`KernelSet::dot_more_q8`].
fn more_q8(f: WeightFormat) -> bool {
    matches!(
        f,
        WeightFormat::Q4_1
            | WeightFormat::Q5_0
            | WeightFormat::Q5_1
            | WeightFormat::Iq4Nl
            | WeightFormat::Q2K
            | WeightFormat::Q3K
            | WeightFormat::Iq4Xs
    )
}

/// Elements and bytes of one block of a [`more_q8`] format (the vector
/// kernels' contract checks).
#[cfg(target_arch = "x86_64")]
fn more_q8_block(f: WeightFormat) -> (usize, usize) {
    let elements = if f.super_block_bytes() > 0 {
        quant::QK_K
    } else {
        QK
    };
    (elements, f.row_bytes(elements).unwrap_or(0))
}

/// The scalar references of [`KernelSet::dot_more_q8`], by format.
pub fn dot_more_q8(f: WeightFormat, w: &[u8], x: &Q8Activation) -> f32 {
    match f {
        WeightFormat::Q4_1 => legacy_q8::dot_q4_1_q8(w, x),
        WeightFormat::Q5_0 => legacy_q8::dot_q5_0_q8(w, x),
        WeightFormat::Q5_1 => legacy_q8::dot_q5_1_q8(w, x),
        WeightFormat::Iq4Nl => legacy_q8::dot_iq4_nl_q8(w, x),
        WeightFormat::Q2K => low_k::dot_q2_k_q8(w, x),
        WeightFormat::Q3K => low_k::dot_q3_k_q8(w, x),
        WeightFormat::Iq4Xs => low_k::dot_iq4_xs_q8(w, x),
        other => panic!("{other:?} has a kernel of its own"),
    }
}

impl Input<'_> {}

/// Row `r` of `w` with a prepared input: the one place every matrix
/// product's element is computed.
#[inline]
fn dot_input(k: &KernelSet, w: &QMatrix, r: usize, x: &Input<'_>) -> f32 {
    match x {
        Input::F32(x) => dot_row(k, w, r, x),
        Input::Q8(a) => dot_q8_row(k, w, r, a),
    }
}

/// Row `r` of `w` (an [`int_format`]) against a quantized activation, by
/// the format's one-token kernel.
fn dot_q8_row(k: &KernelSet, w: &QMatrix, r: usize, a: &Q8Activation) -> f32 {
    if w.is_tiled() {
        return with_tiled_row(w, r, |row| (k.dot_q4_0_q8)(row, a));
    }
    if w.is_k_panels() {
        return with_panel_row(w, r, |row| match w.format {
            WeightFormat::Q4K => (k.dot_q4_k_q8)(row, a),
            WeightFormat::Q5K => (k.dot_q5_k_q8)(row, a),
            WeightFormat::Q6K => (k.dot_q6_k_q8)(row, a),
            other => (k.dot_more_q8)(other, row, a),
        });
    }
    let bytes = w.data().as_slice();
    let blocks = w.cols / QK;
    match w.format {
        WeightFormat::Q8_0 => {
            let rb = blocks * Q8_0_BLOCK_BYTES;
            (k.dot_q8_0_q8)(&bytes[r * rb..(r + 1) * rb], a)
        }
        f if more_q8(f) => {
            let rb = bytes.len() / w.rows;
            (k.dot_more_q8)(f, &bytes[r * rb..(r + 1) * rb], a)
        }
        WeightFormat::Q6K | WeightFormat::Q4K | WeightFormat::Q5K => {
            let rb = w.cols / quant::QK_K * w.format.super_block_bytes();
            let row = &bytes[r * rb..(r + 1) * rb];
            match w.format {
                WeightFormat::Q6K => (k.dot_q6_k_q8)(row, a),
                WeightFormat::Q4K => (k.dot_q4_k_q8)(row, a),
                _ => (k.dot_q5_k_q8)(row, a),
            }
        }
        _ => {
            let rb = blocks * Q4_0_BLOCK_BYTES;
            (k.dot_q4_0_q8)(&bytes[r * rb..(r + 1) * rb], a)
        }
    }
}

/// A tile's first `N` results for one token into `dst`: a whole tile's
/// (`N` = 16) as one fixed-size copy, vector moves, where a copy of a
/// run-time length called `memcpy` for every token and tile (4% of a
/// prompt's time). `N` is a constant so that the compiler cannot merge
/// the two cases back into one `memcpy` of `n` values.
#[inline(always)]
fn put_tile_rows<const N: usize>(dst: &mut [f32], rows: &[f32; q4_0_tiles::TILE_ROWS], n: usize) {
    match (N == q4_0_tiles::TILE_ROWS, dst.first_chunk_mut::<N>()) {
        (true, Some(d)) => {
            for (d, r) in d.iter_mut().zip(rows) {
                *d = *r;
            }
        }
        _ => dst[..n].copy_from_slice(&rows[..n]),
    }
}

/// Rows `r0..r0 + len` of a tiled matrix (`r0` a multiple of the tile
/// height) against each of `xs`, token-major into `out` (`out[t · len +
/// i]`): whole tiles through the tile kernel, each tile once for every
/// token while it is in L1; the rows past the last tile through the row
/// kernel.
#[allow(clippy::too_many_arguments)]
fn tiled_rows(
    k: &KernelSet,
    tile: TileDot,
    w: &QMatrix,
    xs: &[&Q8Activation],
    amx: Option<&AmxInput>,
    r0: usize,
    len: usize,
    out: &mut [f32],
) {
    use q4_0_tiles::TILE_ROWS;
    debug_assert!(r0.is_multiple_of(TILE_ROWS) && out.len() >= xs.len() * len);
    let blocks = w.cols / QK;
    let (tb, rb) = (q4_0_tiles::tile_bytes(blocks), blocks * Q4_0_BLOCK_BYTES);
    let full = w.rows / TILE_ROWS * TILE_ROWS;
    let bytes = w.data().as_slice();
    let mut rows = [0.0f32; TILE_ROWS];
    let mut amx = AmxRun::new(k.amx_q4_0_tiles, amx, xs, blocks);
    for i0 in (0..len).step_by(TILE_ROWS) {
        let r = r0 + i0;
        let n = TILE_ROWS.min(len - i0);
        if r < full {
            let t = &bytes[r / TILE_ROWS * tb..][..tb];
            // The task's next tile, asked for during the first pass.
            let mut next = match r + TILE_ROWS {
                r1 if r1 < full && i0 + TILE_ROWS < len => &bytes[r1 / TILE_ROWS * tb..][..tb],
                _ => &[][..],
            };
            // Tokens the AMX kernel took (the first ones); the rest below.
            let mut j0 = 0;
            if let Some(amx) = &mut amx {
                if n == TILE_ROWS {
                    amx.run(t, blocks, next, |j, rows| {
                        put_tile_rows::<TILE_ROWS>(&mut out[j * len + i0..], rows, n);
                    });
                } else {
                    amx.run(t, blocks, next, |j, rows| {
                        put_tile_rows::<0>(&mut out[j * len + i0..], rows, n);
                    });
                }
                j0 = amx.tokens();
                next = &[];
            }
            if j0 == xs.len() {
                continue;
            }
            if let Some(tiles) = k.dot_q4_0_tiles.filter(|_| xs.len() - j0 > 1) {
                let mut pass = [[0.0f32; TILE_ROWS]; TILE_TOKENS];
                for size in tile_passes(xs.len() - j0) {
                    tiles(t, blocks, &xs[j0..j0 + size], &mut pass, next);
                    next = &[];
                    for (i, rows) in pass.iter().enumerate().take(size) {
                        let dst = &mut out[(j0 + i) * len + i0..];
                        if n == TILE_ROWS {
                            put_tile_rows::<TILE_ROWS>(dst, rows, n);
                        } else {
                            put_tile_rows::<0>(dst, rows, n);
                        }
                    }
                    j0 += size;
                }
                continue;
            }
            // (A decode's products come here, a token a tile: the copy of
            // a run-time length called `memcpy` per tile, 1.2% of a decode.)
            for (j, x) in xs.iter().enumerate().skip(j0) {
                tile(t, blocks, x, &mut rows);
                let dst = &mut out[j * len + i0..];
                if n == TILE_ROWS {
                    put_tile_rows::<TILE_ROWS>(dst, &rows, n);
                } else {
                    put_tile_rows::<0>(dst, &rows, n);
                }
            }
        } else {
            for i in 0..n {
                let row = &bytes[(r + i) * rb..(r + i + 1) * rb];
                for (j, x) in xs.iter().enumerate() {
                    out[j * len + i0 + i] = (k.dot_q4_0_q8)(row, x);
                }
            }
        }
    }
}

/// Rows `r0..r0 + ys.len()` of `w` with a prepared input, `r0` at one of
/// [`Pool::task_rows`]'s or [`Pool::vec_task_rows`]'s boundaries.
fn rows_into(k: &KernelSet, w: &QMatrix, x: &Input<'_>, r0: usize, ys: &mut [f32]) {
    if let (Some(tile), Input::Q8(a)) = (k.dot_q4_0_tile.filter(|_| w.is_tiled()), x) {
        return tiled_rows(k, tile, w, &[a], None, r0, ys.len(), ys);
    }
    let in_panels = w.is_k_panels() && r0.is_multiple_of(k_panels::PANEL_ROWS);
    if let (Some(panels), Input::Q8(a)) = (panel_fn(k, w.format).filter(|_| in_panels), x) {
        let len = ys.len();
        return panel_rows(k, panels, w, &[a], r0, len, ys);
    }
    let rows16 = match (w.format, w.is_quads()) {
        (WeightFormat::Bf16, false) => k.dot_bf16_rows,
        (WeightFormat::F16, false) => k.dot_f16_rows,
        // Quads exist only where their kernels do; `r0` is a multiple of
        // 4 (`whole_units`).
        (WeightFormat::Bf16, true) => k.dot_bf16_quads,
        (WeightFormat::F16, true) => k.dot_f16_quads,
        _ => None,
    };
    if let (Some(rows), Input::F32(x)) = (rows16, x) {
        let all: &[u16] = bytemuck::cast_slice(w.data().as_slice());
        return rows(&all[r0 * w.cols..(r0 + ys.len()) * w.cols], x, ys);
    }
    for (i, o) in ys.iter_mut().enumerate() {
        *o = dot_input(k, w, r0 + i, x);
    }
}

/// `y = W x` for one vector.
pub fn matvec(pool: &Pool, w: &QMatrix, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.cols, "matvec input length");
    assert_eq!(y.len(), w.rows, "matvec output length");
    let k = kernels();
    let input = Input::prepare(k, w, x);
    let chunk = pool.vec_task_rows(w);
    pool.for_each_chunk_mut(y, chunk, |ci, ys| rows_into(k, w, &input, ci * chunk, ys));
}

/// `ys[i] = ws[i] X` for several matrices that share their input (gate and
/// up, or q, k and v): for one vector, one pool job over every matrix's
/// rows and the input prepared once per weight format; the same results
/// as separate [`matmul`] calls.
pub fn matmul_shared_input(
    pool: &Pool,
    ws: &[&QMatrix],
    x: &[f32],
    n: usize,
    ys: &mut [&mut [f32]],
) {
    assert_eq!(ws.len(), ys.len(), "one output per matrix");
    if n != 1 {
        // The vectors prepared once per weight format.
        let mut batches: Vec<(WeightFormat, Batch<'_>)> = Vec::new();
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            assert_eq!(x.len(), n * w.cols, "matmul input length");
            assert_eq!(y.len(), n * w.rows, "matmul output length");
            let i = match batches.iter().position(|(f, _)| *f == w.format) {
                Some(i) => i,
                None => {
                    // The interleaved tokens only where a matrix of the
                    // format is not tiled.
                    let gemm = ws.iter().any(|v| v.format == w.format && !v.is_tiled());
                    let batch = Batch::prepare(pool, w.format, x, w.cols, n, gemm);
                    batches.push((w.format, batch));
                    batches.len() - 1
                }
            };
            matmul_prepared(pool, w, &batches[i].1, y);
        }
        return;
    }
    matvecs(pool, ws, &vec![x; ws.len()], ys);
}

/// `ys[i] = ws[i] xs[i]` for one vector per matrix, in one pool job over
/// every matrix's rows (each distinct input prepared once per weight
/// format): the results of separate [`matvec`] calls, with one wait for
/// the pool instead of one per matrix.
pub fn matvecs(pool: &Pool, ws: &[&QMatrix], xs: &[&[f32]], ys: &mut [&mut [f32]]) {
    assert!(
        ws.len() == ys.len() && ws.len() == xs.len(),
        "one input and one output per matrix"
    );
    let k = kernels();
    // Keyed by the input's address and length and the weight format.
    let mut inputs: Vec<((usize, usize, WeightFormat), Input<'_>)> = Vec::new();
    let mut input_of = Vec::with_capacity(ws.len());
    for (w, x) in ws.iter().zip(xs) {
        assert_eq!(x.len(), w.cols, "matvec input length");
        let key = (x.as_ptr() as usize, x.len(), w.format);
        let i = match inputs.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                inputs.push((key, Input::prepare(k, w, x)));
                inputs.len() - 1
            }
        };
        input_of.push(i);
    }
    let xs: Vec<&Input<'_>> = input_of.iter().map(|&i| &inputs[i].1).collect();
    prepared_matvecs(pool, k, ws, &xs, ys);
}

/// [`matvecs`] with each matrix's input already prepared for its format.
fn prepared_matvecs(
    pool: &Pool,
    k: &KernelSet,
    ws: &[&QMatrix],
    xs: &[&Input<'_>],
    ys: &mut [&mut [f32]],
) {
    // Tasks: (matrix, chunk of its rows), matrix after matrix.
    let mut tasks = Vec::new();
    for (i, (w, y)) in ws.iter().zip(ys.iter_mut()).enumerate() {
        assert_eq!(y.len(), w.rows, "matvec output length");
        let chunk = pool.vec_task_rows(w);
        for (c, part) in y.chunks_mut(chunk).enumerate() {
            tasks.push((i, c * chunk, part));
        }
    }
    pool.for_each_chunk_mut(&mut tasks, 1, |_, task| {
        let (i, r0, part) = &mut task[0];
        rows_into(k, ws[*i], xs[*i], *r0, part)
    });
}

/// Whether [`q8_matmuls`] can multiply `w` here: a block-quantized matrix
/// whose products quantize their input (not `--exact-quant`), in any
/// layout but a row-major Q4_0 one where the matrix–matrix kernel runs
/// (that kernel interleaves each batch's tokens first, which `matmul`
/// does).
pub fn q8_products(w: &QMatrix) -> bool {
    let k = kernels();
    k.int_activations
        && int_format(w.format)
        && (w.format != WeightFormat::Q4_0 || w.is_tiled() || k.gemm_q4_0_q8.is_none())
}

thread_local! {
    /// A [`q8_matmuls`] task's results before they go to the output, kept
    /// per thread: a prompt's many small tasks each allocated and zeroed
    /// their own.
    static TASK_OUT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Per matrix `i`, `ws[i]` times each of the quantized vectors `xs[i]`
/// (token-major, `xs[i].len() × ws[i].rows`), for several matrices
/// ([`q8_products`]) with their own tokens, in one pool job: the bits
/// [`matmul`] gives each (the same kernels, [`q8_rows`]), with one wait
/// for the pool instead of one per matrix (a prefill chunk's experts).
pub fn q8_matmuls(pool: &Pool, ws: &[&QMatrix], xs: &[Vec<&Q8Activation>]) -> Vec<Vec<f32>> {
    assert_eq!(ws.len(), xs.len(), "inputs per matrix");
    let sizes: Vec<usize> = ws.iter().zip(xs).map(|(w, x)| x.len() * w.rows).collect();
    let mut ys: Vec<Vec<f32>> = sizes.iter().map(|&n| Vec::with_capacity(n)).collect();
    let k = kernels();
    // Tasks: (matrix, first row, rows), cut as `matmul` cuts them.
    let mut tasks = Vec::new();
    for (i, (w, x)) in ws.iter().zip(xs).enumerate() {
        assert!(q8_products(w), "q8_matmuls on a {:?} matrix", w.format);
        assert!(x.iter().all(|a| a.quants.len() >= w.cols), "input length");
        let chunk = pool.task_rows(w);
        for r0 in (0..w.rows).step_by(chunk) {
            tasks.push((i, r0, chunk.min(w.rows - r0)));
        }
    }
    let amx = AmxInputs::new(xs);
    // Each task writes its rows of every token straight into the output,
    // which is filled only by them.
    let parts: Vec<pool::Parts<'_>> = ys
        .iter_mut()
        .zip(&sizes)
        .map(|(y, &n)| pool::Parts::over_uninit(&mut y.spare_capacity_mut()[..n]))
        .collect();
    pool.map_collect(tasks.len(), |t| {
        let (i, r0, len) = tasks[t];
        TASK_OUT.with_borrow_mut(|buf| {
            // `q8_rows` writes every element: what a previous task left
            // there is overwritten, never read.
            let need = len * xs[i].len();
            if buf.len() < need {
                buf.resize(need, 0.0);
            }
            let out = &mut buf[..need];
            q8_rows(k, ws[i], &xs[i], Some(amx.of(i)), r0, len, out);
            // SAFETY: task (i, r0, len) alone writes rows r0..r0 + len of
            // each token of output i: the tasks cut each matrix's rows
            // into disjoint ranges.
            unsafe { parts[i].put_rows(r0, ws[i].rows, out, len) };
        });
    });
    // Every row of every token belongs to one task, so each output was
    // written whole (checked: a part missed would leave memory unread).
    assert!(parts.iter().all(|p| p.complete()), "every output written");
    drop(parts);
    for (y, &n) in ys.iter_mut().zip(&sizes) {
        // SAFETY: the first n elements were all written just above
        // (`complete`, the parts disjoint), within the capacity.
        unsafe { y.set_len(n) };
    }
    ys
}

/// `ws[i]` times each of the quantized vectors `xs` into `outs[i]`
/// (token-major, `xs.len() × ws[i].rows`), on the calling thread alone:
/// the bits [`q8_matmuls`] gives, for a pool task that owns whole products
/// (a prompt's expert, gate and up then down, while its results stay in
/// the core's cache). The matrices share the tokens' packing for AMX.
pub fn q8_matmuls_here(ws: &[&QMatrix], xs: &[&Q8Activation], outs: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), outs.len(), "an output per matrix");
    // One packing serves them all: one input length.
    assert!(
        ws.windows(2).all(|p| p[0].cols == p[1].cols),
        "matrices of one input length"
    );
    let k = kernels();
    let amx = AmxInput::default();
    for (w, out) in ws.iter().zip(outs.iter_mut()) {
        assert!(q8_products(w), "q8_matmuls_here on a {:?} matrix", w.format);
        assert!(xs.iter().all(|a| a.quants.len() >= w.cols), "input length");
        assert_eq!(out.len(), xs.len() * w.rows, "output length");
        q8_rows(k, w, xs, Some(&amx), 0, w.rows, out);
    }
}

/// `Y[t] = W X[t]` for `n` vectors stored row after row in `x` (`n × cols`)
/// into `y` (`n × rows`).
pub fn matmul(pool: &Pool, w: &QMatrix, x: &[f32], n: usize, y: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols, "matmul input length");
    assert_eq!(y.len(), n * w.rows, "matmul output length");
    if n == 1 {
        return matvec(pool, w, x, y);
    }
    let batch = Batch::prepare(pool, w.format, x, w.cols, n, !w.is_tiled());
    matmul_prepared(pool, w, &batch, y);
}

/// Several vectors prepared once for every matrix of one weight format
/// that multiplies them: quantized (in parallel) for Q8_0/Q4_0, and
/// interleaved for the Q4_0 matrix–matrix kernel.
struct Batch<'a> {
    inputs: Vec<Input<'a>>,
    tiles: Option<(GemmQ4, Q8Tiles)>,
}

impl<'a> Batch<'a> {
    /// `gemm`: whether a matrix that is not tiled takes the batch, so that
    /// Q4_0's matrix–matrix kernel needs the tokens interleaved (built on
    /// the calling thread alone: 1% of a prompt's time where every matrix
    /// was tiled and none read them).
    fn prepare(
        pool: &Pool,
        format: WeightFormat,
        x: &'a [f32],
        cols: usize,
        n: usize,
        gemm: bool,
    ) -> Self {
        let k = kernels();
        let int = int_format(format) && k.int_activations;
        let inputs: Vec<Input<'a>> = if int {
            pool.map_collect(n, |t| {
                Input::Q8(Q8Activation::quantize(&x[t * cols..(t + 1) * cols]))
            })
        } else {
            (0..n)
                .map(|t| Input::F32(&x[t * cols..(t + 1) * cols]))
                .collect()
        };
        let tiles = match k.gemm_q4_0_q8 {
            Some(g) if gemm && int && format == WeightFormat::Q4_0 && n >= g.min_tokens => {
                let q8: Vec<&Q8Activation> = inputs
                    .iter()
                    .filter_map(|i| if let Input::Q8(a) = i { Some(a) } else { None })
                    .collect();
                Some((g, Q8Tiles::build(&q8, g.width)))
            }
            _ => None,
        };
        Batch { inputs, tiles }
    }
}

/// Rows `r0..r0 + len` of a panel format's matrix (Q2_K to Q6_K, IQ4_XS) against every token of
/// `xs` into `out` (token-major, `len` per token): each full group of 16
/// rows packed into a panel once ([`k_panels::pack`]) and multiplied by up
/// to [`k_panels::PANEL_TOKENS`] tokens per pass, the rows past the last
/// panel by the row kernel. Every value is the row kernel's, bit for bit.
fn panel_rows(
    k: &KernelSet,
    panels: k_panels::PanelDot,
    w: &QMatrix,
    xs: &[&Q8Activation],
    r0: usize,
    len: usize,
    out: &mut [f32],
) {
    use k_panels::{PANEL_ROWS, PANEL_TOKENS};
    const { assert!(PANEL_TOKENS == TILE_TOKENS) };
    let bytes = w.data().as_slice();
    let rb = bytes.len() / w.rows;
    let supers = w.cols / quant::QK_K;
    let full = len / PANEL_ROWS * PANEL_ROWS;
    let mut panel = if w.is_k_panels() {
        Vec::new()
    } else {
        vec![0u8; PANEL_ROWS * rb]
    };
    let mut res = [[0.0f32; PANEL_ROWS]; PANEL_TOKENS];
    // Panels in place (the RAM tier's experts) are read where they are;
    // `r0` is then a multiple of 16 (`task_rows`).
    let in_place = w.is_k_panels();
    debug_assert!(!in_place || r0.is_multiple_of(PANEL_ROWS));
    for p in (0..full).step_by(PANEL_ROWS) {
        let at = (r0 + p) * rb;
        let panel: &[u8] = if in_place {
            &bytes[at..at + PANEL_ROWS * rb]
        } else {
            k_panels::pack_format(w.format, &bytes[at..at + PANEL_ROWS * rb], rb, &mut panel);
            &panel
        };
        // The next panel's rows, asked of L2 a share before each pass
        // (packing them then reads L2, not DRAM: 512-token prefill of a
        // Q4_K file 4% faster, docs/benchmarks.md).
        let next = if p + PANEL_ROWS < full {
            &bytes[at + PANEL_ROWS * rb..at + 2 * PANEL_ROWS * rb]
        } else {
            &[][..]
        };
        let passes = tile_passes(xs.len());
        let share = next
            .len()
            .div_ceil(xs.len().div_ceil(TILE_TOKENS))
            .next_multiple_of(64);
        // Passes as even as `tile_passes` makes them: a kernel runs its
        // fewest tokens slowest.
        let mut t0 = 0;
        for (i, size) in passes.into_iter().enumerate() {
            if let Some(part) = next.get(i * share..next.len().min((i + 1) * share)) {
                k_panels::ask_l2(part);
            }
            panels(w.format, panel, supers, &xs[t0..t0 + size], &mut res);
            for (j, row) in res[..size].iter().enumerate() {
                out[(t0 + j) * len + p..][..PANEL_ROWS].copy_from_slice(row);
            }
            t0 += size;
        }
    }
    for i in full..len {
        let row = &bytes[(r0 + i) * rb..(r0 + i + 1) * rb];
        for (t, x) in xs.iter().enumerate() {
            out[t * len + i] = match w.format {
                WeightFormat::Q4K => (k.dot_q4_k_q8)(row, x),
                WeightFormat::Q5K => (k.dot_q5_k_q8)(row, x),
                WeightFormat::Q6K => (k.dot_q6_k_q8)(row, x),
                other => (k.dot_more_q8)(other, row, x),
            };
        }
    }
}

/// The fewest tokens the AMX tile kernels take ([`q4_0_amx`]); fewer go
/// through the AVX-512 ones. The AMX kernel's cost per block hardly
/// depends on its tokens: on the AMX Xeon VM (`cargo bench --bench
/// kernels -- --tile-tokens`) 3.2–3.5 ns per block and token at 8 tokens
/// against AVX-512's 2.8–2.9, 2.25–2.46 at 12, 2.0–2.1 at 16.
pub const AMX_MIN_TOKENS: usize = 10;

/// One matrix product's tokens packed for the AMX kernels, once for all
/// its tasks: the first task that needs them packs them.
#[derive(Default)]
struct AmxInput(OnceLock<Vec<q4_0_amx::Tokens>>);

impl AmxInput {
    fn passes(&self, xs: &[&Q8Activation], blocks: usize) -> &[q4_0_amx::Tokens] {
        self.0.get_or_init(|| {
            amx_passes(xs.len())
                .scan(0, |t0, size| {
                    let mut p = q4_0_amx::Tokens::default();
                    p.pack(&xs[*t0..*t0 + size], blocks);
                    *t0 += size;
                    Some(p)
                })
                .collect()
        })
    }
}

/// The AMX passes over `n` tokens (the first ones): full passes of
/// [`q4_0_amx::TOKENS`], then the rest if at least [`AMX_MIN_TOKENS`]. A
/// pass costs nearly as much for few tokens as for 16, so 20 tokens go as
/// 16 on AMX and 4 on AVX-512 (about 42 ns a block), not as two passes of
/// 10 (about 50).
fn amx_passes(n: usize) -> impl Iterator<Item = usize> {
    let (full, rest) = (n / q4_0_amx::TOKENS, n % q4_0_amx::TOKENS);
    std::iter::repeat_n(q4_0_amx::TOKENS, full).chain((rest >= AMX_MIN_TOKENS).then_some(rest))
}

/// [`AmxInput`]s for several products' inputs (`xs[i]` for matrix `i`):
/// products of the same tokens (an expert's gate and up) share one.
struct AmxInputs {
    /// Matrix `i`'s input is `cells[of[i]]`.
    of: Vec<usize>,
    cells: Vec<AmxInput>,
}

impl AmxInputs {
    fn new(xs: &[Vec<&Q8Activation>]) -> AmxInputs {
        let same = |a: &[&Q8Activation], b: &[&Q8Activation]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| std::ptr::eq(*x, *y))
        };
        let mut of: Vec<usize> = Vec::with_capacity(xs.len());
        let mut firsts: Vec<usize> = Vec::new();
        for (i, x) in xs.iter().enumerate() {
            match firsts.iter().position(|&j| same(&xs[j], x)) {
                Some(c) => of.push(c),
                None => {
                    of.push(firsts.len());
                    firsts.push(i);
                }
            }
        }
        let cells = firsts.iter().map(|_| AmxInput::default()).collect();
        AmxInputs { of, cells }
    }

    fn of(&self, i: usize) -> &AmxInput {
        &self.cells[self.of[i]]
    }
}

/// A task's AMX products of one tile against every token: the packed
/// passes, the kernel's scratch and the results.
struct AmxRun<'a> {
    f: PackedTilesDot,
    passes: &'a [q4_0_amx::Tokens],
    scratch: q4_0_amx::Scratch,
    res: Vec<[f32; q4_0_tiles::TILE_ROWS]>,
}

impl<'a> AmxRun<'a> {
    /// The AMX kernel `f` for `xs` (`blocks` blocks each) where it runs:
    /// a kernel, an input to share and enough tokens.
    fn new(
        f: Option<PackedTilesDot>,
        input: Option<&'a AmxInput>,
        xs: &[&Q8Activation],
        blocks: usize,
    ) -> Option<AmxRun<'a>> {
        let (f, input) = f.zip(input).filter(|_| xs.len() >= AMX_MIN_TOKENS)?;
        Some(AmxRun {
            f,
            passes: input.passes(xs, blocks),
            scratch: q4_0_amx::Scratch::default(),
            res: vec![[0.0; q4_0_tiles::TILE_ROWS]; amx_passes(xs.len()).sum()],
        })
    }

    /// The tokens it takes: the first ones (see [`amx_passes`]).
    fn tokens(&self) -> usize {
        self.res.len()
    }

    /// `tile` against its tokens (asking L2 for `next` meanwhile):
    /// `take(t, rows)` receives token `t`'s 16 results.
    fn run(
        &mut self,
        tile: &[u8],
        blocks: usize,
        next: &[u8],
        mut take: impl FnMut(usize, &[f32; q4_0_tiles::TILE_ROWS]),
    ) {
        (self.f)(
            tile,
            blocks,
            self.passes,
            &mut self.scratch,
            &mut self.res,
            next,
        );
        for (t, rows) in self.res.iter().enumerate() {
            take(t, rows);
        }
    }
}

/// The fewest tokens [`iq4_nl_tiled_rows`] takes: with four or fewer the
/// row kernels were as fast or faster (the kernels bench on a Zen 4 VM:
/// 33–37 GB/s × batch either way at 4 tokens, 64 against 36 at 5).
const IQ4_NL_TILE_MIN_TOKENS: usize = 5;

/// Rows `r0..r0 + len` of an IQ4_NL matrix (`bytes`, `rb` bytes a row)
/// against every token of `xs` into `out` (token-major, `len` per token):
/// each full group of 16 rows copied and tiled as Q4_0's ([`q4_0_tiles`];
/// the blocks have the same 18 bytes) and multiplied by up to
/// [`TILE_TOKENS`] tokens per pass, the rows past the last group by the
/// row kernels. Every value is `dot_more_q8`'s for IQ4_NL, bit for bit.
#[allow(clippy::too_many_arguments)]
fn iq4_nl_tiled_rows(
    k: &KernelSet,
    tiles: TilesDot,
    bytes: &[u8],
    rb: usize,
    xs: &[&Q8Activation],
    amx: Option<&AmxInput>,
    r0: usize,
    len: usize,
    out: &mut [f32],
) {
    use q4_0_tiles::TILE_ROWS;
    const { assert!(quant::IQ4_NL_BLOCK_BYTES == Q4_0_BLOCK_BYTES) };
    let blocks = rb / quant::IQ4_NL_BLOCK_BYTES;
    let full = len / TILE_ROWS * TILE_ROWS;
    let (mut rows, mut tile) = (vec![0u8; TILE_ROWS * rb], vec![0u8; TILE_ROWS * rb]);
    let mut res = [[0.0f32; TILE_ROWS]; TILE_TOKENS];
    let mut amx = AmxRun::new(k.amx_iq4_nl_tiles, amx, xs, blocks);
    for p in (0..full).step_by(TILE_ROWS) {
        let at = (r0 + p) * rb;
        // Copied first: one stream through the 16 rows, where tiling
        // straight from them reads 16 streams at once (the 512-token
        // prefill of an IQ4_NL file 10-20% slower).
        rows.copy_from_slice(&bytes[at..at + TILE_ROWS * rb]);
        q4_0_tiles::tile_into(&rows, blocks, &mut tile);
        // The next group's rows, asked of L2 during the first pass: they
        // are copied next.
        let next = if p + TILE_ROWS < full {
            &bytes[at + TILE_ROWS * rb..at + 2 * TILE_ROWS * rb]
        } else {
            &[][..]
        };
        // Tokens the AMX kernel took (the first ones); the rest below.
        let mut t0 = 0;
        if let Some(amx) = &mut amx {
            amx.run(&tile, blocks, next, |t, row| {
                out[t * len + p..][..TILE_ROWS].copy_from_slice(row);
            });
            t0 = amx.tokens();
        }
        for (i, size) in tile_passes(xs.len() - t0).enumerate() {
            let hint = if i == 0 && t0 == 0 { next } else { &[][..] };
            tiles(&tile, blocks, &xs[t0..t0 + size], &mut res[..size], hint);
            for (j, row) in res[..size].iter().enumerate() {
                out[(t0 + j) * len + p..][..TILE_ROWS].copy_from_slice(row);
            }
            t0 += size;
        }
    }
    for i in full..len {
        let row = &bytes[(r0 + i) * rb..(r0 + i + 1) * rb];
        for (t, x) in xs.iter().enumerate() {
            out[t * len + i] = (k.dot_more_q8)(WeightFormat::Iq4Nl, row, x);
        }
    }
}

/// Rows `r0..r0 + len` of a Q8_0 matrix (`bytes`, `rb` bytes a row)
/// against every token of `xs` into `out` (token-major, `len` per token):
/// two rows at a time against up to 8 tokens per pass, the
/// rows of a pass still in L1 for the next; an odd last row by the
/// several-token row kernel. Every value is `dot_q8_0_q8`'s, bit for bit.
#[allow(clippy::too_many_arguments)]
fn q8_0_pair_rows(
    k: &KernelSet,
    pair: PairDot,
    bytes: &[u8],
    rb: usize,
    xs: &[&Q8Activation],
    r0: usize,
    len: usize,
    out: &mut [f32],
) {
    // Passes as even as `tile_passes` makes them (a pass of few tokens
    // runs slowest per token); `TILE_TOKENS` is the pair kernel's most.
    #[cfg(target_arch = "x86_64")]
    const {
        assert!(q8act::avx512::PAIR_TOKENS == TILE_TOKENS)
    };
    let mut res = [[0.0f32; 2]; TILE_TOKENS];
    let pairs = len / 2;
    for p in 0..pairs {
        let at = (r0 + 2 * p) * rb;
        let (w0, w1) = (&bytes[at..at + rb], &bytes[at + rb..at + 2 * rb]);
        let mut t0 = 0;
        for size in tile_passes(xs.len()) {
            pair(w0, w1, &xs[t0..t0 + size], &mut res);
            for (j, r) in res[..size].iter().enumerate() {
                out[(t0 + j) * len + 2 * p] = r[0];
                out[(t0 + j) * len + 2 * p + 1] = r[1];
            }
            t0 += size;
        }
    }
    if len % 2 == 1 {
        let i = len - 1;
        let row = &bytes[(r0 + i) * rb..(r0 + i + 1) * rb];
        let mut tmp = [0.0f32; q8act::MULTI];
        for (g, group) in xs.chunks(q8act::MULTI).enumerate() {
            (k.dot_q8_0_q8_multi)(row, group, &mut tmp[..group.len()]);
            for (j, v) in tmp[..group.len()].iter().enumerate() {
                out[(g * q8act::MULTI + j) * len + i] = *v;
            }
        }
    }
}

/// A several-token row kernel: one row against up to [`q8act::MULTI`]
/// activations, each result the single-token kernel's.
#[derive(Clone, Copy)]
enum Multi {
    /// A format's own field (Q8_0, Q4_0).
    Own(MultiDot),
    /// [`KernelSet::dot_more_q8_multi`], for this format.
    More(MoreMultiDot, WeightFormat),
}

impl Multi {
    /// `k`'s several-token kernel for format `f`, where it has one.
    fn of(k: &KernelSet, f: WeightFormat) -> Option<Multi> {
        Some(match f {
            WeightFormat::Q8_0 => Multi::Own(k.dot_q8_0_q8_multi),
            WeightFormat::Q4_0 => Multi::Own(k.dot_q4_0_q8_multi?),
            f if more_q8(f) => Multi::More(k.dot_more_q8_multi?, f),
            _ => return None,
        })
    }

    fn run(self, row: &[u8], xs: &[&Q8Activation], out: &mut [f32]) {
        match self {
            Multi::Own(multi) => multi(row, xs, out),
            Multi::More(multi, f) => multi(f, row, xs, out),
        }
    }
}

/// Rows `r0..r0 + len` of `w` (an [`int_format`]; `r0` at one of
/// [`Pool::task_rows`]'s boundaries) against every quantized token of
/// `q8` into `out` (token-major, `len` per token), by the fastest kernel
/// this CPU has for the layout: tiles, panels, IQ4_NL tiles, Q8_0 row
/// pairs, several-token row kernels, else a row and a token at a time.
/// Every value is the one-token kernel's, bit for bit.
///
/// `amx`: where the product's tasks share one, the tokens packed for the
/// AMX kernels.
fn q8_rows(
    k: &KernelSet,
    w: &QMatrix,
    q8: &[&Q8Activation],
    amx: Option<&AmxInput>,
    r0: usize,
    len: usize,
    out: &mut [f32],
) {
    let n = q8.len();
    let bytes = w.data().as_slice();
    let rb = bytes.len() / w.rows;
    let r1 = r0 + len;
    // Tiles: a token at a time through each tile while it is in L1, which
    // beats the matrix–matrix kernel at every batch measured
    // (docs/benchmarks.md).
    if let Some(tile) = k.dot_q4_0_tile.filter(|_| w.is_tiled()) {
        tiled_rows(k, tile, w, q8, amx, r0, len, out);
    } else if let Some(panels) =
        panel_fn(k, w.format).filter(|_| n >= k_panels::PANEL_MIN_TOKENS || w.is_k_panels())
    {
        panel_rows(k, panels, w, q8, r0, len, out);
    } else if let Some(tiles) = k
        .dot_iq4_nl_tiles
        .filter(|_| w.format == WeightFormat::Iq4Nl && n >= IQ4_NL_TILE_MIN_TOKENS)
    {
        iq4_nl_tiled_rows(k, tiles, bytes, rb, q8, amx, r0, len, out);
    } else if let Some(pair) = k
        .dot_q8_0_q8_pair
        .filter(|_| w.format == WeightFormat::Q8_0)
    {
        q8_0_pair_rows(k, pair, bytes, rb, q8, r0, len, out);
    } else if let Some(multi) = Multi::of(k, w.format).filter(|_| !w.is_tiled() && !w.is_k_panels())
    {
        // One pass over each row serves up to MULTI tokens (same results
        // as one token at a time).
        let mut tmp = [0.0f32; q8act::MULTI];
        for r in r0..r1 {
            let row = &bytes[r * rb..(r + 1) * rb];
            for (g, group) in q8.chunks(q8act::MULTI).enumerate() {
                multi.run(row, group, &mut tmp[..group.len()]);
                for (j, v) in tmp[..group.len()].iter().enumerate() {
                    out[(g * q8act::MULTI + j) * len + (r - r0)] = *v;
                }
            }
        }
    } else {
        for r in r0..r1 {
            for (t, a) in q8.iter().enumerate() {
                out[t * len + (r - r0)] = dot_q8_row(k, w, r, a);
            }
        }
    }
}

/// `Y[t] = W X[t]` for a prepared batch (of `w`'s format).
fn matmul_prepared(pool: &Pool, w: &QMatrix, batch: &Batch<'_>, y: &mut [f32]) {
    let k = kernels();
    let n = batch.inputs.len();
    let chunk = pool.task_rows(w);
    let rows = w.rows;
    let inputs = &batch.inputs;
    let q8: Vec<&Q8Activation> = inputs
        .iter()
        .filter_map(|i| if let Input::Q8(a) = i { Some(a) } else { None })
        .collect();
    let f32s: Vec<&[f32]> = inputs
        .iter()
        .filter_map(|i| {
            if let Input::F32(x) = i {
                Some(*x)
            } else {
                None
            }
        })
        .collect();
    let bytes = w.data().as_slice();
    let rb = bytes.len() / rows;
    // Q4_0 with a matrix–matrix kernel: the tokens interleaved once (in
    // the batch), each task's rows multiplied into every token.
    let gemm = batch.tiles.as_ref();
    let amx = AmxInput::default();
    // Each task writes its block of rows of every token straight into y.
    let parts = pool::Parts::over(y);
    // Each task owns a block of rows and computes it for every vector while
    // those rows are hot in cache; the blocks are scattered afterwards.
    {
        pool.map_collect(rows.div_ceil(chunk), |b| {
            let r0 = b * chunk;
            let r1 = (r0 + chunk).min(rows);
            // Token-major output, but row-major loop: each weight row is
            // read from memory once and reused from L1 for every token.
            let len = r1 - r0;
            let mut out = vec![0.0f32; len * n];
            // Tiles: a token at a time through each tile while it is in
            // L1, which beats the matrix–matrix kernel at every batch
            // measured (docs/benchmarks.md).
            if let Some((g, tiles)) = gemm.filter(|_| !w.is_tiled()) {
                let stride = tiles.row_stride();
                let mut tmp = vec![0.0f32; len * stride];
                (g.run)(
                    &bytes[r0 * rb..r1 * rb],
                    tiles,
                    &mut RowScratch::default(),
                    &mut tmp,
                );
                for (i, row) in tmp.chunks_exact(stride).enumerate() {
                    for (t, v) in row[..n].iter().enumerate() {
                        out[t * len + i] = *v;
                    }
                }
            } else if q8.len() == n {
                q8_rows(k, w, &q8, Some(&amx), r0, len, &mut out);
            } else if let Some(multi) = match (w.format, w.is_quads()) {
                (WeightFormat::Bf16, false) => k.dot_bf16_multi,
                (WeightFormat::F16, false) => k.dot_f16_multi,
                // The block starts at a quad boundary (`task_rows`).
                (WeightFormat::Bf16, true) => k.dot_bf16_quads_multi,
                (WeightFormat::F16, true) => k.dot_f16_quads_multi,
                _ => None,
            }
            .filter(|_| f32s.len() == n)
            {
                // The block's 16-bit rows against all the vectors at once
                // (same results as a row and a vector at a time).
                let all: &[u16] = bytemuck::cast_slice(bytes);
                let mut tmp = vec![0.0f32; len * n];
                multi(&all[r0 * w.cols..r1 * w.cols], &f32s, &mut tmp);
                for (i, row) in tmp.chunks_exact(n).enumerate() {
                    for (t, v) in row.iter().enumerate() {
                        out[t * len + i] = *v;
                    }
                }
            } else if dequantizes(w) && f32s.len() == n {
                // The exact product of a format without an f32-input
                // kernel is the dequantized row through `dot_f32`
                // (`dot_row`): each row dequantized once for every token.
                let mut row = vec![0.0f32; w.cols];
                for r in r0..r1 {
                    row_to_f32(w, r, &mut row);
                    for (t, x) in f32s.iter().enumerate() {
                        out[t * len + (r - r0)] = (k.dot_f32)(&row, x);
                    }
                }
            } else {
                for r in r0..r1 {
                    for (t, input) in inputs.iter().enumerate() {
                        out[t * len + (r - r0)] = dot_input(k, w, r, input);
                    }
                }
            }
            // SAFETY: task b alone writes rows r0..r1 of each token: the
            // tasks' row blocks are disjoint.
            unsafe { parts.put_rows(r0, rows, &out, len) };
        });
    }
    debug_assert!(parts.complete(), "every row of every token written");
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    pub(crate) fn rand_vec(rng: &mut impl Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn rel_err(a: f32, b: f32, scale: f32) -> f32 {
        (a - b).abs() / scale.max(1e-6)
    }

    /// A Q4_0 matrix of random weights.
    pub(crate) fn q4_matrix(rng: &mut impl Rng, rows: usize, cols: usize) -> QMatrix {
        let w = rand_vec(rng, rows * cols);
        let bytes: Vec<u8> = w
            .chunks(cols)
            .flat_map(|r| quant::quantize_q4_0(r).unwrap())
            .collect();
        let data = crate::tensor::Bytes::from_vec(bytes);
        QMatrix::new("t", rows, cols, WeightFormat::Q4_0, data, None).unwrap()
    }

    /// Sum of |w_i x_i|: the natural scale of a dot product's rounding error.
    fn abs_scale(w: &[f32], x: &[f32]) -> f32 {
        w.iter().zip(x).map(|(a, b)| (a * b).abs()).sum()
    }

    /// Every kernel set this CPU runs besides [`SCALAR`] (the tests
    /// compare each with the scalar references).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x86_families_from_cpuid() {
        // Zen 3 and Zen 4 (family 19h), Zen 5 (1Ah), Sapphire Rapids (6).
        assert_eq!(x86_family(0x00A0_0F11), 0x19);
        assert_eq!(x86_family(0x00A1_0F11), 0x19);
        assert_eq!(x86_family(0x00B0_0F21), 0x1A);
        assert_eq!(x86_family(0x0008_06F8), 6);
        // Only a CPU with AVX-512 can split it.
        assert!(!splits_512_bit() || is_x86_feature_detected!("avx512f"));
        let chosen = select_simd().name;
        let forced = ["COLIBRI_NO_AVX512", "COLIBRI_SCALAR_KERNELS"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
        if has_avx512_vnni() && !forced {
            let want = if splits_512_bit() {
                AVX512_VNNI_HALF_WIDTH.name
            } else {
                AVX512_VNNI.name
            };
            assert_eq!(chosen, want);
        }
    }

    pub(crate) fn simd_sets() -> Vec<KernelSet> {
        let mut sets = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                sets.push(AVX2);
            } else {
                eprintln!(
                    "SKIP avx2: this CPU has no AVX2+FMA+F16C (probe: is_x86_feature_detected)"
                );
            }
            if has_avx512_vnni() {
                sets.push(AVX512_VNNI);
                sets.push(AVX512_VNNI_HALF_WIDTH);
            } else {
                eprintln!(
                    "SKIP avx512: this CPU has no AVX-512 VNNI (probe: is_x86_feature_detected)"
                );
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            sets.push(NEON);
            if has_neon_dotprod() {
                sets.push(NEON_DOTPROD);
            } else {
                eprintln!(
                    "SKIP neon+dotprod: this CPU has no dotprod (probe: is_aarch64_feature_detected)"
                );
            }
        }
        sets
    }

    /// On aarch64 the NEON kernels are chosen, with SDOT where the CPU has
    /// it.
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn aarch64_selects_neon() {
        if std::env::var_os("COLIBRI_SCALAR_KERNELS").is_some() {
            eprintln!("SKIP: COLIBRI_SCALAR_KERNELS is set");
            return;
        }
        let want = if has_neon_dotprod() {
            "neon+dotprod"
        } else {
            "neon"
        };
        assert_eq!(select_simd().name, want);
        // tools/neon_check.sh names the set each emulated CPU must get.
        if let Some(expect) = std::env::var_os("COLIBRI_EXPECT_KERNELS") {
            assert_eq!(select_simd().name, expect, "COLIBRI_EXPECT_KERNELS");
        }
    }

    /// bf16 and f16 rows in fours: every row's result has the bits of the
    /// one-row kernel, for row counts around four and lengths around the
    /// vector widths, through the kernel and through `matvec` (which takes
    /// it).
    #[test]
    fn half_rows_equal_single_dots_bit_for_bit() {
        type One = fn(&[u16], &[f32]) -> f32;
        type Encode<'a> = &'a dyn Fn(f32) -> u16;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(35);
        let bf16 = |v: f32| half::bf16::from_f32(v).to_bits();
        let f16 = |v: f32| half::f16::from_f32(v).to_bits();
        let mut checked = 0;
        for k in simd_sets() {
            let formats: [(&str, Option<RowsDot16>, One, Encode); 2] = [
                ("bf16", k.dot_bf16_rows, k.dot_bf16, &bf16),
                ("f16", k.dot_f16_rows, k.dot_f16, &f16),
            ];
            for (name, rows_dot, one, enc) in formats {
                let Some(f) = rows_dot else {
                    continue;
                };
                for n in [1usize, 7, 8, 9, 15, 16, 17, 24, 31, 33, 2048] {
                    for rows in [0usize, 1, 3, 4, 5, 8, 11] {
                        let w: Vec<u16> = rand_vec(&mut rng, rows * n)
                            .iter()
                            .map(|&v| enc(v * 3.0))
                            .collect();
                        let x = rand_vec(&mut rng, n);
                        let mut out = vec![f32::NAN; rows];
                        f(&w, &x, &mut out);
                        for (r, o) in out.iter().enumerate() {
                            let want = one(&w[r * n..(r + 1) * n], &x);
                            assert_eq!(
                                o.to_bits(),
                                want.to_bits(),
                                "{} {name} n={n} row {r}",
                                k.name
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        assert!(checked > 0, "no 16-bit rows kernel on an x86-64 SIMD set");
        let _ = checked;
        // Rows in quads: each the one-row kernel's bits on the row-major row,
        // with and without rows past the last quad.
        let mut checked = 0;
        for k in simd_sets() {
            let formats: [(&str, Option<RowsDot16>, One, Encode); 2] = [
                ("bf16", k.dot_bf16_quads, k.dot_bf16, &bf16),
                ("f16", k.dot_f16_quads, k.dot_f16, &f16),
            ];
            for (name, quads_dot, one, enc) in formats {
                let Some(f) = quads_dot else {
                    continue;
                };
                for n in [16usize, 32, 48, 144, 2048] {
                    for rows in [0usize, 1, 3, 4, 5, 8, 11] {
                        let w: Vec<u16> = rand_vec(&mut rng, rows * n)
                            .iter()
                            .map(|&v| enc(v * 3.0))
                            .collect();
                        let mut q = w.clone();
                        quads16::to_quads(&mut q, rows, n, &mut Vec::new());
                        let x = rand_vec(&mut rng, n);
                        let mut out = vec![f32::NAN; rows];
                        f(&q, &x, &mut out);
                        for (r, o) in out.iter().enumerate() {
                            let want = one(&w[r * n..(r + 1) * n], &x);
                            assert_eq!(
                                o.to_bits(),
                                want.to_bits(),
                                "{} {name} quads n={n} rows={rows} row {r}",
                                k.name
                            );
                        }
                        // Several vectors through the quads, each the
                        // one-row kernel's bits.
                        let multi = if name == "bf16" {
                            k.dot_bf16_quads_multi
                        } else {
                            k.dot_f16_quads_multi
                        };
                        let multi = multi.expect("a quads kernel has a several-vector one");
                        for nt in [1usize, 3, 4, 5, 17] {
                            let xs: Vec<Vec<f32>> =
                                (0..nt).map(|_| rand_vec(&mut rng, n)).collect();
                            let xr: Vec<&[f32]> = xs.iter().map(|v| v.as_slice()).collect();
                            let mut out = vec![f32::NAN; rows * nt];
                            multi(&q, &xr, &mut out);
                            for r in 0..rows {
                                for (t, x) in xr.iter().enumerate() {
                                    let want = one(&w[r * n..(r + 1) * n], x);
                                    assert_eq!(
                                        out[r * nt + t].to_bits(),
                                        want.to_bits(),
                                        "{} {name} quads × {nt} n={n} rows={rows} row {r}",
                                        k.name
                                    );
                                }
                            }
                        }
                        checked += 1;
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        assert!(checked > 0, "no 16-bit quads kernel on an x86-64 SIMD set");
        let _ = checked;
        // One row against several vectors: each the one-row kernel's bits,
        // for vector counts around the kernels' four.
        let mut checked = 0;
        for k in simd_sets() {
            let formats: [(&str, Option<MultiDot16>, One, Encode); 2] = [
                ("bf16", k.dot_bf16_multi, k.dot_bf16, &bf16),
                ("f16", k.dot_f16_multi, k.dot_f16, &f16),
            ];
            for (name, multi, one, enc) in formats {
                let Some(f) = multi else {
                    continue;
                };
                for n in [1usize, 7, 8, 9, 15, 16, 17, 24, 31, 33, 2048, 2072] {
                    let w: Vec<u16> = rand_vec(&mut rng, n)
                        .iter()
                        .map(|&v| enc(v * 3.0))
                        .collect();
                    let xs: Vec<Vec<f32>> = (0..9).map(|_| rand_vec(&mut rng, n)).collect();
                    for t in 0..=xs.len() {
                        let refs: Vec<&[f32]> = xs[..t].iter().map(Vec::as_slice).collect();
                        let mut out = vec![f32::NAN; t];
                        f(&w, &refs, &mut out);
                        for (j, (o, x)) in out.iter().zip(&refs).enumerate() {
                            assert_eq!(
                                o.to_bits(),
                                one(&w, x).to_bits(),
                                "{} {name} n={n}, {t} vectors, vector {j}",
                                k.name
                            );
                        }
                        checked += 1;
                    }
                    // Several rows at once: more vectors than take a row
                    // whole (17, 21), more rows than a row group (37), rows
                    // long enough for several column spans (n ≥ 2048).
                    let rows = 37;
                    let xs: Vec<Vec<f32>> = (0..21).map(|_| rand_vec(&mut rng, n)).collect();
                    let wr: Vec<u16> = rand_vec(&mut rng, rows * n)
                        .iter()
                        .map(|&v| enc(v * 3.0))
                        .collect();
                    for t in [1usize, 4, 6, 9, 16, 17, 21] {
                        let refs: Vec<&[f32]> = xs[..t].iter().map(Vec::as_slice).collect();
                        let mut out = vec![f32::NAN; rows * t];
                        f(&wr, &refs, &mut out);
                        for (i, o) in out.iter().enumerate() {
                            let (r, j) = (i / t, i % t);
                            assert_eq!(
                                o.to_bits(),
                                one(&wr[r * n..(r + 1) * n], refs[j]).to_bits(),
                                "{} {name} n={n}, {rows} rows, {t} vectors, row {r} vector {j}",
                                k.name
                            );
                        }
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        assert!(
            checked > 0,
            "no 16-bit multi-vector kernel on an x86-64 SIMD set"
        );
        let _ = checked;
        // matvec and matmul take the kernels: the same bits as a row and a
        // vector at a time.
        let k = kernels();
        let (rows, cols) = (203, 2048 + 24);
        for (format, one, enc) in [
            (WeightFormat::Bf16, k.dot_bf16, &bf16 as Encode),
            (WeightFormat::F16, k.dot_f16, &f16),
        ] {
            let w: Vec<u16> = rand_vec(&mut rng, rows * cols)
                .iter()
                .map(|&v| enc(v))
                .collect();
            let bytes = crate::tensor::Bytes::from_vec(bytemuck::cast_slice(&w).to_vec());
            let m = QMatrix::new("t", rows, cols, format, bytes, None).unwrap();
            for n in [1, 7] {
                let x = rand_vec(&mut rng, n * cols);
                let mut y = vec![f32::NAN; n * rows];
                matmul(&Pool::new(3).unwrap(), &m, &x, n, &mut y);
                for (i, v) in y.iter().enumerate() {
                    let (t, r) = (i / rows, i % rows);
                    let want = one(&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    assert_eq!(
                        v.to_bits(),
                        want.to_bits(),
                        "{format:?}, {n} vectors, row {r}"
                    );
                }
            }
        }
    }

    /// Grouped scores: every (query, row) result of `dot_f32_rows_group`
    /// has the bits of `dot_f32`, for group sizes around the kernel's four
    /// queries and row lengths around the vector widths.
    #[test]
    fn grouped_scores_equal_single_dots_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(34);
        let mut checked = 0;
        for k in simd_sets() {
            let Some(f) = k.dot_f32_rows_group else {
                continue;
            };
            for d in [1usize, 7, 8, 15, 16, 17, 24, 64, 128, 129] {
                for g in [1usize, 2, 3, 4, 5, 8, 9] {
                    for rows in [0usize, 1, 6, 33] {
                        let stride = 3 * d + 5;
                        let qs = rand_vec(&mut rng, g * d);
                        let keys = rand_vec(&mut rng, rows.max(1) * stride);
                        let mut out = vec![f32::NAN; g * rows];
                        f(&qs, g, &keys, stride, &mut out, rows % 2 == 1);
                        for j in 0..g {
                            for t in 0..rows {
                                let want = (k.dot_f32)(
                                    &qs[j * d..(j + 1) * d],
                                    &keys[t * stride..t * stride + d],
                                );
                                assert_eq!(
                                    out[j * rows + t].to_bits(),
                                    want.to_bits(),
                                    "{} d={d} g={g} query {j} row {t}",
                                    k.name
                                );
                            }
                        }
                        checked += 1;
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        assert!(checked > 0, "no grouped kernel on an x86-64 SIMD set");
        let _ = checked;
    }

    /// Grouped weighted sums: each head of `weighted_rows_group` gets the
    /// bits `weighted_rows` gives it alone, for group sizes around the
    /// kernel's four heads, row lengths around its 16 and 64 columns, and
    /// blocks of rows continued across calls.
    #[test]
    fn grouped_weighted_sums_equal_single_heads_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(35);
        let mut checked = 0;
        for k in simd_sets() {
            let Some(f) = k.weighted_rows_group else {
                continue;
            };
            for n in [1usize, 15, 16, 17, 48, 64, 80, 128, 129] {
                for g in [1usize, 3, 4, 5, 8, 9] {
                    for rows in [0usize, 1, 7, 40] {
                        let v_stride = 2 * n + 3;
                        let s_stride = rows + 5;
                        let v = rand_vec(&mut rng, rows.max(1) * v_stride);
                        let s = rand_vec(&mut rng, g * s_stride);
                        let start = rand_vec(&mut rng, g * n);
                        let mut want = start.clone();
                        for j in 0..g {
                            (k.weighted_rows)(
                                &mut want[j * n..(j + 1) * n],
                                &s[j * s_stride..j * s_stride + rows],
                                &v,
                                v_stride,
                            );
                        }
                        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        let mut got = start.clone();
                        f(&mut got, g, &s, s_stride, rows, &v, v_stride, rows % 2 == 1);
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{} n={n} g={g} rows={rows}",
                            k.name
                        );
                        // In two blocks of rows: one call's bits.
                        let cut = rows / 2;
                        let mut parts = start.clone();
                        f(&mut parts, g, &s, s_stride, cut, &v, v_stride, true);
                        let rest = &v[(cut * v_stride).min(v.len())..];
                        f(
                            &mut parts,
                            g,
                            &s[cut..],
                            s_stride,
                            rows - cut,
                            rest,
                            v_stride,
                            false,
                        );
                        assert_eq!(bits(&parts), bits(&want), "{} n={n} g={g} cut", k.name);
                        checked += 1;
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            assert!(checked > 0, "no grouped weighted sum on an AVX-512 machine");
        }
        let _ = checked;
    }

    /// Attention's kernels: scores over many rows equal one `dot_f32` per
    /// row, and the weighted sum of value rows gives the scalar reference's
    /// bits in every kernel set, on row lengths around the vector widths.
    #[test]
    fn attention_kernels_equal_their_references_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        let mut sets = vec![SCALAR];
        sets.extend(simd_sets());
        sets.push(*kernels());
        for len in [1usize, 3, 4, 5, 7, 8, 9, 63, 64, 65, 67, 128, 200] {
            for rows in [1usize, 2, 17, 40] {
                let stride = len + 3;
                let v = rand_vec(&mut rng, (rows - 1) * stride + len);
                let mut s = rand_vec(&mut rng, rows);
                s.iter_mut().for_each(|x| *x = x.abs());
                let mut want = vec![0.0f32; len];
                scalar::weighted_rows(&mut want, &s, &v, stride);
                // The reference is the plain sum, row after row, one fused
                // multiply-add per row.
                for (i, w) in want.iter().enumerate() {
                    let plain = (0..rows).fold(0.0f32, |a, t| s[t].mul_add(v[t * stride + i], a));
                    assert_eq!(w.to_bits(), plain.to_bits());
                }
                let q = rand_vec(&mut rng, len);
                for k in &sets {
                    let mut dots = vec![f32::NAN; rows];
                    (k.dot_f32_rows)(&q, &v, stride, &mut dots);
                    for (t, d) in dots.iter().enumerate() {
                        let one = (k.dot_f32)(&q, &v[t * stride..t * stride + len]);
                        assert_eq!(d.to_bits(), one.to_bits(), "{} dot rows", k.name);
                    }
                    let mut got = vec![0.0f32; len];
                    (k.weighted_rows)(&mut got, &s, &v, stride);
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{} len {len} rows {rows}", k.name);
                    // Called on consecutive blocks of rows, it continues
                    // each element's sum: one call's bits.
                    for cut in [1, rows / 2, rows - 1] {
                        let mut parts = vec![0.0f32; len];
                        (k.weighted_rows)(&mut parts, &s[..cut], &v, stride);
                        let rest = &v[(cut * stride).min(v.len())..];
                        (k.weighted_rows)(&mut parts, &s[cut..], rest, stride);
                        assert_eq!(
                            bits(&parts),
                            bits(&want),
                            "{} len {len} rows {rows} cut {cut}",
                            k.name
                        );
                    }
                }
            }
        }
    }

    /// The AVX2 kernels' float dot arithmetic in scalar code: two 8-lane
    /// accumulators fed 16 elements a step with fused multiply-adds (with
    /// `wide`; AVX2's f16 dot takes only 8-element steps), then 8 at a time
    /// into the first, their lane sums reduced as `_mm256` halves, then an
    /// unfused tail.
    fn avx2_shape_dot(w: &[f32], x: &[f32], wide: bool) -> f32 {
        let n = w.len();
        let mut acc = [[0.0f32; 8]; 2];
        let mut i = 0;
        while wide && i + 16 <= n {
            for (h, a) in acc.iter_mut().enumerate() {
                for (l, v) in a.iter_mut().enumerate() {
                    let j = i + 8 * h + l;
                    *v = w[j].mul_add(x[j], *v);
                }
            }
            i += 16;
        }
        while i + 8 <= n {
            for (l, v) in acc[0].iter_mut().enumerate() {
                *v = w[i + l].mul_add(x[i + l], *v);
            }
            i += 8;
        }
        let v: [f32; 8] = if wide {
            std::array::from_fn(|l| acc[0][l] + acc[1][l])
        } else {
            acc[0]
        };
        let s: [f32; 4] = std::array::from_fn(|l| v[l] + v[l + 4]);
        let mut r = (s[0] + s[2]) + (s[1] + s[3]);
        for j in i..n {
            r += w[j] * x[j];
        }
        r
    }

    /// Every SIMD set's f32, bf16 and f16 dots run the AVX2 arithmetic
    /// ([`avx2_shape_dot`]), so AVX2, AVX-512 and NEON give the same bits
    /// (Q8_0/Q4_0 rows with f32 inputs follow, as they equal `dot_f32` on
    /// the dequantized rows).
    #[test]
    fn float_dots_run_the_avx2_arithmetic_on_every_isa() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for k in simd_sets() {
            for n in [1usize, 3, 4, 8, 15, 16, 17, 24, 31, 33, 100, 257] {
                let x = rand_vec(&mut rng, n);
                let w = rand_vec(&mut rng, n);
                let name = k.name;
                let want = avx2_shape_dot(&w, &x, true);
                assert_eq!(
                    (k.dot_f32)(&w, &x).to_bits(),
                    want.to_bits(),
                    "{name} f32 n={n}"
                );
                let wb: Vec<u16> = w
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                let wf: Vec<f32> = wb.iter().map(|&b| bf16_to_f32(b)).collect();
                let want = avx2_shape_dot(&wf, &x, true);
                assert_eq!(
                    (k.dot_bf16)(&wb, &x).to_bits(),
                    want.to_bits(),
                    "{name} bf16 n={n}"
                );
                let wh: Vec<u16> = w
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_bits())
                    .collect();
                let wf: Vec<f32> = wh.iter().map(|&b| f16_to_f32(b)).collect();
                let want = avx2_shape_dot(&wf, &x, false);
                assert_eq!(
                    (k.dot_f16)(&wh, &x).to_bits(),
                    want.to_bits(),
                    "{name} f16 n={n}"
                );
            }
        }
    }

    #[test]
    fn selected_kernels_match_scalar_on_random_data() {
        let mut sets = simd_sets();
        sets.push(*kernels());
        for k in &sets {
            kernels_match_scalar_on_random_data(k);
        }
    }

    fn kernels_match_scalar_on_random_data(k: &KernelSet) {
        // f16 widening is exact for every bit pattern (subnormals,
        // infinities, NaNs), inside the vector loop.
        let mut w = [0u16; 16];
        for h in 0..=u16::MAX {
            w[5] = h;
            let got = (k.dot_f16)(&w, &[1.0; 16]);
            let want = f16_to_f32(h);
            assert!(
                got == want || got.is_nan() && want.is_nan(),
                "{} f16 {h:#x}",
                k.name
            );
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &n in &[1usize, 3, 4, 5, 7, 8, 15, 16, 17, 33, 128, 257, 1000] {
            let x = rand_vec(&mut rng, n);
            let w = rand_vec(&mut rng, n);
            let s = abs_scale(&w, &x);
            let name = k.name;
            assert!(
                rel_err((k.dot_f32)(&w, &x), scalar::dot_f32(&w, &x), s) < 1e-6,
                "{name} f32 n={n}"
            );

            let wb: Vec<u16> = w
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            assert!(
                rel_err((k.dot_bf16)(&wb, &x), scalar::dot_bf16(&wb, &x), s) < 1e-5,
                "{name} bf16 n={n}"
            );
            let wh: Vec<u16> = w
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect();
            assert!(
                rel_err((k.dot_f16)(&wh, &x), scalar::dot_f16(&wh, &x), s) < 1e-5,
                "{name} f16 n={n}"
            );

            let w8: Vec<u8> = (0..n).map(|_| rng.random_range(0u8..=0x7e)).collect();
            let w8: Vec<u8> = w8
                .iter()
                .map(|&b| b | if rng.random_bool(0.5) { 0x80 } else { 0 })
                .collect();
            let scales = rand_vec(&mut rng, n.div_ceil(128));
            let wf: Vec<f32> = w8
                .iter()
                .enumerate()
                .map(|(i, &b)| fp8_e4m3_to_f32(b) * scales[i / 128])
                .collect();
            let s8 = abs_scale(&wf, &x);
            let got = (k.dot_fp8)(&w8, &x, &scales, 128);
            let want = scalar::dot_fp8(&w8, &x, &scales, 128);
            assert!(
                rel_err(got, want, s8) < 1e-6,
                "{name} fp8 n={n}: {got} vs {want}"
            );
            // And the reference equals a plain dequantize-then-dot in f64.
            let exact: f64 = wf.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            assert!(rel_err(want, exact as f32, s8) < 1e-6);
        }
    }

    /// Q8_0/Q4_0 rows give exactly what their dequantized f32 rows give
    /// under the same kernel set (scalar and SIMD alike), and the SIMD
    /// kernels agree with the scalar ones within rounding.
    #[test]
    fn block_quant_kernels_equal_f32_on_dequantized_rows() {
        let mut sets = vec![SCALAR];
        sets.extend(simd_sets());
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
        for &n in &[32usize, 64, 96, 160, 256, 1024] {
            for round in 0..20 {
                let x = rand_vec(&mut rng, n);
                let w: Vec<f32> = (0..n)
                    .map(|_| rng.random_range(-1.0f32..1.0) * rng.random_range(0.01f32..3.0))
                    .collect();
                let mut q8 = quant::quantize_q8_0(&w).unwrap();
                let mut q4 = quant::quantize_q4_0(&w).unwrap();
                let awkward = round % 2 == 1 && n > QK;
                if awkward {
                    // A zero scale, negative ones, every nibble and byte.
                    q8[0..2].fill(0);
                    q4[0..2].fill(0);
                    for b in 1..n / QK {
                        q8[b * Q8_0_BLOCK_BYTES + 1] |= 0x80;
                        q4[b * Q4_0_BLOCK_BYTES + 1] |= 0x80;
                    }
                    let last = n / QK - 1;
                    for j in 0..QK {
                        q8[last * Q8_0_BLOCK_BYTES + 2 + j] = (j as u8).wrapping_mul(8) ^ 0x80;
                    }
                    for j in 0..QK / 2 {
                        q4[last * Q4_0_BLOCK_BYTES + 2 + j] = (j as u8) | ((15 - j as u8) << 4);
                    }
                }
                let (mut d8, mut d4) = (vec![0.0; n], vec![0.0; n]);
                quant::dequantize_q8_0(&q8, &mut d8);
                quant::dequantize_q4_0(&q4, &mut d4);
                assert!(d4.iter().any(|v| *v != 0.0) && d8.iter().any(|v| *v != 0.0));
                if awkward {
                    assert!(d4[..QK].iter().chain(&d8[..QK]).all(|v| *v == 0.0));
                }
                for k in &sets {
                    let a = (k.dot_q8_0)(&q8, &x);
                    assert_eq!(
                        a.to_bits(),
                        (k.dot_f32)(&d8, &x).to_bits(),
                        "{} q8_0 n={n}",
                        k.name
                    );
                    let b = (k.dot_q4_0)(&q4, &x);
                    assert_eq!(
                        b.to_bits(),
                        (k.dot_f32)(&d4, &x).to_bits(),
                        "{} q4_0 n={n}",
                        k.name
                    );
                    let s8 = abs_scale(&d8, &x);
                    assert!(rel_err(a, scalar::dot_q8_0(&q8, &x), s8) < 1e-6);
                    let s4 = abs_scale(&d4, &x);
                    assert!(rel_err(b, scalar::dot_q4_0(&q4, &x), s4) < 1e-6);
                }
            }
        }
        // row_to_f32 and dot_row over a QMatrix use the same layout.
        let (rows, cols) = (5, 64);
        let m = q4_matrix(&mut rng, rows, cols);
        let x = rand_vec(&mut rng, cols);
        let deq = m.to_f32();
        for r in 0..rows {
            let want = (kernels().dot_f32)(&deq[r * cols..(r + 1) * cols], &x);
            assert_eq!(dot_row(kernels(), &m, r, &x).to_bits(), want.to_bits());
        }
        assert!(WeightFormat::Q8_0.row_bytes(48).is_err());
    }

    #[test]
    fn matmul_rows_do_not_depend_on_batch_or_threads() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let (rows, cols, n) = (301, 77, 5);
        let w = QMatrix::from_f32(rows, cols, rand_vec(&mut rng, rows * cols)).unwrap();
        let x = rand_vec(&mut rng, n * cols);
        let p1 = Pool::new(1).unwrap();
        let p3 = Pool::new(3).unwrap();
        let mut y1 = vec![f32::NAN; n * rows];
        let mut y3 = vec![f32::NAN; n * rows];
        matmul(&p1, &w, &x, n, &mut y1);
        matmul(&p3, &w, &x, n, &mut y3);
        assert_eq!(y1, y3);
        for t in 0..n {
            let mut yt = vec![f32::NAN; rows];
            matvec(&p3, &w, &x[t * cols..(t + 1) * cols], &mut yt);
            assert_eq!(&y1[t * rows..(t + 1) * rows], &yt[..]);
        }
        // Against a float64 reference.
        let wf = w.to_f32();
        for t in 0..n {
            for r in 0..rows {
                let exact: f64 = (0..cols)
                    .map(|j| wf[r * cols + j] as f64 * x[t * cols + j] as f64)
                    .sum();
                assert!((y1[t * rows + r] as f64 - exact).abs() < 1e-4);
            }
        }
    }

    /// Q4_0 products over many tokens (the matrix–matrix kernel, tokens in
    /// groups, rows several at a time) give each token what a product of
    /// that token alone gives, whatever the thread count.
    #[test]
    fn q4_0_batches_equal_single_tokens_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for (rows, cols) in [(37usize, 96usize), (130, 768)] {
            let m = q4_matrix(&mut rng, rows, cols);
            assert_batches_equal_single_tokens(&m, &[2, 5, 6, 16, 17, 35], &mut rng);
        }
    }

    /// `matmul` of `m` over each batch of `batches` gives every token the
    /// bits of a one-token `matvec`, on 1, 2 and 3 threads.
    fn assert_batches_equal_single_tokens(m: &QMatrix, batches: &[usize], rng: &mut impl Rng) {
        let (rows, cols) = (m.rows, m.cols);
        let n = batches.iter().copied().max().unwrap_or(1);
        let x = rand_vec(rng, n * cols);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let one = Pool::new(1).unwrap();
        let single: Vec<Vec<f32>> = (0..n)
            .map(|t| {
                let mut y = vec![f32::NAN; rows];
                matvec(&one, m, &x[t * cols..(t + 1) * cols], &mut y);
                y
            })
            .collect();
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            for &batch in batches {
                let mut y = vec![f32::NAN; batch * rows];
                matmul(&pool, m, &x[..batch * cols], batch, &mut y);
                for t in 0..batch {
                    assert_eq!(
                        bits(&y[t * rows..(t + 1) * rows]),
                        bits(&single[t]),
                        "{:?} {rows}x{cols}, batch {batch}, token {t}, {threads} threads",
                        m.format
                    );
                }
            }
        }
    }

    /// Q8_0 products over many tokens (two rows at a time where the CPU
    /// has the pair kernel, up to 8 tokens a pass; odd row counts leave a
    /// row to the several-token row kernel) give each token what a product
    /// of that token alone gives, whatever the thread count.
    #[test]
    fn q8_0_batches_equal_single_tokens_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for (rows, cols) in [(37usize, 96usize), (130, 768), (9, 32)] {
            let data: Vec<u8> = (0..rows)
                .flat_map(|_| quant::quantize_q8_0(&rand_vec(&mut rng, cols)).unwrap())
                .collect();
            let m = QMatrix::new(
                "q8",
                rows,
                cols,
                WeightFormat::Q8_0,
                crate::tensor::Bytes::from_vec(data),
                None,
            )
            .unwrap();
            assert_batches_equal_single_tokens(&m, &[2, 5, 8, 9, 16, 17, 35], &mut rng);
        }
    }

    /// Q4_K, Q5_K and Q6_K products over many tokens (panels of 16 rows, up to
    /// 8 tokens a pass, the rows past the last panel by the row kernel)
    /// give each token what a product of that token alone gives, whatever
    /// the thread count; and the panels run where the CPU has them.
    #[test]
    fn k_quant_batches_equal_single_tokens_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
        for format in [WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K] {
            let size = k_panels::super_bytes(format).unwrap();
            for (rows, cols) in [(37usize, 256usize), (130, 768)] {
                let bytes: Vec<u8> = (0..rows)
                    .flat_map(|_| match format {
                        WeightFormat::Q6K => q6_k::tests::random_row(&mut rng, cols / 256),
                        _ => q4_k::tests::random_row(&mut rng, cols / 256, size),
                    })
                    .collect();
                let data = crate::tensor::Bytes::from_vec(bytes);
                let m = QMatrix::new("k", rows, cols, format, data, None).unwrap();
                let n = 19;
                let x = rand_vec(&mut rng, n * cols);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                let one = Pool::new(1).unwrap();
                let single: Vec<Vec<f32>> = (0..n)
                    .map(|t| {
                        let mut y = vec![f32::NAN; rows];
                        matvec(&one, &m, &x[t * cols..(t + 1) * cols], &mut y);
                        y
                    })
                    .collect();
                for threads in [1, 2, 3] {
                    let pool = Pool::new(threads).unwrap();
                    for batch in [2usize, 3, 8, 9, 16, 19] {
                        let mut y = vec![f32::NAN; batch * rows];
                        matmul(&pool, &m, &x[..batch * cols], batch, &mut y);
                        for t in 0..batch {
                            assert_eq!(
                                bits(&y[t * rows..(t + 1) * rows]),
                                bits(&single[t]),
                                "{format:?} {rows}x{cols}, batch {batch}, token {t}, {threads} threads"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A `rows × cols` matrix of a [`more_q8`] format ([`more_q8_bytes`]).
    fn more_q8_matrix(
        rng: &mut impl Rng,
        format: WeightFormat,
        rows: usize,
        cols: usize,
    ) -> QMatrix {
        let data = crate::tensor::Bytes::from_vec(more_q8_bytes(rng, format, rows * cols));
        QMatrix::new("m", rows, cols, format, data, None).unwrap()
    }

    /// `elements` weights of a [`more_q8`] format, whole blocks: every
    /// byte random, then random f16 scales (and mins) over their fields:
    /// ordinary, negative, subnormal and large ones.
    pub(crate) fn more_q8_bytes(
        rng: &mut impl Rng,
        format: WeightFormat,
        elements: usize,
    ) -> Vec<u8> {
        let (per_block, f16s): (usize, &[usize]) = match format {
            WeightFormat::Q5_0 | WeightFormat::Iq4Nl => (QK, &[0]),
            WeightFormat::Q4_1 | WeightFormat::Q5_1 => (QK, &[0, 2]),
            WeightFormat::Q2K => (quant::QK_K, &[quant::Q2_K_D, quant::Q2_K_D + 2]),
            WeightFormat::Q3K => (quant::QK_K, &[quant::Q3_K_D]),
            WeightFormat::Iq4Xs => (quant::QK_K, &[0]),
            other => panic!("{other:?} is not a more_q8 format"),
        };
        let block = format.row_bytes(per_block).unwrap();
        let mut bytes: Vec<u8> = (0..elements / per_block * block)
            .map(|_| rng.random())
            .collect();
        for b in bytes.chunks_exact_mut(block) {
            for &at in f16s {
                let sign = if rng.random() { -1.0f32 } else { 1.0 };
                let v = match rng.random_range(0..5) {
                    0 => rng.random_range(1e-7f32..5e-5),
                    1 => rng.random_range(100.0f32..60000.0),
                    _ => rng.random_range(1e-4f32..0.05),
                };
                let bits = half::f16::from_f32(sign * v).to_bits();
                b[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        bytes
    }

    /// Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K and IQ4_XS products over 1 to
    /// 9, 12 and 21 tokens (rows against up to `MULTI` tokens at a time through
    /// `dot_more_q8_multi`, the rest of a batch in a smaller group) give
    /// each token what a product of that token alone gives (the
    /// single-token kernel), whatever the thread count; and the
    /// several-token kernels run where the CPU has them.
    #[test]
    fn more_q8_batches_equal_single_tokens_bit_for_bit() {
        let k = kernels();
        #[cfg(target_arch = "x86_64")]
        if k.int_activations && is_x86_feature_detected!("avx2") {
            assert!(
                k.dot_more_q8_multi.is_some(),
                "{}: no several-token kernel for these formats",
                k.name
            );
        }
        #[cfg(target_arch = "aarch64")]
        assert!(
            k.dot_more_q8_multi.is_some(),
            "{}: no several-token kernel for these formats",
            k.name
        );
        if k.dot_more_q8_multi.is_none() {
            eprintln!("SKIP multi path: {} has no dot_more_q8_multi", k.name);
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for format in [
            WeightFormat::Q4_1,
            WeightFormat::Q5_0,
            WeightFormat::Q5_1,
            WeightFormat::Iq4Nl,
            WeightFormat::Q2K,
            WeightFormat::Q3K,
            WeightFormat::Iq4Xs,
        ] {
            let shapes: &[(usize, usize)] = if format.super_block_bytes() > 0 {
                &[(37, 256), (130, 9 * 256)]
            } else {
                &[(37, 13 * 32), (130, 768)]
            };
            for &(rows, cols) in shapes {
                let m = more_q8_matrix(&mut rng, format, rows, cols);
                let n = 21;
                let x = rand_vec(&mut rng, n * cols);
                let one = Pool::new(1).unwrap();
                let single: Vec<Vec<f32>> = (0..n)
                    .map(|t| {
                        let mut y = vec![f32::NAN; rows];
                        matvec(&one, &m, &x[t * cols..(t + 1) * cols], &mut y);
                        y
                    })
                    .collect();
                assert!(
                    single.iter().flatten().all(|v| v.is_finite()),
                    "{format:?}: a product overflowed"
                );
                for threads in [1, 2, 3] {
                    let pool = Pool::new(threads).unwrap();
                    // 12 and 21: IQ4_NL's AMX kernel where the CPU has one.
                    for batch in (1..=9).chain([12, n]) {
                        let mut y = vec![f32::NAN; batch * rows];
                        matmul(&pool, &m, &x[..batch * cols], batch, &mut y);
                        for t in 0..batch {
                            assert_eq!(
                                bits(&y[t * rows..(t + 1) * rows]),
                                bits(&single[t]),
                                "{format:?} {rows}x{cols}, batch {batch}, token {t}, {threads} threads"
                            );
                        }
                    }
                }
            }
        }
    }

    /// `m` (row-major Q4_0) rearranged into tiles.
    /// `t` (`m`'s values in another layout) gives exactly `m`'s bits in
    /// every product: `batches` vectors at a time, shared inputs beside an
    /// f32 matrix, one row at a time, widening; for 1, 2 and 3 threads.
    fn assert_same_products(m: &QMatrix, t: &QMatrix, batches: &[usize], rng: &mut impl Rng) {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let (rows, cols) = (m.rows, m.cols);
        let most = batches.iter().copied().max().unwrap_or(1);
        let x = rand_vec(rng, most * cols);
        let name = format!("{:?} {rows}x{cols} as {:?}", m.format, t.layout());
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            for &batch in batches {
                let (mut a, mut b) = (vec![f32::NAN; batch * rows], vec![0.5; batch * rows]);
                matmul(&pool, m, &x[..batch * cols], batch, &mut a);
                matmul(&pool, t, &x[..batch * cols], batch, &mut b);
                assert_eq!(
                    bits(&a),
                    bits(&b),
                    "{name}, batch {batch}, {threads} threads"
                );
            }
            let f = QMatrix::from_f32(5, cols, rand_vec(rng, 5 * cols)).unwrap();
            for n in [1usize, 3, 7].into_iter().filter(|&n| n <= most) {
                let mut want = [vec![f32::NAN; n * rows], vec![f32::NAN; n * 5]];
                let mut got = [vec![0.5; n * rows], vec![0.5; n * 5]];
                let [w0, w1] = &mut want;
                matmul_shared_input(&pool, &[m, &f], &x[..n * cols], n, &mut [w0, w1]);
                let [g0, g1] = &mut got;
                matmul_shared_input(&pool, &[t, &f], &x[..n * cols], n, &mut [g0, g1]);
                assert_eq!(
                    bits(&want[0]),
                    bits(&got[0]),
                    "{name}: shared input, {n} tokens"
                );
                assert_eq!(
                    bits(&want[1]),
                    bits(&got[1]),
                    "{name}: shared input, {n} tokens"
                );
            }
        }
        let k = kernels();
        let (mut a, mut b) = (vec![0.0; cols], vec![0.0; cols]);
        for r in 0..rows {
            assert_eq!(
                dot_row(k, m, r, &x[..cols]).to_bits(),
                dot_row(k, t, r, &x[..cols]).to_bits(),
                "{name}: row {r}"
            );
            row_to_f32(m, r, &mut a);
            row_to_f32(t, r, &mut b);
            assert_eq!(bits(&a), bits(&b), "{name}: row {r} widened");
        }
    }

    pub(crate) fn tiled(m: &QMatrix) -> QMatrix {
        let mut bytes = m.data().as_slice().to_vec();
        q4_0_tiles::tile_in_place(&mut bytes, m.rows, m.cols / QK, &mut Vec::new());
        let data = crate::tensor::Bytes::from_vec(bytes);
        QMatrix::new("t", m.rows, m.cols, m.format, data, None)
            .and_then(QMatrix::tiled_q4_0)
            .unwrap()
    }

    /// Matrices of every panel format in panels in place (the RAM tier's
    /// experts) give exactly the row-major matrix's bits in every
    /// product, whatever the thread count; row counts with and without a
    /// remainder past the last panel, rows of whole 16-byte groups, of
    /// whole words (Q2_K, IQ4_XS) and of a half word more (Q3_K, Q6_K);
    /// [`k_panels::rows_in_place`] restores the stored bytes.
    #[test]
    fn k_quant_panels_in_place_give_row_major_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
        for format in [
            WeightFormat::Q2K,
            WeightFormat::Q3K,
            WeightFormat::Q4K,
            WeightFormat::Q5K,
            WeightFormat::Q6K,
            WeightFormat::Iq4Xs,
        ] {
            assert!(k_panels::in_place(format));
            let size = k_panels::super_bytes(format).unwrap();
            for (rows, cols) in [(16usize, 256usize), (37, 512), (130, 768), (5, 256)] {
                let bytes: Vec<u8> = (0..rows)
                    .flat_map(|_| match format {
                        WeightFormat::Q4K | WeightFormat::Q5K => {
                            q4_k::tests::random_row(&mut rng, cols / 256, size)
                        }
                        WeightFormat::Q6K => q6_k::tests::random_row(&mut rng, cols / 256),
                        _ => k_panels::tests::low_k_row(&mut rng, format, cols / 256),
                    })
                    .collect();
                let mut packed = bytes.clone();
                let rb = bytes.len() / rows;
                k_panels::panels_in_place(format, &mut packed, rows, rb, &mut Vec::new());
                if rows >= 16 {
                    assert_ne!(packed, bytes);
                }
                let mut back = packed.clone();
                k_panels::rows_in_place(format, &mut back, rows, rb, &mut Vec::new());
                assert_eq!(back, bytes);
                use crate::tensor::Bytes;
                let m =
                    QMatrix::new("k", rows, cols, format, Bytes::from_vec(bytes), None).unwrap();
                let t = QMatrix::new("p", rows, cols, format, Bytes::from_vec(packed), None)
                    .and_then(QMatrix::k_panels)
                    .unwrap();
                assert!(t.is_k_panels());
                assert_same_products(&m, &t, &[1, 2, 3, 8, 9, 17], &mut rng);
            }
        }
    }

    /// A tiled matrix gives exactly the row-major matrix's bits in every
    /// product (one token, few tokens, the matrix–matrix kernel, shared
    /// inputs, one row at a time, dequantization), whatever the thread
    /// count; row counts with and without a remainder past the last tile.
    #[test]
    fn tiled_q4_0_products_equal_row_major_ones_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
        for (rows, cols) in [
            (16usize, 64usize),
            (37, 96),
            (130, 768),
            (768, 2048),
            (9, 32),
        ] {
            let m = q4_matrix(&mut rng, rows, cols);
            let t = tiled(&m);
            assert!(t.is_tiled() && !m.is_tiled());
            if rows >= q4_0_tiles::TILE_ROWS {
                assert_ne!(t.data().as_slice(), m.data().as_slice());
            }
            assert_same_products(&m, &t, &[1, 2, 4, 5, 6, 17], &mut rng);
            assert!(t.rows_view(0, 1).is_err(), "tiles have no row views");
        }
        let f = QMatrix::from_f32(2, 32, rand_vec(&mut rng, 64)).unwrap();
        assert!(f.tiled_q4_0().is_err(), "only Q4_0 is tiled");
    }

    /// A 16-bit matrix in quads gives exactly the row-major matrix's bits
    /// in every product (one token; several, below and above the
    /// several-vector kernel's row groups; shared inputs; one row at a
    /// time; widening), whatever the thread count; row counts with and
    /// without rows past the last quad. Where this CPU has no quads kernel
    /// the products take the one-row path, which must agree too.
    #[test]
    fn quads16_products_equal_row_major_ones_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
        for format in [WeightFormat::Bf16, WeightFormat::F16] {
            for (rows, cols) in [(4usize, 16usize), (7, 48), (37, 96), (130, 2048), (9, 32)] {
                let vals = rand_vec(&mut rng, rows * cols);
                let words: Vec<u16> = vals
                    .iter()
                    .map(|&v| match format {
                        WeightFormat::Bf16 => half::bf16::from_f32(v * 2.0).to_bits(),
                        _ => half::f16::from_f32(v * 2.0).to_bits(),
                    })
                    .collect();
                let mut q = words.clone();
                quads16::to_quads(&mut q, rows, cols, &mut Vec::new());
                let bytes = |w: Vec<u16>| crate::tensor::Bytes::from_u16(w);
                let m = QMatrix::new("m", rows, cols, format, bytes(words), None).unwrap();
                let t = QMatrix::new("q", rows, cols, format, bytes(q), None)
                    .and_then(QMatrix::quads16)
                    .unwrap();
                assert!(t.is_quads() && !m.is_quads());
                if cols > quads16::GROUP_COLS {
                    assert_ne!(t.data().as_slice(), m.data().as_slice());
                }
                assert_same_products(&m, &t, &[1, 2, 4, 5, 17, 20], &mut rng);
                assert!(t.rows_view(0, 1).is_err(), "quads have no row views");
            }
        }
        let f = QMatrix::from_f32(4, 32, rand_vec(&mut rng, 128)).unwrap();
        assert!(f.quads16().is_err(), "only 16-bit rows take quads");
        let odd = QMatrix::new(
            "odd",
            4,
            24,
            WeightFormat::Bf16,
            crate::tensor::Bytes::from_u16(vec![0x3f80; 96]),
            None,
        )
        .unwrap();
        assert!(odd.quads16().is_err(), "whole groups of 16 columns");
    }

    /// A 16-bit matrix of random weights, row-major or in quads.
    fn half_matrix(rng: &mut impl Rng, format: WeightFormat, rows: usize, cols: usize) -> QMatrix {
        let words: Vec<u16> = rand_vec(rng, rows * cols)
            .iter()
            .map(|&v| match format {
                WeightFormat::Bf16 => half::bf16::from_f32(v).to_bits(),
                _ => half::f16::from_f32(v).to_bits(),
            })
            .collect();
        let data = crate::tensor::Bytes::from_u16(words);
        QMatrix::new("h", rows, cols, format, data, None).unwrap()
    }

    fn quads(m: &QMatrix) -> QMatrix {
        let mut q: Vec<u16> = bytemuck::cast_slice(m.data().as_slice()).to_vec();
        quads16::to_quads(&mut q, m.rows, m.cols, &mut Vec::new());
        let data = crate::tensor::Bytes::from_u16(q);
        QMatrix::new("q", m.rows, m.cols, m.format, data, None)
            .and_then(QMatrix::quads16)
            .unwrap()
    }

    /// Gated MLPs for one token give the bits of separate products: gate
    /// and up, the activation on the calling thread, then down (its input
    /// prepared by `matvec`), for every format and layout an MLP's three
    /// matrices come in (mixed within a call, as experts of different
    /// files could be), row counts with and without remainders past the
    /// last tile or quad, and 1–3 threads.
    #[test]
    fn gated_products_equal_separate_products_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(23);
        let (hidden, inter) = (96usize, 100usize);
        let f32m = |rng: &mut rand_chacha::ChaCha8Rng, r: usize, c: usize| {
            QMatrix::from_f32(r, c, rand_vec(rng, r * c)).unwrap()
        };
        let q8m = |rng: &mut rand_chacha::ChaCha8Rng, r: usize, c: usize| {
            let bytes: Vec<u8> = rand_vec(rng, r * c)
                .chunks(c)
                .flat_map(|row| quant::quantize_q8_0(row).unwrap())
                .collect();
            let data = crate::tensor::Bytes::from_vec(bytes);
            QMatrix::new("q8", r, c, WeightFormat::Q8_0, data, None).unwrap()
        };
        // (gate, up, down) per MLP. Q4_0 and Q8_0 inputs are whole
        // 32-blocks and quads whole groups of 16 columns, so those MLPs'
        // remainders are in the down rows (70).
        let r = &mut rng;
        let mlps: Vec<[QMatrix; 3]> = vec![
            [
                f32m(r, inter, hidden),
                f32m(r, inter, hidden),
                f32m(r, 70, inter),
            ],
            [
                q4_matrix(r, 128, hidden),
                q4_matrix(r, 128, hidden),
                q8m(r, 70, 128),
            ],
            [
                half_matrix(r, WeightFormat::Bf16, inter, hidden),
                half_matrix(r, WeightFormat::Bf16, inter, hidden),
                half_matrix(r, WeightFormat::F16, 70, inter),
            ],
            [
                tiled(&q4_matrix(r, 160, hidden)),
                tiled(&q4_matrix(r, 160, hidden)),
                tiled(&q4_matrix(r, 70, 160)),
            ],
            [
                quads(&half_matrix(r, WeightFormat::Bf16, 112, hidden)),
                quads(&half_matrix(r, WeightFormat::F16, 112, hidden)),
                quads(&half_matrix(r, WeightFormat::Bf16, 70, 112)),
            ],
        ];
        let x = rand_vec(&mut rng, hidden);
        let act_of = |g: f32, u: f32| g / (1.0 + (-g).exp()) * u;
        let act = |g: &mut [f32], u: &[f32]| {
            for (g, &u) in g.iter_mut().zip(u) {
                *g = act_of(*g, u);
            }
        };
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            let want: Vec<Vec<f32>> = mlps
                .iter()
                .map(|[g, u, d]| {
                    let (mut gy, mut uy) = (vec![0.0; g.rows], vec![0.0; u.rows]);
                    matvec(&pool, g, &x, &mut gy);
                    matvec(&pool, u, &x, &mut uy);
                    let a: Vec<f32> = gy.iter().zip(&uy).map(|(&g, &u)| act_of(g, u)).collect();
                    let mut y = vec![0.0; d.rows];
                    matvec(&pool, d, &a, &mut y);
                    y
                })
                .collect();
            let gated: Vec<Gated<'_>> = mlps
                .iter()
                .map(|[gate, up, down]| Gated { gate, up, down })
                .collect();
            let got = gated_products(&pool, &gated, &x, act);
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                assert!(
                    w.iter().any(|&v| v != 0.0),
                    "MLP {i}: a product of random data"
                );
                assert_eq!(bits(w), bits(g), "MLP {i}, {threads} threads");
            }
            // One MLP alone, and none.
            let one = gated_products(&pool, &gated[3..4], &x, act);
            assert_eq!(bits(&one[0]), bits(&want[3]), "one MLP, {threads} threads");
            assert!(gated_products(&pool, &[], &x, act).is_empty());
        }
    }

    /// Passes over a tile: every token once, in order, each pass at most
    /// TILE_TOKENS, as few passes as that allows, sizes within one.
    /// AMX passes: full ones of 16 first, then the rest only where it is
    /// at least AMX_MIN_TOKENS (the AVX-512 kernel takes a smaller rest).
    #[test]
    fn amx_takes_full_passes_and_a_rest_of_enough_tokens() {
        let p = |n| amx_passes(n).collect::<Vec<_>>();
        assert_eq!(p(0), [0usize; 0]);
        assert_eq!(p(AMX_MIN_TOKENS - 1), [0usize; 0]);
        assert_eq!(p(AMX_MIN_TOKENS), [AMX_MIN_TOKENS]);
        assert_eq!(p(16), [16]);
        assert_eq!(p(20), [16], "4 left to AVX-512");
        assert_eq!(p(16 + AMX_MIN_TOKENS), [16, AMX_MIN_TOKENS]);
        assert_eq!(p(40), [16, 16], "8 left to AVX-512");
        for n in 0..200 {
            let q = p(n);
            let taken: usize = q.iter().sum();
            assert!(taken <= n && n - taken < AMX_MIN_TOKENS, "{n}: {q:?}");
            assert!(
                q.iter().all(|&s| (AMX_MIN_TOKENS..=16).contains(&s)),
                "{n}: {q:?}"
            );
        }
    }

    #[test]
    fn tile_passes_are_few_and_even() {
        assert_eq!(tile_passes(0).count(), 0);
        assert_eq!(tile_passes(36).collect::<Vec<_>>(), [8, 7, 7, 7, 7]);
        assert_eq!(tile_passes(33).collect::<Vec<_>>(), [7, 7, 7, 6, 6]);
        for n in 1..200 {
            let p: Vec<usize> = tile_passes(n).collect();
            assert_eq!(p.iter().sum::<usize>(), n, "{n}");
            assert_eq!(p.len(), n.div_ceil(TILE_TOKENS), "{n}");
            let (lo, hi) = (p.iter().min().unwrap(), p.iter().max().unwrap());
            assert!(*hi <= TILE_TOKENS && hi - lo <= 1, "{n}: {p:?}");
        }
    }

    #[test]
    fn grouped_tiled_products_equal_separate_row_major_ones() {
        if !q4_0_tiles_run_here() {
            eprintln!("SKIP: no tile kernel on this machine, nothing is tiled");
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        // Whole tiles, a tail, fewer rows than a tile; 1 to 19 tokens each
        // (19: passes of 7, 6 and 6).
        let shapes = [
            (48usize, 64usize, 3usize),
            (37, 96, 1),
            (9, 64, 5),
            (130, 96, 2),
            (64, 96, 19),
        ];
        let ms: Vec<QMatrix> = shapes
            .iter()
            .map(|&(r, c, _)| q4_matrix(&mut rng, r, c))
            .collect();
        let ts: Vec<QMatrix> = ms.iter().map(tiled).collect();
        let xs: Vec<Vec<f32>> = shapes
            .iter()
            .map(|&(_, c, n)| rand_vec(&mut rng, n * c))
            .collect();
        let qs: Vec<Vec<Q8Activation>> = shapes
            .iter()
            .zip(&xs)
            .map(|(&(_, c, _), x)| x.chunks_exact(c).map(Q8Activation::quantize).collect())
            .collect();
        let refs: Vec<Vec<&Q8Activation>> = qs.iter().map(|q| q.iter().collect()).collect();
        let ws: Vec<&QMatrix> = ts.iter().collect();
        assert!(ws.iter().all(|w| q8_products(w)));
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            let got = q8_matmuls(&pool, &ws, &refs);
            for (i, (&(rows, _, n), m)) in shapes.iter().zip(&ms).enumerate() {
                let mut want = vec![f32::NAN; n * rows];
                matmul(&pool, m, &xs[i], n, &mut want);
                assert_eq!(bits(&got[i]), bits(&want), "matrix {i}, {threads} threads");
            }
        }
    }

    /// [`q8_matmuls`] over matrices of several formats and layouts at once
    /// (Q8_0 row pairs, IQ4_NL tiles, Q4_K panels, Q2_K and Q5_0 row
    /// kernels; token counts below and above the several-token kernels'
    /// thresholds) gives each the bits of its own [`matmul`], whatever the
    /// thread count.
    #[test]
    fn grouped_products_of_every_integer_format_equal_separate_ones() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let q8_0 = |rng: &mut rand_chacha::ChaCha8Rng, rows: usize, cols: usize| {
            let data: Vec<u8> = (0..rows)
                .flat_map(|_| quant::quantize_q8_0(&rand_vec(rng, cols)).unwrap())
                .collect();
            QMatrix::new(
                "q8",
                rows,
                cols,
                WeightFormat::Q8_0,
                crate::tensor::Bytes::from_vec(data),
                None,
            )
            .unwrap()
        };
        let q4_k = |rng: &mut rand_chacha::ChaCha8Rng, rows: usize, cols: usize| {
            let data: Vec<u8> = (0..rows)
                .flat_map(|_| quant::quantize_q4_k(&rand_vec(rng, cols)).unwrap())
                .collect();
            QMatrix::new(
                "q4k",
                rows,
                cols,
                WeightFormat::Q4K,
                crate::tensor::Bytes::from_vec(data),
                None,
            )
            .unwrap()
        };
        let ms: Vec<(QMatrix, usize)> = vec![
            (q8_0(&mut rng, 37, 96), 3),
            (q8_0(&mut rng, 64, 64), 9),
            (more_q8_matrix(&mut rng, WeightFormat::Iq4Nl, 50, 96), 6),
            (more_q8_matrix(&mut rng, WeightFormat::Iq4Nl, 33, 64), 2),
            (q4_k(&mut rng, 40, 512), 5),
            (more_q8_matrix(&mut rng, WeightFormat::Q2K, 19, 256), 4),
            (more_q8_matrix(&mut rng, WeightFormat::Q5_0, 21, 64), 11),
        ];
        if !ms.iter().all(|(m, _)| q8_products(m)) {
            eprintln!("SKIP: these kernels quantize no input (exact products)");
            return;
        }
        let xs: Vec<Vec<f32>> = ms
            .iter()
            .map(|(m, n)| rand_vec(&mut rng, n * m.cols))
            .collect();
        let qs: Vec<Vec<Q8Activation>> = ms
            .iter()
            .zip(&xs)
            .map(|((m, _), x)| x.chunks_exact(m.cols).map(Q8Activation::quantize).collect())
            .collect();
        let refs: Vec<Vec<&Q8Activation>> = qs.iter().map(|q| q.iter().collect()).collect();
        let ws: Vec<&QMatrix> = ms.iter().map(|(m, _)| m).collect();
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            let got = q8_matmuls(&pool, &ws, &refs);
            for (i, (m, n)) in ms.iter().enumerate() {
                let mut want = vec![f32::NAN; n * m.rows];
                matmul(&pool, m, &xs[i], *n, &mut want);
                assert_eq!(
                    bits(&got[i]),
                    bits(&want),
                    "{:?} matrix {i}, {threads} threads",
                    m.format
                );
            }
        }
    }

    #[test]
    fn shared_input_products_equal_separate_ones() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let cols = 96;
        let quantized = |rng: &mut rand_chacha::ChaCha8Rng, rows: usize, q4: bool| {
            let w = rand_vec(rng, rows * cols);
            let bytes: Vec<u8> = w
                .chunks(cols)
                .flat_map(|r| {
                    if q4 {
                        quant::quantize_q4_0(r).unwrap()
                    } else {
                        quant::quantize_q8_0(r).unwrap()
                    }
                })
                .collect();
            let format = if q4 {
                WeightFormat::Q4_0
            } else {
                WeightFormat::Q8_0
            };
            QMatrix::new(
                "t",
                rows,
                cols,
                format,
                crate::tensor::Bytes::from_vec(bytes),
                None,
            )
            .unwrap()
        };
        let ws = [
            quantized(&mut rng, 301, true),
            QMatrix::from_f32(17, cols, rand_vec(&mut rng, 17 * cols)).unwrap(),
            quantized(&mut rng, 64, false),
            quantized(&mut rng, 9, true),
        ];
        let refs: Vec<&QMatrix> = ws.iter().collect();
        for n in [1usize, 3, 7] {
            let x = rand_vec(&mut rng, n * cols);
            for threads in [1, 2, 3] {
                let pool = Pool::new(threads).unwrap();
                let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; n * w.rows]).collect();
                {
                    let mut outs: Vec<&mut [f32]> =
                        ys.iter_mut().map(|y| y.as_mut_slice()).collect();
                    matmul_shared_input(&pool, &refs, &x, n, &mut outs);
                }
                for (w, y) in ws.iter().zip(&ys) {
                    let mut want = vec![f32::NAN; n * w.rows];
                    matmul(&pool, w, &x, n, &mut want);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(y), bits(&want), "n={n} threads={threads}");
                }
            }
        }
    }
}
