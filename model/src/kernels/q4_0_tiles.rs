//! Q4_0 rows in tiles of 16: the layout the RAM tier gives routed experts
//! where a tile kernel runs, so that one-token products stream at memory
//! speed.
//!
//! Row-major Q4_0 keeps each row's 18-byte blocks one after another. A
//! vector product over one row has to realign every block's 16 packed
//! bytes (they sit 2 bytes past its scale) and reduce each block's partial
//! sums across lanes before scaling them: about 4.4 instructions per block,
//! and the single-token kernel runs at 0.66 of the memory read pass on Zen 4
//! (docs/benchmarks.md, "Where the warm decode goes").
//!
//! A tile puts 16 rows side by side instead. For block `b` it holds the
//! 16 rows' packed bytes as 4 groups of 64 (group `j`: bytes `4j..4j + 4`
//! of row 0, then of row 1, …, row 15), so one 64-byte load carries 4 bytes
//! of every row, and one `vpdpbusd` against 4 broadcast activation bytes
//! advances all 16 rows' sums (with AVX2, two `vpmaddubsw` for 8 rows
//! each): no realignment and no horizontal reduction.
//! Blocks come in pairs: the pair's 2 × 16 f16 scales (64 bytes), then its
//! 2 × 256 bytes of codes, so a tile is one stream read front to back with
//! every load 64-byte aligned within it. (Scales kept apart after all the
//! codes made a second stream per tile and halved the kernel's speed from
//! memory, 10 against 20 GB/s on one Zen 4 core.)
//!
//! A matrix of `R` rows and `B` blocks per row is laid out as `R / 16`
//! tiles of `B × 288` bytes, then its last `R % 16` rows row-major. It has
//! exactly the size of the row-major matrix, so a cache slot is tiled in
//! place.
//!
//! Bits: a tile kernel gives every row exactly what
//! [`super::q4_0::dot_q4_0_q8`] gives for it (the same exact integer sum
//! per block, the same product of scales, the same fused multiply-add into
//! lane `b mod 4` and the same final reduction); the tests compare them.

use std::sync::atomic::{AtomicU64, Ordering};

use super::Q8Activation;
use crate::quant::Q4_0_BLOCK_BYTES;

/// Rows per tile.
pub const TILE_ROWS: usize = 16;
/// Bytes of one block's codes in a tile.
const CODE_BYTES: usize = TILE_ROWS * (Q4_0_BLOCK_BYTES - 2);
/// Packed bytes of one row's block.
const PACKED: usize = Q4_0_BLOCK_BYTES - 2;

/// Bytes of one tile of rows of `blocks` blocks.
pub fn tile_bytes(blocks: usize) -> usize {
    TILE_ROWS * blocks * Q4_0_BLOCK_BYTES
}

/// Which cache a one-token tile kernel's prefetch fills (x86:
/// `prefetcht0` for L1, `prefetcht1` for L2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchLevel {
    L1,
    L2,
}

/// How a one-token tile kernel asks for the tile's bytes ahead of the
/// block it multiplies: `l2` bytes ahead into L2 and `l1` bytes ahead into
/// L1 (0: not at all). A decode streams many short tiled matrices (an
/// expert's rows split among the threads: ~110 KiB per task), too short
/// for the hardware prefetchers to ramp up. Written `BYTES/l2`,
/// `BYTES/l1`, both joined by `+` (`4096/l2+1152/l1`), or `0` for none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TilePrefetch {
    pub l2: usize,
    pub l1: usize,
}

/// The default: 4 KiB ahead into L2, and the lines that request brought
/// to L2 asked into L1 1152 bytes (four blocks) ahead.
///
/// Alone, 4 KiB into L2 beat the earlier 1.5 KiB into L1 in `cargo bench
/// --bench kernels -- --experts 640` (docs/benchmarks.md, "Decode tiles
/// asked of L2"): Xeon (the H200 host) AVX-512 +6–8% with 2 threads, +4%
/// with 8; its AVX2 kernel +12% and +7%; Zen 4 AVX-512 +3–9% with 2
/// threads. Asked into L1, a line in flight from memory holds one of the
/// core's few L1 miss buffers as a demand miss does; asked into L2 it does
/// not, so more lines are in flight. The request into L1 on top, for lines
/// already on their way to L2, then spares the kernel's loads L2's
/// latency: on the AMX Xeon VM the expert products went from 26.1 to 27.2
/// GB/s and a warm decode from 79.5–82.3% to 84.2–88.7% of the read pass's
/// bound (docs/benchmarks.md, "The decode's tiles asked of L1 as well").
pub const DEFAULT_PREFETCH: TilePrefetch = TilePrefetch { l2: 4096, l1: 1152 };

impl TilePrefetch {
    /// None at all.
    pub const NONE: TilePrefetch = TilePrefetch { l2: 0, l1: 0 };

    /// Both distances in one word, for [`PREFETCH`] (each below 2³²:
    /// [`set_prefetch`] and the parser keep them so).
    const fn encode(self) -> u64 {
        (self.l2 as u64) | (self.l1 as u64) << 32
    }

    const fn decode(v: u64) -> TilePrefetch {
        TilePrefetch {
            l2: (v & 0xffff_ffff) as usize,
            l1: (v >> 32) as usize,
        }
    }
}

impl std::fmt::Display for TilePrefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.l2, self.l1) {
            (0, 0) => write!(f, "0"),
            (b, 0) => write!(f, "{b}/l2"),
            (0, b) => write!(f, "{b}/l1"),
            (b2, b1) => write!(f, "{b2}/l2+{b1}/l1"),
        }
    }
}

impl std::str::FromStr for TilePrefetch {
    type Err = String;

    fn from_str(s: &str) -> Result<TilePrefetch, String> {
        let bad =
            || format!("a tile prefetch is BYTES/l2, BYTES/l1, both joined by + or 0, not {s:?}");
        if s == "0" {
            return Ok(TilePrefetch::NONE);
        }
        let mut p = TilePrefetch::NONE;
        for part in s.split('+') {
            let (bytes, level) = part.split_once('/').ok_or_else(bad)?;
            let bytes: u32 = bytes.parse().map_err(|_| bad())?;
            let slot = match level {
                "l2" => &mut p.l2,
                "l1" => &mut p.l1,
                _ => return Err(bad()),
            };
            // Each level once, and at a distance.
            if *slot != 0 || bytes == 0 {
                return Err(bad());
            }
            *slot = bytes as usize;
        }
        Ok(p)
    }
}

static PREFETCH: AtomicU64 = AtomicU64::new(DEFAULT_PREFETCH.encode());

/// Sets how the one-token tile kernels prefetch, for every thread; the
/// products' bits do not depend on it. `cargo bench --bench kernels --
/// --experts N --prefetch P,...` compares settings.
///
/// # Panics
/// If a distance is 2³² bytes or more.
pub fn set_prefetch(p: TilePrefetch) {
    assert!(
        u32::try_from(p.l2).is_ok() && u32::try_from(p.l1).is_ok(),
        "prefetch distances below 4 GiB"
    );
    PREFETCH.store(p.encode(), Ordering::Relaxed);
}

/// What [`set_prefetch`] set ([`DEFAULT_PREFETCH`] unless changed).
pub fn prefetch() -> TilePrefetch {
    TilePrefetch::decode(PREFETCH.load(Ordering::Relaxed))
}

/// Asks for block `c`'s bytes ahead as `pf` says (`c`: where the block's
/// codes start).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn ask_ahead(c: *const u8, pf: TilePrefetch) {
    if pf.l2 != 0 {
        ask_block(c.wrapping_add(pf.l2) as *const i8, PrefetchLevel::L2);
    }
    if pf.l1 != 0 {
        ask_block(c.wrapping_add(pf.l1) as *const i8, PrefetchLevel::L1);
    }
}

