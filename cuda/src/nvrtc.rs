//! Finding NVRTC and compiling one kernel module to a cubin with it.
//!
//! cudarc loads libnvrtc at its first call by `dlopen`ing a list of names
//! (`libnvrtc.so`, …, `libnvrtc.so.13`, `libnvrtc.so.12`, …) — so only
//! through `LD_LIBRARY_PATH` and the linker cache, which the process cannot
//! change for itself once started — and panics when none loads. So before
//! cudarc is asked, [`load`] looks in this order:
//!
//! 1. `$COLIBRI_NVRTC_DIR` (a directory holding `libnvrtc.so.13`, e.g. the
//!    one `tools/fetch_nvrtc.sh` unpacks); set but unusable is an error;
//! 2. the names cudarc tries (`LD_LIBRARY_PATH`, `ldconfig`);
//! 3. `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`.
//!
//! A directory is used by `dlopen`ing its `libnvrtc-builtins.so.13.*` and
//! `libnvrtc.so.13` by full path first: the dynamic loader then answers
//! cudarc's (and libnvrtc's own) lookups by soname with those already-loaded
//! copies. We then check that cudarc really resolved to the same library.
//!
//! Nothing here needs a GPU: CI compiles every kernel with the PyPI wheel.

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::sys;

use crate::error::{CudaError, Result};

/// Environment variable naming a directory that holds `libnvrtc.so.13`.
pub const NVRTC_DIR_ENV: &str = "COLIBRI_NVRTC_DIR";

/// How to get NVRTC, for error messages.
pub const NVRTC_HINT: &str = "install the CUDA toolkit's NVRTC (libnvrtc.so.13), or run \
     `tools/fetch_nvrtc.sh DIR` and `export COLIBRI_NVRTC_DIR=DIR/lib`";

/// The NVRTC this process uses.
#[derive(Clone, Debug)]
pub struct Nvrtc {
    /// (major, minor), e.g. (13, 0).
    pub version: (i32, i32),
    /// Where it came from, for messages.
    pub origin: String,
    /// Architectures it can compile for (`sm_XX` numbers, e.g. 90).
    pub archs: Vec<u32>,
}

/// Finds and loads NVRTC once per process; later calls return the same
/// answer.
pub fn load() -> Result<&'static Nvrtc> {
    static NVRTC: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();
    NVRTC
        .get_or_init(find_and_load)
        .as_ref()
        .map_err(|reason| CudaError::Unavailable {
            reason: reason.clone(),
        })
}

/// Libraries opened by full path; kept for the life of the process so the
/// soname lookups keep finding them.
static PRELOADED: OnceLock<Vec<libloading::Library>> = OnceLock::new();

fn find_and_load() -> std::result::Result<Nvrtc, String> {
    let mut origin = None;
    if let Some(dir) = std::env::var_os(NVRTC_DIR_ENV) {
        let dir = PathBuf::from(dir);
        preload(&dir).map_err(|e| format!("{NVRTC_DIR_ENV}={}: {e}", dir.display()))?;
        origin = Some(dir);
    } else {
        // SAFETY: is_culib_present only dlopens candidate names (running
        // their initializers, which NVIDIA's libraries keep trivial) and
        // drops the handles.
        if !unsafe { sys::is_culib_present() } {
            for dir in well_known_dirs() {
                if dir.join("libnvrtc.so.13").is_file() && preload(&dir).is_ok() {
                    origin = Some(dir);
                    break;
                }
            }
            if origin.is_none() {
                return Err(format!("libnvrtc not found: {NVRTC_HINT}"));
            }
        }
    }
    // SAFETY: a library answering to one of cudarc's names is loaded now
    // (preloaded by soname, or found by cudarc's own probe above), so
    // culib() does not panic.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!("libnvrtc could not be loaded: {NVRTC_HINT}"));
    }
    if let (Some(dir), Some(libs)) = (&origin, PRELOADED.get()) {
        check_same_library(libs, dir)?;
    }
    let version = version().map_err(|e| e.to_string())?;
    let archs = supported_archs().map_err(|e| e.to_string())?;
    let origin = match origin {
        Some(d) => d.display().to_string(),
        None => "the dynamic linker's search path".to_string(),
    };
    tracing::debug!(
        "NVRTC {}.{} from {origin}, archs {archs:?}",
        version.0,
        version.1
    );
    Ok(Nvrtc {
        version,
        origin,
        archs,
    })
}

fn well_known_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.push(PathBuf::from(v).join("lib64"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs
}

/// Opens `dir`'s builtins library and libnvrtc.so.13 by full path.
fn preload(dir: &Path) -> std::result::Result<(), String> {
    let main = dir.join("libnvrtc.so.13");
    if !main.is_file() {
        return Err(format!("no libnvrtc.so.13 in {}", dir.display()));
    }
    // libnvrtc dlopens its builtins by soname (it has no RUNPATH), so they
    // are loaded first. The wheel also ships ".alt." variants; skip them.
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut builtins: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so.13"))
        })
        .collect();
    builtins.sort();
    let mut libs = Vec::new();
    for path in builtins.iter().chain(std::iter::once(&main)) {
        // SAFETY: loading NVIDIA's NVRTC libraries runs only their own
        // initializers; the handles are kept for the life of the process.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
        libs.push(lib);
    }
    PRELOADED
        .set(libs)
        .map_err(|_| "NVRTC was already preloaded from another directory".to_string())
}

