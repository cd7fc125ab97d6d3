//! The on-disk cache of compiled kernel modules.
//!
//! A cubin is stored under a name derived from a 64-bit FNV-1a hash of its
//! full key — cache format version, module name, target architecture, NVRTC
//! version, compiler options and the exact text of the module and of every
//! header it includes — and the file repeats the whole key in front of the
//! cubin. A hit requires the stored key to equal the wanted key byte for
//! byte, so a hash collision, a stale file or a damaged one is a miss (and is
//! overwritten), never a wrong kernel. Files are written to a temporary name
//! and renamed into place, so a crash leaves no half-written entry.
//!
//! Location: `$XDG_CACHE_HOME/colibri/cuda`, else `$HOME/.cache/colibri/cuda`.
//! Cache failures never stop the GPU tier: they are logged and the module is
//! compiled again.

use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"CLBCUBN1";

/// Where compiled modules are kept (or nowhere).
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: Option<PathBuf>,
}

impl KernelCache {
    /// The per-user cache directory (see the module docs); disabled when
    /// neither `XDG_CACHE_HOME` nor `HOME` is set.
    pub fn user_default() -> KernelCache {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME")
                    .filter(|v| !v.is_empty())
                    .map(|h| PathBuf::from(h).join(".cache"))
            });
        KernelCache {
            dir: base.map(|b| b.join("colibri").join("cuda")),
        }
    }

    /// A cache in `dir`.
    pub fn at(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache {
            dir: Some(dir.into()),
        }
    }

    /// No cache: every load compiles.
    pub fn disabled() -> KernelCache {
        KernelCache { dir: None }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    fn path(&self, module: &str, arch: &str, key: &[u8]) -> Option<PathBuf> {
        self.dir
            .as_ref()
            .map(|d| d.join(format!("{module}-{arch}-{:016x}.cubin", fnv1a64(key))))
    }

    /// The cached cubin for `key`, if a file with exactly this key exists.
    pub fn get(&self, module: &str, arch: &str, key: &[u8]) -> Option<Vec<u8>> {
        let path = self.path(module, arch, key)?;
        let bytes = std::fs::read(&path).ok()?;
        let cubin = parse_entry(&bytes, key);
        if cubin.is_none() {
            tracing::debug!(
                "kernel cache: {} does not match, recompiling",
                path.display()
            );
        }
        cubin.map(<[u8]>::to_vec)
    }

    /// Stores `cubin` under `key`. Errors are returned for the caller to log.
    pub fn put(&self, module: &str, arch: &str, key: &[u8], cubin: &[u8]) -> std::io::Result<()> {
        let Some(path) = self.path(module, arch, key) else {
            return Ok(());
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(format!(
            ".{}.{}.tmp",
            path.file_name().and_then(|n| n.to_str()).unwrap_or("entry"),
            std::process::id()
        ));
        let result = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(MAGIC)?;
            f.write_all(&(key.len() as u64).to_le_bytes())?;
            f.write_all(key)?;
            f.write_all(&(cubin.len() as u64).to_le_bytes())?;
            f.write_all(cubin)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

/// The cubin of a cache file if its stored key equals `key`.
fn parse_entry<'a>(bytes: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    let rest = bytes.strip_prefix(MAGIC.as_slice())?;
    let (klen, rest) = split_u64(rest)?;
    let klen = usize::try_from(klen).ok()?;
    if rest.len() < klen || &rest[..klen] != key {
        return None;
    }
    let (clen, cubin) = split_u64(&rest[klen..])?;
    if usize::try_from(clen).ok()? != cubin.len() || cubin.is_empty() {
        return None;
    }
    Some(cubin)
}

fn split_u64(b: &[u8]) -> Option<(u64, &[u8])> {
    let (head, rest) = b.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*head), rest))
}

/// FNV-1a, 64 bit: only names the file (the key itself is compared), so a
/// simple, stable hash is enough.
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Builds a cache key from length-prefixed parts, so no two different part
/// lists give the same bytes.
pub(crate) fn key_of(parts: &[&[u8]]) -> Vec<u8> {
    let mut key = b"colibri-cuda kernel cache v1\n".to_vec();
    for p in parts {
        key.extend_from_slice(&(p.len() as u64).to_le_bytes());
        key.extend_from_slice(p);
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_matches_published_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn round_trip_and_mismatches_are_misses() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::at(dir.path());
        let key = key_of(&[b"matvec", b"sm_90", b"source text"]);
        assert!(cache.get("matvec", "sm_90", &key).is_none());
        cache
            .put("matvec", "sm_90", &key, b"\x7fELF cubin")
            .unwrap();
        assert_eq!(
            cache.get("matvec", "sm_90", &key).unwrap(),
            b"\x7fELF cubin"
        );

        // Another key never reads this entry, even under the same file name.
        let other = key_of(&[b"matvec", b"sm_90", b"source text!"]);
        let path = cache.path("matvec", "sm_90", &key).unwrap();
        let other_path = cache.path("matvec", "sm_90", &other).unwrap();
        std::fs::copy(&path, &other_path).unwrap();
        assert!(cache.get("matvec", "sm_90", &other).is_none());

        // Truncated or damaged files are misses, and a put repairs them.
        let bytes = std::fs::read(&path).unwrap();
        for cut in [0, 5, 8, 20, bytes.len() - 1] {
            std::fs::write(&path, &bytes[..cut]).unwrap();
            assert!(cache.get("matvec", "sm_90", &key).is_none(), "cut at {cut}");
        }
        let mut flipped = bytes.clone();
        flipped[20] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        assert!(cache.get("matvec", "sm_90", &key).is_none());
        cache
            .put("matvec", "sm_90", &key, b"\x7fELF cubin")
            .unwrap();
        assert!(cache.get("matvec", "sm_90", &key).is_some());
        // No temporary files are left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    }

    #[test]
    fn key_parts_are_delimited() {
        assert_ne!(key_of(&[b"ab", b"c"]), key_of(&[b"a", b"bc"]));
    }

    #[test]
    fn disabled_cache_stores_nothing() {
        let c = KernelCache::disabled();
        c.put("m", "sm_80", b"k", b"x").unwrap();
        assert!(c.get("m", "sm_80", b"k").is_none());
    }
}
