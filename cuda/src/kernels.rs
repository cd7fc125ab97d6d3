//! The kernel sources, how they are compiled, and [`KernelSet`]: the loaded
//! modules of one device with their functions.
//!
//! Each `kernels/*.cu` file is one NVRTC program and one module; the shared
//! header `common.cuh` is handed to NVRTC in memory. Modules are compiled to
//! machine code (cubin) for the device's exact architecture, never to PTX:
//! a cubin from a newer NVRTC still loads on an older 13.x driver, PTX would
//! not. Compiled modules are cached on disk ([`crate::cache`]).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use crate::cache::{KernelCache, key_of};
use crate::device::CudaDevice;
use crate::error::{CudaError, DriverResultExt, Result};
use crate::nvrtc;

/// A compute capability, e.g. 9.0 for Hopper.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
}

impl Arch {
    pub const fn new(major: u32, minor: u32) -> Arch {
        Arch { major, minor }
    }

    /// The number NVRTC uses (`90` for 9.0).
    pub fn number(self) -> u32 {
        self.major * 10 + self.minor
    }

    /// The real architecture name, `sm_90`.
    pub fn sm(self) -> String {
        format!("sm_{}", self.number())
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.sm())
    }
}

/// The architectures CI compiles every kernel for: Ampere (A100, RTX 30),
/// Ada (RTX 40, L4/L40) and Hopper (H100/H200).
pub const CI_ARCHS: [Arch; 4] = [
    Arch::new(8, 0),
    Arch::new(8, 6),
    Arch::new(8, 9),
    Arch::new(9, 0),
];

/// One `.cu` file and the kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct ModuleSource {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

/// Headers the modules include, as (include name, text).
pub const HEADERS: &[(&str, &str)] = &[("common.cuh", include_str!("../kernels/common.cuh"))];

