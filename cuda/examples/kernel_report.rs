//! ptxas's resource report for every kernel (registers, shared memory,
//! stack, spills), without a GPU: what to read before timing anything.
//!
//!     COLIBRI_NVRTC_DIR=... cargo run -p colibri-cuda --example kernel_report [sm_XX] [DIR]
//!
//! With DIR, each module's cubin is written there too (for cuobjdump
//! --dump-sass).

use colibri_cuda::MODULES;
use colibri_cuda::kernels::{Arch, compile_module_with};

fn main() -> colibri_cuda::Result<()> {
    let arch = std::env::args()
        .nth(1)
        .and_then(|a| a.strip_prefix("sm_").and_then(|n| n.parse::<u32>().ok()))
        .map_or(Arch::new(9, 0), |n| Arch::new(n / 10, n % 10));
    for m in MODULES {
        let c = compile_module_with(m, arch, &["--ptxas-options=-v".to_string()])?;
        println!(
            "== {}.cu ({arch}): {} bytes of cubin",
            m.name,
            c.cubin.len()
        );
        if let Some(dir) = std::env::args().nth(2) {
            let path = std::path::Path::new(&dir).join(format!("{}-{arch}.cubin", m.name));
            if let Err(e) = std::fs::write(&path, &c.cubin) {
                eprintln!("{}: {e}", path.display());
            }
        }
        for line in c.log.lines().filter(|l| {
            l.contains("Used")
                || l.contains("Compiling")
                || l.contains("spill")
                || l.contains("stack")
        }) {
            println!("{}", line.trim());
        }
    }
    Ok(())
}
