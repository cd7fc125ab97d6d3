//! One GPU: its context, a compute stream and a copy stream, device buffers
//! and their views, events, and host memory registered for DMA.
//!
//! Ordering is explicit, not tracked: cudarc's per-buffer event tracking is
//! turned off (it would record events around every launch). The rules:
//!
//! * every kernel, memset, device-to-device copy and every synchronous
//!   upload/download runs on the **compute** stream, so they are ordered
//!   among themselves and buffers (allocated and freed stream-ordered on the
//!   compute stream) are never freed under a running kernel;
//! * host-to-device copies of expert bytes run on the **copy** stream from
//!   registered host memory ([`HostRegistration`]) and return an [`Event`];
//!   the compute stream must [`CudaDevice::compute_wait`] for it before a
//!   kernel reads the destination.
//!
//! Copies from plain (pageable) host memory are synchronous by nature (the
//! driver stages them), so [`CudaDevice::upload`] and friends are for setup
//! and tests; the decode path uses registered memory on the copy stream.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr, result, sys,
};

use crate::error::{CudaError, DriverResultExt, Result};
use crate::kernels::Arch;

/// The CUDA API version colibri is built against (`cuda-13000`): older
/// drivers lack some of its entry points.
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// Every device allocation is rounded up to this many bytes, so kernels may
/// read whole aligned words that straddle the end of the last row (see
/// kernels/matvec.cu).
pub const ALLOC_PAD: usize = 16;

/// Element types of device buffers.
pub trait DeviceElem: DeviceRepr + Copy + Default + Send + Sync + 'static {}
impl DeviceElem for f32 {}
impl DeviceElem for u8 {}
impl DeviceElem for u16 {}
impl DeviceElem for u32 {}
impl DeviceElem for i32 {}
impl DeviceElem for u64 {}

/// What a device is.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub arch: Arch,
    pub total_mem: usize,
    pub multiprocessors: u32,
    pub l2_bytes: u32,
    /// The driver's CUDA version, e.g. (13, 0).
    pub driver_version: (i32, i32),
}

/// What the host asked of a device so far: the engine reports these per
/// decode step (launches and host waits are what a step's latency is made
/// of once the kernels are fast).
#[derive(Debug, Default)]
pub struct DeviceCounters {
    launches: AtomicU64,
    host_waits: AtomicU64,
    copies: AtomicU64,
    graph_launches: AtomicU64,
}

/// A snapshot of [`DeviceCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Kernel launches issued by the host (kernels replayed inside a graph
    /// are not counted again).
    pub launches: u64,
    /// Times the host blocked on the device (stream or event synchronize).
    pub host_waits: u64,
    /// Host↔device copies issued (uploads, downloads, expert copies).
    pub copies: u64,
    /// Graph replays issued.
    pub graph_launches: u64,
}

impl DeviceCounters {
    pub(crate) fn launch(&self) {
        self.launches.fetch_add(1, Ordering::Relaxed);
    }
    fn wait(&self) {
        self.host_waits.fetch_add(1, Ordering::Relaxed);
    }
    fn copy(&self) {
        self.copies.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            launches: self.launches.load(Ordering::Relaxed),
            host_waits: self.host_waits.load(Ordering::Relaxed),
            copies: self.copies.load(Ordering::Relaxed),
            graph_launches: self.graph_launches.load(Ordering::Relaxed),
        }
    }
}

/// A GPU with its streams.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    info: DeviceInfo,
    counters: Arc<DeviceCounters>,
}

fn unavailable(reason: impl Into<String>) -> CudaError {
    CudaError::Unavailable {
        reason: reason.into(),
    }
}

/// The driver's CUDA version, or why there is no usable driver.
pub fn driver_version() -> Result<(i32, i32)> {
    // SAFETY: only dlopens candidate names of libcuda and drops the handles.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable(
            "no NVIDIA driver found (libcuda.so.1 is not loadable)",
        ));
    }
    let mut v = 0;
    // SAFETY: libcuda is loadable (checked above, so cudarc's loader does not
    // panic); cuDriverGetVersion exists in every driver and needs no cuInit.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .op("cuDriverGetVersion")?;
    Ok((v / 1000, (v % 1000) / 10))
}

