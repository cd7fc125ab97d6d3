//! The one error type of colibri-cuda. `Unavailable` is the expected,
//! benign case (no driver, no GPU, no NVRTC): the engine reports it once and
//! runs on the CPU tier. Everything else names what failed.

use cudarc::driver::DriverError;

/// Errors of the GPU tier.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable GPU tier on this machine: no NVIDIA driver, no device, a
    /// driver too old for the CUDA 13 API, or no NVRTC to build kernels.
    #[error("CUDA unavailable: {reason}")]
    Unavailable { reason: String },

    /// A CUDA driver call failed.
    #[error("CUDA driver: {op} failed: {code}")]
    Driver { op: &'static str, code: String },

    /// An NVRTC call (other than the compilation itself) failed.
    #[error("NVRTC: {op} failed: {message}")]
    Nvrtc { op: &'static str, message: String },

    /// A kernel module did not compile; `log` is NVRTC's program log.
    #[error("NVRTC could not compile {module}.cu for {arch}:\n{log}")]
    Compile {
        module: String,
        arch: String,
        log: String,
    },

    /// A launch helper was given buffers or sizes that do not fit together.
    #[error("{kernel}: {reason}")]
    InvalidArgument {
        kernel: &'static str,
        reason: String,
    },
}

/// Shorthand used throughout the crate.
pub type Result<T> = std::result::Result<T, CudaError>;

impl CudaError {
    pub(crate) fn driver(op: &'static str, e: DriverError) -> CudaError {
        let name = e
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        let text = e
            .error_string()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        CudaError::Driver {
            op,
            code: if text.is_empty() {
                name
            } else {
                format!("{name} ({text})")
            },
        }
    }

    pub(crate) fn invalid(kernel: &'static str, reason: impl Into<String>) -> CudaError {
        CudaError::InvalidArgument {
            kernel,
            reason: reason.into(),
        }
    }
}

/// Maps a driver result into ours, naming the operation.
pub(crate) trait DriverResultExt<T> {
    fn op(self, op: &'static str) -> Result<T>;
}

impl<T> DriverResultExt<T> for std::result::Result<T, DriverError> {
    fn op(self, op: &'static str) -> Result<T> {
        self.map_err(|e| CudaError::driver(op, e))
    }
}
