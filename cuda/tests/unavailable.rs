//! Without a GPU (CI, most laptops) opening a device must give the typed
//! `Unavailable` error the engine turns into "using the CPU tier", never a
//! panic (cudarc panics when it cannot load libcuda; we must not reach it).

use colibri_cuda::{CudaDevice, CudaError};

#[test]
fn opening_a_device_fails_closed_or_succeeds() {
    match CudaDevice::open(0) {
        Ok(dev) => eprintln!("a GPU is present: {}", dev.info().name),
        Err(CudaError::Unavailable { reason }) => eprintln!("unavailable, as expected: {reason}"),
        Err(e) => panic!("expected Ok or Unavailable, got {e}"),
    }
    match CudaDevice::count() {
        Ok(n) => eprintln!("{n} devices"),
        Err(CudaError::Unavailable { .. }) => {}
        Err(e) => panic!("expected Ok or Unavailable, got {e}"),
    }
}

#[test]
fn an_absent_ordinal_is_unavailable() {
    match CudaDevice::open(10_000) {
        Err(CudaError::Unavailable { .. }) => {}
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(_) => panic!("device 10000 cannot exist"),
    }
}
