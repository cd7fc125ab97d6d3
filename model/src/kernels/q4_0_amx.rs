//! Q4_0 tiles (and IQ4_NL rows tiled as Q4_0's) against many tokens on
//! AMX, the tile unit of Intel Xeons since Sapphire Rapids: a prefill's
//! expert products.
//!
//! One `tdpbssd` multiplies a 16 × 64-byte tile of signed bytes by another
//! into 16 × 16 exact 32-bit sums. Q4_0 scales every block of 32 values, so
//! a product here spans one block: A holds `T` tokens' 32 quants of block
//! `b` (one row per token), B the block's 16 weight rows as signed values
//! (8 rows of 64 bytes: 16 weight rows × 4 consecutive values each), and C
//! the `T × 16` exact integer sums `Σ (w − 8)·q`. A tile's layout
//! ([`super::q4_0_tiles`]) is already B's: its code group `j` holds bytes
//! `4j..4j + 4` of each of the 16 rows, whose low nibbles are the row's
//! values `4j..4j + 4` (B's row `j`) and whose high nibbles its values
//! `16 + 4j..` (B's row `4 + j`). So B is the group's nibbles looked up in a
//! 16-entry table (`vpshufb`: `n − 8` for Q4_0, the IQ4_NL values for
//! IQ4_NL), four loads and twelve vector operations per block for all the
//! tokens.
//!
//! The float epilogue is the other kernels' ([`super::q4_0::dot_q4_0_q8`]):
//! per token and block, the exact sum converted, times the product of the
//! row's and the token's scales, added by one fused multiply-add into the
//! accumulator of lane `b mod 4`; the four lanes added as `tree4` adds
//! them. Every result has the row kernel's bits; the tests compare them.
//!
//! The tile registers are configured at the start of each call and
//! released at its end: no AMX state outlives a call, so a thread that is
//! switched out or takes a signal between calls carries none.
//!
//! What it costs (the AMX Xeon VM, one core at about 3.7 GHz;
//! docs/benchmarks.md, "AMX for the prompt's expert products"): a
//! `tdpbssd` of 16 rows takes about 18 cycles with K = 32 (as with 64:
//! half the unit idles), a `tilestored` of the sums about 16, and the
//! tile unit's work and the vector epilogue do not overlap (15.7 ns a
//! block for the tile operations alone, 8.6 for the epilogue alone, 29.5
//! for both). A block then costs nearly the same for 4 tokens as for 16:
//! per block and token 1.9–2.0 ns at 16 tokens against the AVX-512
//! kernel's 2.7–2.9, 2.3 at 12, 2.9–3.2 at 8 (slower), so products of
//! fewer than [`AMX_MIN_TOKENS`](super::AMX_MIN_TOKENS) tokens stay
//! AVX-512.

use super::Q8Activation;

/// The most tokens one call takes: the rows of an A tile.
pub const TOKENS: usize = 16;