/// Every module colibri uses.
pub const MODULES: &[ModuleSource] = &[
    ModuleSource {
        name: "matvec",
        source: include_str!("../kernels/matvec.cu"),
        kernels: &[
            "matvec_f32_t1",
            "matvec_f32_t2",
            "matvec_f32_t4",
            "matvec_f32_t8",
            "matvec_f16_t1",
            "matvec_f16_t2",
            "matvec_f16_t4",
            "matvec_f16_t8",
            "matvec_bf16_t1",
            "matvec_bf16_t2",
            "matvec_bf16_t4",
            "matvec_bf16_t8",
            "matvec_f8e4m3_t1",
            "matvec_f8e4m3_t2",
            "matvec_f8e4m3_t4",
            "matvec_f8e4m3_t8",
            "matvec_q8_0_t1",
            "matvec_q8_0_t2",
            "matvec_q8_0_t4",
            "matvec_q8_0_t8",
            "matvec_q4_0_t1",
            "matvec_q4_0_t2",
            "matvec_q4_0_t4",
            "matvec_q4_0_t8",
            "matvec_f16_stream_t1",
            "matvec_bf16_stream_t1",
            "matvec_f32_table_t1",
            "matvec_f32_table_t2",
            "matvec_f32_table_t4",
            "matvec_f32_table_t8",
            "matvec_f16_table_t1",
            "matvec_f16_table_t2",
            "matvec_f16_table_t4",
            "matvec_f16_table_t8",
            "matvec_bf16_table_t1",
            "matvec_bf16_table_t2",
            "matvec_bf16_table_t4",
            "matvec_bf16_table_t8",
            "matvec_f8e4m3_table_t1",
            "matvec_f8e4m3_table_t2",
            "matvec_f8e4m3_table_t4",
            "matvec_f8e4m3_table_t8",
            "matvec_q8_0_table_t1",
            "matvec_q8_0_table_t2",
            "matvec_q8_0_table_t4",
            "matvec_q8_0_table_t8",
            "matvec_q4_0_table_t1",
            "matvec_q4_0_table_t2",
            "matvec_q4_0_table_t4",
            "matvec_q4_0_table_t8",
            "matvec_f32_seg_t1",
            "matvec_f16_seg_t1",
            "matvec_bf16_seg_t1",
            "matvec_f8e4m3_seg_t1",
            "matvec_q8_0_seg_t1",
            "matvec_q4_0_seg_t1",
            "matvec_f32_table_glu_t1",
            "matvec_f32_table_glu_t2",
            "matvec_f16_table_glu_t1",
            "matvec_f16_table_glu_t2",
            "matvec_bf16_table_glu_t1",
            "matvec_bf16_table_glu_t2",
            "matvec_f8e4m3_table_glu_t1",
            "matvec_f8e4m3_table_glu_t2",
            "matvec_q8_0_table_glu_t1",
            "matvec_q8_0_table_glu_t2",
            "matvec_q4_0_table_glu_t1",
            "matvec_q4_0_table_glu_t2",
            "matvec_q4_0q8_t1",
            "matvec_q4_0q8_t2",
            "matvec_q4_0q8_t4",
            "matvec_q4_0q8_t8",
            "matvec_q4_0q8_seg_t1",
            "matvec_q4_0q8_table_t1",
            "matvec_q4_0q8_table_t2",
            "matvec_q4_0q8_table_t4",
            "matvec_q4_0q8_table_t8",
            "matvec_q4_0q8_table_glu_t1",
            "matvec_q4_0q8_table_glu_t2",
            "matvec_q8_0q8_t1",
            "matvec_q8_0q8_t2",
            "matvec_q8_0q8_t4",
            "matvec_q8_0q8_t8",
            "matvec_q8_0q8_seg_t1",
            "matvec_q8_0q8_table_t1",
            "matvec_q8_0q8_table_t2",
            "matvec_q8_0q8_table_t4",
            "matvec_q8_0q8_table_t8",
            "matvec_q8_0q8_table_glu_t1",
            "matvec_q8_0q8_table_glu_t2",
            "matvec_q6_k_t1",
            "matvec_q6_k_t2",
            "matvec_q6_k_t4",
            "matvec_q6_k_t8",
            "matvec_q6_k_seg_t1",
            "matvec_q6_k_table_t1",
            "matvec_q6_k_table_t2",
            "matvec_q6_k_table_t4",
            "matvec_q6_k_table_t8",
            "matvec_q6_k_table_glu_t1",
            "matvec_q6_k_table_glu_t2",
            "matvec_q6_kq8_t1",
            "matvec_q6_kq8_t2",
            "matvec_q6_kq8_t4",
            "matvec_q6_kq8_t8",
            "matvec_q6_kq8_seg_t1",
            "matvec_q6_kq8_table_t1",
            "matvec_q6_kq8_table_t2",
            "matvec_q6_kq8_table_t4",
            "matvec_q6_kq8_table_t8",
            "matvec_q6_kq8_table_glu_t1",
            "matvec_q6_kq8_table_glu_t2",
            "matvec_q4_k_t1",
            "matvec_q4_k_t2",
            "matvec_q4_k_t4",
            "matvec_q4_k_t8",
            "matvec_q4_k_seg_t1",
            "matvec_q4_k_table_t1",
            "matvec_q4_k_table_t2",
            "matvec_q4_k_table_t4",
            "matvec_q4_k_table_t8",
            "matvec_q4_k_table_glu_t1",
            "matvec_q4_k_table_glu_t2",
            "matvec_q4_kq8_t1",
            "matvec_q4_kq8_t2",
            "matvec_q4_kq8_t4",
            "matvec_q4_kq8_t8",
            "matvec_q4_kq8_seg_t1",
            "matvec_q4_kq8_table_t1",
            "matvec_q4_kq8_table_t2",
            "matvec_q4_kq8_table_t4",
            "matvec_q4_kq8_table_t8",
            "matvec_q4_kq8_table_glu_t1",
            "matvec_q4_kq8_table_glu_t2",
            "matvec_q5_k_t1",
            "matvec_q5_k_t2",
            "matvec_q5_k_t4",
            "matvec_q5_k_t8",
            "matvec_q5_k_seg_t1",
            "matvec_q5_k_table_t1",
            "matvec_q5_k_table_t2",
            "matvec_q5_k_table_t4",
            "matvec_q5_k_table_t8",
            "matvec_q5_k_table_glu_t1",
            "matvec_q5_k_table_glu_t2",
            "matvec_q5_kq8_t1",
            "matvec_q5_kq8_t2",
            "matvec_q5_kq8_t4",
            "matvec_q5_kq8_t8",
            "matvec_q5_kq8_seg_t1",
            "matvec_q5_kq8_table_t1",
            "matvec_q5_kq8_table_t2",
            "matvec_q5_kq8_table_t4",
            "matvec_q5_kq8_table_t8",
            "matvec_q5_kq8_table_glu_t1",
            "matvec_q5_kq8_table_glu_t2",
            "matvec_q4_1_t1",
            "matvec_q4_1_t2",
            "matvec_q4_1_t4",
            "matvec_q4_1_t8",
            "matvec_q4_1_seg_t1",
            "matvec_q4_1_table_t1",
            "matvec_q4_1_table_t2",
            "matvec_q4_1_table_t4",
            "matvec_q4_1_table_t8",
            "matvec_q4_1_table_glu_t1",
            "matvec_q4_1_table_glu_t2",
            "matvec_q5_0_t1",
            "matvec_q5_0_t2",
            "matvec_q5_0_t4",
            "matvec_q5_0_t8",
            "matvec_q5_0_seg_t1",
            "matvec_q5_0_table_t1",
            "matvec_q5_0_table_t2",
            "matvec_q5_0_table_t4",
            "matvec_q5_0_table_t8",
            "matvec_q5_0_table_glu_t1",
            "matvec_q5_0_table_glu_t2",
            "matvec_q5_1_t1",
            "matvec_q5_1_t2",
            "matvec_q5_1_t4",
            "matvec_q5_1_t8",
            "matvec_q5_1_seg_t1",
            "matvec_q5_1_table_t1",
            "matvec_q5_1_table_t2",
            "matvec_q5_1_table_t4",
            "matvec_q5_1_table_t8",
            "matvec_q5_1_table_glu_t1",
            "matvec_q5_1_table_glu_t2",
            "matvec_q2_k_t1",
            "matvec_q2_k_t2",
            "matvec_q2_k_t4",
            "matvec_q2_k_t8",
            "matvec_q2_k_seg_t1",
            "matvec_q2_k_table_t1",
            "matvec_q2_k_table_t2",
            "matvec_q2_k_table_t4",
            "matvec_q2_k_table_t8",
            "matvec_q2_k_table_glu_t1",
            "matvec_q2_k_table_glu_t2",
            "matvec_q3_k_t1",
            "matvec_q3_k_t2",
            "matvec_q3_k_t4",
            "matvec_q3_k_t8",
            "matvec_q3_k_seg_t1",
            "matvec_q3_k_table_t1",
            "matvec_q3_k_table_t2",
            "matvec_q3_k_table_t4",
            "matvec_q3_k_table_t8",
            "matvec_q3_k_table_glu_t1",
            "matvec_q3_k_table_glu_t2",
            "matvec_iq4_nl_t1",
            "matvec_iq4_nl_t2",
            "matvec_iq4_nl_t4",
            "matvec_iq4_nl_t8",
            "matvec_iq4_nl_seg_t1",
            "matvec_iq4_nl_table_t1",
            "matvec_iq4_nl_table_t2",
            "matvec_iq4_nl_table_t4",
            "matvec_iq4_nl_table_t8",
            "matvec_iq4_nl_table_glu_t1",
            "matvec_iq4_nl_table_glu_t2",
            "matvec_iq4_xs_t1",
            "matvec_iq4_xs_t2",
            "matvec_iq4_xs_t4",
            "matvec_iq4_xs_t8",
            "matvec_iq4_xs_seg_t1",
            "matvec_iq4_xs_table_t1",
            "matvec_iq4_xs_table_t2",
            "matvec_iq4_xs_table_t4",
            "matvec_iq4_xs_table_t8",
            "matvec_iq4_xs_table_glu_t1",
            "matvec_iq4_xs_table_glu_t2",
            "matvec_q4_1q8_t1",
            "matvec_q4_1q8_t2",
            "matvec_q4_1q8_t4",
            "matvec_q4_1q8_t8",
            "matvec_q4_1q8_seg_t1",
            "matvec_q4_1q8_table_t1",
            "matvec_q4_1q8_table_t2",
            "matvec_q4_1q8_table_t4",
            "matvec_q4_1q8_table_t8",
            "matvec_q4_1q8_table_glu_t1",
            "matvec_q4_1q8_table_glu_t2",
            "matvec_q5_0q8_t1",
            "matvec_q5_0q8_t2",
            "matvec_q5_0q8_t4",
            "matvec_q5_0q8_t8",
            "matvec_q5_0q8_seg_t1",
            "matvec_q5_0q8_table_t1",
            "matvec_q5_0q8_table_t2",
            "matvec_q5_0q8_table_t4",
            "matvec_q5_0q8_table_t8",
            "matvec_q5_0q8_table_glu_t1",
            "matvec_q5_0q8_table_glu_t2",
            "matvec_q5_1q8_t1",
            "matvec_q5_1q8_t2",
            "matvec_q5_1q8_t4",
            "matvec_q5_1q8_t8",
            "matvec_q5_1q8_seg_t1",
            "matvec_q5_1q8_table_t1",
            "matvec_q5_1q8_table_t2",
            "matvec_q5_1q8_table_t4",
            "matvec_q5_1q8_table_t8",
            "matvec_q5_1q8_table_glu_t1",
            "matvec_q5_1q8_table_glu_t2",
            "matvec_q2_kq8_t1",
            "matvec_q2_kq8_t2",
            "matvec_q2_kq8_t4",
            "matvec_q2_kq8_t8",
            "matvec_q2_kq8_seg_t1",
            "matvec_q2_kq8_table_t1",
            "matvec_q2_kq8_table_t2",
            "matvec_q2_kq8_table_t4",
            "matvec_q2_kq8_table_t8",
            "matvec_q2_kq8_table_glu_t1",
            "matvec_q2_kq8_table_glu_t2",
            "matvec_q3_kq8_t1",
            "matvec_q3_kq8_t2",
            "matvec_q3_kq8_t4",
            "matvec_q3_kq8_t8",
            "matvec_q3_kq8_seg_t1",
            "matvec_q3_kq8_table_t1",
            "matvec_q3_kq8_table_t2",
            "matvec_q3_kq8_table_t4",
            "matvec_q3_kq8_table_t8",
            "matvec_q3_kq8_table_glu_t1",
            "matvec_q3_kq8_table_glu_t2",
            "matvec_iq4_nlq8_t1",
            "matvec_iq4_nlq8_t2",
            "matvec_iq4_nlq8_t4",
            "matvec_iq4_nlq8_t8",
            "matvec_iq4_nlq8_seg_t1",
            "matvec_iq4_nlq8_table_t1",
            "matvec_iq4_nlq8_table_t2",
            "matvec_iq4_nlq8_table_t4",
            "matvec_iq4_nlq8_table_t8",
            "matvec_iq4_nlq8_table_glu_t1",
            "matvec_iq4_nlq8_table_glu_t2",
            "matvec_iq4_xsq8_t1",
            "matvec_iq4_xsq8_t2",
            "matvec_iq4_xsq8_t4",
            "matvec_iq4_xsq8_t8",
            "matvec_iq4_xsq8_seg_t1",
            "matvec_iq4_xsq8_table_t1",
            "matvec_iq4_xsq8_table_t2",
            "matvec_iq4_xsq8_table_t4",
            "matvec_iq4_xsq8_table_t8",
            "matvec_iq4_xsq8_table_glu_t1",
            "matvec_iq4_xsq8_table_glu_t2",
        ],
    },
    ModuleSource {
        name: "elementwise",
        source: include_str!("../kernels/elementwise.cu"),
        kernels: &[
            "rms_norm",
            "add_rms_norm",
            "gqa_prep",
            "rope",
            "swiglu",
            "moe_combine",
        ],
    },
    ModuleSource {
        name: "attention",
        source: include_str!("../kernels/attention.cu"),
        kernels: &["attention", "attention_split", "mla_absorb"],
    },
    ModuleSource {
        name: "rows",
        source: include_str!("../kernels/rows.cu"),
        kernels: &[
            "add_inplace",
            "add_bias",
            "clamp_inplace",
            "gather_rows",
            "copy_2d",
        ],
    },
    ModuleSource {
        name: "router",
        source: include_str!("../kernels/router.cu"),
        kernels: &["router_softmax_topk", "router_sigmoid_grouped_topk"],
    },
    ModuleSource {
        name: "moe",
        source: include_str!("../kernels/moe.cu"),
        kernels: &["moe_route_plan", "kv_append"],
    },
];

