//! The copy kernels of `kernels/transfer.cu`, compiled for the host by build.rs, and the
//! launcher of `kernels/host_emulation.h` that walks a grid thread by thread with checked loads
//! and stores.

use std::ffi::c_void;

pub const READ: u64 = 1;
pub const WRITE: u64 = 2;

/// `hicache_emu_range`.
#[repr(C)]
pub struct Range {
    pub start: u64,
    pub len: u64,
    pub flags: u64,
    pub host: u64,
}

/// `hicache_emu_report`.
#[repr(C)]
#[derive(Default, Debug)]
pub struct Report {
    pub faults: u64,
    pub first_fault_addr: u64,
    pub first_fault_size: u64,
    pub first_fault_flags: u64,
    pub bytes_loaded: u64,
    pub bytes_stored: u64,
}

type Kernel = unsafe extern "C" fn(*const c_void, i32, *const i64, *const i64, i64, u64, u64, i64);

extern "C" {
    fn hicache_gather_w8(launches: *const c_void, n: i32, s: *const i64, d: *const i64, items: i64, heads: u64, chunk: u64, ipw: i64);
    fn hicache_gather_w4(launches: *const c_void, n: i32, s: *const i64, d: *const i64, items: i64, heads: u64, chunk: u64, ipw: i64);
    fn hicache_emu_launch(
        kernel: Kernel,
        grid: u32,
        block: u32,
        params: *mut *mut c_void,
        ranges: *const Range,
        n: i32,
        report: *mut Report,
    ) -> i32;
}

/// Runs `hicache_gather_w8`/`_w4` with `args` (the table and index-list pointers already host
/// addresses); every other access goes through `ranges`.
pub fn launch(w8: bool, grid: u32, block: u32, args: &[u64; 8], ranges: &[Range]) -> Result<Report, ()> {
    let mut a = *args;
    let mut n_launches = args[1] as i32;
    let mut params: [*mut c_void; 8] = [
        &mut a[0] as *mut u64 as *mut c_void,
        &mut n_launches as *mut i32 as *mut c_void,
        &mut a[2] as *mut u64 as *mut c_void,
        &mut a[3] as *mut u64 as *mut c_void,
        &mut a[4] as *mut u64 as *mut c_void,
        &mut a[5] as *mut u64 as *mut c_void,
        &mut a[6] as *mut u64 as *mut c_void,
        &mut a[7] as *mut u64 as *mut c_void,
    ];
    let mut report = Report::default();
    let kernel: Kernel = if w8 { hicache_gather_w8 } else { hicache_gather_w4 };
    // SAFETY: the parameters point at the eight arguments in the kernel's order; the table and
    // index lists are host spans the caller located inside live allocations; every other access
    // is checked against `ranges` by the emulation's loads and stores.
    let rc = unsafe { hicache_emu_launch(kernel, grid, block, params.as_mut_ptr(), ranges.as_ptr(), ranges.len() as i32, &mut report) };
    if rc == 0 {
        Ok(report)
    } else {
        Err(())
    }
}