fn init_driver() -> Result<(i32, i32)> {
    let (major, minor) = driver_version()?;
    if major * 1000 + minor * 10 < MIN_DRIVER_VERSION {
        return Err(unavailable(format!(
            "the NVIDIA driver supports CUDA {major}.{minor}; colibri's GPU tier needs a CUDA 13.0 \
             driver (R580 or newer)"
        )));
    }
    result::init().map_err(|e| {
        let why = CudaError::driver("cuInit", e);
        unavailable(format!("the NVIDIA driver did not initialize: {why}"))
    })?;
    Ok((major, minor))
}

impl CudaDevice {
    /// How many CUDA devices there are; `Unavailable` without a driver.
    pub fn count() -> Result<usize> {
        init_driver()?;
        let n = result::device::get_count().op("cuDeviceGetCount")?;
        Ok(n.max(0) as usize)
    }

    /// Opens device `ordinal` (its primary context) with a compute and a
    /// copy stream. No driver, no such device or a driver older than CUDA
    /// 13.0 give [`CudaError::Unavailable`].
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        let driver_version = init_driver()?;
        let count = result::device::get_count().op("cuDeviceGetCount")?.max(0) as usize;
        if ordinal >= count {
            return Err(unavailable(if count == 0 {
                "no CUDA device is present".to_string()
            } else {
                format!("there is no CUDA device {ordinal} ({count} present)")
            }));
        }
        let ctx = CudaContext::new(ordinal).op("cuDevicePrimaryCtxRetain")?;
        // SAFETY: before any buffer exists; from here on ordering between
        // the two streams is ours to keep (module docs).
        unsafe { ctx.disable_event_tracking() };
        let compute = ctx.new_stream().op("cuStreamCreate")?;
        let copy = ctx.new_stream().op("cuStreamCreate")?;
        let (major, minor) = ctx.compute_capability().op("cuDeviceGetAttribute")?;
        let attr = |a| ctx.attribute(a).op("cuDeviceGetAttribute");
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().op("cuDeviceGetName")?,
            arch: Arch::new(major.max(0) as u32, minor.max(0) as u32),
            total_mem: ctx.total_mem().op("cuDeviceTotalMem")?,
            multiprocessors: attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )?
            .max(0) as u32,
            l2_bytes: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(0)
                as u32,
            driver_version,
        };
        Ok(CudaDevice {
            ctx,
            compute,
            copy,
            info,
            counters: Arc::new(DeviceCounters::default()),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// What the host has asked of this device so far.
    pub fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    pub(crate) fn count_launch(&self) {
        self.counters.launch();
    }

    fn event(&self, e: CudaEvent) -> Event {
        Event {
            ev: e,
            counters: Arc::clone(&self.counters),
        }
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// A zero-filled buffer of `len` elements (stream-ordered on the
    /// compute stream), padded to [`ALLOC_PAD`] bytes.
    pub fn alloc<T: DeviceElem>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let elem = std::mem::size_of::<T>();
        let bytes = len
            .checked_mul(elem)
            .and_then(|b| b.checked_next_multiple_of(ALLOC_PAD))
            .ok_or_else(|| CudaError::invalid("alloc", format!("{len} elements overflow")))?
            .max(ALLOC_PAD);
        let padded = bytes.div_ceil(elem);
        // SAFETY: the memory is zeroed right below, before anyone reads it.
        let slice: CudaSlice<T> = unsafe { self.compute.alloc(padded) }.op("cuMemAllocAsync")?;
        let ptr = {
            let (p, _no_event) = slice.device_ptr(&self.compute);
            p
        };
        // SAFETY: `ptr` is the start of an allocation of `padded * elem`
        // bytes on this context, used in stream order.
        unsafe { result::memset_d8_async(ptr, 0, padded * elem, self.compute.cu_stream()) }
            .op("cuMemsetD8Async")?;
        Ok(DeviceBuffer {
            _alloc: slice,
            ptr,
            len,
        })
    }

    /// A buffer holding `src` (synchronous; for setup and tests).
    pub fn upload<T: DeviceElem>(&self, src: &[T]) -> Result<DeviceBuffer<T>> {
        let mut buf = self.alloc::<T>(src.len())?;
        self.write(buf.as_mut(), src)?;
        Ok(buf)
    }

    /// Copies `src` into `dst` (equal lengths) and waits for it.
    pub fn write<T: DeviceElem>(&self, dst: BufMut<'_, T>, src: &[T]) -> Result<()> {
        if dst.len != src.len() {
            return Err(CudaError::invalid(
                "write",
                format!("{} elements into a view of {}", src.len(), dst.len),
            ));
        }
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        // SAFETY: dst covers src.len() elements of a live allocation (views
        // are bounds-checked); `src` outlives the synchronize below.
        unsafe { result::memcpy_htod_async(dst.ptr, src, self.compute.cu_stream()) }
            .op("cuMemcpyHtoDAsync")?;
        self.counters.copy();
        self.counters.wait();
        self.compute.synchronize().op("cuStreamSynchronize")
    }

    /// The contents of `src`, after all earlier compute work (synchronous).
    pub fn download<T: DeviceElem>(&self, src: BufView<'_, T>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len];
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        // SAFETY: src covers out.len() elements of a live allocation; `out`
        // outlives the synchronize below.
        unsafe { result::memcpy_dtoh_async(&mut out[..], src.ptr, self.compute.cu_stream()) }
            .op("cuMemcpyDtoHAsync")?;
        self.counters.copy();
        self.counters.wait();
        self.compute.synchronize().op("cuStreamSynchronize")?;
        Ok(out)
    }

    /// Sets every byte of `dst` to `byte` (async, compute stream): tests
    /// poison outputs with it before a kernel runs.
    pub fn fill_bytes<T: DeviceElem>(&self, dst: BufMut<'_, T>, byte: u8) -> Result<()> {
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        // SAFETY: dst is a bounds-checked view of a live allocation.
        unsafe {
            result::memset_d8_async(
                dst.ptr,
                byte,
                dst.len * std::mem::size_of::<T>(),
                self.compute.cu_stream(),
            )
        }
        .op("cuMemsetD8Async")
    }

    /// Device-to-device copy on the compute stream (equal lengths).
    pub fn copy<T: DeviceElem>(&self, src: BufView<'_, T>, dst: BufMut<'_, T>) -> Result<()> {
        if src.len != dst.len {
            return Err(CudaError::invalid(
                "copy",
                format!("{} elements into a view of {}", src.len, dst.len),
            ));
        }
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        // SAFETY: both views are bounds-checked views of live allocations;
        // `&`/`&mut` borrows keep them from overlapping.
        unsafe {
            result::memcpy_dtod_async(
                dst.ptr,
                src.ptr,
                src.len * std::mem::size_of::<T>(),
                self.compute.cu_stream(),
            )
        }
        .op("cuMemcpyDtoDAsync")
    }

    /// Waits for both streams and reports any error a kernel or an earlier
    /// asynchronous call left behind.
    pub fn synchronize(&self) -> Result<()> {
        self.counters.wait();
        self.compute.synchronize().op("cuStreamSynchronize")?;
        self.copy.synchronize().op("cuStreamSynchronize")?;
        self.ctx.check_err().op("an earlier asynchronous call")
    }

    /// An event marking all compute work issued so far.
    pub fn record_compute(&self) -> Result<Event> {
        Ok(self.event(self.compute.record_event(None).op("cuEventRecord")?))
    }

    /// Like [`Self::record_compute`], with timing enabled (for benchmarks).
    pub fn record_compute_timed(&self) -> Result<Event> {
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        Ok(self.event(self.compute.record_event(Some(flags)).op("cuEventRecord")?))
    }

    /// Makes later compute work wait for `event` (no host wait).
    pub fn compute_wait(&self, event: &Event) -> Result<()> {
        self.compute.wait(&event.ev).op("cuStreamWaitEvent")
    }

    /// Makes later copies wait for `event` (e.g. until the kernels reading
    /// a staging slot are done before it is refilled).
    pub fn copy_wait(&self, event: &Event) -> Result<()> {
        self.copy.wait(&event.ev).op("cuStreamWaitEvent")
    }

    /// Page-locks and registers `len` bytes at `ptr` with the driver, so
    /// that copies from them are true asynchronous DMA.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid host memory that stays allocated (and
    /// is not registered elsewhere) until the returned registration drops.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<HostRegistration> {
        if ptr.is_null() || len == 0 {
            return Err(CudaError::invalid("register_host", "null or empty range"));
        }
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        // SAFETY: the caller guarantees the range is live host memory;
        // PORTABLE makes it usable from every context (several GPUs),
        // DEVICEMAP lets kernels read it in place ([`Self::mapped_address`]).
        unsafe {
            sys::cuMemHostRegister_v2(
                ptr.cast(),
                len,
                sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        }
        .result()
        .op("cuMemHostRegister")?;
        Ok(HostRegistration {
            ptr,
            len,
            ctx: self.ctx.clone(),
            copy: self.copy.clone(),
        })
    }

    /// The address at which this device's kernels read the byte at `ptr`
    /// inside `reg` (a registration made with [`Self::register_host`], by
    /// this device or another: the registrations are portable), over the
    /// bus. Kernels given it read host memory in place, so the bytes must
    /// stay registered, and unchanged while a kernel may read them.
    pub fn mapped_address(&self, reg: &HostRegistration, ptr: *const u8) -> Result<u64> {
        let off = (ptr as usize)
            .checked_sub(reg.ptr as usize)
            .filter(|&o| o < reg.len)
            .ok_or_else(|| {
                CudaError::invalid("mapped_address", "the byte is outside the registration")
            })?;
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `reg.ptr` starts a live registration made with DEVICEMAP
        // (register_host); the call only writes `base`.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut base, reg.ptr.cast(), 0) }
            .result()
            .op("cuMemHostGetDevicePointer")?;
        Ok(base + off as u64)
    }

    /// Starts copying `src[offset .. offset + dst.len()]` into `dst` on the
    /// copy stream; the returned event completes with the copy. Make the
    /// compute stream wait for it ([`Self::compute_wait`]) before reading
    /// `dst`.
    ///
    /// # Safety
    /// The source bytes must not be written, and `dst` neither read by
    /// another stream nor freed, until the event has completed.
    pub unsafe fn copy_to_device_async(
        &self,
        src: &HostRegistration,
        offset: usize,
        dst: BufMut<'_, u8>,
    ) -> Result<Event> {
        let end = offset
            .checked_add(dst.len)
            .filter(|&e| e <= src.len)
            .ok_or_else(|| {
                CudaError::invalid(
                    "copy_to_device_async",
                    format!(
                        "{}..+{} outside a registration of {}",
                        offset, dst.len, src.len
                    ),
                )
            })?;
        debug_assert!(end <= src.len);
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        // SAFETY: the source range lies inside the registered range
        // (checked), `dst` is a bounds-checked view; the caller keeps both
        // untouched until the event completes.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.ptr,
                src.ptr.add(offset).cast_const().cast(),
                dst.len,
                self.copy.cu_stream(),
            )
        }
        .result()
        .op("cuMemcpyHtoDAsync")?;
        self.counters.copy();
        Ok(self.event(self.copy.record_event(None).op("cuEventRecord")?))
    }
}