/// NVRTC options for `arch`. No fast-math: the kernels rely on IEEE
/// division, square root and explicit rounding. ptxas is asked to warn on
/// register spills and local memory, so such a regression fails CI's
/// no-warning check like any other warning.
pub fn nvrtc_options(arch: Arch) -> Vec<String> {
    vec![
        format!("--gpu-architecture={}", arch.sm()),
        "--std=c++17".into(),
        "--fmad=true".into(),
        "--ptxas-options=--warn-on-spills".into(),
        "--ptxas-options=--warn-on-local-memory-usage".into(),
    ]
}

/// The options `m` compiles with: [`nvrtc_options`], and the defines the
/// environment sets for comparing variants, each only where the module's
/// own text names the macro (elsewhere it changes no bit of the cubin, and
/// the module keeps its cache entry):
///
/// * `COLIBRI_PDL_RELEASE=MASK`: which light kernels let their successor
///   be scheduled before their own wait (`PDL_RELEASE_FIRST` in
///   kernels/common.cuh; the two norms by default). The bits are the
///   same either way.
fn module_options(m: &ModuleSource, arch: Arch) -> Vec<String> {
    let mut options = nvrtc_options(arch);
    if m.source.contains("PDL_REL_")
        && let Some(mask) = std::env::var("COLIBRI_PDL_RELEASE")
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
    {
        options.push(format!("-DPDL_RELEASE_FIRST={mask}u"));
    }
    options
}

