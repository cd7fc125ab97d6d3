//! CI's check that every kernel compiles, with no error and no warning, for
//! every architecture colibri supports (DESIGN.md principle 4). Needs only
//! NVRTC, no GPU: `tools/fetch_nvrtc.sh DIR` fetches it from PyPI and
//! `COLIBRI_NVRTC_DIR=DIR/lib` points at it. Without NVRTC this test fails
//! and says how to get it; it never skips.

use colibri_cuda::{CI_ARCHS, MODULES, compile_all, nvrtc};

fn nvrtc_or_fail() -> &'static nvrtc::Nvrtc {
    match nvrtc::load() {
        Ok(n) => n,
        Err(e) => panic!(
            "{e}\n\nThis test compiles every CUDA kernel and needs NVRTC (no GPU). Fetch it with\n    \
             tools/fetch_nvrtc.sh target/nvrtc\nand run with\n    \
             COLIBRI_NVRTC_DIR=$PWD/target/nvrtc/lib cargo test -p colibri-cuda --test compile"
        ),
    }
}

#[test]
fn every_kernel_compiles_without_warnings_for_every_arch() {
    let nv = nvrtc_or_fail();
    eprintln!("NVRTC {}.{} from {}", nv.version.0, nv.version.1, nv.origin);
    let mut failures = Vec::new();
    for arch in CI_ARCHS {
        let modules = match compile_all(arch) {
            Ok(m) => m,
            Err(e) => {
                failures.push(format!("{arch}: {e}"));
                continue;
            }
        };
        assert_eq!(modules.len(), MODULES.len());
        for (m, src) in modules.iter().zip(MODULES) {
            if !m.log.is_empty() {
                failures.push(format!("{}.cu for {arch} warned:\n{}", m.name, m.log));
            }
            // A cubin is an ELF file whose string table names every kernel:
            // the list KernelSet loads by name must match the sources.
            assert!(
                m.cubin.starts_with(b"\x7fELF"),
                "{}.cu for {arch}: not a cubin",
                m.name
            );
            for k in src.kernels {
                let needle = format!(".text.{k}\0");
                assert!(
                    m.cubin
                        .windows(needle.len())
                        .any(|w| w == needle.as_bytes()),
                    "{}.cu for {arch}: kernel {k} missing from the cubin",
                    m.name
                );
            }
            eprintln!("{:>12}.cu {arch}: {} bytes", m.name, m.cubin.len());
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn nvrtc_supports_every_ci_arch() {
    let nv = nvrtc_or_fail();
    for arch in CI_ARCHS {
        assert!(
            nv.archs.contains(&arch.number()),
            "NVRTC {:?} lacks {arch}: {:?}",
            nv.version,
            nv.archs
        );
    }
}