/// Compute-stream work captured once and replayed as one launch (see
/// [`CudaDevice::begin_capture`]).
pub struct Graph(CudaGraph);

// SAFETY: a graph and its executable are driver objects that any thread
// may use as long as no two use them at once (CUDA's graph thread-safety
// rules); `replay` takes `&Graph` but the engine keeps its graphs inside
// the GPU tier's mutex, and `Graph` is deliberately not `Sync`.
unsafe impl Send for Graph {}

impl CudaDevice {
    /// Starts recording the compute stream's work into a graph instead of
    /// running it: every launch, device copy and host↔device copy issued on
    /// the compute stream until [`Self::end_capture`] becomes a node. Host
    /// copies must be from page-locked memory ([`HostBuffer`]), which the
    /// replay reads at the time it runs. Nothing may wait for the stream
    /// (synchronize, event waits on the host) or use the copy stream while
    /// capturing.
    pub fn begin_capture(&self) -> Result<()> {
        self.compute
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .op("cuStreamBeginCapture")
    }

    /// Ends the capture begun by [`Self::begin_capture`] and instantiates
    /// the graph (`None` if nothing was captured). Must be called after a
    /// failed capture too, to give the stream back.
    pub fn end_capture(&self) -> Result<Option<Graph>> {
        let g = self
            .compute
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .op("cuStreamEndCapture")?;
        Ok(g.map(Graph))
    }