/// A module compiled for one architecture.
#[derive(Clone, Debug)]
pub struct CompiledModule {
    pub name: &'static str,
    pub arch: Arch,
    pub cubin: Vec<u8>,
    /// NVRTC's log; empty unless it warned.
    pub log: String,
}

/// Compiles one module for `arch` (no cache).
pub fn compile_module(m: &ModuleSource, arch: Arch) -> Result<CompiledModule> {
    compile_module_with(m, arch, &[])
}

/// Like [`compile_module`] with extra NVRTC options (e.g.
/// `--ptxas-options=-v` for the resource report of examples/kernel_report).
pub fn compile_module_with(
    m: &ModuleSource,
    arch: Arch,
    extra: &[String],
) -> Result<CompiledModule> {
    let mut options = module_options(m, arch);
    options.extend_from_slice(extra);
    let out = nvrtc::compile(m.name, &arch.sm(), m.source, HEADERS, &options)?;
    Ok(CompiledModule {
        name: m.name,
        arch,
        cubin: out.cubin,
        log: out.log,
    })
}

/// Compiles every module for `arch` (no cache): what CI runs for each of
/// [`CI_ARCHS`], and what [`KernelSet::load`] does on a cache miss.
pub fn compile_all(arch: Arch) -> Result<Vec<CompiledModule>> {
    MODULES.iter().map(|m| compile_module(m, arch)).collect()
}

