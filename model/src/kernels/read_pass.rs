//! The memory read pass behind every roofline: how fast the cores can
//! pull bytes from RAM, the bound a decode that streams weights is held
//! to ([`super::read_bandwidth`], `bench-io --warm`).
//!
//! A bound must be the fastest way to read, not one way: a pass the
//! decode outruns understates the roofline and overstates every share of
//! it. Summing words as the baseline target compiles it (16-byte SSE2
//! loads, no software prefetch) read 22.9–23.3 GB/s with two threads on an
//! Intel Xeon VM (model 207, 2 vCPUs) where 64-byte loads read 33.0 and a
//! warm decode streamed 24.7: 1.08 "of the roofline"
//! (docs/benchmarks.md). So the pass takes the widest loads the CPU has
//! (AVX-512, else AVX2, chosen at run time) and asks L2 for the bytes
//! [`AHEAD`] on, as the decode's tile kernels do (32-byte loads alone read
//! 27.3 GB/s there, 32.4 with the requests).
//!
//! Every level returns the same value, the wrapping sum of the words, so a
//! test can hold them to the scalar fold.

/// How far ahead of its loads the pass asks L2 for the bytes (the tile
/// kernels' distance, [`super::q4_0_tiles::TilePrefetch`]'s default).
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 4096;

/// The wrapping sum of `words`, reading them as fast as this CPU can.
pub fn sum_words(words: &[u32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512 F was detected just above.
            return unsafe { x86::sum_avx512(words) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected just above.
            return unsafe { x86::sum_avx2(words) };
        }
    }
    // aarch64's baseline has NEON: the compiler vectorizes this fold with
    // 16-byte loads, which its cores stream at full rate.
    sum_scalar(words)
}

/// The reference: the words one at a time.
pub fn sum_scalar(words: &[u32]) -> u32 {
    words.iter().fold(0u32, |a, &w| a.wrapping_add(w))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{AHEAD, sum_scalar};
    use std::arch::x86_64::*;

    /// Asks L2 for the two lines of the 128 bytes [`AHEAD`] of `p`.
    #[inline(always)]
    fn ask(p: *const u32) {
        let at = p.cast::<i8>().wrapping_add(AHEAD);
        // SAFETY: a prefetch is a hint that never faults, whatever the
        // address; `wrapping_add` keeps the pointer arithmetic defined.
        unsafe {
            _mm_prefetch::<_MM_HINT_T1>(at);
            _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(64));
        }
    }

    /// # Safety
    /// The CPU has AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_avx512(words: &[u32]) -> u32 {
        let mut parts = words.chunks_exact(32);
        let (mut a, mut b) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        for c in parts.by_ref() {
            ask(c.as_ptr());
            // SAFETY: `c` holds 32 words, the two unaligned 64-byte loads'
            // bytes.
            unsafe {
                let p = c.as_ptr() as *const __m512i;
                a = _mm512_add_epi32(a, _mm512_loadu_si512(p));
                b = _mm512_add_epi32(b, _mm512_loadu_si512(p.add(1)));
            }
        }
        let lanes = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b)) as u32;
        lanes.wrapping_add(sum_scalar(parts.remainder()))
    }

    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum_avx2(words: &[u32]) -> u32 {
        let mut parts = words.chunks_exact(32);
        let mut acc = [_mm256_setzero_si256(); 4];
        for c in parts.by_ref() {
            ask(c.as_ptr());
            // SAFETY: `c` holds 32 words, the four unaligned 32-byte
            // loads' bytes.
            unsafe {
                let p = c.as_ptr() as *const __m256i;
                for (j, s) in acc.iter_mut().enumerate() {
                    *s = _mm256_add_epi32(*s, _mm256_loadu_si256(p.add(j)));
                }
            }
        }
        let v = _mm256_add_epi32(
            _mm256_add_epi32(acc[0], acc[1]),
            _mm256_add_epi32(acc[2], acc[3]),
        );
        let mut lanes = [0u32; 8];
        // SAFETY: `lanes` has the 32 bytes of one unaligned store.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, v) };
        sum_scalar(&lanes).wrapping_add(sum_scalar(parts.remainder()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every level the CPU has equals the scalar fold on random words of
    /// awkward lengths and offsets (not multiples of the 32 words a step
    /// reads), with sums that wrap.
    #[test]
    fn every_level_equals_the_scalar_sum() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(61);
        let words: Vec<u32> = (0..5000).map(|_| rng.random()).collect();
        for (start, len) in [
            (0, 0),
            (0, 1),
            (3, 31),
            (1, 32),
            (5, 33),
            (7, 1000),
            (0, 4999),
        ] {
            let w = &words[start..start + len];
            let want = sum_scalar(w);
            assert_eq!(sum_words(w), want, "{start}+{len}");
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx512f") {
                    // SAFETY: detected.
                    assert_eq!(unsafe { x86::sum_avx512(w) }, want, "avx512 {start}+{len}");
                }
                if is_x86_feature_detected!("avx2") {
                    // SAFETY: detected.
                    assert_eq!(unsafe { x86::sum_avx2(w) }, want, "avx2 {start}+{len}");
                }
            }
        }
        // The words wrap: a u64 sum of them differs.
        let wide: u64 = words.iter().map(|&w| w as u64).sum();
        assert_ne!(wide, sum_words(&words) as u64);
    }
}