    /// Runs a captured graph on the compute stream (asynchronously, in
    /// order with the stream's other work).
    ///
    /// # Safety
    /// Every buffer the graph's nodes read or write must still be allocated
    /// and hold what the captured work expects (the captured launches keep
    /// raw device addresses).
    pub unsafe fn replay(&self, g: &Graph) -> Result<()> {
        g.0.launch().op("cuGraphLaunch")?;
        self.counters.graph_launches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// (free, total) bytes of device memory now.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        self.ctx.mem_get_info().op("cuMemGetInfo")
    }

    /// An event marking all copies issued so far.
    pub fn record_copy(&self) -> Result<Event> {
        Ok(self.event(self.copy.record_event(None).op("cuEventRecord")?))
    }

    /// Like [`Self::record_copy`], with timing enabled (for benchmarks).
    pub fn record_copy_timed(&self) -> Result<Event> {
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        Ok(self.event(self.copy.record_event(Some(flags)).op("cuEventRecord")?))
    }

    /// `len` bytes of page-locked host memory, registered with this
    /// context and mapped into the device's address space (see
    /// [`HostBuffer`]); zero-filled.
    pub fn alloc_host(&self, len: usize) -> Result<HostBuffer> {
        let size = len
            .max(1)
            .checked_next_multiple_of(HOST_PAGE)
            .ok_or_else(|| CudaError::invalid("alloc_host", format!("{len} bytes overflow")))?;
        let layout = std::alloc::Layout::from_size_align(size, HOST_PAGE)
            .map_err(|e| CudaError::invalid("alloc_host", e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            return Err(CudaError::invalid(
                "alloc_host",
                format!("out of host memory for {size} bytes"),
            ));
        };
        let fail = |e: CudaError| {
            // SAFETY: allocated just above with this layout, not registered.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
            e
        };
        self.ctx
            .bind_to_thread()
            .op("cuCtxSetCurrent")
            .map_err(fail)?;
        // SAFETY: `ptr..ptr + size` is our own live allocation, registered
        // once; PORTABLE makes it usable from every context, DEVICEMAP maps
        // it so kernels can read and write it in place.
        unsafe {
            sys::cuMemHostRegister_v2(
                ptr.as_ptr().cast(),
                size,
                sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        }
        .result()
        .op("cuMemHostRegister")
        .map_err(fail)?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: the range was just registered with DEVICEMAP.
        let mapped =
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr.as_ptr().cast(), 0) }
                .result()
                .op("cuMemHostGetDevicePointer");
        if let Err(e) = mapped {
            // SAFETY: registered above, not used by any copy yet.
            let _ = unsafe { sys::cuMemHostUnregister(ptr.as_ptr().cast()) };
            return Err(fail(e));
        }
        Ok(HostBuffer {
            ptr,
            layout,
            len,
            dptr,
            ctx: self.ctx.clone(),
            compute: self.compute.clone(),
            copy: self.copy.clone(),
        })
    }