/// The cache key of a module: everything that determines its cubin.
fn cache_key(m: &ModuleSource, arch: Arch, nvrtc: &nvrtc::Nvrtc) -> Vec<u8> {
    let version = format!("nvrtc {}.{}", nvrtc.version.0, nvrtc.version.1);
    let options = module_options(m, arch).join("\n");
    let sm = arch.sm();
    let mut parts: Vec<&[u8]> = vec![
        m.name.as_bytes(),
        sm.as_bytes(),
        version.as_bytes(),
        options.as_bytes(),
        m.source.as_bytes(),
    ];
    for (name, text) in HEADERS {
        parts.push(name.as_bytes());
        parts.push(text.as_bytes());
    }
    key_of(&parts)
}

/// The compiled cubin of `m` for `arch`, from `cache` or freshly compiled.
fn cubin_for(m: &ModuleSource, arch: Arch, cache: &KernelCache) -> Result<Vec<u8>> {
    let nv = nvrtc::load()?;
    let sm = arch.sm();
    let key = cache_key(m, arch, nv);
    if let Some(cubin) = cache.get(m.name, &sm, &key) {
        return Ok(cubin);
    }
    let compiled = compile_module(m, arch)?;
    if !compiled.log.is_empty() {
        tracing::warn!("NVRTC warnings for {}.cu ({sm}):\n{}", m.name, compiled.log);
    }
    if let Err(e) = cache.put(m.name, &sm, &key, &compiled.cubin) {
        tracing::warn!(
            "kernel cache {}: cannot store {}: {e}",
            cache
                .dir()
                .map(|d| d.display().to_string())
                .unwrap_or_default(),
            m.name
        );
    }
    Ok(compiled.cubin)
}

