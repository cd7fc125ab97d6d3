//! glibc's malloc tuned for the compute pool: activations come from the
//! heap and go back to it, not from fresh mappings.
//!
//! A prompt's layer allocates its products' outputs and scratch (hundreds
//! of KiB to a few MiB each) on every thread and frees them a moment later.
//! glibc's defaults map the larger ones with `mmap` and unmap them on free,
//! and hand the arenas' free tops back to the kernel: every buffer then
//! page-faults its memory in again (zeroed) and every unmap interrupts
//! every other thread of the process to flush its TLB. On the 16-core
//! Xeon of an H100 host, 16 threads prefilled a 512-token prompt at
//! 168.9 / 177.0 tok/s with glibc's defaults and 305.1 / 301.1 with this
//! policy (decode 37.2–39.6 → 41.9–42.8 tok/s); 8 threads 205.9–214.4 →
//! 215.9–237.1; two threads on a 2-vCPU VM alike either way
//! (docs/benchmarks.md, "Prefill on 16 cores").
//!
//! So buffers up to [`MMAP_THRESHOLD`] come from the arenas, and an
//! arena keeps up to [`TRIM_THRESHOLD`] of free memory for the next layer.
//! What that retains is bounded by the activations' peak; the model's
//! weights and the expert cache are mapped on their own
//! (`colibri_model::tensor::AnonStorage`) and unaffected. glibc's own
//! `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` in the environment
//! win over this.

/// Allocations at least this large are mapped on their own (glibc's
/// largest dynamic threshold on 64-bit; fixed instead of grown).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 32 << 20;

/// Free memory at an arena's top beyond this goes back to the kernel.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: libc::c_int = 512 << 20;

/// Applies the policy; call before any thread starts.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set_by_user = ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
        if set_by_user {
            return;
        }
        for (param, value) in [
            (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        ] {
            // SAFETY: mallopt only sets an allocator parameter (it takes
            // glibc's own lock); no memory is touched.
            if unsafe { libc::mallopt(param, value) } != 1 {
                eprintln!("warning: mallopt({param}, {value}) failed; keeping glibc's default");
            }
        }
    }
}
