//! `CUresult` values the simulator returns, and their names.

pub const CUDA_SUCCESS: u32 = 0;
pub const CUDA_ERROR_INVALID_VALUE: u32 = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: u32 = 3;
pub const CUDA_ERROR_NO_DEVICE: u32 = 100;
pub const CUDA_ERROR_INVALID_DEVICE: u32 = 101;
pub const CUDA_ERROR_INVALID_IMAGE: u32 = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: u32 = 201;
pub const CUDA_ERROR_INVALID_PTX: u32 = 218;
pub const CUDA_ERROR_INVALID_HANDLE: u32 = 400;
pub const CUDA_ERROR_ILLEGAL_STATE: u32 = 401;
pub const CUDA_ERROR_NOT_FOUND: u32 = 500;
pub const CUDA_ERROR_NOT_READY: u32 = 600;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: u32 = 700;
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: u32 = 712;
pub const CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: u32 = 713;
pub const CUDA_ERROR_MISALIGNED_ADDRESS: u32 = 716;
pub const CUDA_ERROR_NOT_SUPPORTED: u32 = 801;

pub fn name(code: u32) -> &'static str {
    match code {
        CUDA_SUCCESS => "CUDA_SUCCESS",
        CUDA_ERROR_INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
        CUDA_ERROR_OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
        CUDA_ERROR_NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
        CUDA_ERROR_NO_DEVICE => "CUDA_ERROR_NO_DEVICE",
        CUDA_ERROR_INVALID_DEVICE => "CUDA_ERROR_INVALID_DEVICE",
        CUDA_ERROR_INVALID_IMAGE => "CUDA_ERROR_INVALID_IMAGE",
        CUDA_ERROR_INVALID_CONTEXT => "CUDA_ERROR_INVALID_CONTEXT",
        CUDA_ERROR_INVALID_PTX => "CUDA_ERROR_INVALID_PTX",
        CUDA_ERROR_INVALID_HANDLE => "CUDA_ERROR_INVALID_HANDLE",
        CUDA_ERROR_ILLEGAL_STATE => "CUDA_ERROR_ILLEGAL_STATE",
        CUDA_ERROR_NOT_FOUND => "CUDA_ERROR_NOT_FOUND",
        CUDA_ERROR_NOT_READY => "CUDA_ERROR_NOT_READY",
        CUDA_ERROR_ILLEGAL_ADDRESS => "CUDA_ERROR_ILLEGAL_ADDRESS",
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        CUDA_ERROR_MISALIGNED_ADDRESS => "CUDA_ERROR_MISALIGNED_ADDRESS",
        CUDA_ERROR_NOT_SUPPORTED => "CUDA_ERROR_NOT_SUPPORTED",
        _ => "CUDA_ERROR_UNKNOWN",
    }
}

/// The driver's own description of each code the simulator returns.
pub fn describe(code: u32) -> &'static str {
    match code {
        CUDA_SUCCESS => "no error",
        CUDA_ERROR_INVALID_VALUE => "invalid argument",
        CUDA_ERROR_OUT_OF_MEMORY => "out of memory",
        CUDA_ERROR_NOT_INITIALIZED => "initialization error",
        CUDA_ERROR_NO_DEVICE => "no CUDA-capable device is detected",
        CUDA_ERROR_INVALID_DEVICE => "invalid device ordinal",
        CUDA_ERROR_INVALID_IMAGE => "device kernel image is invalid",
        CUDA_ERROR_INVALID_CONTEXT => "invalid device context",
        CUDA_ERROR_INVALID_PTX => "a PTX JIT compilation failed",
        CUDA_ERROR_INVALID_HANDLE => "invalid resource handle",
        CUDA_ERROR_ILLEGAL_STATE => "the operation cannot be performed in the present state",
        CUDA_ERROR_NOT_FOUND => "named symbol not found",
        CUDA_ERROR_NOT_READY => "device not ready",
        CUDA_ERROR_ILLEGAL_ADDRESS => "an illegal memory access was encountered",
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => "part or all of the requested memory range is already mapped",
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED => "pointer does not correspond to a registered memory region",
        CUDA_ERROR_MISALIGNED_ADDRESS => "misaligned address",
        CUDA_ERROR_NOT_SUPPORTED => "operation not supported",
        _ => "unknown error",
    }
}