/// Whether this CPU and kernel run the AMX kernels: AMX-TILE and
/// AMX-INT8 (CPUID leaf 7), the AVX-512 the epilogue uses, and the
/// kernel's permission for this process to use tile data (Linux asks each
/// process to request it: `arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`). Probed once.
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(probe)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn probe() -> bool {
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    let (tile, int8) = (leaf7.edx >> 24 & 1 == 1, leaf7.edx >> 25 & 1 == 1);
    if !(tile && int8 && super::has_avx512_vnni()) {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and
    // touches no memory of ours; it fails (EINVAL) on kernels without AMX
    // support, which leaves AMX off.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn probe() -> bool {
    false
}

/// Up to [`TOKENS`] activations laid out for the A tiles, block by block:
/// block `b`'s A tile is the tokens' 32 quants of the block one after
/// another (`n × 32` contiguous bytes, 8 cache lines for 16 tokens where
/// rows `blocks × 32` bytes apart would touch 16), and the tokens' scales
/// of the block beside.
#[derive(Clone, Debug, Default)]
pub struct Tokens {
    n: usize,
    blocks: usize,
    /// `[block][token][32]`.
    quants: Vec<i8>,
    /// `[block][token]`.
    scales: Vec<f32>,
}

impl Tokens {
    /// `xs` (1 to [`TOKENS`] activations of at least `blocks` blocks)
    /// packed, reusing this one's memory.
    pub fn pack(&mut self, xs: &[&Q8Activation], blocks: usize) {
        assert!(
            (1..=TOKENS).contains(&xs.len()),
            "1 to {TOKENS} tokens a pass"
        );
        assert!(
            xs.iter()
                .all(|x| x.quants.len() >= blocks * 32 && x.scales.len() >= blocks),
            "activations of the rows' length"
        );
        let n = xs.len();
        self.n = n;
        self.blocks = blocks;
        self.quants.resize(blocks * n * 32, 0);
        for (b, tokens) in self.quants.chunks_exact_mut(n * 32).enumerate() {
            for (q, x) in tokens.chunks_exact_mut(32).zip(xs) {
                q.copy_from_slice(&x.quants[b * 32..(b + 1) * 32]);
            }
        }
        self.scales.resize(blocks * n, 0.0);
        for (b, scales) in self.scales.chunks_exact_mut(n).enumerate() {
            for (s, x) in scales.iter_mut().zip(xs) {
                *s = x.scales[b];
            }
        }
    }

    /// The tokens packed.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The blocks of each.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

/// One block of a tile as a B tile: `[8][64]` signed bytes, row `j` (`j <
/// 4`) the low nibbles of the block's code group `j`, row `4 + j` its high
/// nibbles, each as its value.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct BTile([i8; 512]);

/// A tile's blocks as B tiles, unpacked once for all the passes over the
/// tile; kept between calls so that its memory is reused.
#[derive(Clone, Default)]
pub struct Scratch {
    // Read by the x86 kernels only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    b: Vec<BTile>,
}

#[cfg(target_arch = "x86_64")]
pub mod x86 {
    //! # Safety
    //! Every kernel requires [`super::available`] (AMX-TILE, AMX-INT8,
    //! AVX-512 F/BW/VL, FMA and F16C, and the process's permission to use
    //! tile data), a tile of `blocks` blocks (`tile.len() ==
    //! tile_bytes(blocks)`), passes of tokens packed for `blocks` blocks
    //! and room for each token's 16 results.
    //!
    //! The tile registers are used only between this module's `ldtilecfg`
    //! and `tilerelease`, within one call: the compiler never allocates
    //! them (nothing else in the program uses AMX), so their contents
    //! survive from one `asm!` block to the next. A call configures them
    //! again only where a pass's token count differs from the pass
    //! before: an `ldtilecfg` costs about 180 cycles (docs/benchmarks.md),
    //! a pass of a 768-column tile about 3,000.

    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::{BTile, Scratch, TOKENS, Tokens};
    use crate::kernels::q4_0::LANES;
    use crate::kernels::q4_0_tiles::{TILE_ROWS, ask_l2, codes_at, scales_at, tile_bytes};

    /// Products in flight ahead of the epilogue that reads their sums
    /// back: 4 against 1 saved 3–7% (`cargo bench --bench kernels --
    /// --tile-tokens`, the AMX Xeon VM); 8 saved nothing more.
    const DEPTH: usize = 4;

    /// `ldtilecfg`'s 64-byte operand: palette 1; per tile register its
    /// bytes per row (16-bit, from byte 16) and rows (from byte 48).
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    impl TileConfig {
        /// C in tmm0..tmm3 (`t` rows of 16 sums), A in tmm4/tmm5 (`t`
        /// rows of a block's 32 quants), B in tmm6/tmm7 (8 rows of 64
        /// bytes): [`DEPTH`] products in flight.
        fn new(t: usize) -> TileConfig {
            let mut c = [0u8; 64];
            c[0] = 1;
            let t = t as u8;
            for (reg, rows, colsb) in [
                (0, t, 64u16),
                (1, t, 64),
                (2, t, 64),
                (3, t, 64),
                (4, t, 32),
                (5, t, 32),
                (6, 8, 64),
                (7, 8, 64),
            ] {
                c[16 + 2 * reg..18 + 2 * reg].copy_from_slice(&colsb.to_le_bytes());
                c[48 + reg] = rows;
            }
            TileConfig(c)
        }
    }

    /// 64-byte aligned sums: C tiles stored, `[slot][token][row]`.
    #[repr(C, align(64))]
    struct Sums([[[i32; TILE_ROWS]; TOKENS]; DEPTH]);

    /// Q4_0's codes as signed values, `n − 8`, in every 128-bit lane (the
    /// `vpshufb` table of B).
    #[inline(always)]
    fn q4_0_table() -> __m512i {
        table(std::array::from_fn(|i| i as i8 - 8))
    }

    /// IQ4_NL's 16 values, in every 128-bit lane.
    #[inline(always)]
    fn nl_table() -> __m512i {
        table(crate::quant::IQ4_NL_VALUES)
    }

    #[inline(always)]
    fn table(v: [i8; 16]) -> __m512i {
        let lane = u128::from_le_bytes(v.map(|x| x as u8));
        let (lo, hi) = (lane as u64 as i64, (lane >> 64) as u64 as i64);
        // SAFETY: register arithmetic (AVX-512 F, under the callers'
        // target features).
        unsafe { _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo) }
    }

    /// A Q4_0 tile (`NL`: IQ4_NL rows tiled as Q4_0's) against every
    /// pass of packed tokens, token after token into `out`: `out[t]` is
    /// exactly what `dot_q4_0_q8` (`dot_iq4_nl_q8`) gives each row for
    /// token `t`. `next`: bytes the caller reads next, asked of L2 (a
    /// hint).
    ///
    /// # Safety
    /// See the module docs.
    pub unsafe fn dot_tiles<const NL: bool>(
        tile: &[u8],
        blocks: usize,
        passes: &[Tokens],
        scratch: &mut Scratch,
        out: &mut [[f32; TILE_ROWS]],
        next: &[u8],
    ) {
        // SAFETY: forwarded contract.
        unsafe { run::<NL>(tile, blocks, passes, scratch, out, next) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn run<const NL: bool>(
        tile: &[u8],
        blocks: usize,
        passes: &[Tokens],
        scratch: &mut Scratch,
        out: &mut [[f32; TILE_ROWS]],
        next: &[u8],
    ) {
        assert_eq!(tile.len(), tile_bytes(blocks), "one whole tile");
        let total: usize = passes.iter().map(|p| p.n).sum();
        assert!(
            out.len() >= total
                && passes
                    .iter()
                    .all(|p| p.blocks == blocks && (1..=TOKENS).contains(&p.n)),
            "passes packed for the tile, an output for each token"
        );
        let table = if NL { nl_table() } else { q4_0_table() };
        // The tile registers' configuration: for passes of `rows` tokens.
        let mut rows = 0;
        let mut configure = |n: usize| {
            if n != rows {
                let cfg = TileConfig::new(n);
                // SAFETY: `ldtilecfg` reads the 64-byte aligned
                // configuration; AMX is present and permitted (caller).
                unsafe {
                    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly))
                };
                rows = n;
            }
        };
        // SAFETY: the caller's contract; every pass was checked above, and
        // `scratch` holds `blocks` B tiles where the passes read it; each
        // pass runs with the registers configured for its token count,
        // released before returning.
        unsafe {
            if let [p] = passes {
                // One pass: each block unpacked just ahead of its product,
                // into a few B tiles that stay in L1 (the whole tile's, 32
                // KiB at 2048 columns, pushed the tokens out: 2.55 against
                // 1.9 ns per block and token at 768 columns).
                configure(p.n);
                by_tokens::<true>(tile, blocks, table, &[], p, out, next);
            } else {
                scratch.b.resize(blocks, BTile([0; 512]));
                for (i, bt) in scratch.b.iter_mut().enumerate() {
                    ask_l2(next, i);
                    unpack(tile.as_ptr(), blocks, i, table, bt as *mut BTile);
                }
                let mut t0 = 0;
                for p in passes {
                    configure(p.n);
                    by_tokens::<false>(
                        tile,
                        blocks,
                        table,
                        &scratch.b,
                        p,
                        &mut out[t0..t0 + p.n],
                        &[],
                    );
                    t0 += p.n;
                }
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    }

    /// Block `b` of the tile at `base` (of `blocks` blocks) as its B tile
    /// into `out`, every byte written: the codes' nibbles looked up in
    /// `table`. (`out` may be uninitialised: it is only written.)
    ///
    /// # Safety
    /// `b < blocks` of a whole tile at `base`; `out` valid for writing one
    /// B tile; the caller's target features.
    #[inline(always)]
    unsafe fn unpack(base: *const u8, blocks: usize, b: usize, table: __m512i, out: *mut BTile) {
        // SAFETY: block `b`'s 256 bytes of codes lie in the tile
        // (`codes_at`, b < blocks: caller); a B tile holds 512 bytes,
        // 64-byte aligned (`out`: caller). The rest is register arithmetic.
        unsafe {
            let nibble = _mm512_set1_epi8(0x0f);
            let c = base.add(codes_at(blocks, b)) as *const __m512i;
            let o = out.cast::<__m512i>();
            for j in 0..4 {
                let w = _mm512_loadu_si512(c.add(j));
                let lo = _mm512_and_si512(w, nibble);
                let hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
                _mm512_store_si512(o.add(j), _mm512_shuffle_epi8(table, lo));
                _mm512_store_si512(o.add(4 + j), _mm512_shuffle_epi8(table, hi));
            }
        }
    }

    /// One pass, for its token count: a constant count keeps the tokens'
    /// accumulators in registers.
    ///
    /// # Safety
    /// As [`pass`].
    unsafe fn by_tokens<const INLINE: bool>(
        tile: &[u8],
        blocks: usize,
        table: __m512i,
        b: &[BTile],
        x: &Tokens,
        out: &mut [[f32; TILE_ROWS]],
        next: &[u8],
    ) {
        macro_rules! counts {
            ($($t:literal)*) => {
                match x.n {
                    // SAFETY: the caller's contract.
                    $($t => unsafe { pass::<$t, INLINE>(tile, blocks, table, b, x, out, next) },)*
                    _ => unreachable!("a pass holds 1 to 16 tokens"),
                }
            };
        }
        counts!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    }

    /// Block sums into a C tile and stored: `tileloadd` A (the tokens'
    /// quants of the block, a row per token) and B, `tdpbssd`, `tilestored`
    /// to `$out` (rows of 64 bytes).
    macro_rules! product {
        ($c:literal, $a:literal, $b:literal, $quants:expr, $stride:expr, $btile:expr, $out:expr) => {
            asm!(
                concat!("tileloadd ", $a, ", [{q} + {s}*1]"),
                concat!("tileloadd ", $b, ", [{w} + {ws}*1]"),
                concat!("tilezero ", $c),
                concat!("tdpbssd ", $c, ", ", $a, ", ", $b),
                concat!("tilestored [{o} + {ws}*1], ", $c),
                q = in(reg) $quants,
                s = in(reg) $stride,
                w = in(reg) $btile,
                ws = in(reg) 64usize,
                o = in(reg) $out,
                options(nostack),
            )
        };
    }

    /// B tiles unpacked ahead of their products in a one-pass call.
    const LEAD: usize = 4;
    /// The ring they go to: more than [`LEAD`], so that a slot is
    /// rewritten only after its product's load.
    const RING: usize = 8;

    /// The tile against one pass of `T` tokens: its blocks as B tiles
    /// from `b` (all of them), or (`INLINE`) unpacked with `table` into a
    /// ring [`LEAD`] blocks ahead of their products, asking L2 for `next`
    /// meanwhile. Blocks go lane by lane (`l, l + 4, …` for lane `l`, as
    /// `tiles_by_lane`), [`DEPTH`] products ahead of the epilogue, which
    /// does the row kernel's float operations in its order: the sum
    /// converted, times the product of the row's and the token's scales,
    /// one fused multiply-add into the lane; the lanes added as `tree4`.
    ///
    /// # Safety
    /// AMX present and permitted and this function's target features, the
    /// tile registers configured by `TileConfig::new(T)`; a whole tile of
    /// `blocks` blocks, `b.len() == blocks` unless `INLINE`, `x` packed
    /// for `blocks` blocks with `T` tokens, `out.len() >= T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes the sums, the scales and acc
    unsafe fn pass<const T: usize, const INLINE: bool>(
        tile: &[u8],
        blocks: usize,
        table: __m512i,
        b: &[BTile],
        x: &Tokens,
        out: &mut [[f32; TILE_ROWS]],
        next: &[u8],
    ) {
        debug_assert!(x.n == T && out.len() >= T && x.blocks == blocks);
        debug_assert!(INLINE || b.len() == blocks);
        let base = tile.as_ptr();
        // Neither the sums nor the ring is read before it is written (a
        // slot's sums by `tilestored`, a ring tile by `unpack`), so neither
        // is zeroed: 8 KiB of stores a pass, 1.1% of a 512-token prefill
        // (docs/benchmarks.md).
        let mut sums = std::mem::MaybeUninit::<Sums>::uninit();
        let sums = sums.as_mut_ptr().cast::<[[i32; TILE_ROWS]; TOKENS]>();
        let mut order = (0..LANES).flat_map(|l| (l..blocks).step_by(LANES));
        let mut ahead = order.clone();
        let mut ring = [const { std::mem::MaybeUninit::<BTile>::uninit() }; RING];
        let mut unpacked = 0usize;
        // The next block of `ahead` into the ring (INLINE).
        macro_rules! unpack_ahead {
            () => {
                if let Some(blk) = ahead.next() {
                    ask_l2(next, blk);
                    // (Used inside the unsafe block below: blk < blocks of
                    // the caller's whole tile.)
                    unpack(base, blocks, blk, table, ring[unpacked % RING].as_mut_ptr());
                    unpacked += 1;
                }
            };
        }
        // SAFETY: a tile load reads the `T × 32` quants at `blk × T × 32` (blk <
        // blocks) of the packed tokens (`blocks × T × 32` bytes) or the 512
        // bytes of B tile `blk` (a ring tile only after `unpack` wrote it:
        // LEAD tiles ahead, RING > LEAD); a tile store writes `T ≤ 16`
        // rows of 64 bytes into a slot of `sums` (16 rows), and the
        // epilogue reads that slot's first `T` rows only after the store;
        // the tile's scales are read within it (`scales_at`, blk <
        // blocks), the tokens' at `blk × T + t`; a lane's accumulators are
        // read only after they are written (lanes `0..=lane`, every one of
        // them visited in order) or zeroed. The rest is register
        // arithmetic under this function's target features, AMX being
        // present, permitted and configured for `T` tokens (caller).
        unsafe {
            if INLINE {
                for _ in 0..LEAD {
                    unpack_ahead!();
                }
            }
            let sc = x.scales.as_ptr();
            // Written as each lane's blocks end (not zeroed first: 4 KiB
            // of stores a pass at 16 tokens).
            let mut lanes = std::mem::MaybeUninit::<[[__m512; T]; LANES]>::uninit();
            let lanes = lanes.as_mut_ptr().cast::<[__m512; T]>();
            let mut acc = [_mm512_setzero_ps(); T];
            let mut lane = 0;
            // The block of each product in flight, by slot.
            let mut pending = [0usize; DEPTH];
            let (mut issued, mut done) = (0usize, 0usize);
            loop {
                while issued < done + DEPTH {
                    let Some(blk) = order.next() else { break };
                    let slot = issued % DEPTH;
                    pending[slot] = blk;
                    let q = x.quants.as_ptr().add(blk * T * 32);
                    let w = if INLINE {
                        unpack_ahead!();
                        ring[issued % RING].as_ptr().cast::<i8>()
                    } else {
                        b[blk].0.as_ptr()
                    };
                    let o = sums.add(slot).cast::<[i32; TILE_ROWS]>();
                    match slot {
                        0 => product!("tmm0", "tmm4", "tmm6", q, 32usize, w, o),
                        1 => product!("tmm1", "tmm5", "tmm7", q, 32usize, w, o),
                        2 => product!("tmm2", "tmm4", "tmm6", q, 32usize, w, o),
                        _ => product!("tmm3", "tmm5", "tmm7", q, 32usize, w, o),
                    }
                    issued += 1;
                }
                if done == issued {
                    break;
                }
                let slot = done % DEPTH;
                let blk = pending[slot];
                if blk % LANES != lane {
                    lanes.add(lane).write(acc);
                    acc = [_mm512_setzero_ps(); T];
                    lane = blk % LANES;
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(
                    base.add(scales_at(blocks, blk)) as *const __m256i
                ));
                let c = sums.add(slot).cast::<[i32; TILE_ROWS]>().cast_const();
                for t in 0..T {
                    let s = _mm512_cvtepi32_ps(_mm512_load_si512(c.add(t) as *const __m512i));
                    let d = _mm512_mul_ps(dw, _mm512_set1_ps(sc.add(blk * T + t).read()));
                    acc[t] = _mm512_fmadd_ps(d, s, acc[t]);
                }
                done += 1;
            }
            lanes.add(lane).write(acc);
            // Lanes without blocks (fewer than four blocks) add zeros.
            for l in lane + 1..LANES {
                lanes.add(l).write([_mm512_setzero_ps(); T]);
            }
            let lanes = &*lanes.cast::<[[__m512; T]; LANES]>();
            for (t, o) in out.iter_mut().enumerate().take(T) {
                let v = _mm512_add_ps(
                    _mm512_add_ps(lanes[0][t], lanes[2][t]),
                    _mm512_add_ps(lanes[1][t], lanes[3][t]),
                );
                _mm512_storeu_ps(o.as_mut_ptr(), v);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::kernels::q4_0::dot_q4_0_q8;
    use crate::kernels::q4_0_tiles::tests::{activations, matrix};
    use crate::kernels::q4_0_tiles::{TILE_ROWS, tile_in_place};
    use crate::kernels::q8act::tests::data;
    use crate::quant::{Q4_0_BLOCK_BYTES, QK};
    use rand::SeedableRng;

    #[test]
    fn packing_keeps_each_tokens_quants_and_scales() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(61);
        let xs: Vec<Q8Activation> = (0..5)
            .map(|_| Q8Activation::quantize(&data(&mut rng, 3 * QK, 1.0)))
            .collect();
        let refs: Vec<&Q8Activation> = xs.iter().collect();
        let mut p = Tokens::default();
        p.pack(&refs, 3);
        assert_eq!((p.len(), p.blocks()), (5, 3));
        for (t, x) in xs.iter().enumerate() {
            for b in 0..3 {
                let at = (b * 5 + t) * 32;
                assert_eq!(p.quants[at..at + 32], x.quants[b * 32..(b + 1) * 32]);
                assert_eq!(p.scales[b * 5 + t], x.scales[b]);
            }
        }
        // Repacking fewer tokens forgets the others.
        p.pack(&refs[..2], 2);
        assert_eq!((p.len(), p.quants.len(), p.scales.len()), (2, 128, 4));
    }

    /// On a CPU with AMX: each (row, token) has the row kernel's bits, for
    /// 1 to 16 tokens in one pass and up to 40 in passes of different
    /// sizes, on block counts around the 4 lanes, the products in flight
    /// and the model sizes, with zero, huge and infinite activation
    /// blocks; Q4_0 and the same bytes read as IQ4_NL; one scratch reused
    /// across tiles of every size.
    #[test]
    fn the_amx_kernels_equal_the_row_kernels_bit_for_bit() {
        if !available() {
            eprintln!(
                "SKIP amx: this CPU or kernel has no AMX-INT8 (probe: CPUID leaf 7, arch_prctl)"
            );
            return;
        }
        type Dots =
            unsafe fn(&[u8], usize, &[Tokens], &mut Scratch, &mut [[f32; TILE_ROWS]], &[u8]);
        type Row = fn(&[u8], &Q8Activation) -> f32;
        let levels: [(&str, Dots, Row); 2] = [
            ("q4_0", x86::dot_tiles::<false>, dot_q4_0_q8),
            (
                "iq4_nl",
                x86::dot_tiles::<true>,
                crate::kernels::legacy_q8::dot_iq4_nl_q8,
            ),
        ];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(62);
        let mut scratch = Scratch::default();
        const MOST: usize = 40;
        for blocks in [65, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 17, 24, 31, 64] {
            let w = matrix(&mut rng, TILE_ROWS, blocks);
            let mut t = w.clone();
            tile_in_place(&mut t, TILE_ROWS, blocks, &mut Vec::new());
            let xs = activations(&mut rng, MOST, blocks);
            let rb = blocks * Q4_0_BLOCK_BYTES;
            for (name, dots, row_dot) in levels {
                for n in (1..=TOKENS).chain([17, 23, 33, MOST]) {
                    let refs: Vec<&Q8Activation> = xs.iter().skip(MOST - n).collect();
                    let mut t0 = 0;
                    let passes: Vec<Tokens> = crate::kernels::passes_of(n, TOKENS)
                        .map(|size| {
                            let mut p = Tokens::default();
                            p.pack(&refs[t0..t0 + size], blocks);
                            t0 += size;
                            p
                        })
                        .collect();
                    let mut out = vec![[f32::NAN; TILE_ROWS]; n];
                    let next = [&[][..], &w[..]][n % 2];
                    // SAFETY: AMX available (checked above); a whole tile
                    // of `blocks` blocks, tokens packed for it, an output
                    // per token.
                    unsafe { dots(&t, blocks, &passes, &mut scratch, &mut out, next) };
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
}
