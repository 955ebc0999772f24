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

/// The kernels of `kernels/transfer.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    GatherW16,
    GatherW8,
    GatherW4,
    CheckIndices,
    GatherSumW16,
    GatherSumW8,
    GatherSumW4,
}

/// The most arguments a kernel takes (the summing gathers').
pub const MAX_ARGS: usize = 11;

impl Kernel {
    /// The entry point's name.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::GatherW16 => "hicache_gather_w16",
            Kernel::GatherW8 => "hicache_gather_w8",
            Kernel::GatherW4 => "hicache_gather_w4",
            Kernel::CheckIndices => "hicache_check_indices",
            Kernel::GatherSumW16 => "hicache_gather_sum_w16",
            Kernel::GatherSumW8 => "hicache_gather_sum_w8",
            Kernel::GatherSumW4 => "hicache_gather_sum_w4",
        }
    }
    /// Every kernel.
    pub const ALL: [Kernel; 7] = [
        Kernel::GatherW16,
        Kernel::GatherW8,
        Kernel::GatherW4,
        Kernel::CheckIndices,
        Kernel::GatherSumW16,
        Kernel::GatherSumW8,
        Kernel::GatherSumW4,
    ];
    /// How many arguments it takes: nine, the summing gathers eleven (the key stream's base and the sums).
    pub fn arg_count(self) -> usize {
        if self.sums() {
            11
        } else {
            9
        }
    }
    /// Whether it is a checksumming gather.
    pub fn sums(self) -> bool {
        matches!(self, Kernel::GatherSumW16 | Kernel::GatherSumW8 | Kernel::GatherSumW4)
    }
    /// Every kernel, by name.
    pub fn by_name(name: &[u8]) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name().as_bytes() == name)
    }
    /// Which of the arguments are `int`s (the others are 64-bit).
    pub fn is_int_arg(self, i: usize) -> bool {
        match self {
            Kernel::CheckIndices => i == 5 || i == 8,
            _ => i == 1,
        }
    }
}

type Thunk = unsafe extern "C" fn(*mut *mut c_void);

extern "C" {
    fn hicache_emu_gather_w16(params: *mut *mut c_void);
    fn hicache_emu_gather_w8(params: *mut *mut c_void);
    fn hicache_emu_gather_w4(params: *mut *mut c_void);
    fn hicache_emu_check_indices(params: *mut *mut c_void);
    fn hicache_emu_gather_sum_w16(params: *mut *mut c_void);
    fn hicache_emu_gather_sum_w8(params: *mut *mut c_void);
    fn hicache_emu_gather_sum_w4(params: *mut *mut c_void);
    fn hicache_emu_launch(
        kernel: Thunk,
        grid: u32,
        block: u32,
        params: *mut *mut c_void,
        ranges: *const Range,
        n: i32,
        report: *mut Report,
    ) -> i32;
}

/// Runs `kernel` with its arguments `args` (the first [`Kernel::arg_count`]; the gathers' table
/// and index-list pointers already host addresses; `int` arguments in the low half of their
/// word); every other access goes through `ranges`.
pub fn launch(kernel: Kernel, grid: u32, block: u32, args: &[u64; MAX_ARGS], ranges: &[Range]) -> Result<Report, ()> {
    let mut a = *args;
    let mut ints: [i32; MAX_ARGS] = std::array::from_fn(|i| args[i] as i32);
    let mut params: [*mut c_void; MAX_ARGS] = std::array::from_fn(|_| std::ptr::null_mut());
    for (i, p) in params.iter_mut().enumerate() {
        *p = if kernel.is_int_arg(i) { &mut ints[i] as *mut i32 as *mut c_void } else { &mut a[i] as *mut u64 as *mut c_void };
    }
    let mut report = Report::default();
    let thunk: Thunk = match kernel {
        Kernel::GatherW16 => hicache_emu_gather_w16,
        Kernel::GatherW8 => hicache_emu_gather_w8,
        Kernel::GatherW4 => hicache_emu_gather_w4,
        Kernel::CheckIndices => hicache_emu_check_indices,
        Kernel::GatherSumW16 => hicache_emu_gather_sum_w16,
        Kernel::GatherSumW8 => hicache_emu_gather_sum_w8,
        Kernel::GatherSumW4 => hicache_emu_gather_sum_w4,
    };
    // SAFETY: the parameters point at the arguments with the kernel's types; pointers the
    // kernel reads directly are host spans the caller located inside live allocations; every
    // other access is checked against `ranges` by the emulation's loads and stores.
    let rc = unsafe { hicache_emu_launch(thunk, grid, block, params.as_mut_ptr(), ranges.as_ptr(), ranges.len() as i32, &mut report) };
    if rc == 0 {
        Ok(report)
    } else {
        Err(())
    }
}