    /// Starts copying `dst.len()` bytes from host address `src` into `dst`
    /// on the copy stream and returns an event that completes with the
    /// copy. From page-locked memory (a registered arena, a
    /// [`HostBuffer`]) this is true asynchronous DMA; from pageable memory
    /// the driver stages the bytes before returning.
    ///
    /// # Safety
    /// `src .. src + dst.len()` must be readable host memory that is
    /// neither written nor freed, and `dst` neither read by another stream
    /// nor freed, until the event has completed.
    pub unsafe fn copy_host_ptr_async(&self, src: *const u8, dst: BufMut<'_, u8>) -> Result<Event> {
        if src.is_null() {
            return Err(CudaError::invalid("copy_host_ptr_async", "null source"));
        }
        if dst.len == 0 {
            return self.record_copy();
        }
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        // SAFETY: the caller vouches for the source range and keeps both
        // ends untouched until the event; `dst` is a bounds-checked view.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst.ptr, src.cast(), dst.len, self.copy.cu_stream()) }
            .result()
            .op("cuMemcpyHtoDAsync")?;
        self.counters.copy();
        self.record_copy()
    }

    /// Copies `src` into `dst` (equal lengths) on the compute stream, in
    /// order with the kernels around it, without waiting.
    ///
    /// # Safety
    /// `src` must be page-locked (a [`HostBuffer`]) or the call is
    /// synchronous; either way it must not be written or freed until the
    /// compute stream has passed this point (an event recorded after it
    /// completed, or a synchronize).
    pub unsafe fn upload_async<T: DeviceElem>(&self, src: &[T], dst: BufMut<'_, T>) -> Result<()> {
        if dst.len != src.len() {
            return Err(CudaError::invalid(
                "upload_async",
                format!("{} elements into a view of {}", src.len(), dst.len),
            ));
        }
        if src.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        // SAFETY: dst covers src.len() elements of a live allocation; the
        // caller keeps `src` unchanged until the stream has passed.
        unsafe { result::memcpy_htod_async(dst.ptr, src, self.compute.cu_stream()) }
            .op("cuMemcpyHtoDAsync")?;
        self.counters.copy();
        Ok(())
    }

