//! colibri-cuda: the GPU tier. It depends on no other crate of colibri's:
//! the engine calls in, nothing calls out.
//!
//! What is here (the foundation):
//!
//! * [`CudaDevice`]: one GPU's primary context with a compute stream and a
//!   copy stream, [`DeviceBuffer`]s with shared/exclusive views, [`Event`]s,
//!   and [`HostRegistration`] (`cuMemHostRegister`) for asynchronous DMA of
//!   host bytes on the copy stream. The driver is loaded at run time
//!   (cudarc, `dynamic-loading`): the crate builds without CUDA, and a
//!   machine without a driver, a device, a CUDA 13 driver or NVRTC gets
//!   [`CudaError::Unavailable`], which the engine reports once before
//!   running on the CPU tier.
//! * Kernels in `kernels/*.cu`, compiled by NVRTC for the device's exact
//!   architecture ([`compile_all`], [`KernelSet::load`]) and cached on disk
//!   ([`KernelCache`]); [`KernelSet`]'s methods are typed, bounds-checked
//!   launch helpers ([`ops`]).
//!
//! Exactness (DESIGN.md principle 2): every kernel computes each output
//! element with a reduction order fixed by the problem's shape alone — never
//! by the batch size, the grid, the placement or alignment of the weights,
//! or timing — and with no floating-point atomics, so a GPU run is
//! bit-identical to itself whatever the engine's budgets. The matvec gives
//! the same bits for a quantized matrix as for its dequantized f32 twin.
//!
//! * [`HostBuffer`]: page-locked host memory of our own, registered and
//!   mapped, for inputs, read-backs and whatever the engine keeps in RAM
//!   but kernels read in place; [`CudaDevice::upload_async`] /
//!   [`CudaDevice::download_async`] order such copies with the kernels,
//!   [`CudaDevice::copy_host_ptr_async`] copies any host bytes (a
//!   registered io arena's, say) on the copy stream with an [`Event`].
//! * [`batch`]: the pointer-table matvec ([`MatvecTable`]: the experts of a
//!   layer wherever their slots are, one launch) and the row kernels.
//!
//! The staging ring and the VRAM expert cache that use these live in the
//! engine (`colibri_sched::gpu`): ring slots filled on the copy stream from
//! the RAM tier's registered arenas, "filled" events the compute stream
//! waits for and "consumed" events the copy stream waits for before a
//! refill; cache slots with the RAM tier's lease/LRU/pin rules, hits read
//! in place, misses promoted by a device-to-device copy from their ring
//! slot. Several GPUs (one `CudaDevice` per ordinal, experts placed across
//! them; host registrations are PORTABLE so every context can DMA from
//! them) are not done yet.

pub mod batch;
pub mod cache;
pub mod device;
pub mod error;
pub mod kernels;
pub mod moe;
pub mod nvrtc;
pub mod ops;

pub use batch::{GLU_MAX_TOK, MatvecTable};
pub use cache::KernelCache;
pub use device::{
    BufMut, BufView, CounterSnapshot, CudaDevice, DeviceBuffer, DeviceElem, DeviceInfo, Event,
    Graph, HOST_PAGE, HostBuffer, HostRegistration,
};
pub use error::{CudaError, Result};
pub use kernels::{Arch, CI_ARCHS, CompiledModule, KernelSet, MODULES, compile_all};
pub use moe::{DeviceRouter, MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_K, MoeRoutePlan};
pub use ops::{
    ATTENTION_CHUNK, Attention, AttentionSplit, Fp8Scales, KvView, MatvecGroup, RopeTable,
    WeightFormat, WeightView, attention_split_records, q8_row_bytes,
};
