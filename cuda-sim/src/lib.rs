//! A simulated CUDA driver for hicache-io's tests: a `libcuda.so` that cudarc loads like the real
//! one (`scripts/cuda-sim.sh` puts it first on the loader's path).
//!
//! - **Devices**: `HICACHE_CUDA_SIM_DEVICES` (default 1, at most 2) H200-like devices (sm_90,
//!   132 SMs, 1024 threads per block, 64K registers), named as simulated.
//! - **Memory**: device allocations are host memory behind addresses no host pointer has, so a
//!   device pointer used as a host pointer faults; fresh memory is filled with 0xCD and freed
//!   memory poisoned (0xDB) and never handed out again. Pinned host memory is host memory whose
//!   device address is its host address (unified addressing).
//! - **Streams** are ordered queues, each run by its own worker thread, with a seeded random delay
//!   per op (`HICACHE_CUDA_SIM_DELAY_US`, `HICACHE_CUDA_SIM_SEED`): a missing wait shows up as wrong
//!   bytes. The legacy NULL stream waits for the blocking streams of its device and they for it;
//!   non-blocking streams order against nothing but events.
//! - **Kernels**: `cuModuleLoadData` accepts the project's cubins (8-byte aligned) and PTX; the
//!   `hicache_gather_w16`/`_w8`/`_w4` and `hicache_check_indices` run `kernels/transfer.cu` compiled for the host,
//!   over the launch's grid, on the stream's worker. A bad or misaligned access is a sticky
//!   error, as on a GPU.
//! - **Race checker** (see `engine`): a race is logged, returned as `CUDA_ERROR_ILLEGAL_STATE` by
//!   the next synchronizing call, and (unless `HICACHE_CUDA_SIM_STRICT=0`) makes the process exit
//!   with status 86 at its end.
//! - **Trace**: `HICACHE_CUDA_SIM_TRACE=file` appends one line per driver call: its name, stream,
//!   whether it blocked the calling thread, and its result.
//! - Every other driver entry point answers `CUDA_ERROR_NOT_SUPPORTED` and logs its name.

#![allow(non_snake_case, clippy::missing_safety_doc)]

mod codes;
mod emu;
mod engine;

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::io::Write;
use std::sync::{Mutex, OnceLock};

use codes::*;
use emu::Kernel;
use engine::{lock, Loc, Mem, OpKind, Origin, State, StreamKind, BLOCKED};

include!(concat!(env!("OUT_DIR"), "/unsupported.rs"));

const CTX_BASE: u64 = 0xC7C7_0000;
const EVENT_DISABLE_TIMING: u32 = 2;
const STREAM_NON_BLOCKING: u32 = 1;
const HOSTREGISTER_READ_ONLY: u32 = 8;

// ------------------------------------------------------------------------------------------
// Logging, trace, errors
// ------------------------------------------------------------------------------------------

fn trace_file() -> Option<&'static Mutex<std::fs::File>> {
    static T: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();
    T.get_or_init(|| {
        let path = std::env::var("HICACHE_CUDA_SIM_TRACE").ok().filter(|p| !p.is_empty())?;
        std::fs::OpenOptions::new().create(true).append(true).open(path).ok().map(Mutex::new)
    })
    .as_ref()
}

/// Runs one driver call: records whether it blocked, traces it, returns its result.
fn api(name: &str, stream: u64, body: impl FnOnce() -> u32) -> u32 {
    BLOCKED.with(|b| b.set(false));
    let rc = body();
    if let Some(f) = trace_file() {
        let blocked = BLOCKED.with(|b| b.get());
        let t = lock().started.elapsed().as_micros();
        let tid = std::thread::current().id();
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(f, "{t} {tid:?} {name} stream={stream:#x} blocked={} rc={}", blocked as u8, codes::name(rc));
    }
    rc
}

/// The answer of every entry point the simulator does not implement.
pub fn unsupported(name: &str) -> u32 {
    eprintln!("cuda-sim: {name} is not simulated: CUDA_ERROR_NOT_SUPPORTED");
    api(name, 0, || CUDA_ERROR_NOT_SUPPORTED)
}

fn messages() -> &'static Mutex<std::collections::HashMap<u32, &'static CStr>> {
    static M: OnceLock<Mutex<std::collections::HashMap<u32, &'static CStr>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

/// The text `cuGetErrorString` gives for `code` from now on: what the simulator found.
pub fn set_last_message(code: u32, msg: &str) {
    let text = format!("{} [cuda-sim: {}]", codes::describe(code), msg.replace('\0', " "));
    let leaked: &'static CStr = Box::leak(std::ffi::CString::new(text).expect("no NUL").into_boxed_c_str());
    messages().lock().unwrap_or_else(|e| e.into_inner()).insert(code, leaked);
}

extern "C" fn at_exit() {
    let g = lock();
    if g.races + g.faults == 0 {
        return;
    }
    eprintln!("cuda-sim: this process had {} stream-ordering race(s) and {} device fault(s)", g.races, g.faults);
    if g.cfg.strict {
        eprintln!("cuda-sim: exiting with status 86 (HICACHE_CUDA_SIM_STRICT=0 keeps the process's own status)");
        // SAFETY: ends the process without running further exit handlers.
        unsafe { libc::_exit(86) };
    }
}

/// Races and faults so far (for tests that plant them): `hicache_cuda_sim_errors(&races, &faults)`.
#[no_mangle]
pub unsafe extern "C" fn hicache_cuda_sim_errors(races: *mut u64, faults: *mut u64) {
    let g = lock();
    if !races.is_null() {
        *races = g.races;
    }
    if !faults.is_null() {
        *faults = g.faults;
    }
}

/// Forgets races and faults found so far (a test that planted them on purpose).
#[no_mangle]
pub extern "C" fn hicache_cuda_sim_clear_errors() {
    let mut g = lock();
    g.races = 0;
    g.faults = 0;
    for u in &mut g.unreported {
        u.clear();
    }
    for s in &mut g.sticky {
        *s = 0;
    }
}

// ------------------------------------------------------------------------------------------
// Contexts
// ------------------------------------------------------------------------------------------

thread_local! {
    static CURRENT: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn current_ctx() -> u64 {
    CURRENT.with(|c| c.borrow().last().copied().unwrap_or(0))
}

fn set_current(ctx: u64) {
    CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        c.pop();
        c.push(ctx);
    })
}

