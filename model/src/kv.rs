//! The KV cache of one sequence: per layer, the keys and values of every
//! past position (grouped-query attention), or the compressed latent and the
//! shared rotary key (multi-head latent attention, ~1/50 of the size).

use crate::config::{AttentionSpec, ModelSpec};
use crate::error::{ModelError, Result};

#[derive(Clone, Debug)]
pub(crate) enum LayerCache {
    /// `k`, `v`: one run of rows per KV head, `[pos][head_dim]` each, so
    /// that the heads attending with one KV head read its keys and values
    /// as one stream (interleaved, a long context's decode step ran ~20%
    /// slower: docs/benchmarks.md).
    Gqa { k: Vec<KvRows>, v: Vec<KvRows> },
    /// `latent`: `[pos][kv_lora_rank]` (normed); `k_pe`: `[pos][rope_dim]` (rotated).
    Mla { latent: KvRows, k_pe: KvRows },
}

/// One stream of a KV cache (a KV head's keys, say): floats appended a
/// position at a time, in anonymous memory that grows in place or moves
/// by remapping its pages, never by copying them. In a `Vec`, every
/// layer's streams reached a power of two at the same step and were all
/// copied then: after a 2,048-token prompt, Qwen3-30B-A3B's first decode
/// step copied 384 MB (docs/benchmarks.md). Memory is taken from the
/// system as positions are written (at most [`KV_RESIDENT_AHEAD`] ahead)
/// and given back when the cache is dropped.
pub struct KvRows {
    map: Option<memmap2::MmapMut>,
    /// Floats written.
    len: usize,
    /// Bytes from the mapping's start made resident ahead of the writes
    /// ([`KV_RESIDENT_AHEAD`]).
    resident: usize,
}

/// The least a [`KvRows`] maps (and what its growth rounds to).
const KV_ROWS_MIN_BYTES: usize = 64 << 10;

/// How much of a stream's mapping is made resident at once, ahead of
/// its writes: one `MADV_POPULATE_WRITE` instead of a page fault every
/// 4 KiB (a decode step appends 512 bytes to each of Qwen3-30B-A3B's
/// 384 streams, so it faulted 48 pages a token, on the thread the
/// workers wait for). At most this much per stream is resident before
/// it is written: 6 MiB a sequence for that model. 64 KiB took the same
/// time out of a decode's serial work, for four times the memory
/// (docs/benchmarks.md).
const KV_RESIDENT_AHEAD: usize = 16 << 10;

impl KvRows {
    pub fn new() -> KvRows {
        KvRows {
            map: None,
            len: 0,
            resident: 0,
        }
    }

    /// Floats the mapping holds.
    pub fn capacity(&self) -> usize {
        self.map.as_ref().map_or(0, |m| m.len() / 4)
    }

    /// Appends `x`, growing the mapping (at least doubling it) when it is
    /// full.
    pub fn extend_from_slice(&mut self, x: &[f32]) -> Result<()> {
        let need = self.len + x.len();
        if need > self.capacity() {
            self.grow(need)?;
        }
        self.make_resident(need * 4);
        let len = self.len;
        if let Some(m) = &mut self.map {
            let all: &mut [f32] = bytemuck::cast_slice_mut(&mut m[..]);
            all[len..need].copy_from_slice(x);
        }
        self.len = need;
        Ok(())
    }

    /// Makes the mapping resident up to at least `end` bytes, in steps of
    /// [`KV_RESIDENT_AHEAD`]. A hint: where the kernel refuses (before
    /// Linux 5.14), the writes fault the pages in as before.
    fn make_resident(&mut self, end: usize) {
        if end <= self.resident {
            return;
        }
        let Some(m) = &self.map else { return };
        let to = end.next_multiple_of(KV_RESIDENT_AHEAD).min(m.len());
        let from = self.resident.min(to);
        #[cfg(target_os = "linux")]
        let _ = m.advise_range(memmap2::Advice::PopulateWrite, from, to - from);
        self.resident = to;
    }

    /// Forgets every float from `len` on (the memory stays mapped).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    fn grow(&mut self, floats: usize) -> Result<()> {
        let bytes = (floats * 4)
            .max(2 * self.capacity() * 4)
            .next_multiple_of(KV_ROWS_MIN_BYTES);
        let failed = |source| ModelError::KvMemory { bytes, source };
        match &mut self.map {
            None => {
                let m = memmap2::MmapOptions::new()
                    .len(bytes)
                    .map_anon()
                    .map_err(failed)?;
                self.map = Some(m);
            }
            #[cfg(target_os = "linux")]
            Some(m) => {
                // SAFETY: the mapping is anonymous, so there is no file
                // whose end the new length could run past: every byte of
                // it is memory the kernel gives (the old bytes where they
                // were, the rest zeroed). Nothing borrows the mapping
                // while it moves: `&mut self`.
                unsafe { m.remap(bytes, memmap2::RemapOptions::new().may_move(true)) }
                    .map_err(failed)?;
            }
            #[cfg(not(target_os = "linux"))]
            Some(m) => {
                let mut new = memmap2::MmapOptions::new()
                    .len(bytes)
                    .map_anon()
                    .map_err(failed)?;
                new[..m.len()].copy_from_slice(m);
                *m = new;
            }
        }
        Ok(())
    }
}