/// cudarc resolves libnvrtc by name; if another copy shadows the one we
/// preloaded, we would compile with a compiler the user did not choose.
fn check_same_library(libs: &[libloading::Library], dir: &Path) -> std::result::Result<(), String> {
    let Some(ours) = libs.last() else {
        return Ok(());
    };
    // SAFETY: only symbol addresses are read and compared; nothing is called.
    let (a, b) = unsafe {
        let a = ours
            .get::<*const ()>(b"nvrtcVersion\0")
            .map(|s| *s)
            .map_err(|e| e.to_string())?;
        let b = sys::culib()
            .get::<*const ()>(b"nvrtcVersion\0")
            .map(|s| *s)
            .map_err(|e| e.to_string())?;
        (a, b)
    };
    if a != b {
        return Err(format!(
            "another libnvrtc on the library path shadows {}; unset LD_LIBRARY_PATH entries \
             that hold one, or point {NVRTC_DIR_ENV} at that one",
            dir.display()
        ));
    }
    Ok(())
}

fn check(op: &'static str, r: sys::nvrtcResult) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string
    // for every result code (or null, handled).
    let message = unsafe {
        let p = sys::nvrtcGetErrorString(r);
        if p.is_null() {
            format!("{r:?}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(CudaError::Nvrtc { op, message })
}

fn version() -> Result<(i32, i32)> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: both out-pointers point to live c_ints.
    check("nvrtcVersion", unsafe {
        sys::nvrtcVersion(&mut major, &mut minor)
    })?;
    Ok((major, minor))
}

fn supported_archs() -> Result<Vec<u32>> {
    let mut n: c_int = 0;
    // SAFETY: the out-pointer points to a live c_int.
    check("nvrtcGetNumSupportedArchs", unsafe {
        sys::nvrtcGetNumSupportedArchs(&mut n)
    })?;
    let mut archs = vec![0 as c_int; n.max(0) as usize];
    // SAFETY: `archs` has room for the `n` entries NVRTC reported.
    check("nvrtcGetSupportedArchs", unsafe {
        sys::nvrtcGetSupportedArchs(archs.as_mut_ptr())
    })?;
    Ok(archs.into_iter().map(|a| a.max(0) as u32).collect())
}

/// A compiled module: its cubin and NVRTC's log (empty when there was
/// nothing to say; warnings land here).
#[derive(Clone, Debug)]
pub struct CompileOutput {
    pub cubin: Vec<u8>,
    pub log: String,
}

/// Destroys the program however compilation ends.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: self.0 came from a successful nvrtcCreateProgram and is
        // destroyed exactly once.
        let _ = unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| CudaError::Nvrtc {
        op: "nvrtcCreateProgram",
        message: format!("{what} contains a NUL byte"),
    })
}

/// Compiles `source` (named `name`, with in-memory `headers` as
/// (include name, text)) with `options`. `arch` is only used in messages.
/// A compilation error returns [`CudaError::Compile`] with the log.
pub fn compile(
    name: &str,
    arch: &str,
    source: &str,
    headers: &[(&str, &str)],
    options: &[String],
) -> Result<CompileOutput> {
    load()?;
    let src = cstring("source", source)?;
    let cname = cstring("name", &format!("{name}.cu"))?;
    let header_texts = headers
        .iter()
        .map(|(_, t)| cstring("header", t))
        .collect::<Result<Vec<_>>>()?;
    let header_names = headers
        .iter()
        .map(|(n, _)| cstring("header name", n))
        .collect::<Result<Vec<_>>>()?;
    let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|s| s.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
    let opts = options
        .iter()
        .map(|o| cstring("option", o))
        .collect::<Result<Vec<_>>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|s| s.as_ptr()).collect();

    let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a NUL-terminated CString that outlives
    // the call; the two header arrays have `headers.len()` entries each.
    check("nvrtcCreateProgram", unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            cname.as_ptr(),
            headers.len() as c_int,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    })?;
    let prog = Program(raw);
    // SAFETY: `prog.0` is a live program; `opt_ptrs` holds `opts.len()`
    // pointers to live CStrings.
    let compiled =
        unsafe { sys::nvrtcCompileProgram(prog.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    let log = program_log(&prog)?;
    if compiled == sys::nvrtcResult::NVRTC_ERROR_COMPILATION {
        return Err(CudaError::Compile {
            module: name.to_string(),
            arch: arch.to_string(),
            log,
        });
    }
    check("nvrtcCompileProgram", compiled)?;
    let mut size = 0usize;
    // SAFETY: live program, out-pointer to a live usize.
    check("nvrtcGetCUBINSize", unsafe {
        sys::nvrtcGetCUBINSize(prog.0, &mut size)
    })?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the `size` bytes NVRTC asked for.
    check("nvrtcGetCUBIN", unsafe {
        sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char)
    })?;
    if cubin.is_empty() {
        return Err(CudaError::Nvrtc {
            op: "nvrtcGetCUBIN",
            message: format!("{name}.cu for {arch}: empty cubin (was a virtual arch given?)"),
        });
    }
    Ok(CompileOutput { cubin, log })
}

fn program_log(prog: &Program) -> Result<String> {
    let mut size = 0usize;
    // SAFETY: live program, out-pointer to a live usize.
    check("nvrtcGetProgramLogSize", unsafe {
        sys::nvrtcGetProgramLogSize(prog.0, &mut size)
    })?;
    let mut buf = vec![0u8; size.max(1)];
    // SAFETY: `buf` has the `size` bytes (including the NUL) NVRTC asked for.
    check("nvrtcGetProgramLog", unsafe {
        sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr() as *mut c_char)
    })?;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).trim().to_string())
}