    /// Copies `src` into `dst` (equal lengths) on the compute stream after
    /// the work issued before it, without waiting.
    ///
    /// # Safety
    /// `dst` must be page-locked host memory that is neither read nor
    /// freed until the compute stream has passed this point.
    pub unsafe fn download_async<T: DeviceElem>(
        &self,
        src: BufView<'_, T>,
        dst: &mut [T],
    ) -> Result<()> {
        if dst.len() != src.len {
            return Err(CudaError::invalid(
                "download_async",
                format!("{} elements into {}", src.len, dst.len()),
            ));
        }
        if dst.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread().op("cuCtxSetCurrent")?;
        // SAFETY: src covers dst.len() elements of a live allocation; the
        // caller keeps `dst` alive and unread until the stream has passed.
        unsafe { result::memcpy_dtoh_async(dst, src.ptr, self.compute.cu_stream()) }
            .op("cuMemcpyDtoHAsync")?;
        self.counters.copy();
        Ok(())
    }
}

/// Host allocations are page-aligned multiples of this.
pub const HOST_PAGE: usize = 4096;

/// Page-locked host memory of our own: registered with the context (so
/// copies from and to it are asynchronous DMA) and mapped into the device's
/// address space (so kernels can read and write it in place, over the
/// bus). Plain cached memory, not write-combined: the host reads it too.
/// Unregistered and freed on drop, after both streams are idle.
pub struct HostBuffer {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
    len: usize,
    dptr: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
}