/// Asks for the five cache lines from `at` (one block's 288 bytes of a
/// tile) into `level`.
///
/// A hint only: a prefetch never faults, whatever the address, and
/// changes no result.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn ask_block(at: *const i8, level: PrefetchLevel) {
    use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
    for line in 0..5 {
        let p = at.wrapping_add(64 * line);
        // SAFETY: a prefetch is a hint that never faults; `wrapping_add`
        // keeps the address arithmetic defined.
        unsafe {
            match level {
                PrefetchLevel::L1 => _mm_prefetch::<_MM_HINT_T0>(p),
                PrefetchLevel::L2 => _mm_prefetch::<_MM_HINT_T1>(p),
            }
        }
    }
}

/// Bytes of one block's 16 scales in a tile.
const SCALE_BYTES: usize = 2 * TILE_ROWS;

/// Where block `b`'s scales start in a tile of `blocks` blocks: blocks
/// come in pairs, the pair's scales (64 bytes) before its codes, so a
/// tile is read front to back and every load of codes is 64-byte aligned
/// within it.
#[inline(always)]
pub(crate) fn scales_at(_blocks: usize, b: usize) -> usize {
    let pair = b / 2 * 2 * (SCALE_BYTES + CODE_BYTES);
    pair + b % 2 * SCALE_BYTES
}

/// Where block `b`'s codes start in a tile of `blocks` blocks (see
/// [`scales_at`]; a last, unpaired block has 32 bytes of scales).
#[inline(always)]
pub(crate) fn codes_at(blocks: usize, b: usize) -> usize {
    let p = b / 2 * 2;
    let in_pair = (blocks - p).min(2);
    p * (SCALE_BYTES + CODE_BYTES) + in_pair * SCALE_BYTES + b % 2 * CODE_BYTES
}

/// What the several-token tile kernels' safety contract asks of their
/// arguments (`t` activations), checked in debug builds.
#[cfg(target_arch = "x86_64")]
fn debug_check_tiles(tile: &[u8], blocks: usize, xs: &[&Q8Activation], outs: usize, t: usize) {
    debug_assert_eq!(tile.len(), tile_bytes(blocks));
    debug_assert!(xs.len() == t && outs >= t);
    debug_assert!(
        xs.iter()
            .all(|x| x.quants.len() >= blocks * 32 && x.scales.len() >= blocks)
    );
}

/// Asks L2 for block `b`'s share of `next`, its `b`-th 288 bytes (the
/// size of one block of a tile), where a several-token kernel multiplies
/// block `b` of the tile before it. Once per block of a pass, that asks for
/// the whole of a next tile as large as this one while this one is
/// computed: the hardware prefetchers do not, as a tile spans several
/// 4 KiB pages (docs/benchmarks.md, "The next tile asked of L2").
///
/// A hint only: `prefetcht1` never faults and changes no result.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn ask_l2(next: &[u8], b: usize) {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    let share = Q4_0_BLOCK_BYTES * TILE_ROWS;
    let Some(part) = next.get(b * share..next.len().min((b + 1) * share)) else {
        return;
    };
    // From the start of the cache line that holds the share's first byte.
    let lead = part.as_ptr() as usize % 64;
    let first = part.as_ptr().wrapping_sub(lead);
    for at in (0..lead + part.len()).step_by(64) {
        // SAFETY: a prefetch is a hint that never faults, whatever the
        // address; `wrapping_*` keeps the pointer arithmetic defined.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(first.wrapping_add(at) as *const i8) };
    }
}

/// Rearranges a row-major Q4_0 matrix of `rows` rows of `blocks` blocks
/// (`bytes.len() == rows × blocks × 18`) into tiles, in place: every full
/// group of 16 rows becomes a tile, the remaining rows stay as they are.
/// `scratch` holds one tile's rows while it is rewritten.
pub fn tile_in_place(bytes: &mut [u8], rows: usize, blocks: usize, scratch: &mut Vec<u8>) {
    for_each_tile(bytes, rows, blocks, scratch, |tile, old| {
        tile_into(old, blocks, tile)
    });
}

/// The 16 row-major rows of `blocks` blocks in `rows` (`16 × blocks × 18`
/// bytes) as one tile, written into `tile` (as long): what
/// [`tile_in_place`] makes of them, without a copy of the rows first.
pub fn tile_into(rows: &[u8], blocks: usize, tile: &mut [u8]) {
    let rb = blocks * Q4_0_BLOCK_BYTES;
    assert!(
        rows.len() == TILE_ROWS * rb && tile.len() == tile_bytes(blocks),
        "16 whole rows and a tile of their size"
    );
    // Block by block, so that every write goes forward through the tile.
    for b in 0..blocks {
        let at = b * Q4_0_BLOCK_BYTES;
        let src: [&[u8; Q4_0_BLOCK_BYTES]; TILE_ROWS] = std::array::from_fn(|r| {
            rows[r * rb + at..][..Q4_0_BLOCK_BYTES]
                .try_into()
                .expect("a block is 18 bytes")
        });
        let scales: &mut [u8; SCALE_BYTES] = (&mut tile[scales_at(blocks, b)..][..SCALE_BYTES])
            .try_into()
            .expect("16 scales");
        for (scale, blk) in scales.chunks_exact_mut(2).zip(&src) {
            scale.copy_from_slice(&blk[..2]);
        }
        let codes: &mut [u8; CODE_BYTES] = (&mut tile[codes_at(blocks, b)..][..CODE_BYTES])
            .try_into()
            .expect("a block's codes");
        interleave_codes(&src, codes);
    }
}

/// Block `b`'s codes of 16 rows (`src[r]` is row `r`'s 18-byte block) in
/// their tile order: group `j` holds bytes `4j..4j + 4` of each row in
/// turn. A 16 × 4 transpose of 32-bit words; with SSE2 (every x86-64 CPU)
/// four 4 × 4 transposes in registers, tiling a cache slot as it is
/// installed at ~2.5× the speed of word-by-word moves (`cargo bench
/// --bench kernels -- --tiling`).
fn interleave_codes(src: &[&[u8; Q4_0_BLOCK_BYTES]; TILE_ROWS], codes: &mut [u8; CODE_BYTES]) {
    #[cfg(target_arch = "x86_64")]
    {
        interleave_codes_sse2(src, codes);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        interleave_codes_scalar(src, codes);
    }
}

