//! Quads of 16-bit rows: a bf16 or f16 matrix's rows interleaved by fours,
//! so that a one-token product reads one linear stream.
//!
//! A one-token product runs four rows at a time, sharing each load of the
//! input (`x86::rows4`). Row-major, those four rows are four streams, one
//! 4 KiB page each for 2048 columns: the hardware prefetchers start each
//! one cold, and the BF16 output head of a Qwen3-30B-A3B-geometry model
//! streamed at 0.83 of the read pass in a warm decode (perf, this repo's
//! docs/benchmarks.md, "Quads of 16-bit rows"). Interleaved, the same
//! products read the bytes in order, with a software prefetch ahead.
//!
//! Layout of a run of rows that starts at a multiple of 4 (the whole
//! matrix, or a product task's rows): each whole quad of rows `4q..4q + 4`
//! occupies the same `4 × cols` values it would row-major, as `cols / 16`
//! groups of 64 values, group `g` holding columns `16g..16g + 16` of row
//! `4q`, then of `4q + 1`, `4q + 2`, `4q + 3`. The last `rows % 4` rows
//! stay row-major. So a run of rows starting at a quad boundary covers the
//! same bytes in either layout, and is itself laid out by the same rule.
//! Products give the same bits either way: each row's sums run in the
//! one-row kernel's order.

use std::sync::atomic::{AtomicUsize, Ordering};

/// How far ahead of the group it multiplies a quads kernel asks for the
/// quad's bytes by default (`prefetcht0`, x86; the one-token kernel asks
/// L2 at this distance and L1 nearer, see `x86::NEAR_L1`). Measured when
/// every request went to L1: one token, quads against
/// row-major fours, per-round ratios' medians (`cargo bench --bench
/// kernels -- --quads --prefetch D,...`, docs/benchmarks.md "Quads of
/// 16-bit rows"): Zen 3 (AVX2, 2 threads) ×1.08–1.11 at 1 KiB, ×1.03–1.06
/// at 4 KiB, ×1.06–1.10 at 8 KiB; Xeon (AVX-512, 2 and 8 threads)
/// ×0.72–0.81 with none, ×0.89–0.97 at 1 KiB, ×1.05–1.12 at 4 KiB,
/// ×1.06–1.08 at 8 KiB.
pub const DEFAULT_PREFETCH_AHEAD: usize = 8192;

static PREFETCH_AHEAD: AtomicUsize = AtomicUsize::new(DEFAULT_PREFETCH_AHEAD);

/// Sets how many bytes ahead the quads kernels prefetch (0: not at all),
/// for every thread; the products' bits do not depend on it. `cargo
/// bench --bench kernels -- --quads --prefetch D,...` compares distances.
pub fn set_prefetch_ahead(bytes: usize) {
    PREFETCH_AHEAD.store(bytes, Ordering::Relaxed);
}

/// The distance [`set_prefetch_ahead`] set ([`DEFAULT_PREFETCH_AHEAD`]
/// unless changed).
pub fn prefetch_ahead() -> usize {
    PREFETCH_AHEAD.load(Ordering::Relaxed)
}

/// Rows per quad.
pub const QUAD_ROWS: usize = 4;
/// Columns of one row in each group of a quad.
pub const GROUP_COLS: usize = 16;

/// Whether a `rows × cols` matrix can be laid out in quads: whole groups
/// of columns and at least one whole quad.
pub fn fits(rows: usize, cols: usize) -> bool {
    cols > 0 && cols.is_multiple_of(GROUP_COLS) && rows >= QUAD_ROWS
}

/// Index, in a quad's values, of row `j`'s column `c`.
#[inline]
fn at(j: usize, c: usize) -> usize {
    (c / GROUP_COLS) * (QUAD_ROWS * GROUP_COLS) + j * GROUP_COLS + c % GROUP_COLS
}