// SAFETY: the buffer owns its allocation; host access goes through `&`/
// `&mut` borrows of this value, device access through the unsafe copy and
// launch calls whose callers order it.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only reads.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for the host.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` ≤ the allocation's size; the memory is initialized
        // (zeroed at allocation) and owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, for the host to write.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow exclusive on
        // the host side.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The first `len / size_of::<T>()` elements of type `T`.
    pub fn typed<T: DeviceElem>(&self) -> &[T] {
        // SAFETY: page-aligned (≥ any DeviceElem's alignment), in bounds,
        // initialized; DeviceElem types are plain numbers, valid for every
        // bit pattern.
        unsafe {
            std::slice::from_raw_parts(
                self.ptr.as_ptr().cast::<T>(),
                self.len / std::mem::size_of::<T>(),
            )
        }
    }

    /// Like [`Self::typed`], writable.
    pub fn typed_mut<T: DeviceElem>(&mut self) -> &mut [T] {
        // SAFETY: as in `typed`, with an exclusive borrow.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr().cast::<T>(),
                self.len / std::mem::size_of::<T>(),
            )
        }
    }

    /// The buffer as the device sees it (kernels read it over the bus).
    pub fn device_view<T: DeviceElem>(&self) -> BufView<'_, T> {
        BufView {
            ptr: self.dptr,
            len: self.len / std::mem::size_of::<T>(),
            _p: PhantomData,
        }
    }

    /// The buffer as the device sees it, for kernels to write.
    pub fn device_view_mut<T: DeviceElem>(&mut self) -> BufMut<'_, T> {
        BufMut {
            ptr: self.dptr,
            len: self.len / std::mem::size_of::<T>(),
            _p: PhantomData,
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // Kernels and copies may still touch the memory: wait for both.
        self.ctx.record_err(self.compute.synchronize());
        self.ctx.record_err(self.copy.synchronize());
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: registered by alloc_host and not since; the streams are
        // idle, so nothing uses the range any more.
        self.ctx
            .record_err(unsafe { sys::cuMemHostUnregister(self.ptr.as_ptr().cast()) }.result());
        // SAFETY: allocated by alloc_host with exactly this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// A point in a stream's work.
pub struct Event {
    ev: CudaEvent,
    counters: Arc<DeviceCounters>,
}

impl Event {
    /// Blocks the host until the event's work is done.
    pub fn synchronize(&self) -> Result<()> {
        self.counters.wait();
        self.ev.synchronize().op("cuEventSynchronize")
    }

    /// Whether the event's work is done (errors of earlier work surface
    /// here).
    pub fn is_complete(&self) -> Result<bool> {
        self.ev.try_is_complete().op("cuEventQuery")
    }

    /// Milliseconds from `self` to `end` (both timed events; waits for both).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.ev.elapsed_ms(&end.ev).op("cuEventElapsedTime")
    }
}

/// Host memory registered with the driver for DMA; unregistered on drop
/// (after the copy stream has finished with it).
pub struct HostRegistration {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
    copy: Arc<CudaStream>,
}

// SAFETY: the registration is a plain (pointer, length) pair owned by this
// value; the driver calls it makes are thread-safe.
unsafe impl Send for HostRegistration {}
// SAFETY: shared access only reads ptr/len.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Whether `ptr .. ptr + len` lies inside the registered range.
    pub fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let (a, b) = (self.ptr as usize, self.ptr as usize + self.len);
        let p = ptr as usize;
        p >= a && p.checked_add(len).is_some_and(|e| e <= b)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // Copies still reading the range must finish before it is unpinned.
        self.ctx.record_err(self.copy.synchronize());
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: `ptr` was registered by register_host and not since.
        self.ctx
            .record_err(unsafe { sys::cuMemHostUnregister(self.ptr.cast()) }.result());
    }
}

/// Device memory for `len` elements of `T`.
pub struct DeviceBuffer<T: DeviceElem> {
    // Owns the allocation (freed stream-ordered on drop); kernels use `ptr`.
    _alloc: CudaSlice<T>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl<T: DeviceElem> DeviceBuffer<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole buffer, shared.
    pub fn as_view(&self) -> BufView<'_, T> {
        BufView {
            ptr: self.ptr,
            len: self.len,
            _p: PhantomData,
        }
    }

    /// The whole buffer, exclusive.
    pub fn as_mut(&mut self) -> BufMut<'_, T> {
        BufMut {
            ptr: self.ptr,
            len: self.len,
            _p: PhantomData,
        }
    }

    /// Elements `r`, shared.
    pub fn view(&self, r: Range<usize>) -> Result<BufView<'_, T>> {
        self.as_view().slice(r)
    }

    /// Elements `r`, exclusive.
    pub fn view_mut(&mut self, r: Range<usize>) -> Result<BufMut<'_, T>> {
        let (ptr, len) = sub_range::<T>(self.ptr, self.len, r)?;
        Ok(BufMut {
            ptr,
            len,
            _p: PhantomData,
        })
    }
}