/// Compiles every module for `arch` into `cache` where it is not there
/// yet (no GPU needed: NVRTC only), so that a GPU machine with the same
/// NVRTC release starts without compiling. Returns how many modules were
/// compiled.
pub fn fill_cache(arch: Arch, cache: &KernelCache) -> Result<usize> {
    let nv = nvrtc::load()?;
    let sm = arch.sm();
    let mut compiled = 0;
    for m in MODULES {
        let key = cache_key(m, arch, nv);
        if cache.get(m.name, &sm, &key).is_none() {
            cubin_for(m, arch, cache)?;
            compiled += 1;
        }
    }
    Ok(compiled)
}

/// Every kernel, loaded into one device's context.
pub struct KernelSet {
    // Modules stay loaded as long as a function of theirs exists (cudarc's
    // CudaFunction holds its module); kept here too for clarity.
    _modules: Vec<Arc<CudaModule>>,
    functions: HashMap<&'static str, CudaFunction>,
    /// Launch with programmatic stream serialization (sm_90 and later,
    /// unless `COLIBRI_PDL=0`): see `pdl_entry()` in kernels/common.cuh.
    pub(crate) pdl: bool,
    /// Tall one-token f16/bf16 products take the persistent stream kernel
    /// (unless `COLIBRI_MV_STREAM=0`, for comparing the two; the bits are
    /// the same): see `matvec_stream_body` in kernels/matvec.cu.
    pub(crate) stream: bool,
    /// One-token GLU table launches ask L2 for the down projections ahead
    /// (unless `COLIBRI_DOWN_AHEAD=0`, for comparing; the same bits): see
    /// `l2_ahead_share` in kernels/matvec.cu.
    pub(crate) down_ahead: bool,
    /// Whether a one-token attention quantizes its output once for the
    /// output projection (unless `COLIBRI_Q8_ONCE=0`, for comparing; the
    /// same bits): see [`KernelSet::q8_once`].
    q8_once: bool,
}

