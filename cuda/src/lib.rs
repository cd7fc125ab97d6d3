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
//! Intended design of what comes next (not implemented yet):
//!
//! * **Staging ring**: N device slots, each the size of the largest expert
//!   record, filled by [`CudaDevice::copy_to_device_async`] from the io
//!   crate's registered pinned buffers on the copy stream. Each slot has two
//!   events: "filled" (copy stream; the compute stream waits on it before the
//!   expert's matvecs) and "consumed" (compute stream; the copy stream waits
//!   on it before refilling). The io reader's completion hands a slot index
//!   to the engine; kernels take [`WeightView`]s into the slot, and the
//!   grouped matvec ([`MatvecGroup`]) applies all experts of a layer that sit
//!   at a fixed stride in one launch.
//! * **VRAM expert cache**: a fixed array of expert slots, sized by the
//!   planner from free VRAM, with the same lease/LRU rules as the RAM tier;
//!   a hit is just a `WeightView` into its slot, and a miss is promoted by a
//!   device-to-device copy from the staging slot.
//! * Several GPUs: one `CudaDevice` per ordinal, experts placed across them;
//!   host registrations are PORTABLE so every context can DMA from them.

pub mod batch;
pub mod cache;
pub mod device;
pub mod error;
pub mod kernels;
pub mod nvrtc;
pub mod ops;

pub use batch::MatvecTable;
pub use cache::KernelCache;
pub use device::{
    BufMut, BufView, CudaDevice, DeviceBuffer, DeviceElem, DeviceInfo, Event, HOST_PAGE,
    HostBuffer, HostRegistration,
};
pub use error::{CudaError, Result};
pub use kernels::{Arch, CI_ARCHS, CompiledModule, KernelSet, MODULES, compile_all};
pub use ops::{Attention, Fp8Scales, KvView, MatvecGroup, RopeTable, WeightFormat, WeightView};