fn sub_range<T>(ptr: sys::CUdeviceptr, len: usize, r: Range<usize>) -> Result<(u64, usize)> {
    if r.start > r.end || r.end > len {
        return Err(CudaError::invalid(
            "view",
            format!("range {}..{} outside a view of {len}", r.start, r.end),
        ));
    }
    Ok((
        ptr + (r.start * std::mem::size_of::<T>()) as u64,
        r.end - r.start,
    ))
}

/// A shared view of device elements (what kernels read).
#[derive(Clone, Copy, Debug)]
pub struct BufView<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    _p: PhantomData<&'a T>,
}

impl<'a, T> BufView<'a, T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Elements `r` of this view.
    pub fn slice(&self, r: Range<usize>) -> Result<BufView<'a, T>> {
        let (ptr, len) = sub_range::<T>(self.ptr, self.len, r)?;
        Ok(BufView {
            ptr,
            len,
            _p: PhantomData,
        })
    }
}

impl<'a> BufView<'a, u8> {
    /// These bytes as elements of `T` (aligned, a whole number of them).
    pub fn cast<T: DeviceElem>(self) -> Result<BufView<'a, T>> {
        let (ptr, len) = cast_range::<T>(self.ptr, self.len)?;
        Ok(BufView {
            ptr,
            len,
            _p: PhantomData,
        })
    }
}

impl<'a> BufMut<'a, u8> {
    /// These bytes as elements of `T` (aligned, a whole number of them).
    pub fn cast<T: DeviceElem>(self) -> Result<BufMut<'a, T>> {
        let (ptr, len) = cast_range::<T>(self.ptr, self.len)?;
        Ok(BufMut {
            ptr,
            len,
            _p: PhantomData,
        })
    }
}

impl<'a, T> BufMut<'a, T> {
    /// Elements `r` of this view, exclusive (consumes the view).
    pub fn slice_mut(self, r: Range<usize>) -> Result<BufMut<'a, T>> {
        let (ptr, len) = sub_range::<T>(self.ptr, self.len, r)?;
        Ok(BufMut {
            ptr,
            len,
            _p: PhantomData,
        })
    }

    /// Elements `..mid` and `mid..` as two exclusive views (consumes the
    /// view).
    pub fn split_at(self, mid: usize) -> Result<(BufMut<'a, T>, BufMut<'a, T>)> {
        if mid > self.len {
            return Err(CudaError::invalid(
                "view",
                format!("split at {mid} of a view of {}", self.len),
            ));
        }
        let size = std::mem::size_of::<T>() as u64;
        Ok((
            BufMut {
                ptr: self.ptr,
                len: mid,
                _p: PhantomData,
            },
            BufMut {
                ptr: self.ptr + mid as u64 * size,
                len: self.len - mid,
                _p: PhantomData,
            },
        ))
    }

    /// The same elements, shared (consumes the view).
    pub fn into_view(self) -> BufView<'a, T> {
        BufView {
            ptr: self.ptr,
            len: self.len,
            _p: PhantomData,
        }
    }
}

fn cast_range<T>(ptr: sys::CUdeviceptr, bytes: usize) -> Result<(u64, usize)> {
    let size = std::mem::size_of::<T>();
    if !ptr.is_multiple_of(std::mem::align_of::<T>() as u64) || !bytes.is_multiple_of(size) {
        return Err(CudaError::invalid(
            "view",
            format!("{bytes} bytes at {ptr:#x} are not whole aligned {size}-byte elements"),
        ));
    }
    Ok((ptr, bytes / size))
}

/// An exclusive view of device elements (what kernels write).
#[derive(Debug)]
pub struct BufMut<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    _p: PhantomData<&'a mut T>,
}

impl<T> BufMut<'_, T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// A shorter-lived exclusive view of the same elements.
    pub fn reborrow(&mut self) -> BufMut<'_, T> {
        BufMut {
            ptr: self.ptr,
            len: self.len,
            _p: PhantomData,
        }
    }
}