/// The word-by-word reference of [`interleave_codes`].
#[cfg(any(test, not(target_arch = "x86_64")))]
fn interleave_codes_scalar(
    src: &[&[u8; Q4_0_BLOCK_BYTES]; TILE_ROWS],
    codes: &mut [u8; CODE_BYTES],
) {
    for (j, group) in codes.chunks_exact_mut(4 * TILE_ROWS).enumerate() {
        for (word, blk) in group.chunks_exact_mut(4).zip(src) {
            word.copy_from_slice(&blk[2 + 4 * j..6 + 4 * j]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn interleave_codes_sse2(src: &[&[u8; Q4_0_BLOCK_BYTES]; TILE_ROWS], codes: &mut [u8; CODE_BYTES]) {
    use std::arch::x86_64::*;
    for q in 0..TILE_ROWS / 4 {
        // SAFETY: SSE2 is part of x86-64, so these intrinsics run on every
        // CPU this code is compiled for. Each load reads bytes 2..18 of an
        // 18-byte block and each store writes 16 bytes at `16q + 64j`
        // (q, j < 4) of the 256-byte `codes`: all in bounds; the unaligned
        // forms need no alignment.
        unsafe {
            let row = |r: usize| _mm_loadu_si128(src[4 * q + r].as_ptr().add(2).cast());
            let (a, b, c, d) = (row(0), row(1), row(2), row(3));
            let ab_lo = _mm_unpacklo_epi32(a, b);
            let cd_lo = _mm_unpacklo_epi32(c, d);
            let ab_hi = _mm_unpackhi_epi32(a, b);
            let cd_hi = _mm_unpackhi_epi32(c, d);
            let groups = [
                _mm_unpacklo_epi64(ab_lo, cd_lo),
                _mm_unpackhi_epi64(ab_lo, cd_lo),
                _mm_unpacklo_epi64(ab_hi, cd_hi),
                _mm_unpackhi_epi64(ab_hi, cd_hi),
            ];
            for (j, g) in groups.into_iter().enumerate() {
                _mm_storeu_si128(codes.as_mut_ptr().add(64 * j + 16 * q).cast(), g);
            }
        }
    }
}

/// Undoes [`tile_in_place`]: the tiles of a matrix of `rows` rows of
/// `blocks` blocks back to row-major rows, in place.
pub fn untile_in_place(bytes: &mut [u8], rows: usize, blocks: usize, scratch: &mut Vec<u8>) {
    let rb = blocks * Q4_0_BLOCK_BYTES;
    for_each_tile(bytes, rows, blocks, scratch, |tile, old| {
        for (r, row) in tile.chunks_exact_mut(rb).enumerate() {
            row_of(old, TILE_ROWS, blocks, r, row);
        }
    });
}

/// `rewrite(tile, old)` for each full group of 16 rows of a matrix of
/// `rows` rows of `blocks` blocks, with `old` a copy of the group's bytes
/// (in `scratch`).
fn for_each_tile(
    bytes: &mut [u8],
    rows: usize,
    blocks: usize,
    scratch: &mut Vec<u8>,
    mut rewrite: impl FnMut(&mut [u8], &[u8]),
) {
    assert_eq!(
        bytes.len(),
        rows * blocks * Q4_0_BLOCK_BYTES,
        "whole Q4_0 rows"
    );
    for tile in bytes
        .chunks_exact_mut(tile_bytes(blocks))
        .take(rows / TILE_ROWS)
    {
        scratch.clear();
        scratch.extend_from_slice(tile);
        rewrite(tile, scratch);
    }
}

/// Row `r` of a tiled matrix (`rows` rows of `blocks` blocks) in its
/// row-major form, into `out` (`blocks × 18` bytes): what the generic
/// paths (one row at a time, dequantization) read.
pub fn row_of(bytes: &[u8], rows: usize, blocks: usize, r: usize, out: &mut [u8]) {
    let rb = blocks * Q4_0_BLOCK_BYTES;
    assert!(r < rows && bytes.len() == rows * rb && out.len() == rb);
    let full = rows / TILE_ROWS * TILE_ROWS;
    if r >= full {
        out.copy_from_slice(&bytes[r * rb..(r + 1) * rb]);
        return;
    }
    let tile = &bytes[r / TILE_ROWS * tile_bytes(blocks)..][..tile_bytes(blocks)];
    let i = r % TILE_ROWS;
    for (b, blk) in out.chunks_exact_mut(Q4_0_BLOCK_BYTES).enumerate() {
        blk[..2].copy_from_slice(&tile[scales_at(blocks, b) + 2 * i..][..2]);
        for j in 0..PACKED / 4 {
            let at = codes_at(blocks, b) + (j * TILE_ROWS + i) * 4;
            blk[2 + 4 * j..6 + 4 * j].copy_from_slice(&tile[at..at + 4]);
        }
    }
}

/// Scalar reference of the tile kernels: the 16 rows of `tile` (of
/// `blocks` blocks) against `x`, row by row through
/// [`super::q4_0::dot_q4_0_q8`].
pub fn dot_tile_ref(tile: &[u8], blocks: usize, x: &Q8Activation, out: &mut [f32; TILE_ROWS]) {
    let mut row = vec![0u8; blocks * Q4_0_BLOCK_BYTES];
    for (r, o) in out.iter_mut().enumerate() {
        row_of(tile, TILE_ROWS, blocks, r, &mut row);
        *o = super::q4_0::dot_q4_0_q8(&row, x);
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! The tile kernel on AVX2: 8 rows in the 8 lanes of a register, two
    //! registers per tile. `vpmaddubsw` multiplies the unsigned codes
    //! (0..15) by the signed quants (|q| ≤ 127) into 16-bit pair sums
    //! (|·| ≤ 3810, never saturating); the 8 of a block add up to at most
    //! 30480 in magnitude, still exact in 16 bits, and `vpmaddwd` by ones
    //! widens them to each row's 32-bit sum. The zero point is taken off
    //! afterwards, `Σ(w−8)q = Σwq − 8Σq`: the block's exact integer sum, as
    //! in every other kernel.
    //!
    //! # Safety
    //! Requires AVX2, FMA and F16C (checked by the caller with
    //! `is_x86_feature_detected!`), `tile.len() == tile_bytes(blocks)` and
    //! an activation of `blocks × 32` quants.

    use std::arch::x86_64::*;

    use super::{Q8Activation, codes_at, scales_at};
    use crate::kernels::q4_0::LANES;

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // h indexes the lanes and the output
    pub unsafe fn dot_tile(tile: &[u8], blocks: usize, x: &Q8Activation, out: &mut [f32; 16]) {
        debug_assert_eq!(tile.len(), super::tile_bytes(blocks));
        debug_assert!(x.quants.len() >= blocks * 32 && x.scales.len() >= blocks);
        let base = tile.as_ptr();
        let q = x.quants.as_ptr() as *const i32;
        // SAFETY: block `b < blocks` reads codes `codes_at(b)..+256` and
        // scales `scales_at(b)..+32` of the tile, quants `b × 32..+32`,
        // scale `b` and `bsums8[b]` of the activation, all in bounds
        // (module docs); the rest is register arithmetic.
        unsafe {
            let nibble = _mm256_set1_epi8(0x0f);
            let ones = _mm256_set1_epi16(1);
            let pf = super::prefetch();
            let step = |b: usize, acc: &mut [__m256; 2]| {
                let c = base.add(codes_at(blocks, b));
                // The 288 bytes of a block `pf`'s distances on: this
                // tile's, the next tile's of the same rows task, or (at the
                // end of the task's rows) bytes it never reads. A prefetch
                // is only a hint and never faults, and `wrapping_add` keeps
                // the address arithmetic defined past the slice.
                super::ask_ahead(c, pf);
                let qb = q.add(b * 8);
                let zero = _mm256_set1_epi32(*x.bsums8.get_unchecked(b));
                let xd = _mm256_set1_ps(*x.scales.get_unchecked(b));
                for (h, a) in acc.iter_mut().enumerate() {
                    // Rows 8h..8h + 8: bytes 32h.. of each 64-byte group.
                    let mut s16 = _mm256_setzero_si256();
                    for j in 0..4 {
                        let w = _mm256_loadu_si256(c.add(64 * j + 32 * h) as *const __m256i);
                        let wl = _mm256_and_si256(w, nibble);
                        let wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
                        let ql = _mm256_set1_epi32(qb.add(j).read_unaligned());
                        let qh = _mm256_set1_epi32(qb.add(4 + j).read_unaligned());
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wl, ql));
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wh, qh));
                    }
                    let s = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), zero);
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(
                        base.add(scales_at(blocks, b) + 16 * h) as *const __m128i,
                    ));
                    *a = _mm256_fmadd_ps(_mm256_mul_ps(dw, xd), _mm256_cvtepi32_ps(s), *a);
                }
            };
            let mut acc = [[_mm256_setzero_ps(); 2]; LANES];
            crate::kernels::q4_0::blocks_into_lanes!(blocks, acc, step);
            for h in 0..2 {
                let v = _mm256_add_ps(
                    _mm256_add_ps(acc[0][h], acc[2][h]),
                    _mm256_add_ps(acc[1][h], acc[3][h]),
                );
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * h), v);
            }
        }
    }

    /// Tokens [`dot_tiles`] takes at once (as the AVX-512 kernel).
    pub const TOKENS: usize = 8;

    /// The tile against `xs.len() ≤ TOKENS` activations: `out[t]` is
    /// exactly what [`dot_tile`] gives for `xs[t]`.
    ///
    /// From three tokens on, block by block: the block's codes are split
    /// into nibbles once (16 registers' worth, which the compiler keeps in
    /// L1) and every token multiplies them from there, two tokens at a
    /// time so each load of split codes serves both. Sixteen registers
    /// then hold a pair's four 16-bit sums, its broadcast quants and the
    /// codes in flight; the accumulators live in L1, one fused
    /// multiply-add per token and half of a block. Passes of four tokens
    /// over the tile with every token's sums in registers, as before,
    /// spilled inside the multiply loop and ran 12–35% slower
    /// (docs/benchmarks.md, "The AVX2 tile kernel without spills"). One
    /// or two tokens take [`tiles_n`], whose split codes stay in
    /// registers: there the stores of the split would not pay.
    ///
    /// # Safety
    /// As [`dot_tile`], for every activation; `out.len() >= xs.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // h indexes the halves of acc and of out
    pub unsafe fn dot_tiles(
        tile: &[u8],
        blocks: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; 16]],
        next: &[u8],
    ) {
        let n = xs.len();
        assert!(n <= TOKENS, "dot_tiles takes at most {TOKENS} activations");
        // SAFETY: forwarded contract (module docs).
        match n {
            1 => return unsafe { tiles_n::<1>(tile, blocks, xs, out, next) },
            2 => return unsafe { tiles_n::<2>(tile, blocks, xs, out, next) },
            _ => {}
        }
        super::debug_check_tiles(tile, blocks, xs, out.len(), n);
        let base = tile.as_ptr();
        // SAFETY: block `b < blocks` reads codes `codes_at(b)..+256` and
        // scales `scales_at(b)..+32` of the tile, and quants `b × 32..+32`,
        // scale `b` and `bsums8[b]` of each of the `n` activations, all in
        // bounds (module docs); the rest is register arithmetic and
        // accesses to local arrays.
        unsafe {
            let nibble = _mm256_set1_epi8(0x0f);
            let ones = _mm256_set1_epi16(1);
            // acc[lane][t][h]: token t's rows 8h..8h + 8, lane b mod 4.
            let mut acc = [[[_mm256_setzero_ps(); 2]; TOKENS]; LANES];
            // Block b's codes split: [4j] low and [4j + 1] high nibbles of
            // rows 0..8 in group j, [4j + 2] and [4j + 3] of rows 8..16.
            let mut split = [_mm256_setzero_si256(); 16];
            // Tokens t..t + $p of block b into `lane`, as `dot_tile`'s
            // step does for each.
            macro_rules! tokens {
                ($p:literal, $t:expr, $b:expr, $dw:expr, $lane:expr) => {{
                    let (t, b): (usize, usize) = ($t, $b);
                    let q: [*const i32; $p] = std::array::from_fn(|i| {
                        (xs.get_unchecked(t + i).quants.as_ptr() as *const i32).add(b * 8)
                    });
                    let mut s16 = [[_mm256_setzero_si256(); 2]; $p];
                    for j in 0..4 {
                        for i in 0..$p {
                            let ql = _mm256_set1_epi32(q[i].add(j).read_unaligned());
                            let qh = _mm256_set1_epi32(q[i].add(4 + j).read_unaligned());
                            let s = &mut s16[i];
                            let lo = _mm256_add_epi16(
                                _mm256_maddubs_epi16(split[4 * j], ql),
                                _mm256_maddubs_epi16(split[4 * j + 1], qh),
                            );
                            let hi = _mm256_add_epi16(
                                _mm256_maddubs_epi16(split[4 * j + 2], ql),
                                _mm256_maddubs_epi16(split[4 * j + 3], qh),
                            );
                            s[0] = _mm256_add_epi16(s[0], lo);
                            s[1] = _mm256_add_epi16(s[1], hi);
                        }
                    }
                    for i in 0..$p {
                        let x = xs.get_unchecked(t + i);
                        let zero = _mm256_set1_epi32(*x.bsums8.get_unchecked(b));
                        let xd = _mm256_set1_ps(*x.scales.get_unchecked(b));
                        for h in 0..2 {
                            let s = _mm256_sub_epi32(_mm256_madd_epi16(s16[i][h], ones), zero);
                            let a = &mut $lane[t + i][h];
                            *a = _mm256_fmadd_ps(
                                _mm256_mul_ps($dw[h], xd),
                                _mm256_cvtepi32_ps(s),
                                *a,
                            );
                        }
                    }
                }};
            }
            for b in 0..blocks {
                super::ask_l2(next, b);
                let c = base.add(codes_at(blocks, b));
                for j in 0..4 {
                    let w0 = _mm256_loadu_si256(c.add(64 * j) as *const __m256i);
                    let w1 = _mm256_loadu_si256(c.add(64 * j + 32) as *const __m256i);
                    split[4 * j] = _mm256_and_si256(w0, nibble);
                    split[4 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(w0, 4), nibble);
                    split[4 * j + 2] = _mm256_and_si256(w1, nibble);
                    split[4 * j + 3] = _mm256_and_si256(_mm256_srli_epi16(w1, 4), nibble);
                }
                let sc = base.add(scales_at(blocks, b));
                let dw = [
                    _mm256_cvtph_ps(_mm_loadu_si128(sc as *const __m128i)),
                    _mm256_cvtph_ps(_mm_loadu_si128(sc.add(16) as *const __m128i)),
                ];
                let lane = &mut acc[b % LANES];
                let mut t = 0;
                while t + 2 <= n {
                    tokens!(2, t, b, dw, lane);
                    t += 2;
                }
                if t < n {
                    tokens!(1, t, b, dw, lane);
                }
            }
            for (t, o) in out.iter_mut().enumerate().take(n) {
                for h in 0..2 {
                    let v = _mm256_add_ps(
                        _mm256_add_ps(acc[0][t][h], acc[2][t][h]),
                        _mm256_add_ps(acc[1][t][h], acc[3][t][h]),
                    );
                    _mm256_storeu_ps(o.as_mut_ptr().add(8 * h), v);
                }
            }
        }
    }

    /// One or two tokens (`T`) through the tile: each group of codes is
    /// loaded and split once for both, their sums kept in registers.
    ///
    /// # Safety
    /// As [`dot_tiles`], with `xs.len() == T`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // h indexes the halves and the output
    unsafe fn tiles_n<const T: usize>(
        tile: &[u8],
        blocks: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; 16]],
        next: &[u8],
    ) {
        super::debug_check_tiles(tile, blocks, xs, out.len(), T);
        let base = tile.as_ptr();
        let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
        // SAFETY: as in `dot_tile`, for block `b < blocks` of the tile and
        // of each of the T activations; the rest is register arithmetic.
        unsafe {
            let nibble = _mm256_set1_epi8(0x0f);
            let ones = _mm256_set1_epi16(1);
            let mut acc = [[[_mm256_setzero_ps(); 2]; T]; LANES];
            // One block into accumulator lane `$lane`, as `dot_tile`'s
            // `step` does for each token, in its order. Both halves of a
            // group of codes are split before the tokens' quants are
            // broadcast, so each broadcast serves 16 rows, not 8.
            macro_rules! step {
                ($b:expr, $lane:expr) => {{
                    let b: usize = $b;
                    super::ask_l2(next, b);
                    let c = base.add(codes_at(blocks, b));
                    let mut s16 = [[_mm256_setzero_si256(); 2]; T];
                    for j in 0..4 {
                        let w0 = _mm256_loadu_si256(c.add(64 * j) as *const __m256i);
                        let w1 = _mm256_loadu_si256(c.add(64 * j + 32) as *const __m256i);
                        let wl0 = _mm256_and_si256(w0, nibble);
                        let wh0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), nibble);
                        let wl1 = _mm256_and_si256(w1, nibble);
                        let wh1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), nibble);
                        for t in 0..T {
                            let qb = q[t].add(b * 8);
                            let ql = _mm256_set1_epi32(qb.add(j).read_unaligned());
                            let qh = _mm256_set1_epi32(qb.add(4 + j).read_unaligned());
                            let s = &mut s16[t];
                            s[0] = _mm256_add_epi16(s[0], _mm256_maddubs_epi16(wl0, ql));
                            s[0] = _mm256_add_epi16(s[0], _mm256_maddubs_epi16(wh0, qh));
                            s[1] = _mm256_add_epi16(s[1], _mm256_maddubs_epi16(wl1, ql));
                            s[1] = _mm256_add_epi16(s[1], _mm256_maddubs_epi16(wh1, qh));
                        }
                    }
                    for h in 0..2 {
                        let dw = _mm256_cvtph_ps(_mm_loadu_si128(
                            base.add(scales_at(blocks, b) + 16 * h) as *const __m128i,
                        ));
                        for t in 0..T {
                            let x = xs.get_unchecked(t);
                            let zero = _mm256_set1_epi32(*x.bsums8.get_unchecked(b));
                            let xd = _mm256_set1_ps(*x.scales.get_unchecked(b));
                            let s = _mm256_sub_epi32(_mm256_madd_epi16(s16[t][h], ones), zero);
                            let a = &mut acc[$lane][t][h];
                            *a = _mm256_fmadd_ps(_mm256_mul_ps(dw, xd), _mm256_cvtepi32_ps(s), *a);
                        }
                    }
                }};
            }
            crate::kernels::q4_0::blocks_into_const_lanes!(blocks, step);
            for (t, o) in out.iter_mut().enumerate().take(T) {
                for h in 0..2 {
                    let v = _mm256_add_ps(
                        _mm256_add_ps(acc[0][t][h], acc[2][t][h]),
                        _mm256_add_ps(acc[1][t][h], acc[3][t][h]),
                    );
                    _mm256_storeu_ps(o.as_mut_ptr().add(8 * h), v);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    //! The tile kernel on AVX-512 VNNI: the 16 rows in the 16 lanes of a
    //! register. Weight codes enter `vpdpbusd` unsigned and the zero point
    //! is taken off exactly afterwards, `Σ(w−8)q = Σwq − 8Σq`. In the
    //! one-token [`dot_tile`], low nibbles enter as 0..15 (the byte masked
    //! by 0x0f) and high nibbles stay where they are, 16 × (0..15) (the byte
    //! masked by 0xf0, at most 240, still an unsigned byte operand): their
    //! chain sums exactly 16 × Σwq, and one arithmetic shift by 4 per block
    //! takes the factor off. That spares the shift per 64 bytes of a split
    //! into 0..15, in the kernel a decode streams from memory
    //! (docs/benchmarks.md, "High nibbles in place").
    //!
    //! # Safety
    //! Requires AVX-512 F, BW, VL and VNNI, FMA and F16C (checked by the
    //! caller with `is_x86_feature_detected!`), `tile.len() ==
    //! tile_bytes(blocks)` and an activation of `blocks × 32` quants.

    use std::arch::x86_64::*;

    use super::{Q8Activation, codes_at, scales_at};
    use crate::kernels::q4_0::LANES;

    /// # Safety
    /// See the module docs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    pub unsafe fn dot_tile(tile: &[u8], blocks: usize, x: &Q8Activation, out: &mut [f32; 16]) {
        debug_assert_eq!(tile.len(), super::tile_bytes(blocks));
        debug_assert!(x.quants.len() >= blocks * 32 && x.scales.len() >= blocks);
        let base = tile.as_ptr();
        let q = x.quants.as_ptr() as *const i32;
        // SAFETY: block `b < blocks` reads codes `b × 256..+256`, scales
        // `b × 32..+32` of the tile and quants `b × 32..+32`, scale `b`
        // and `bsums8[b]` of the activation, all in bounds (module docs);
        // the rest is register arithmetic.
        unsafe {
            let (low, high) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0xf0u8 as i8));
            let pf = super::prefetch();
            let step = |b: usize, acc: &mut __m512| {
                let c = base.add(codes_at(blocks, b)) as *const __m512i;
                // As in the AVX2 kernel: ask for the bytes `pf`'s distances
                // on (hints that never fault).
                super::ask_ahead(c as *const u8, pf);
                let qb = q.add(b * 8);
                // Low nibbles pair with the block's first 16 quants, high
                // ones (in place, 16×) with its last 16; two chains halve
                // the latency.
                let mut lo = _mm512_setzero_si512();
                let mut hi = _mm512_setzero_si512();
                for j in 0..4 {
                    let w = _mm512_loadu_si512(c.add(j));
                    let wl = _mm512_and_si512(w, low);
                    let wh = _mm512_and_si512(w, high);
                    lo = _mm512_dpbusd_epi32(lo, wl, _mm512_set1_epi32(qb.add(j).read_unaligned()));
                    hi = _mm512_dpbusd_epi32(
                        hi,
                        wh,
                        _mm512_set1_epi32(qb.add(4 + j).read_unaligned()),
                    );
                }
                let zero = _mm512_set1_epi32(*x.bsums8.get_unchecked(b));
                let s = _mm512_sub_epi32(_mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4)), zero);
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(
                    base.add(scales_at(blocks, b)) as *const __m256i
                ));
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(*x.scales.get_unchecked(b)));
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), *acc);
            };
            let mut acc = [_mm512_setzero_ps(); LANES];
            crate::kernels::q4_0::blocks_into_lanes!(blocks, acc, step);
            let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
            _mm512_storeu_ps(out.as_mut_ptr(), v);
        }
    }

    /// Block `b` of a tile at `base`: its codes' low and high nibbles
    /// (four registers each, 16 rows × 4 bytes apiece) and its 16 scales.
    /// Both split into 0..15: the several-token kernels split a block once
    /// for all their tokens, where the one-token kernel's high nibbles in
    /// place would cost a shift per token instead.
    ///
    /// # Safety
    /// `b < blocks` of a tile of `blocks` blocks at `base`; the caller's
    /// target features.
    ///
    /// `NL`: the tile holds IQ4_NL blocks (the same 18 bytes: f16 scale,
    /// 16 bytes of nibbles), and each nibble becomes its value in
    /// [`IQ4_NL_VALUES`](crate::quant::IQ4_NL_VALUES) plus 128, an unsigned
    /// byte (1..=241) for `vpdpbusd`; [`zero_point`] then takes 128 · Σq
    /// off instead of Q4_0's 8 · Σq.
    #[inline(always)]
    unsafe fn split_block<const NL: bool>(
        base: *const u8,
        blocks: usize,
        b: usize,
        nibble: __m512i,
    ) -> ([__m512i; 4], [__m512i; 4], __m512) {
        // SAFETY: the block's 256 bytes of codes and 32 of scales lie in
        // the tile (caller).
        unsafe {
            let c = base.add(codes_at(blocks, b)) as *const __m512i;
            let mut wl = [_mm512_setzero_si512(); 4];
            let mut wh = [_mm512_setzero_si512(); 4];
            let table = nl_table();
            for j in 0..4 {
                let w = _mm512_loadu_si512(c.add(j));
                wl[j] = _mm512_and_si512(w, nibble);
                wh[j] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
                if NL {
                    wl[j] = _mm512_shuffle_epi8(table, wl[j]);
                    wh[j] = _mm512_shuffle_epi8(table, wh[j]);
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(
                base.add(scales_at(blocks, b)) as *const __m256i
            ));
            (wl, wh, dw)
        }
    }

    /// IQ4_NL's 16 values plus 128 (unsigned bytes), in every 128-bit lane:
    /// the `vpshufb` table that turns a nibble into its biased value.
    #[inline(always)]
    fn nl_table() -> __m512i {
        let biased: [u8; 16] =
            std::array::from_fn(|i| (crate::quant::IQ4_NL_VALUES[i] as u8) ^ 0x80);
        let lane = u128::from_le_bytes(biased);
        let (lo, hi) = (lane as u64 as i64, (lane >> 64) as u64 as i64);
        // SAFETY: register arithmetic (AVX-512 F, under the caller's
        // target features).
        unsafe { _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo) }
    }

    /// What block `b`'s codes add beyond the weights' values, from the
    /// activation's `bsums8 = 8 · Σq`: Q4_0's zero point 8 · Σq, or (`NL`)
    /// the bias 128 · Σq of [`split_block`]'s IQ4_NL bytes. Exact.
    #[inline(always)]
    fn zero_point<const NL: bool>(bsums8: i32) -> i32 {
        if NL { bsums8 << 4 } else { bsums8 }
    }

    /// `start` plus a block's exact integer sums of codes times quants for
    /// one token (`qb`: its 8 words of quants): the low nibbles against the
    /// first 16 quants, the high ones against the last 16, in two chains.
    ///
    /// # Safety
    /// `qb` points at 8 readable words; the caller's target features.
    #[inline(always)]
    unsafe fn block_sums(
        start: __m512i,
        wl: &[__m512i; 4],
        wh: &[__m512i; 4],
        qb: *const i32,
    ) -> __m512i {
        // SAFETY: words 0..8 at qb (caller); register arithmetic.
        unsafe {
            let mut lo = start;
            let mut hi = _mm512_setzero_si512();
            for j in 0..4 {
                lo = _mm512_dpbusd_epi32(lo, wl[j], _mm512_set1_epi32(qb.add(j).read_unaligned()));
                hi = _mm512_dpbusd_epi32(
                    hi,
                    wh[j],
                    _mm512_set1_epi32(qb.add(4 + j).read_unaligned()),
                );
            }
            _mm512_add_epi32(lo, hi)
        }
    }

    /// Tokens [`dot_tiles`] takes at once.
    pub const TOKENS: usize = 8;

    /// The tile against `xs.len() ≤ TOKENS` activations: `out[t]` is
    /// exactly what [`dot_tile`] gives for `xs[t]`. Each block's codes are
    /// loaded and split into nibbles once for all the tokens: on Zen 4 the
    /// split (three 512-bit logic ops per 64 bytes) takes as many cycles
    /// as the `vpdpbusd`s of one token, so a prefill pays for it once per
    /// several tokens instead of once per token. Five to eight tokens take
    /// [`tiles_by_lane`] (in L1 on Zen 5, 8 tokens: 1.74 ns per block and
    /// token against 2.29 as two calls of 4; `cargo bench --bench kernels
    /// -- --tile-tokens`); up to four, whose tile is more often read from
    /// memory (batched decode), keep the blocks in memory order.
    ///
    /// # Safety
    /// As [`dot_tile`], for every activation; `out.len() >= xs.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    pub unsafe fn dot_tiles(
        tile: &[u8],
        blocks: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; 16]],
        next: &[u8],
    ) {
        // SAFETY: forwarded contract.
        unsafe { tiles::<false>(tile, blocks, xs, out, next) }
    }

    /// [`dot_tiles`] for a tile of IQ4_NL rows (tiled as Q4_0's: the
    /// blocks have the same 18 bytes): for each row, `out[t]` is exactly
    /// what [`crate::kernels::legacy_q8::dot_iq4_nl_q8`] gives for `xs[t]`
    /// (the same exact integer sum per block, product of scales, fused
    /// multiply-add into lane `b mod 4` and final reduction).
    ///
    /// # Safety
    /// As [`dot_tiles`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    pub unsafe fn dot_iq4_nl_tiles(
        tile: &[u8],
        blocks: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; 16]],
        next: &[u8],
    ) {
        // SAFETY: forwarded contract.
        unsafe { tiles::<true>(tile, blocks, xs, out, next) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn tiles<const NL: bool>(
        tile: &[u8],
        blocks: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; 16]],
        next: &[u8],
    ) {
        // SAFETY: forwarded contract (module docs): each call reads the
        // tile and its activations within bounds.
        unsafe {
            match xs.len() {
                8 => tiles_by_lane::<8, NL>(tile, blocks, xs, out, next),
                7 => tiles_by_lane::<7, NL>(tile, blocks, xs, out, next),
                6 => tiles_by_lane::<6, NL>(tile, blocks, xs, out, next),
                5 => tiles_by_lane::<5, NL>(tile, blocks, xs, out, next),
                4 => tiles_n::<4, NL>(tile, blocks, xs, out, next),
                3 => tiles_n::<3, NL>(tile, blocks, xs, out, next),
                2 => tiles_n::<2, NL>(tile, blocks, xs, out, next),
                1 => tiles_n::<1, NL>(tile, blocks, xs, out, next),
                0 => {}
                _ => panic!("dot_tiles takes at most {TOKENS} activations"),
            }
        }
    }

    /// The tile against `T` activations, one accumulator lane at a time:
    /// lane `l`'s blocks `l, l + 4, l + 8, …` in increasing order into
    /// `T` registers, so eight tokens' accumulators fit (all four lanes of
    /// eight tokens would be 32 registers). Each lane's chain of fused
    /// multiply-adds is the one `dot_tile` forms, and the lanes are added
    /// as it adds them: the same bits. The zero point starts the low
    /// nibbles' integer chain (exact integer arithmetic, in any order).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn tiles_by_lane<const T: usize, const NL: bool>(
        tile: &[u8],
        blocks: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; 16]],
        next: &[u8],
    ) {
        super::debug_check_tiles(tile, blocks, xs, out.len(), T);
        let base = tile.as_ptr();
        let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
        let z: [*const i32; T] = std::array::from_fn(|t| xs[t].bsums8.as_ptr());
        let sc: [*const f32; T] = std::array::from_fn(|t| xs[t].scales.as_ptr());
        // SAFETY: as in `dot_tile`, for block `b < blocks` of the tile and
        // of each of the T activations; the rest is register arithmetic.
        unsafe {
            let nibble = _mm512_set1_epi8(0x0f);
            let mut lanes = [[_mm512_setzero_ps(); T]; LANES];
            for (lane, sums) in lanes.iter_mut().enumerate() {
                let mut acc = [_mm512_setzero_ps(); T];
                let mut b = lane;
                while b < blocks {
                    super::ask_l2(next, b);
                    let (wl, wh, dw) = split_block::<NL>(base, blocks, b, nibble);
                    for t in 0..T {
                        let zero = zero_point::<NL>(z[t].add(b).read());
                        let start = _mm512_set1_epi32(zero.wrapping_neg());
                        let s = block_sums(start, &wl, &wh, q[t].add(b * 8));
                        let d = _mm512_mul_ps(dw, _mm512_set1_ps(sc[t].add(b).read()));
                        acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), acc[t]);
                    }
                    b += LANES;
                }
                *sums = acc;
            }
            for (t, o) in out.iter_mut().enumerate().take(T) {
                let v = _mm512_add_ps(
                    _mm512_add_ps(lanes[0][t], lanes[2][t]),
                    _mm512_add_ps(lanes[1][t], lanes[3][t]),
                );
                _mm512_storeu_ps(o.as_mut_ptr(), v);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn tiles_n<const T: usize, const NL: bool>(
        tile: &[u8],
        blocks: usize,
        xs: &[&Q8Activation],
        out: &mut [[f32; 16]],
        next: &[u8],
    ) {
        super::debug_check_tiles(tile, blocks, xs, out.len(), T);
        let base = tile.as_ptr();
        let q: [*const i32; T] = std::array::from_fn(|t| xs[t].quants.as_ptr() as *const i32);
        // SAFETY: as in `dot_tile`, for block `b < blocks` of the tile and
        // of each of the T activations; the rest is register arithmetic.
        unsafe {
            let nibble = _mm512_set1_epi8(0x0f);
            let mut acc = [[_mm512_setzero_ps(); T]; LANES];
            // One block into accumulator lane `$lane` (a constant: see
            // blocks_into_const_lanes).
            macro_rules! step {
                ($b:expr, $lane:expr) => {{
                    let b: usize = $b;
                    super::ask_l2(next, b);
                    let (wl, wh, dw) = split_block::<NL>(base, blocks, b, nibble);
                    for t in 0..T {
                        // `dot_tile`'s operations for token t, in its order.
                        let x = xs.get_unchecked(t);
                        let sums = block_sums(_mm512_setzero_si512(), &wl, &wh, q[t].add(b * 8));
                        let zero = _mm512_set1_epi32(zero_point::<NL>(*x.bsums8.get_unchecked(b)));
                        let s = _mm512_sub_epi32(sums, zero);
                        let d = _mm512_mul_ps(dw, _mm512_set1_ps(*x.scales.get_unchecked(b)));
                        acc[$lane][t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), acc[$lane][t]);
                    }
                }};
            }
            crate::kernels::q4_0::blocks_into_const_lanes!(blocks, step);
            for (t, o) in out.iter_mut().enumerate().take(T) {
                let v = _mm512_add_ps(
                    _mm512_add_ps(acc[0][t], acc[2][t]),
                    _mm512_add_ps(acc[1][t], acc[3][t]),
                );
                _mm512_storeu_ps(o.as_mut_ptr(), v);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::q4_0::dot_q4_0_q8;
    use crate::kernels::q8act::tests::data;
    use crate::quant::{QK, quantize_q4_0};
    use rand::{Rng, SeedableRng};

    /// A row-major Q4_0 matrix with every nibble value, zero and negative
    /// scales.
    pub(crate) fn matrix(rng: &mut impl Rng, rows: usize, blocks: usize) -> Vec<u8> {
        let mut w = quantize_q4_0(&data(rng, rows * blocks * QK, 1.0)).unwrap();
        for (i, b) in w.iter_mut().enumerate() {
            match (i % Q4_0_BLOCK_BYTES, i / Q4_0_BLOCK_BYTES % 5) {
                (0 | 1, 3) => *b = 0,
                (1, 4) => *b |= 0x80,
                (j, 2) if j >= 2 => *b = (i as u8).wrapping_mul(37),
                _ => {}
            }
        }
        w
    }

    /// `n` activations of `blocks` blocks: spreads from 0.01 to 300, and
    /// blocks of zeros, with a huge value and with an infinite one.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn activations(rng: &mut impl Rng, n: usize, blocks: usize) -> Vec<Q8Activation> {
        (0..n)
            .map(|i| {
                let mut x = data(rng, blocks * QK, [0.01f32, 1.0, 300.0, 2.0][i % 4]);
                for (b, blk) in x.chunks_mut(QK).enumerate() {
                    match (b + i) % 7 {
                        1 => blk.fill(0.0),
                        4 => blk[5] = 1e30,
                        6 => blk[9] = f32::INFINITY,
                        _ => {}
                    }
                }
                Q8Activation::quantize(&x)
            })
            .collect()
    }

    #[test]
    fn interleaving_equals_its_word_by_word_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(44);
        for _ in 0..8 {
            let w = matrix(&mut rng, TILE_ROWS, 1);
            let src: [&[u8; Q4_0_BLOCK_BYTES]; TILE_ROWS] = std::array::from_fn(|r| {
                w[r * Q4_0_BLOCK_BYTES..][..Q4_0_BLOCK_BYTES]
                    .try_into()
                    .unwrap()
            });
            let (mut got, mut want) = ([0u8; CODE_BYTES], [0u8; CODE_BYTES]);
            interleave_codes(&src, &mut got);
            interleave_codes_scalar(&src, &mut want);
            assert_eq!(got, want);
            assert_ne!(want, [0u8; CODE_BYTES]);
        }
    }

    #[test]
    fn tiling_moves_every_byte_and_rows_come_back_unchanged() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(41);
        let mut scratch = Vec::new();
        for (rows, blocks) in [(16, 1), (17, 3), (37, 24), (48, 64), (5, 2), (33, 65)] {
            let w = matrix(&mut rng, rows, blocks);
            let mut t = w.clone();
            tile_in_place(&mut t, rows, blocks, &mut scratch);
            if rows >= TILE_ROWS {
                assert_ne!(t, w, "{rows}×{blocks}: a full tile is rearranged");
            }
            let mut sorted = (t.clone(), w.clone());
            sorted.0.sort_unstable();
            sorted.1.sort_unstable();
            assert_eq!(sorted.0, sorted.1, "a permutation of the bytes");
            let rb = blocks * Q4_0_BLOCK_BYTES;
            let mut row = vec![0u8; rb];
            for r in 0..rows {
                row_of(&t, rows, blocks, r, &mut row);
                assert_eq!(row, w[r * rb..(r + 1) * rb], "{rows}×{blocks}, row {r}");
            }
            untile_in_place(&mut t, rows, blocks, &mut scratch);
            assert_eq!(t, w, "{rows}×{blocks}: untiled back to the rows");
        }
    }

    /// The layout the module docs describe: blocks in pairs, each pair's
    /// 16 + 16 scales before its codes; block `b`'s code group `j` holds 4
    /// packed bytes of each row in turn. An odd block count leaves the last
    /// block alone with its 16 scales.
    #[test]
    fn a_tile_is_laid_out_as_documented() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
        for blocks in [3, 4] {
            let w = matrix(&mut rng, TILE_ROWS, blocks);
            let mut t = w.clone();
            tile_in_place(&mut t, TILE_ROWS, blocks, &mut Vec::new());
            let rb = blocks * Q4_0_BLOCK_BYTES;
            for r in 0..TILE_ROWS {
                for b in 0..blocks {
                    let blk = &w[r * rb + b * Q4_0_BLOCK_BYTES..][..Q4_0_BLOCK_BYTES];
                    let pair = b / 2 * 576;
                    let paired = if b / 2 * 2 + 1 < blocks { 2 } else { 1 };
                    let s = pair + b % 2 * 32 + 2 * r;
                    assert_eq!(
                        t[s..s + 2],
                        blk[..2],
                        "{blocks} blocks: scale of row {r} block {b}"
                    );
                    for j in 0..4 {
                        let c = pair + paired * 32 + b % 2 * 256 + j * 64 + 4 * r;
                        assert_eq!(t[c..c + 4], blk[2 + 4 * j..6 + 4 * j]);
                    }
                }
            }
        }
    }

    #[test]
    fn the_reference_equals_the_row_kernel() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(43);
        for blocks in [1, 2, 3, 5, 24, 64, 65] {
            let w = matrix(&mut rng, TILE_ROWS, blocks);
            let x = Q8Activation::quantize(&data(&mut rng, blocks * QK, 2.0));
            let mut t = w.clone();
            tile_in_place(&mut t, TILE_ROWS, blocks, &mut Vec::new());
            let mut out = [f32::NAN; TILE_ROWS];
            dot_tile_ref(&t, blocks, &x, &mut out);
            let rb = blocks * Q4_0_BLOCK_BYTES;
            for (r, o) in out.iter().enumerate() {
                let want = dot_q4_0_q8(&w[r * rb..(r + 1) * rb], &x);
                assert_eq!(o.to_bits(), want.to_bits(), "{blocks} blocks, row {r}");
            }
        }
    }

    /// Every several-token tile kernel this CPU runs gives each (row,
    /// token) the row kernel's bits, for 1 to 8 tokens, with or without
    /// the next tile asked for, on the block counts
    /// of the single-token test, with zero, huge and infinite activation
    /// blocks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_several_token_tile_kernels_equal_the_row_kernel_bit_for_bit() {
        type Dots = unsafe fn(&[u8], usize, &[&Q8Activation], &mut [[f32; TILE_ROWS]], &[u8]);
        type Row = fn(&[u8], &Q8Activation) -> f32;
        let mut levels: Vec<(&str, Dots, usize, Row)> = Vec::new();
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            levels.push(("avx2", avx2::dot_tiles, avx2::TOKENS, dot_q4_0_q8));
        } else {
            eprintln!("SKIP avx2: this CPU has no AVX2+FMA+F16C (probe: is_x86_feature_detected)");
        }
        if crate::kernels::has_avx512_vnni() {
            levels.push(("avx512", avx512::dot_tiles, avx512::TOKENS, dot_q4_0_q8));
            // The same bytes read as IQ4_NL blocks (the same 18-byte
            // layout; every nibble, zero and negative scales).
            levels.push((
                "avx512 iq4_nl",
                avx512::dot_iq4_nl_tiles,
                avx512::TOKENS,
                crate::kernels::legacy_q8::dot_iq4_nl_q8,
            ));
        } else {
            eprintln!("SKIP avx512: this CPU has no AVX-512 VNNI (probe: is_x86_feature_detected)");
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(45);
        for blocks in [1, 2, 3, 4, 5, 7, 9, 24, 31, 64, 65] {
            let w = matrix(&mut rng, TILE_ROWS, blocks);
            let mut t = w.clone();
            tile_in_place(&mut t, TILE_ROWS, blocks, &mut Vec::new());
            let xs = activations(&mut rng, avx512::TOKENS.max(avx2::TOKENS), blocks);
            let rb = blocks * Q4_0_BLOCK_BYTES;
            for &(name, dots, tokens, row_dot) in &levels {
                assert!(tokens <= xs.len());
                for n in 1..=tokens {
                    let refs: Vec<&Q8Activation> = xs.iter().skip(xs.len() - n).collect();
                    let mut out = vec![[f32::NAN; TILE_ROWS]; n];
                    // The hint for the next tile: none, a whole tile, a
                    // part of one; it must change no bit.
                    let next = [&[][..], &w[..], &w[..w.len() / 3]][n % 3];
                    // SAFETY: features checked above; the tile and every
                    // activation have `blocks` blocks.
                    unsafe { dots(&t, blocks, &refs, &mut out, next) };
                    for (x, o) in refs.iter().zip(&out) {
                        for (r, v) in o.iter().enumerate() {
                            let want = row_dot(&w[r * rb..(r + 1) * rb], x);
                            assert_eq!(
                                v.to_bits(),
                                want.to_bits(),
                                "{name}: {blocks} blocks, {n} tokens, row {r}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every tile kernel this CPU runs gives each row the row kernel's
    /// bits, on block counts around the 4 accumulator lanes and the model
    /// sizes, with zero, huge and infinite activation blocks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_tile_kernels_equal_the_row_kernel_bit_for_bit() {
        type Dot = unsafe fn(&[u8], usize, &Q8Activation, &mut [f32; TILE_ROWS]);
        let mut levels: Vec<(&str, Dot)> = Vec::new();
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            levels.push(("avx2", avx2::dot_tile));
        } else {
            eprintln!("SKIP avx2: this CPU has no AVX2+FMA+F16C (probe: is_x86_feature_detected)");
        }
        if crate::kernels::has_avx512_vnni() {
            levels.push(("avx512", avx512::dot_tile));
        } else {
            eprintln!("SKIP avx512: this CPU has no AVX-512 VNNI (probe: is_x86_feature_detected)");
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(44);
        for blocks in [1, 2, 3, 4, 5, 7, 9, 24, 31, 64, 65] {
            for spread in [0.01f32, 1.0, 300.0] {
                let w = matrix(&mut rng, TILE_ROWS, blocks);
                let mut t = w.clone();
                tile_in_place(&mut t, TILE_ROWS, blocks, &mut Vec::new());
                let mut x = data(&mut rng, blocks * QK, spread);
                for (b, blk) in x.chunks_mut(QK).enumerate() {
                    match b % 7 {
                        1 => blk.fill(0.0),
                        4 => blk[5] = 1e30,
                        6 => blk[9] = f32::INFINITY,
                        _ => {}
                    }
                }
                let x = Q8Activation::quantize(&x);
                let rb = blocks * Q4_0_BLOCK_BYTES;
                // Any prefetch distance (none, inside the tile, the
                // default, far past it) gives the same bits.
                for (&(name, dot), pf) in levels.iter().flat_map(|l| {
                    [
                        TilePrefetch::NONE,
                        TilePrefetch { l2: 0, l1: 64 },
                        TilePrefetch { l2: 0, l1: 1536 },
                        DEFAULT_PREFETCH,
                        TilePrefetch { l2: 1 << 20, l1: 0 },
                        TilePrefetch {
                            l2: 1 << 20,
                            l1: 1 << 16,
                        },
                    ]
                    .map(|pf| (l, pf))
                }) {
                    set_prefetch(pf);
                    let mut out = [f32::NAN; TILE_ROWS];
                    // SAFETY: features checked above; the tile and the
                    // activation have `blocks` blocks.
                    unsafe { dot(&t, blocks, &x, &mut out) };
                    for (r, o) in out.iter().enumerate() {
                        let want = dot_q4_0_q8(&w[r * rb..(r + 1) * rb], &x);
                        assert_eq!(
                            o.to_bits(),
                            want.to_bits(),
                            "{name}, prefetch {pf}: {blocks} blocks, spread {spread}, row {r}"
                        );
                    }
                }
            }
        }
        set_prefetch(DEFAULT_PREFETCH);
    }

    #[test]
    fn prefetch_settings_parse_and_print() {
        for p in [
            TilePrefetch::NONE,
            DEFAULT_PREFETCH,
            TilePrefetch { l2: 0, l1: 1536 },
            TilePrefetch { l2: 8192, l1: 0 },
        ] {
            assert_eq!(p.to_string().parse::<TilePrefetch>(), Ok(p));
            assert_eq!(TilePrefetch::decode(p.encode()), p);
        }
        assert_eq!(DEFAULT_PREFETCH.to_string(), "4096/l2+1152/l1");
        assert_eq!(
            "1152/l1+4096/l2".parse::<TilePrefetch>(),
            Ok(DEFAULT_PREFETCH)
        );
        let big = TilePrefetch {
            l2: u32::MAX as usize,
            l1: 7,
        };
        assert_eq!(TilePrefetch::decode(big.encode()), big);
        for bad in [
            "",
            "4096",
            "4096/l3",
            "x/l1",
            "/l2",
            "0/l2",
            "4096/l2+",
            "4096/l2+0",
            "4096/l2+8/l2",
            "4294967296/l2",
        ] {
            assert!(bad.parse::<TilePrefetch>().is_err(), "{bad:?}");
        }
    }
}