impl KernelSet {
    /// Whether a one-token attention should write its output's Q8 row for
    /// the output projection to copy (`AttentionSplit::out_q8`,
    /// [`KernelSet::matvec_from_q8`]) rather than have each of its blocks
    /// quantize the output again: the same bits. On by default;
    /// `COLIBRI_Q8_ONCE=0` turns it off to compare.
    pub fn q8_once(&self) -> bool {
        self.q8_once
    }
}

impl KernelSet {
    /// Compiles (or takes from `cache`) and loads every module for `dev`.
    pub fn load(dev: &CudaDevice, cache: &KernelCache) -> Result<KernelSet> {
        let arch = dev.info().arch;
        let nv = nvrtc::load()?;
        if !nv.archs.contains(&arch.number()) {
            return Err(CudaError::Unavailable {
                reason: format!(
                    "NVRTC {}.{} ({}) cannot compile for {arch} ({}); it supports {:?}",
                    nv.version.0,
                    nv.version.1,
                    nv.origin,
                    dev.info().name,
                    nv.archs
                ),
            });
        }
        let mut modules = Vec::new();
        let mut functions = HashMap::new();
        for m in MODULES {
            let cubin = cubin_for(m, arch, cache)?;
            let module = dev
                .context()
                .load_module(Ptx::from_binary(cubin))
                .op("cuModuleLoadData")?;
            for &k in m.kernels {
                let f = module.load_function(k).op("cuModuleGetFunction")?;
                functions.insert(k, f);
            }
            modules.push(module);
        }
        Ok(KernelSet {
            _modules: modules,
            functions,
            pdl: arch.major >= 9 && std::env::var("COLIBRI_PDL").map_or(true, |v| v != "0"),
            stream: std::env::var("COLIBRI_MV_STREAM").map_or(true, |v| v != "0"),
            down_ahead: std::env::var("COLIBRI_DOWN_AHEAD").map_or(true, |v| v != "0"),
            q8_once: std::env::var("COLIBRI_Q8_ONCE").map_or(true, |v| v != "0"),
        })
    }

    pub(crate) fn function(&self, name: &'static str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::invalid(name, "no such kernel in the loaded modules"))
    }
}

#[cfg(test)]
mod tests {
    use super::MODULES;

    /// `div127` of kernels/matvec.cu (the Q8 activation scale amax / 127
    /// without a division), written out.
    fn div127(a: f32) -> f32 {
        let y = f32::from_bits(0x3c01_0204);
        let q = a * y;
        let r = (-q).mul_add(127.0, a);
        if a == f32::INFINITY {
            a
        } else {
            r.mul_add(y, q)
        }
    }

    /// It is IEEE division, bit for bit, for every amax the kernel can
    /// see: every f32 below 2^-96 (where the product or the residual may
    /// be subnormal), every one of three whole binades and +inf. Above
    /// 2^-96 each step scales exactly with a power of two, so a binade
    /// stands for all. (Checked once for every non-negative f32 too.)
    #[test]
    fn q8_scale_division_is_correctly_rounded() {
        assert_eq!((1.0f32 / 127.0).to_bits(), 0x3c01_0204);
        let binade = |e: u32| (e << 23)..((e + 1) << 23);
        let ranges = [0..(31u32 << 23), binade(31), binade(127), binade(254)];
        for bits in ranges.into_iter().flatten() {
            let a = f32::from_bits(bits);
            assert_eq!(div127(a).to_bits(), (a / 127.0).to_bits(), "amax {a:e}");
        }
        assert_eq!(div127(f32::INFINITY), f32::INFINITY);
    }

