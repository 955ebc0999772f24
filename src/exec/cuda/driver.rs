//! The driver: probing it without panicking, errors, the embedded kernel images and the
//! batched-copy entry point resolved by ABI version.

use std::ffi::c_void;

use cudarc::driver::result;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, DriverError};

use crate::error::{Result, TransferError};

pub(super) const PTX_80: &str = include_str!("../../../kernels/transfer.compute_80.ptx");
pub(super) const CUBIN_80: &[u8] = include_bytes!("../../../kernels/transfer.sm_80.cubin");
pub(super) const CUBIN_90: &[u8] = include_bytes!("../../../kernels/transfer.sm_90.cubin");

pub(super) fn drv(what: &str, e: DriverError) -> TransferError {
    rc_err(what, e.0)
}

/// A failed driver call: [`TransferError::DeviceLost`] for the sticky faults, after which every
/// call on the context fails (an illegal address, a failed launch, ...), else an executor error.
pub(super) fn rc_err(what: impl std::fmt::Display, rc: sys::CUresult) -> TransferError {
    use sys::CUresult as R;
    let sticky = matches!(
        rc,
        R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_LAUNCH_FAILED
            | R::CUDA_ERROR_LAUNCH_TIMEOUT
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_ECC_UNCORRECTABLE
    );
    if sticky {
        TransferError::DeviceLost { backend: "cuda", cause: format!("{what}: {rc:?}") }
    } else {
        TransferError::Executor { backend: "cuda", message: format!("{what}: {rc:?}") }
    }
}

pub(super) fn drv_msg(m: &str) -> TransferError {
    TransferError::Executor { backend: "cuda", message: m.into() }
}

pub(super) fn unavailable(reason: impl Into<String>) -> TransferError {
    TransferError::Unavailable { backend: "cuda", reason: reason.into() }
}

/// Probes the driver without panicking: library → driver version → device count.
/// Returns the driver version (e.g. 12080) and the device count.
pub fn probe() -> Result<(i32, i32)> {
    // SAFETY: only dlopens the candidate library names.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable("libcuda not found (no NVIDIA driver)"));
    }
    let mut version = 0;
    // SAFETY: plain out-parameter call; the library is present.
    let rc = unsafe { sys::cuDriverGetVersion(&mut version) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(unavailable(format!("cuDriverGetVersion: {rc:?}")));
    }
    result::init().map_err(|e| unavailable(format!("cuInit: {e:?} (driver {version})")))?;
    let count = CudaContext::device_count().map_err(|e| unavailable(format!("device count: {e:?}")))?;
    if count == 0 {
        return Err(unavailable(format!("driver {version} sees no device")));
    }
    Ok((version, count))
}

/// `cuMemcpyBatchAsync` with the CUDA 12.8 signature (with `failIdx`).
pub(super) type BatchFn = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// Resolves `cuMemcpyBatchAsync` *by ABI version* (12.8) through `cuGetProcAddress`, so a 13.x
/// driver's renamed `_v2` entry point (a different signature) can never be picked up by name.
/// `None` when the driver is older or does not provide it; nothing here panics for a missing
/// symbol (cudarc's loader would).
pub(super) fn batch_memcpy_fn(driver_version: i32) -> Option<BatchFn> {
    type GetProcV2 = unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void, i32, u64, *mut i32) -> sys::CUresult;
    type GetProcV1 = unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void, i32, u64) -> sys::CUresult;
    if driver_version < 12080 {
        return None;
    }
    let name = c"cuMemcpyBatchAsync";
    let mut pfn: *mut c_void = std::ptr::null_mut();
    // SAFETY: culib() is only called after is_culib_present() succeeded in `probe`; the symbols'
    // signatures are the driver API's; flags 0 = CU_GET_PROC_ADDRESS_DEFAULT.
    let rc = unsafe {
        let lib = sys::culib();
        if let Ok(f) = lib.get::<GetProcV2>(b"cuGetProcAddress_v2\0") {
            let mut status = 0;
            f(name.as_ptr(), &mut pfn, 12080, 0, &mut status)
        } else if let Ok(f) = lib.get::<GetProcV1>(b"cuGetProcAddress\0") {
            f(name.as_ptr(), &mut pfn, 12080, 0)
        } else {
            return None;
        }
    };
    if rc != sys::CUresult::CUDA_SUCCESS || pfn.is_null() {
        return None;
    }
    // SAFETY: the driver returned the 12.8-ABI entry point for this name.
    Some(unsafe { std::mem::transmute::<*mut c_void, BatchFn>(pfn) })
}

/// Most copies one `cuMemcpyBatchAsync` call carries: drivers have crashed or hung near 52k
/// descriptors per call, and a 61-layer page_first_direct backup has hundreds of thousands.
pub(super) const BATCH_MAX: usize = 4096;

/// The legacy NULL stream and the per-thread default stream, which `cuMemcpyBatchAsync` rejects.
pub(super) fn is_default_stream(s: sys::CUstream) -> bool {
    // NULL, CU_STREAM_LEGACY (0x1), CU_STREAM_PER_THREAD (0x2).
    (s as usize) <= 2
}