/// Rearranges `rows` row-major rows of `cols` values in place into quads
/// (see the module docs); `scratch` holds one quad.
pub fn to_quads(words: &mut [u16], rows: usize, cols: usize, scratch: &mut Vec<u16>) {
    assert_eq!(words.len(), rows * cols, "rows × cols values");
    assert!(cols.is_multiple_of(GROUP_COLS), "whole groups of columns");
    scratch.resize(QUAD_ROWS * cols, 0);
    for quad in words.chunks_exact_mut(QUAD_ROWS * cols) {
        scratch.copy_from_slice(quad);
        for j in 0..QUAD_ROWS {
            for g in 0..cols / GROUP_COLS {
                let src = j * cols + g * GROUP_COLS;
                let dst = at(j, g * GROUP_COLS);
                quad[dst..dst + GROUP_COLS].copy_from_slice(&scratch[src..src + GROUP_COLS]);
            }
        }
    }
}

/// The inverse of [`to_quads`].
pub fn from_quads(words: &mut [u16], rows: usize, cols: usize, scratch: &mut Vec<u16>) {
    assert_eq!(words.len(), rows * cols, "rows × cols values");
    assert!(cols.is_multiple_of(GROUP_COLS), "whole groups of columns");
    scratch.resize(QUAD_ROWS * cols, 0);
    for quad in words.chunks_exact_mut(QUAD_ROWS * cols) {
        scratch.copy_from_slice(quad);
        rows_of_quad(scratch, cols, quad);
    }
}

/// One quad's values (`4 × cols`, interleaved) as four row-major rows.
fn rows_of_quad(quad: &[u16], cols: usize, out: &mut [u16]) {
    for j in 0..QUAD_ROWS {
        for g in 0..cols / GROUP_COLS {
            let src = at(j, g * GROUP_COLS);
            let dst = j * cols + g * GROUP_COLS;
            out[dst..dst + GROUP_COLS].copy_from_slice(&quad[src..src + GROUP_COLS]);
        }
    }
}

/// Row `r` of `rows` rows in quads, row-major into `out` (`cols` values).
pub fn row_of(words: &[u16], rows: usize, cols: usize, r: usize, out: &mut [u16]) {
    assert!(
        r < rows && words.len() == rows * cols,
        "a row of the matrix"
    );
    let whole = rows / QUAD_ROWS * QUAD_ROWS;
    if r >= whole {
        out.copy_from_slice(&words[r * cols..(r + 1) * cols]);
        return;
    }
    let quad = &words[r / QUAD_ROWS * QUAD_ROWS * cols..][..QUAD_ROWS * cols];
    let j = r % QUAD_ROWS;
    for g in 0..cols / GROUP_COLS {
        let src = at(j, g * GROUP_COLS);
        out[g * GROUP_COLS..][..GROUP_COLS].copy_from_slice(&quad[src..src + GROUP_COLS]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every row comes back from quads, by row and by run; the round trip
    /// restores the bytes; a quad's first group is its rows' first columns.
    #[test]
    fn quads_round_trip_and_rows() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for (rows, cols) in [(4, 16), (5, 32), (7, 48), (9, 16), (12, 64), (35, 2048)] {
            let orig: Vec<u16> = (0..rows * cols).map(|_| rng.random()).collect();
            let mut q = orig.clone();
            let mut scratch = Vec::new();
            to_quads(&mut q, rows, cols, &mut scratch);
            // With one group per row a quad is its rows as they were.
            assert_eq!(q == orig, cols == GROUP_COLS, "{rows}x{cols}: rearranged");
            assert_eq!(&q[16..32], &orig[cols..cols + 16], "row 1's first group");
            let mut row = vec![0u16; cols];
            for r in 0..rows {
                row_of(&q, rows, cols, r, &mut row);
                assert_eq!(row, orig[r * cols..(r + 1) * cols], "{rows}x{cols} row {r}");
            }
            from_quads(&mut q, rows, cols, &mut scratch);
            assert_eq!(q, orig, "{rows}x{cols}: round trip");
        }
        assert!(fits(4, 16) && !fits(3, 16) && !fits(8, 40) && !fits(8, 0));
    }
}