    /// The bodies of the `extern "C" __global__` kernels of a source file
    /// (macro-generated ones included), by kernel signature.
    fn kernel_bodies(src: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut rest = src;
        while let Some(at) = rest.find("extern \"C\" __global__") {
            let tail = &rest[at..];
            let Some(open) = tail.find('{') else { break };
            let mut depth = 0usize;
            let mut end = open;
            for (i, c) in tail[open..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = open + i;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            out.push((tail[..open].to_string(), tail[open..=end].to_string()));
            rest = &tail[end..];
        }
        out
    }

    /// The kernels a source file defines: each plain `extern "C"
    /// __global__` function, and the names matvec.cu's macros generate.
    fn defined_kernels(src: &str) -> Vec<String> {
        let mut out = Vec::new();
        for (sig, _) in kernel_bodies(src) {
            let head = &sig[..sig.find('(').map_or(sig.len(), |i| {
                // Past `__launch_bounds__(...)`, the name's own parenthesis.
                sig[i + 1..].find('(').map_or(i, |j| i + 1 + j)
            })];
            let name = head
                .rsplit(|c: char| !(c.is_alphanumeric() || c == '_'))
                .next()
                .unwrap_or_default();
            if name != "NAME" {
                out.push(name.to_string());
            }
        }
        for line in src.lines() {
            let arg = |m: &str| line.strip_prefix(m).and_then(|r| r.split(',').next());
            if let Some(p) = arg("MATVEC_FORMAT(") {
                for t in ["_t1", "_t2", "_t4", "_t8", "_seg_t1"] {
                    out.push(format!("{p}{t}"));
                }
                for t in ["_t1", "_t2", "_t4", "_t8", "_glu_t1", "_glu_t2"] {
                    out.push(format!("{p}_table{t}"));
                }
            } else if let Some(n) =
                arg("MATVEC_STREAM_KERNEL(").or_else(|| arg("MATVEC_TABLE_KERNEL_P("))
            {
                out.push(n.to_string());
            }
        }
        out
    }

    /// Every kernel a module defines is in its list (the host loads only
    /// listed ones: a kernel missing there fails only at its first launch,
    /// on a GPU), and every listed one is defined.
    #[test]
    fn every_kernel_is_listed() {
        for m in MODULES {
            let mut defined = defined_kernels(m.source);
            let mut listed: Vec<String> = m.kernels.iter().map(|k| k.to_string()).collect();
            defined.sort();
            listed.sort();
            assert_eq!(defined, listed, "{}.cu", m.name);
        }
    }

    /// The host launches every kernel with programmatic dependent launch
    /// on sm_90 and later, so every kernel must wait for its predecessor
    /// (`pdl_entry()`, kernels/common.cuh) before touching what it wrote.
    /// Kernels generated by a macro name the helper that does it.
    #[test]
    fn every_kernel_waits_for_its_predecessor() {
        let mut seen = 0;
        for m in MODULES {
            let bodies = kernel_bodies(m.source);
            assert!(!bodies.is_empty(), "{}: no kernels found", m.name);
            for (sig, body) in bodies {
                seen += 1;
                assert!(
                    body.contains("pdl_entry("),
                    "{}.cu: kernel without pdl_entry(): {sig}",
                    m.name
                );
            }
        }
        assert!(seen >= 20, "only {seen} kernels found");
        // The matvec helpers the macro kernels defer to call it themselves.
        let mv = MODULES
            .iter()
            .find(|m| m.name == "matvec")
            .map(|m| m.source);
        let mv = mv.unwrap_or_default();
        for helper in [
            "void matvec_body",
            "void matvec_seg_body",
            "void matvec_table_body",
            "void matvec_stream_body",
        ] {
            let at = mv
                .find(helper)
                .unwrap_or_else(|| panic!("{helper} missing"));
            let body = &mv[at..];
            let body = &body[..body.find("\n}\n").unwrap_or(body.len())];
            assert!(
                body.contains("pdl_entry()"),
                "{helper} never calls pdl_entry()"
            );
        }
    }
}