impl Default for KvRows {
    fn default() -> Self {
        KvRows::new()
    }
}

impl std::ops::Deref for KvRows {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.map {
            // A mapping is page-aligned and a whole number of pages long.
            Some(m) => &bytemuck::cast_slice(&m[..])[..self.len],
            None => &[],
        }
    }
}

impl Clone for KvRows {
    /// A copy of the floats written. Panics if the system gives no memory
    /// for it, as a `Vec`'s clone would.
    fn clone(&self) -> Self {
        let mut copy = KvRows::new();
        if let Err(e) = copy.extend_from_slice(self) {
            panic!("{e}");
        }
        copy
    }
}

impl std::fmt::Debug for KvRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRows")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .finish()
    }
}

/// Keys and values a compute tier other than the CPU keeps for a cache
/// (the GPU tier's, in device or mapped memory). It moves with the cache
/// and is dropped with it; a clone does not carry it, and a clone of such a
/// cache refuses to run (its positions are nowhere the clone can reach).
#[derive(Default)]
pub struct TierState(Option<Box<dyn std::any::Any + Send + Sync>>);

impl Clone for TierState {
    fn clone(&self) -> Self {
        TierState(None)
    }
}

impl std::fmt::Debug for TierState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "TierState(attached)"
        } else {
            "TierState(none)"
        })
    }
}

#[derive(Clone, Debug)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    len: usize,
    capacity: usize,
    /// Set once a tier other than the CPU has appended positions: from
    /// then on the positions live in `tier`, not in `layers`.
    external: bool,
    tier: TierState,
}

impl KvCache {
    /// An empty cache for `spec` holding at most `capacity` positions
    /// (memory grows with use, not with capacity).
    pub fn new(spec: &ModelSpec, capacity: usize) -> KvCache {
        let layers = (0..spec.num_layers())
            .map(|_| match spec.attention {
                AttentionSpec::Gqa { num_kv_heads, .. } => LayerCache::Gqa {
                    k: (0..num_kv_heads).map(|_| KvRows::new()).collect(),
                    v: (0..num_kv_heads).map(|_| KvRows::new()).collect(),
                },
                AttentionSpec::Mla { .. } => LayerCache::Mla {
                    latent: KvRows::new(),
                    k_pe: KvRows::new(),
                },
            })
            .collect();
        KvCache {
            layers,
            len: 0,
            capacity: capacity.min(spec.max_position_embeddings),
            external: false,
            tier: TierState::default(),
        }
    }

    /// Positions already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Checks that `more` positions fit.
    pub fn check_room(&self, more: usize) -> Result<()> {
        if self.len + more > self.capacity {
            return Err(ModelError::ContextExceeded {
                needed: self.len + more,
                context: self.capacity,
            });
        }
        Ok(())
    }

    /// Forgets every position from `len` on (to reuse a shared prefix).
    pub fn truncate(&mut self, len: usize, spec: &ModelSpec) {
        if len >= self.len {
            return;
        }
        let per_pos = |which: usize| -> usize {
            match &spec.attention {
                // Per KV head's vector.
                AttentionSpec::Gqa { head_dim, .. } => *head_dim,
                AttentionSpec::Mla {
                    kv_lora_rank,
                    qk_rope_head_dim,
                    ..
                } => {
                    if which == 0 {
                        *kv_lora_rank
                    } else {
                        *qk_rope_head_dim
                    }
                }
            }
        };
        for l in &mut self.layers {
            match l {
                LayerCache::Gqa { k, v } => {
                    for x in k.iter_mut().chain(v.iter_mut()) {
                        x.truncate(len * per_pos(0));
                    }
                }
                LayerCache::Mla { latent, k_pe } => {
                    latent.truncate(len * per_pos(0));
                    k_pe.truncate(len * per_pos(1));
                }
            }
        }
        self.len = len;
        if len == 0 && self.tier.0.is_none() {
            self.external = false;
        }
    }

