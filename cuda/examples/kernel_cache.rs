//! Compiles every kernel module into the kernel cache ahead of time, without
//! a GPU (NVRTC only): a GPU machine (or a container image) whose NVRTC is
//! the same release then loads the cubins instead of compiling them.
//!
//!     COLIBRI_NVRTC_DIR=... cargo run --release -p colibri-cuda --example kernel_cache [sm_XX ...]
//!
//! The cache is the one `colibri` uses (`$XDG_CACHE_HOME/colibri/cuda`,
//! else under `$HOME/.cache`); the default architecture is sm_90.

use colibri_cuda::KernelCache;
use colibri_cuda::kernels::{Arch, fill_cache};

fn main() -> colibri_cuda::Result<()> {
    let mut archs: Vec<Arch> = std::env::args()
        .skip(1)
        .filter_map(|a| a.strip_prefix("sm_").and_then(|n| n.parse::<u32>().ok()))
        .map(|n| Arch::new(n / 10, n % 10))
        .collect();
    if archs.is_empty() {
        archs.push(Arch::new(9, 0));
    }
    let cache = KernelCache::user_default();
    let dir = cache
        .dir()
        .map_or_else(|| "(disabled)".to_string(), |d| d.display().to_string());
    for arch in archs {
        let n = fill_cache(arch, &cache)?;
        println!("{arch}: {n} modules compiled into {dir}");
    }
    Ok(())
}