fn ctx_dev(g: &State, ctx: u64) -> Result<usize, u32> {
    if ctx >= CTX_BASE && ((ctx - CTX_BASE) as usize) < g.cfg.devices {
        Ok((ctx - CTX_BASE) as usize)
    } else {
        Err(CUDA_ERROR_INVALID_CONTEXT)
    }
}

/// The current context's device, or the call's error (not initialized, no context, sticky fault).
fn cur(g: &State) -> Result<usize, u32> {
    if !g.inited {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    let dev = ctx_dev(g, current_ctx())?;
    match g.sticky[dev] {
        0 => Ok(dev),
        e => Err(e),
    }
}

macro_rules! tryc {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
}

macro_rules! out {
    ($p:expr, $v:expr) => {{
        if $p.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        *$p = $v;
    }};
}

#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> u32 {
    api("cuInit", 0, || {
        if flags != 0 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let mut g = lock();
        if g.cfg.devices == 0 {
            return CUDA_ERROR_NO_DEVICE;
        }
        if !g.inited {
            g.inited = true;
            // SAFETY: registers a plain extern "C" function.
            unsafe { libc::atexit(at_exit) };
            if g.cfg.verbose {
                eprintln!(
                    "cuda-sim: initialized: {} simulated device(s), delays up to {} us, seed {}",
                    g.cfg.devices, g.cfg.max_delay_us, g.cfg.seed
                );
            }
        }
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> u32 {
    api("cuDriverGetVersion", 0, || {
        out!(v, lock().cfg.driver_version);
        CUDA_SUCCESS
    })
}

fn device_ok(g: &State, dev: c_int) -> Result<usize, u32> {
    if !g.inited {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    if dev < 0 || dev as usize >= g.cfg.devices {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    Ok(dev as usize)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> u32 {
    api("cuDeviceGetCount", 0, || {
        let g = lock();
        if !g.inited {
            return CUDA_ERROR_NOT_INITIALIZED;
        }
        out!(n, g.cfg.devices as c_int);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(d: *mut c_int, ordinal: c_int) -> u32 {
    api("cuDeviceGet", 0, || {
        let dev = tryc!(device_ok(&lock(), ordinal));
        out!(d, dev as c_int);
        CUDA_SUCCESS
    })
}

/// The name `hicache-io info` shows: plainly not hardware.
fn device_name(dev: usize) -> String {
    format!("hicache-io cuda-sim device {dev} (simulated H200-like sm_90; not a GPU)")
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> u32 {
    api("cuDeviceGetName", 0, || {
        let dev = tryc!(device_ok(&lock(), dev));
        if name.is_null() || len <= 0 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let s = device_name(dev);
        let n = s.len().min(len as usize - 1);
        std::ptr::copy_nonoverlapping(s.as_ptr() as *const c_char, name, n);
        *name.add(n) = 0;
        CUDA_SUCCESS
    })
}

fn attribute(attr: c_int, dev: usize, g: &State) -> c_int {
    match attr {
        1 | 2 => 1024,               // max threads per block, max block dim x
        3 => 1024,                   // block dim y
        4 => 64,                     // block dim z
        5 => i32::MAX,               // grid dim x
        6 | 7 => 65535,              // grid dim y, z
        8 => 49152,                  // shared memory per block
        9 => 65536,                  // constant memory
        10 => 32,                    // warp size
        12 | 82 => 65536,            // registers per block / per SM
        13 => 1_980_000,             // clock rate, kHz
        16 => 132,                   // SMs
        19 | 41 | 31 | 91 | 99 => 1, // map host memory, unified addressing, concurrent kernels, registered host pointers, host register
        33 => 0x18 + dev as c_int,   // PCI bus id
        36 => 3_201_000,             // memory clock, kHz
        37 => 6144,                  // bus width
        38 => 60 << 20,              // L2
        39 => 2048,                  // threads per SM
        40 => 3,                     // copy engines
        75 => 9,                     // compute capability
        76 => 0,
        115 => 0, // memory pools: no (cudarc then allocates with cuMemAlloc)
        _ => {
            if g.cfg.verbose {
                eprintln!("cuda-sim: device attribute {attr} reads as 0");
            }
            0
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: c_int) -> u32 {
    api("cuDeviceGetAttribute", 0, || {
        let g = lock();
        let dev = tryc!(device_ok(&g, dev));
        out!(v, attribute(attr, dev, &g));
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: c_int) -> u32 {
    api("cuDeviceComputeCapability", 0, || {
        tryc!(device_ok(&lock(), dev));
        out!(major, 9);
        out!(minor, 0);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> u32 {
    api("cuDeviceTotalMem_v2", 0, || {
        let g = lock();
        tryc!(device_ok(&g, dev));
        out!(bytes, g.cfg.mem_bytes as usize);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: c_int) -> u32 {
    api("cuDeviceGetUuid", 0, || {
        let dev = tryc!(device_ok(&lock(), dev));
        let mut u = *b"hicache-cudasim0";
        u[15] = b'0' + dev as u8;
        out!(uuid, u);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: c_int) -> u32 {
    cuDeviceGetUuid(uuid, dev)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(buf: *mut c_char, len: c_int, dev: c_int) -> u32 {
    api("cuDeviceGetPCIBusId", 0, || {
        let dev = tryc!(device_ok(&lock(), dev));
        if buf.is_null() || len < 13 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let s = format!("0000:{:02x}:00.0\0", 0x18 + dev);
        std::ptr::copy_nonoverlapping(s.as_ptr() as *const c_char, buf, s.len());
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut u64, dev: c_int) -> u32 {
    api("cuDevicePrimaryCtxRetain", 0, || {
        let mut g = lock();
        let dev = tryc!(device_ok(&g, dev));
        g.primary_refs[dev] += 1;
        out!(ctx, CTX_BASE + dev as u64);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> u32 {
    api("cuDevicePrimaryCtxRelease_v2", 0, || {
        let mut g = lock();
        let dev = tryc!(device_ok(&g, dev));
        if g.primary_refs[dev] == 0 {
            return CUDA_ERROR_INVALID_CONTEXT;
        }
        // The primary context (its memory, streams and modules) stays: other holders may exist
        // that do not count (the CUDA runtime), as with the real driver's process-wide context.
        g.primary_refs[dev] -= 1;
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(dev: c_int) -> u32 {
    cuDevicePrimaryCtxRelease_v2(dev)
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(dev: c_int, flags: *mut c_uint, active: *mut c_int) -> u32 {
    api("cuDevicePrimaryCtxGetState", 0, || {
        let g = lock();
        let dev = tryc!(device_ok(&g, dev));
        out!(flags, 0);
        out!(active, (g.primary_refs[dev] > 0) as c_int);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut u64) -> u32 {
    api("cuCtxGetCurrent", 0, || {
        if !lock().inited {
            return CUDA_ERROR_NOT_INITIALIZED;
        }
        out!(ctx, current_ctx());
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: u64) -> u32 {
    api("cuCtxSetCurrent", 0, || {
        let g = lock();
        if !g.inited {
            return CUDA_ERROR_NOT_INITIALIZED;
        }
        if ctx != 0 {
            tryc!(ctx_dev(&g, ctx));
        }
        set_current(ctx);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: u64) -> u32 {
    api("cuCtxPushCurrent_v2", 0, || {
        tryc!(ctx_dev(&lock(), ctx));
        CURRENT.with(|c| c.borrow_mut().push(ctx));
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut u64) -> u32 {
    api("cuCtxPopCurrent_v2", 0, || {
        let c = CURRENT.with(|c| c.borrow_mut().pop());
        match c {
            Some(c) if c != 0 => {
                if !ctx.is_null() {
                    *ctx = c;
                }
                CUDA_SUCCESS
            }
            _ => CUDA_ERROR_INVALID_CONTEXT,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> u32 {
    api("cuCtxGetDevice", 0, || {
        let d = tryc!(ctx_dev(&lock(), current_ctx()));
        out!(dev, d as c_int);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetFlags(_flags: c_uint) -> u32 {
    api("cuCtxSetFlags", 0, || tryc!(cur(&lock()).map(|_| CUDA_SUCCESS)))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetFlags(flags: *mut c_uint) -> u32 {
    api("cuCtxGetFlags", 0, || {
        tryc!(cur(&lock()));
        out!(flags, 0);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> u32 {
    api("cuCtxSynchronize", 0, || {
        let mut g = lock();
        let dev = match ctx_dev(&g, current_ctx()) {
            Ok(d) => d,
            Err(e) => return e,
        };
        let targets: Vec<(usize, u64, Vec<u64>)> =
            g.streams.iter().enumerate().filter(|(_, s)| s.dev == dev).map(|(i, s)| (i, s.enq, s.vc.clone())).collect();
        for (sid, seq, vc) in targets {
            g = State::wait(g, sid, seq, &vc);
        }
        BLOCKED.with(|b| b.set(true));
        g.sync_error(dev)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> u32 {
    api("cuMemGetInfo_v2", 0, || {
        let g = lock();
        let dev = tryc!(cur(&g));
        out!(free, (g.cfg.mem_bytes - g.dev_used[dev]) as usize);
        out!(total, g.cfg.mem_bytes as usize);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: u32, s: *mut *const c_char) -> u32 {
    if s.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if let Some(m) = messages().lock().unwrap_or_else(|e| e.into_inner()).get(&code) {
        *s = m.as_ptr();
        return CUDA_SUCCESS;
    }
    static TEXTS: OnceLock<Mutex<std::collections::HashMap<u32, &'static CStr>>> = OnceLock::new();
    let mut t = TEXTS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let c = t.entry(code).or_insert_with(|| Box::leak(std::ffi::CString::new(codes::describe(code)).expect("text").into_boxed_c_str()));
    *s = c.as_ptr();
    CUDA_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: u32, s: *mut *const c_char) -> u32 {
    if s.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    static NAMES: OnceLock<Mutex<std::collections::HashMap<u32, &'static CStr>>> = OnceLock::new();
    let mut t = NAMES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let c = t.entry(code).or_insert_with(|| Box::leak(std::ffi::CString::new(codes::name(code)).expect("name").into_boxed_c_str()));
    *s = c.as_ptr();
    CUDA_SUCCESS
}

// ------------------------------------------------------------------------------------------
// Memory
// ------------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(p: *mut u64, bytes: usize) -> u32 {
    api("cuMemAlloc_v2", 0, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        if p.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        *p = tryc!(g.alloc(bytes as u64, Mem::Device(dev)));
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(p: u64) -> u32 {
    api("cuMemFree_v2", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        if !matches!(g.allocs.get(&p).map(|a| a.mem), Some(Mem::Device(_))) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        tryc!(g.free(p, "cuMemFree").map(|_| CUDA_SUCCESS))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(p: *mut *mut c_void, bytes: usize, _flags: c_uint) -> u32 {
    api("cuMemHostAlloc", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        if p.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        *p = tryc!(g.alloc(bytes as u64, Mem::Pinned)) as *mut c_void;
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(p: *mut *mut c_void, bytes: usize) -> u32 {
    cuMemHostAlloc(p, bytes, 0)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> u32 {
    api("cuMemFreeHost", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        if !matches!(g.allocs.get(&(p as u64)).map(|a| a.mem), Some(Mem::Pinned)) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        tryc!(g.free(p as u64, "cuMemFreeHost").map(|_| CUDA_SUCCESS))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister_v2(p: *mut c_void, bytes: usize, flags: c_uint) -> u32 {
    api("cuMemHostRegister_v2", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        tryc!(g.register_host(p as u64, bytes as u64, flags & HOSTREGISTER_READ_ONLY != 0).map(|_| CUDA_SUCCESS))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister(p: *mut c_void, bytes: usize, flags: c_uint) -> u32 {
    cuMemHostRegister_v2(p, bytes, flags)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> u32 {
    api("cuMemHostUnregister", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        if !matches!(g.allocs.get(&(p as u64)).map(|a| a.mem), Some(Mem::Registered { .. })) {
            return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
        }
        tryc!(g.free(p as u64, "cuMemHostUnregister").map(|_| CUDA_SUCCESS))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(d: *mut u64, p: *mut c_void, flags: c_uint) -> u32 {
    api("cuMemHostGetDevicePointer_v2", 0, || {
        let g = lock();
        tryc!(cur(&g));
        if flags != 0 || d.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        match g.locate(p as u64, 1) {
            Loc::Tracked { mem: Mem::Pinned | Mem::Registered { .. }, .. } => {
                *d = p as u64;
                CUDA_SUCCESS
            }
            _ => CUDA_ERROR_INVALID_VALUE,
        }
    })
}

// ---- the virtual-memory API ---------------------------------------------------------------

/// `CUmemAllocationProp`'s device: `location.id` (after `type`, `requestedHandleTypes` and
/// `location.type`, three `u32`s).
unsafe fn prop_device(g: &State, prop: *const c_void) -> Result<usize, u32> {
    if prop.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let id = *(prop as *const i32).add(3);
    usize::try_from(id).ok().filter(|&d| d < g.dev_used.len()).ok_or(CUDA_ERROR_INVALID_DEVICE)
}

/// The granularity of mappings: 2 MiB, as on current GPUs.
const GRANULARITY: usize = 2 << 20;

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const c_void, _option: c_uint) -> u32 {
    api("cuMemGetAllocationGranularity", 0, || {
        let g = lock();
        tryc!(cur(&g));
        tryc!(prop_device(&g, prop));
        if granularity.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        *granularity = GRANULARITY;
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(ptr: *mut u64, size: usize, _alignment: usize, _addr: u64, _flags: u64) -> u32 {
    api("cuMemAddressReserve", 0, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        if ptr.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        *ptr = tryc!(g.reserve(size as u64, dev));
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressFree(ptr: u64, size: usize) -> u32 {
    api("cuMemAddressFree", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        tryc!(g.address_free(ptr, size as u64).map(|_| CUDA_SUCCESS))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(handle: *mut u64, size: usize, prop: *const c_void, _flags: u64) -> u32 {
    api("cuMemCreate", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        let dev = tryc!(prop_device(&g, prop));
        if handle.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        *handle = tryc!(g.create(size as u64, dev));
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> u32 {
    api("cuMemRelease", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        tryc!(g.release(handle).map(|_| CUDA_SUCCESS))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemMap(ptr: u64, size: usize, offset: usize, handle: u64, _flags: u64) -> u32 {
    api("cuMemMap", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        tryc!(g.map(ptr, size as u64, offset as u64, handle).map(|_| CUDA_SUCCESS))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: u64, size: usize) -> u32 {
    api("cuMemUnmap", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        // Queued work that may still use the memory is reported like a free's (a race).
        tryc!(g.unmap(ptr, size as u64).map(|_| CUDA_SUCCESS))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(ptr: u64, size: usize, desc: *const c_void, count: usize) -> u32 {
    api("cuMemSetAccess", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        if desc.is_null() || count == 0 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        tryc!(g.set_access(ptr, size as u64).map(|_| CUDA_SUCCESS))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(base: *mut u64, size: *mut usize, ptr: u64) -> u32 {
    api("cuMemGetAddressRange_v2", 0, || {
        let g = lock();
        tryc!(cur(&g));
        match g.locate(ptr, 1) {
            Loc::Tracked { key, .. } => {
                if !base.is_null() {
                    *base = key;
                }
                if !size.is_null() {
                    *size = g.allocs[&key].len as usize;
                }
                CUDA_SUCCESS
            }
            _ => CUDA_ERROR_NOT_FOUND,
        }
    })
}

// ---- stream-ordered allocation -------------------------------------------------------------

/// The default pool of device `dev` (a handle of its own per device).
fn default_pool(dev: usize) -> u64 {
    0x9001_0000 + dev as u64
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut u64, dev: c_int) -> u32 {
    api("cuDeviceGetDefaultMemPool", 0, || {
        let g = lock();
        tryc!(cur(&g));
        if pool.is_null() || dev < 0 || dev as usize >= g.dev_used.len() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        *pool = default_pool(dev as usize);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolCreate(pool: *mut u64, props: *const c_void) -> u32 {
    api("cuMemPoolCreate", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        // `CUmemPoolProps` starts like `CUmemAllocationProp`: the device at the same place.
        let dev = tryc!(prop_device(&g, props));
        if pool.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let _ = dev;
        *pool = g.new_handle();
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolDestroy(_pool: u64) -> u32 {
    api("cuMemPoolDestroy", 0, || CUDA_SUCCESS)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolTrimTo(_pool: u64, _keep: usize) -> u32 {
    api("cuMemPoolTrimTo", 0, || CUDA_SUCCESS)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAttribute(_pool: u64, _attr: c_int, _value: *mut c_void) -> u32 {
    api("cuMemPoolSetAttribute", 0, || CUDA_SUCCESS)
}

unsafe fn alloc_async(name: &str, dptr: *mut u64, size: usize, pool: Option<u64>, stream: u64) -> u32 {
    api(name, stream, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        if dptr.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let sid = tryc!(g.resolve(stream, dev));
        let pool = pool.unwrap_or_else(|| default_pool(dev));
        *dptr = tryc!(g.alloc_async(size as u64, dev, pool, sid));
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut u64, size: usize, stream: u64) -> u32 {
    alloc_async("cuMemAllocAsync", dptr, size, None, stream)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(dptr: *mut u64, size: usize, pool: u64, stream: u64) -> u32 {
    alloc_async("cuMemAllocFromPoolAsync", dptr, size, Some(pool), stream)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: u64, stream: u64) -> u32 {
    api("cuMemFreeAsync", stream, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        if !matches!(g.allocs.get(&dptr).map(|a| a.origin), Some(Origin::Pool { .. })) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let sid = tryc!(g.resolve(stream, dev));
        g.enqueue(sid, OpKind::Free { addr: dptr }, "cuMemFreeAsync".to_string(), vec![], None);
        CUDA_SUCCESS
    })
}

/// Writes one pointer attribute; `Err` for an unknown pointer.
unsafe fn pointer_attribute(g: &State, attr: c_int, data: *mut c_void, ptr: u64) -> Result<(), u32> {
    let (key, mem) = match g.locate(ptr, 1) {
        Loc::Tracked { key, mem, .. } => (key, mem),
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    let a = &g.allocs[&key];
    let dev = match mem {
        Mem::Device(d) => d as i32,
        _ => ctx_dev(g, current_ctx()).map_or(0, |d| d as i32),
    };
    if data.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match (attr, a.origin) {
        // Memory of the virtual-memory API belongs to no context (the query fails); a
        // stream-ordered pool's answers an empty context.
        (1, Origin::Mapped { .. }) => return Err(CUDA_ERROR_INVALID_VALUE),
        (1, Origin::Pool { .. }) => {
            *(data as *mut u64) = 0;
            return Ok(());
        }
        (17, Origin::Pool { pool }) => {
            *(data as *mut u64) = pool;
            return Ok(());
        }
        (17, _) => return Err(CUDA_ERROR_INVALID_VALUE),
        _ => {}
    }
    match attr {
        1 => *(data as *mut u64) = CTX_BASE + dev as u64,
        2 => *(data as *mut u32) = if matches!(mem, Mem::Device(_)) { 2 } else { 1 },
        3 => *(data as *mut u64) = ptr,
        4 => {
            if matches!(mem, Mem::Device(_)) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            *(data as *mut u64) = ptr
        }
        6 | 13 => *(data as *mut u32) = 1,
        7 => *(data as *mut u64) = key,
        8 => *(data as *mut u32) = 0,
        9 => *(data as *mut i32) = dev,
        11 => *(data as *mut u64) = key,
        12 => *(data as *mut usize) = a.len as usize,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(data: *mut c_void, attr: c_int, ptr: u64) -> u32 {
    api("cuPointerGetAttribute", 0, || {
        let g = lock();
        tryc!(cur(&g));
        tryc!(pointer_attribute(&g, attr, data, ptr).map(|_| CUDA_SUCCESS))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttributes(n: c_uint, attrs: *const c_int, data: *mut *mut c_void, ptr: u64) -> u32 {
    api("cuPointerGetAttributes", 0, || {
        let g = lock();
        tryc!(cur(&g));
        if attrs.is_null() || data.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        for i in 0..n as usize {
            let (attr, out) = (*attrs.add(i), *data.add(i));
            // Unknown pointers read as "not CUDA memory" (zeros), as the driver documents.
            if pointer_attribute(&g, attr, out, ptr).is_err() && !out.is_null() {
                match attr {
                    2 | 6 | 8 | 13 => *(out as *mut u32) = 0,
                    9 => *(out as *mut i32) = -2,
                    _ => *(out as *mut u64) = 0,
                }
            }
        }
        CUDA_SUCCESS
    })
}

// ------------------------------------------------------------------------------------------
// Streams and events
// ------------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(s: *mut u64, flags: c_uint) -> u32 {
    api("cuStreamCreate", 0, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        if s.is_null() || flags > 1 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let kind = if flags & STREAM_NON_BLOCKING != 0 { StreamKind::NonBlocking } else { StreamKind::Blocking };
        let sid = g.spawn_stream(dev, kind, flags, 0);
        *s = g.streams[sid].handle;
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(s: *mut u64, flags: c_uint, _priority: c_int) -> u32 {
    cuStreamCreate(s, flags)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(s: u64) -> u32 {
    api("cuStreamDestroy_v2", s, || {
        let mut g = lock();
        let Some(sid) = g.stream_ids.remove(&s) else {
            return CUDA_ERROR_INVALID_HANDLE;
        };
        // Work already enqueued still runs; the worker ends after it.
        g.streams[sid].destroyed = true;
        engine::engine().cv.notify_all();
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(s: u64, ctx: *mut u64) -> u32 {
    api("cuStreamGetCtx", s, || {
        let mut g = lock();
        let dev = tryc!(ctx_dev(&g, current_ctx()).or_else(|e| if s > 2 { Ok(0) } else { Err(e) }));
        let sid = tryc!(g.resolve(s, dev));
        out!(ctx, CTX_BASE + g.streams[sid].dev as u64);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetFlags(s: u64, flags: *mut c_uint) -> u32 {
    api("cuStreamGetFlags", s, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        let sid = tryc!(g.resolve(s, dev));
        out!(flags, g.streams[sid].flags);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(s: u64) -> u32 {
    api("cuStreamSynchronize", s, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        let sid = tryc!(g.resolve(s, dev));
        let (seq, vc) = (g.streams[sid].enq, g.streams[sid].vc.clone());
        g = State::wait(g, sid, seq, &vc);
        g.sync_error(dev)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(s: u64) -> u32 {
    api("cuStreamQuery", s, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        let sid = tryc!(g.resolve(s, dev));
        let st = &g.streams[sid];
        if st.done < st.enq {
            return CUDA_ERROR_NOT_READY;
        }
        let vc = st.vc.clone();
        g.observe(&vc);
        g.sync_error(dev)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(s: u64, e: u64, flags: c_uint) -> u32 {
    api("cuStreamWaitEvent", s, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        if flags != 0 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let sid = tryc!(g.resolve(s, dev));
        let Some(ev) = g.events.get(&e) else {
            return CUDA_ERROR_INVALID_HANDLE;
        };
        // Waiting on an event never recorded is a no-op, as on the real driver.
        if let Some((esid, seq, clock)) = ev.rec.clone() {
            g.enqueue(sid, OpKind::Nop, format!("cuStreamWaitEvent({e:#x})"), vec![(esid, seq)], Some(&clock));
        }
        CUDA_SUCCESS
    })
}

type HostCallback = unsafe extern "C" fn(*mut c_void);

#[no_mangle]
pub unsafe extern "C" fn cuLaunchHostFunc(s: u64, f: Option<HostCallback>, data: *mut c_void) -> u32 {
    api("cuLaunchHostFunc", s, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        let Some(f) = f else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        let sid = tryc!(g.resolve(s, dev));
        g.enqueue(sid, OpKind::HostFn { f, data: data as usize }, "cuLaunchHostFunc".into(), vec![], None);
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(e: *mut u64, flags: c_uint) -> u32 {
    api("cuEventCreate", 0, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        if e.is_null() || flags > 7 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let h = g.new_handle();
        g.events.insert(h, engine::EventSt { dev, flags, rec: None, generation: 0, when: None });
        *e = h;
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(e: u64) -> u32 {
    api("cuEventDestroy_v2", 0, || {
        // Destroying a pending event is allowed; waits already enqueued keep what they need.
        if lock().events.remove(&e).is_none() {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(e: u64, s: u64) -> u32 {
    api("cuEventRecord", s, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        let sid = tryc!(g.resolve(s, dev));
        let sdev = g.streams[sid].dev;
        let Some(ev) = g.events.get_mut(&e) else {
            return CUDA_ERROR_INVALID_HANDLE;
        };
        if ev.dev != sdev {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        ev.generation += 1;
        ev.when = None;
        let generation = ev.generation;
        let seq = g.enqueue(sid, OpKind::Record { event: e, generation }, format!("cuEventRecord({e:#x})"), vec![], None);
        let clock = g.streams[sid].vc.clone();
        if let Some(ev) = g.events.get_mut(&e) {
            ev.rec = Some((sid, seq, clock));
        }
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecordWithFlags(e: u64, s: u64, _flags: c_uint) -> u32 {
    cuEventRecord(e, s)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(e: u64) -> u32 {
    api("cuEventQuery", 0, || {
        let mut g = lock();
        let Some(ev) = g.events.get(&e) else {
            return CUDA_ERROR_INVALID_HANDLE;
        };
        let dev = ev.dev;
        if let Some((sid, seq, clock)) = ev.rec.clone() {
            if g.streams[sid].done < seq {
                return CUDA_ERROR_NOT_READY;
            }
            g.observe(&clock);
        }
        g.sync_error(dev)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(e: u64) -> u32 {
    api("cuEventSynchronize", 0, || {
        let mut g = lock();
        let Some(ev) = g.events.get(&e) else {
            return CUDA_ERROR_INVALID_HANDLE;
        };
        let dev = ev.dev;
        BLOCKED.with(|b| b.set(true));
        if let Some((sid, seq, clock)) = ev.rec.clone() {
            g = State::wait(g, sid, seq, &clock);
        }
        g.sync_error(dev)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: u64, end: u64) -> u32 {
    api("cuEventElapsedTime", 0, || {
        let g = lock();
        let (Some(a), Some(b)) = (g.events.get(&start), g.events.get(&end)) else {
            return CUDA_ERROR_INVALID_HANDLE;
        };
        if a.flags & EVENT_DISABLE_TIMING != 0 || b.flags & EVENT_DISABLE_TIMING != 0 || a.rec.is_none() || b.rec.is_none() {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        match (a.when, b.when) {
            (Some(x), Some(y)) => {
                out!(ms, (y.saturating_duration_since(x).as_secs_f64() * 1e3) as f32);
                CUDA_SUCCESS
            }
            _ => CUDA_ERROR_NOT_READY,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: u64, end: u64) -> u32 {
    cuEventElapsedTime(ms, start, end)
}

// ------------------------------------------------------------------------------------------
// Copies and memsets
// ------------------------------------------------------------------------------------------

/// How a copy's side is reached, checked when the copy is enqueued.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Device,
    /// Pinned or registered host memory.
    Pinned,
    Pageable,
}

fn side(g: &State, addr: u64, len: u64) -> Result<Side, u32> {
    if len == 0 {
        return Ok(Side::Pageable);
    }
    // A span may cross mappings of the virtual-memory API that lie side by side.
    match g.span(addr, len) {
        Ok(None) => Ok(Side::Pageable),
        Ok(Some(pieces)) => match g.allocs[&pieces[0].0].mem {
            Mem::Device(_) => Ok(Side::Device),
            _ => Ok(Side::Pinned),
        },
        Err(why) => {
            eprintln!("cuda-sim: copy refused: {why}");
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

/// What a copy call promises about its sides.
#[derive(Clone, Copy)]
enum Want {
    HtoD,
    DtoH,
    DtoD,
    Any,
}

/// Enqueues a copy on `stream` (`sync`: the synchronous API on the legacy stream), with the
/// driver's documented host behaviour: a pageable source is staged at the call; a copy into
/// pageable memory, and a synchronous copy into host memory or from pinned memory, return only
/// once done.
fn copy(name: &str, dst: u64, src: u64, len: usize, stream: u64, want: Want, sync: bool) -> u32 {
    api(name, stream, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        let len = len as u64;
        let sid = tryc!(g.resolve(if sync { 0 } else { stream }, dev));
        let (ds, ss) = (tryc!(side(&g, dst, len)), tryc!(side(&g, src, len)));
        let ok = match want {
            Want::HtoD => ds == Side::Device && ss != Side::Device,
            Want::DtoH => ss == Side::Device && ds != Side::Device,
            Want::DtoD => ds == Side::Device && ss == Side::Device,
            Want::Any => true,
        };
        if !ok && len > 0 {
            eprintln!("cuda-sim: {name}: a side is not the kind of memory the call names (dst {dst:#x}, src {src:#x})");
            return CUDA_ERROR_INVALID_VALUE;
        }
        if len == 0 {
            return CUDA_SUCCESS;
        }
        let staged = (ss == Side::Pageable).then(|| {
            // SAFETY: the caller hands `len` readable bytes at `src`.
            unsafe { std::slice::from_raw_parts(src as *const u8, len as usize) }.to_vec()
        });
        let seq = g.enqueue(sid, OpKind::Copy { dst, src, len, staged }, format!("{name}({len} bytes)"), vec![], None);
        let wait = ds == Side::Pageable || (sync && (ds == Side::Pinned || ss == Side::Pinned));
        if wait {
            let vc = g.streams[sid].vc.clone();
            g = State::wait(g, sid, seq, &vc);
            return g.sync_error(dev);
        }
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: u64, src: *const c_void, n: usize, s: u64) -> u32 {
    copy("cuMemcpyHtoDAsync_v2", dst, src as u64, n, s, Want::HtoD, false)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: u64, n: usize, s: u64) -> u32 {
    copy("cuMemcpyDtoHAsync_v2", dst as u64, src, n, s, Want::DtoH, false)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, s: u64) -> u32 {
    copy("cuMemcpyDtoDAsync_v2", dst, src, n, s, Want::DtoD, false)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyAsync(dst: u64, src: u64, n: usize, s: u64) -> u32 {
    copy("cuMemcpyAsync", dst, src, n, s, Want::Any, false)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> u32 {
    copy("cuMemcpyHtoD_v2", dst, src as u64, n, 0, Want::HtoD, true)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> u32 {
    copy("cuMemcpyDtoH_v2", dst as u64, src, n, 0, Want::DtoH, true)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, n: usize) -> u32 {
    copy("cuMemcpyDtoD_v2", dst, src, n, 0, Want::DtoD, true)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpy(dst: u64, src: u64, n: usize) -> u32 {
    copy("cuMemcpy", dst, src, n, 0, Want::Any, true)
}

fn memset(name: &str, dst: u64, value: u32, n: usize, width: u8, stream: u64, sync: bool) -> u32 {
    api(name, stream, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        let sid = tryc!(g.resolve(if sync { 0 } else { stream }, dev));
        let bytes = (n as u64).saturating_mul(width as u64);
        let s = tryc!(side(&g, dst, bytes));
        if bytes > 0 && s == Side::Pageable {
            return CUDA_ERROR_INVALID_VALUE;
        }
        if bytes == 0 {
            return CUDA_SUCCESS;
        }
        if !dst.is_multiple_of(width as u64) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let seq = g.enqueue(sid, OpKind::Memset { dst, len: n as u64, value, width }, format!("{name}({bytes} bytes)"), vec![], None);
        if sync && s == Side::Pinned {
            let vc = g.streams[sid].vc.clone();
            g = State::wait(g, sid, seq, &vc);
            return g.sync_error(dev);
        }
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(dst: u64, v: u8, n: usize, s: u64) -> u32 {
    memset("cuMemsetD8Async", dst, v as u32, n, 1, s, false)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD16Async(dst: u64, v: u16, n: usize, s: u64) -> u32 {
    memset("cuMemsetD16Async", dst, v as u32, n, 2, s, false)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(dst: u64, v: u32, n: usize, s: u64) -> u32 {
    memset("cuMemsetD32Async", dst, v, n, 4, s, false)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: u64, v: u8, n: usize) -> u32 {
    memset("cuMemsetD8_v2", dst, v as u32, n, 1, 0, true)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD16_v2(dst: u64, v: u16, n: usize) -> u32 {
    memset("cuMemsetD16_v2", dst, v as u32, n, 2, 0, true)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: u64, v: u32, n: usize) -> u32 {
    memset("cuMemsetD32_v2", dst, v, n, 4, 0, true)
}

/// `CUmemcpyAttributes` (CUDA 12.8).
#[repr(C)]
pub struct MemcpyAttributes {
    src_access_order: u32,
    src_loc_hint: [i32; 2],
    dst_loc_hint: [i32; 2],
    flags: c_uint,
}

/// Both batch ABIs: 12.8 (`fail_idx`) and 13.0 (`_v2`, without it).
#[allow(clippy::too_many_arguments)]
unsafe fn batch(
    name: &str,
    dsts: *const u64,
    srcs: *const u64,
    sizes: *const usize,
    count: usize,
    attrs: *const MemcpyAttributes,
    attr_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    s: u64,
) -> u32 {
    api(name, s, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        if !fail_idx.is_null() {
            *fail_idx = usize::MAX;
        }
        // The batch API refuses the legacy and per-thread default streams.
        if s <= 2
            || count == 0
            || dsts.is_null()
            || srcs.is_null()
            || sizes.is_null()
            || attrs.is_null()
            || attr_idxs.is_null()
            || num_attrs == 0
            || num_attrs > count
        {
            return CUDA_ERROR_INVALID_VALUE;
        }
        if *attr_idxs != 0 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        for i in 0..num_attrs {
            let a = &*attrs.add(i);
            if !(1..=3).contains(&a.src_access_order) || (i > 0 && *attr_idxs.add(i) <= *attr_idxs.add(i - 1)) || *attr_idxs.add(i) >= count
            {
                return CUDA_ERROR_INVALID_VALUE;
            }
        }
        let sid = tryc!(g.resolve(s, dev));
        let mut list = Vec::with_capacity(count);
        for i in 0..count {
            let (d, src, n) = (*dsts.add(i), *srcs.add(i), *sizes.add(i) as u64);
            let bad = match (side(&g, d, n), side(&g, src, n)) {
                // Pageable memory is not for batches here: the caller's buffers must outlive the
                // stream's copy (order STREAM), which only pinned or device memory guarantees.
                (Ok(a), Ok(b)) => n > 0 && (a == Side::Pageable || b == Side::Pageable),
                _ => true,
            };
            if bad {
                if !fail_idx.is_null() {
                    *fail_idx = i;
                }
                eprintln!("cuda-sim: {name}: copy {i} of {count} refused ({n} bytes, dst {d:#x}, src {src:#x})");
                return CUDA_ERROR_INVALID_VALUE;
            }
            list.push((d, src, n));
        }
        g.enqueue(sid, OpKind::Batch(list), format!("{name}({count} copies)"), vec![], None);
        CUDA_SUCCESS
    })
}

/// `cuMemcpyBatchAsync`, CUDA 12.8 ABI.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuMemcpyBatchAsync(
    dsts: *const u64,
    srcs: *const u64,
    sizes: *const usize,
    count: usize,
    attrs: *const MemcpyAttributes,
    attr_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    s: u64,
) -> u32 {
    batch("cuMemcpyBatchAsync", dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, s)
}

/// `cuMemcpyBatchAsync_v2`, CUDA 13.0 ABI (no `failIdx`).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuMemcpyBatchAsync_v2(
    dsts: *const u64,
    srcs: *const u64,
    sizes: *const usize,
    count: usize,
    attrs: *const MemcpyAttributes,
    attr_idxs: *const usize,
    num_attrs: usize,
    s: u64,
) -> u32 {
    batch("cuMemcpyBatchAsync_v2", dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, std::ptr::null_mut(), s)
}

// ------------------------------------------------------------------------------------------
// Modules and kernels
// ------------------------------------------------------------------------------------------

/// Length of an ELF64 image from its header (section headers end it), if it is one.
unsafe fn elf_len(p: *const u8) -> Option<usize> {
    if std::slice::from_raw_parts(p, 4) != b"\x7fELF" || *p.add(4) != 2 {
        return None;
    }
    let rd = |off: usize, n: usize| -> u64 { (0..n).fold(0u64, |acc, i| acc | ((*p.add(off + i) as u64) << (8 * i))) };
    let shoff = rd(0x28, 8) as usize;
    let (shentsize, shnum) = (rd(0x3A, 2) as usize, rd(0x3C, 2) as usize);
    Some(shoff + shentsize * shnum)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(m: *mut u64, image: *const c_void) -> u32 {
    api("cuModuleLoadData", 0, || {
        let mut g = lock();
        tryc!(cur(&g));
        if m.is_null() || image.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let p = image as *const u8;
        let body: &[u8] = if let Some(len) = elf_len(p) {
            // Stricter than needed: an ELF image must be 8-byte aligned, as the driver's own
            // loaders assume (an include_bytes! array is not).
            if !(p as usize).is_multiple_of(8) {
                eprintln!("cuda-sim: cuModuleLoadData: cubin at {p:?} is not 8-byte aligned");
                return CUDA_ERROR_INVALID_IMAGE;
            }
            std::slice::from_raw_parts(p, len)
        } else {
            let text = CStr::from_ptr(image as *const c_char).to_bytes();
            if !contains(text, b".version") || !contains(text, b".entry") {
                return CUDA_ERROR_INVALID_IMAGE;
            }
            text
        };
        // Only the project's kernels can run here.
        if !contains(body, b"hicache_gather_w8") || !contains(body, b"hicache_gather_w4") || !contains(body, b"hicache_check_indices") {
            eprintln!("cuda-sim: cuModuleLoadData: the image has no hicache_gather kernels; only those are simulated");
            return CUDA_ERROR_INVALID_IMAGE;
        }
        let h = g.new_handle();
        g.modules.insert(h);
        *m = h;
        CUDA_SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadDataEx(m: *mut u64, image: *const c_void, _n: c_uint, _o: *mut c_void, _v: *mut c_void) -> u32 {
    cuModuleLoadData(m, image)
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(m: u64) -> u32 {
    api("cuModuleUnload", 0, || if lock().modules.remove(&m) { CUDA_SUCCESS } else { CUDA_ERROR_INVALID_HANDLE })
}

/// A function handle: its module's handle plus 1 + the kernel's number (module handles are
/// multiples of 16).
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut u64, m: u64, name: *const c_char) -> u32 {
    api("cuModuleGetFunction", 0, || {
        let g = lock();
        if !g.modules.contains(&m) {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        if f.is_null() || name.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        match Kernel::by_name(CStr::from_ptr(name).to_bytes()) {
            Some(k) => *f = m + 1 + KERNELS.iter().position(|x| *x == k).expect("listed") as u64,
            None => return CUDA_ERROR_NOT_FOUND,
        }
        CUDA_SUCCESS
    })
}

const KERNELS: [Kernel; 7] = Kernel::ALL;

fn function(g: &State, f: u64) -> Result<Kernel, u32> {
    let (m, k) = (f & !0xF, f & 0xF);
    match KERNELS.get((k as usize).wrapping_sub(1)) {
        Some(kernel) if g.modules.contains(&m) => Ok(*kernel),
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(v: *mut c_int, attr: c_int, f: u64) -> u32 {
    api("cuFuncGetAttribute", 0, || {
        let g = lock();
        tryc!(function(&g, f));
        let value = match attr {
            0 => 1024, // max threads per block (__launch_bounds__(1024))
            1 | 3 => 0,
            2 => 392,
            4 => 32,
            5 => 80,
            6 => 90,
            _ => return CUDA_ERROR_INVALID_VALUE,
        };
        out!(v, value);
        CUDA_SUCCESS
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: u64,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    s: u64,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> u32 {
    api("cuLaunchKernel", s, || {
        let mut g = lock();
        let dev = tryc!(cur(&g));
        let kernel = tryc!(function(&g, f));
        if gx == 0 || bx == 0 || gy == 0 || gz == 0 || by == 0 || bz == 0 || bx > 1024 || gx > i32::MAX as u32 || shared > 49152 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        if gy != 1 || gz != 1 || by != 1 || bz != 1 || !extra.is_null() {
            eprintln!("cuda-sim: cuLaunchKernel: only 1-D grids with kernel parameters are simulated");
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        if params.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // The kernel's arguments, copied now as the driver does (`int`s sign-extended).
        let mut args = [0u64; emu::MAX_ARGS];
        for (i, a) in args.iter_mut().enumerate().take(kernel.arg_count()) {
            let p = *params.add(i);
            if p.is_null() {
                return CUDA_ERROR_INVALID_VALUE;
            }
            *a = if kernel.is_int_arg(i) { (p as *const i32).read_unaligned() as i64 as u64 } else { (p as *const u64).read_unaligned() };
        }
        let sid = tryc!(g.resolve(s, dev));
        let desc = match kernel {
            Kernel::CheckIndices => format!("kernel {} (phase {}, {} pairs, {gx}x{bx})", kernel.name(), args[8] as i64, args[2] as i64),
            _ => format!("kernel {} ({} items, {gx}x{bx})", kernel.name(), args[4] as i64),
        };
        g.enqueue(sid, OpKind::Kernel { kernel, grid: gx, block: bx, args }, desc, vec![], None);
        CUDA_SUCCESS
    })
}

// ------------------------------------------------------------------------------------------
// cuGetProcAddress
// ------------------------------------------------------------------------------------------

include!(concat!(env!("OUT_DIR"), "/implemented.rs"));

unsafe fn self_symbol(name: &CStr) -> *mut c_void {
    static HANDLE: OnceLock<usize> = OnceLock::new();
    let h = *HANDLE.get_or_init(|| {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(cuInit as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return 0;
        }
        libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD) as usize
    });
    if h == 0 {
        return std::ptr::null_mut();
    }
    libc::dlsym(h as *mut c_void, name.as_ptr())
}

unsafe fn proc_address(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, status: *mut c_int) -> u32 {
    if symbol.is_null() || pfn.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pfn = std::ptr::null_mut();
    let name = CStr::from_ptr(symbol);
    let chosen: Option<&str> = match name.to_bytes() {
        // The batch copy exists from 12.8; a 13.x caller gets the 13.0 ABI.
        b"cuMemcpyBatchAsync" if version >= 13000 => Some("cuMemcpyBatchAsync_v2"),
        b"cuMemcpyBatchAsync" if version >= 12080 => Some("cuMemcpyBatchAsync"),
        b"cuMemcpyBatchAsync" => None,
        n => {
            let n = std::str::from_utf8(n).unwrap_or("");
            [format!("{n}_v2"), n.to_string()]
                .into_iter()
                .find(|c| IMPLEMENTED.contains(&c.as_str()))
                .and_then(|c| IMPLEMENTED.iter().copied().find(|i| *i == c))
        }
    };
    let p = chosen.map_or(std::ptr::null_mut(), |c| self_symbol(&std::ffi::CString::new(c).expect("name")));
    if !status.is_null() {
        *status = if p.is_null() { 1 } else { 0 }; // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND / SUCCESS
    }
    *pfn = p;
    CUDA_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    _flags: u64,
    status: *mut c_int,
) -> u32 {
    api("cuGetProcAddress_v2", 0, || proc_address(symbol, pfn, version, status))
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, _flags: u64) -> u32 {
    api("cuGetProcAddress", 0, || {
        let rc = proc_address(symbol, pfn, version, std::ptr::null_mut());
        if rc == CUDA_SUCCESS && (*pfn).is_null() {
            return CUDA_ERROR_NOT_FOUND;
        }
        rc
    })
}