    pub fn clear(&mut self, spec: &ModelSpec) {
        self.truncate(0, spec);
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// The state of the tier that keeps this cache's positions outside
    /// `layers` (the GPU tier's), if any.
    pub fn tier_state(&mut self) -> &mut Option<Box<dyn std::any::Any + Send + Sync>> {
        &mut self.tier.0
    }

    /// Whether another tier has appended positions to this cache.
    pub fn is_external(&self) -> bool {
        self.external
    }

    /// Records that another tier appended `n` positions (kept in its
    /// [`Self::tier_state`]); fails if they do not fit or if the CPU tier
    /// already holds positions here.
    pub fn append_external(&mut self, n: usize) -> Result<()> {
        self.check_room(n)?;
        if self.len > 0 && !self.external {
            return Err(ModelError::Invalid(
                "this KV cache's positions were computed by the CPU tier; another tier cannot                  extend it"
                    .into(),
            ));
        }
        self.external = true;
        self.len += n;
        Ok(())
    }

    /// Fails if this cache's positions live in another tier (the CPU tier
    /// cannot read them).
    pub fn check_host(&self) -> Result<()> {
        if self.external && self.len > 0 {
            return Err(ModelError::Invalid(format!(
                "this KV cache's {} positions live in the GPU tier (or were cloned from                  such a cache); the CPU tier cannot read them",
                self.len
            )));
        }
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Gqa { k, v } => k.iter().chain(v).map(|r| r.len()).sum::<usize>() * 4,
                LayerCache::Mla { latent, k_pe } => (latent.len() + k_pe.len()) * 4,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows appended across many growths (each at least doubling, the
    /// mapping moved or grown in place) read back as a `Vec` holds them;
    /// truncation forgets the tail and appending goes on from it; a clone
    /// holds the same floats in its own memory.
    #[test]
    fn rows_grow_without_losing_a_float() {
        let mut rows = KvRows::new();
        let mut want: Vec<f32> = Vec::new();
        assert!(rows.is_empty() && rows.capacity() == 0);
        let mut caps = Vec::new();
        for pos in 0..9000usize {
            let row: Vec<f32> = (0..24).map(|i| (pos * 24 + i) as f32 * 0.5 - 7.0).collect();
            rows.extend_from_slice(&row).unwrap();
            want.extend_from_slice(&row);
            if caps.last() != Some(&rows.capacity()) {
                caps.push(rows.capacity());
            }
        }
        assert_eq!(&rows[..], &want[..]);
        // 64 KiB, then doubling: 16384, 32768, … floats.
        assert_eq!(caps[0], KV_ROWS_MIN_BYTES / 4);
        assert!(caps.windows(2).all(|w| w[1] >= 2 * w[0]), "{caps:?}");
        assert!(caps.len() >= 4, "{caps:?}");

        rows.truncate(100 * 24);
        want.truncate(100 * 24);
        rows.extend_from_slice(&[1.5; 24]).unwrap();
        want.extend_from_slice(&[1.5; 24]);
        assert_eq!(&rows[..], &want[..]);
        rows.truncate(usize::MAX);
        assert_eq!(rows.len(), want.len());

        let copy = rows.clone();
        assert_eq!(&copy[..], &want[..]);
        assert_ne!(copy.as_ptr(), rows.as_ptr());
        rows.truncate(0);
        assert!(rows.is_empty());
        assert_eq!(copy.len(), want.len());
    }

    /// Which of the pages of `len` bytes at `p` (page-aligned) are
    /// resident.
    #[cfg(target_os = "linux")]
    fn resident_pages(p: *const u8, len: usize) -> Vec<bool> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let mut v = vec![0u8; len.div_ceil(page)];
        // SAFETY: `p` is the page-aligned start of a mapping at least
        // `len` bytes long, and `v` has a byte per page of it.
        let rc = unsafe { libc::mincore(p as *mut libc::c_void, len, v.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().map(|b| b & 1 == 1).collect()
    }

    /// Where the kernel carries out `MADV_POPULATE_WRITE` (Linux 5.14
    /// on), a stream's pages are resident ahead of its writes, through the
    /// next `KV_RESIDENT_AHEAD` boundary and no further, across growths;
    /// elsewhere (an older kernel refuses it; qemu's user mode, where the
    /// aarch64 tests run, accepts it and does nothing) the writes alone
    /// fault them in.
    #[cfg(target_os = "linux")]
    #[test]
    fn pages_ahead_of_the_writes_are_resident() {
        let probe = memmap2::MmapMut::map_anon(KV_RESIDENT_AHEAD).unwrap();
        let supported = probe
            .advise_range(memmap2::Advice::PopulateWrite, 0, KV_RESIDENT_AHEAD)
            .is_ok()
            && resident_pages(probe.as_ptr(), KV_RESIDENT_AHEAD)
                .iter()
                .all(|&r| r);
        let mut rows = KvRows::new();
        let row = [0.25f32; 128];
        for pos in 0..1500usize {
            rows.extend_from_slice(&row).unwrap();
            let written = (pos + 1) * 512;
            let mapped = rows.capacity() * 4;
            let ahead = written.next_multiple_of(KV_RESIDENT_AHEAD).min(mapped);
            let pages = resident_pages(rows.as_ptr().cast(), mapped);
            let page = mapped / pages.len();
            let count = pages.iter().filter(|&&r| r).count();
            if supported {
                assert_eq!(count, ahead / page, "position {pos}");
            } else {
                assert!(count >= written.div_ceil(page), "position {pos}");
            }
        }
        assert!(rows.iter().all(|&x| x == 0.25));
    }
}
