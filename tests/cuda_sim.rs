//! The simulated CUDA driver itself (cuda-sim/, run with `scripts/cuda-sim.sh`): that it catches
//! what it claims to catch — unordered accesses of two streams, a free while work is queued, a
//! device pointer used as a host pointer, the legacy stream's implicit ordering — and stays
//! silent when the ordering is there. Skips outside the simulator (fails if `HICACHE_CUDA_SIM`
//! is set, as `scripts/cuda-sim.sh` does, and the simulator is not what loaded).
//!
//! One test function: a device fault is sticky for the whole process, so the steps run in order
//! and clear what they planted.
#![cfg(feature = "cuda")]

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};

type Errors = unsafe extern "C" fn(*mut u64, *mut u64);
type Clear = unsafe extern "C" fn();

struct Sim {
    errors: Errors,
    clear: Clear,
}

impl Sim {
    fn errors(&self) -> (u64, u64) {
        let (mut r, mut f) = (0, 0);
        // SAFETY: the simulator's own hook.
        unsafe { (self.errors)(&mut r, &mut f) };
        (r, f)
    }
    fn clear(&self) {
        // SAFETY: as above.
        unsafe { (self.clear)() }
    }
}

fn sim() -> Option<Sim> {
    let expected = std::env::var("HICACHE_CUDA_SIM").is_ok_and(|v| v == "1");
    // SAFETY: dlopen of the driver's candidate names only.
    let found = unsafe { sys::is_culib_present() }
        .then(|| unsafe {
            let lib = sys::culib();
            Some(Sim {
                errors: *lib.get::<Errors>(b"hicache_cuda_sim_errors\0").ok()?,
                clear: *lib.get::<Clear>(b"hicache_cuda_sim_clear_errors\0").ok()?,
            })
        })
        .flatten();
    if found.is_none() {
        assert!(!expected, "HICACHE_CUDA_SIM=1 but the loaded libcuda is not the simulator");
        eprintln!("skipping: not running on the simulated driver (scripts/cuda-sim.sh)");
    }
    found
}

unsafe extern "C" fn sleep_20ms(_: *mut c_void) {
    std::thread::sleep(std::time::Duration::from_millis(20));
}

fn code(r: Result<(), result::DriverError>) -> sys::CUresult {
    match r {
        Ok(()) => sys::CUresult::CUDA_SUCCESS,
        Err(e) => e.0,
    }
}

#[test]
fn the_simulator_catches_unordered_streams_and_misused_memory() {
    let Some(sim) = sim() else { return };
    let ctx = CudaContext::new(0).unwrap();
    let name = ctx.name().unwrap();
    assert!(name.contains("cuda-sim") && name.contains("not a GPU"), "{name}");
    let (a, b) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let (sa, sb) = (a.cu_stream(), b.cu_stream());
    let n = 4096usize;
    // SAFETY: raw driver calls on live handles of the bound context; every buffer outlives the
    // work that uses it (each step synchronizes before the next).
    unsafe {
        let dev = result::malloc_sync(n).unwrap();
        let pinned = result::malloc_host(n, 0).unwrap() as *mut u8;
        let ev = streams_race_unless_ordered(&sim, (&a, &b), dev, pinned, n);
        let blocking = null_stream_orders_blocking_streams(&sim, sa, dev, pinned, n);
        ctx.synchronize().unwrap();
        freed_memory_loses_the_device(&sim, &ctx, &a, n);

        // 7. Freeing memory an unsynchronized op already used is a race with that op.
        result::memset_d8_async(dev, 3, n, sa).unwrap();
        ctx.synchronize().ok();
        let other = result::malloc_sync(n).unwrap();
        result::memset_d8_async(other, 3, n, sb).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        result::free_sync(other).unwrap();
        assert_eq!(sim.errors().0, 1, "a free after an unsynchronized write is a race");
        sim.clear();

        result::event::destroy(ev).unwrap();
        assert_eq!(sys::cuStreamDestroy_v2(blocking), sys::CUresult::CUDA_SUCCESS);
        result::free_host(pinned as *mut c_void).unwrap();
        result::free_sync(dev).unwrap();
    }
    ctx.synchronize().unwrap();
    assert_eq!(sim.errors(), (0, 0));
}

/// Parts 1-3: a write on stream `a` and a read on `b` race unless an event orders them. The
/// event (for the caller to destroy).
///
/// # Safety
/// `dev` (device) and `pinned` (host) hold `n` bytes; the streams are live.
unsafe fn streams_race_unless_ordered(sim: &Sim, (a, b): (&CudaStream, &CudaStream), dev: u64, pinned: *mut u8, n: usize) -> sys::CUevent {
    let (sa, sb) = (a.cu_stream(), b.cu_stream());
    unsafe {
        let host = std::slice::from_raw_parts_mut(pinned, n);
        // 1. A write on one stream and a read on another with nothing between them is a race,
        //    reported by the next synchronizing call, whatever bytes the schedule produced.
        result::memset_d8_async(dev, 7, n, sa).unwrap();
        assert_eq!(sys::cuMemcpyDtoHAsync_v2(pinned as *mut c_void, dev, n, sb), sys::CUresult::CUDA_SUCCESS);
        let (ra, rb) = (code(a.synchronize()), code(b.synchronize()));
        assert!([ra, rb].contains(&sys::CUresult::CUDA_ERROR_ILLEGAL_STATE), "{ra:?} {rb:?}");
        assert_eq!(sim.errors(), (1, 0));
        sim.clear();

        // 2. The same with an event between them: ordered, silent, and the bytes arrive.
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
        result::stream::launch_host_function(sa, sleep_20ms, std::ptr::null_mut()).unwrap();
        result::memset_d8_async(dev, 9, n, sa).unwrap();
        result::event::record(ev, sa).unwrap();
        result::stream::wait_event(sb, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap();
        assert_eq!(sys::cuMemcpyDtoHAsync_v2(pinned as *mut c_void, dev, n, sb), sys::CUresult::CUDA_SUCCESS);
        b.synchronize().unwrap();
        assert!(host.iter().all(|x| *x == 9), "the copy ran before the memset it waited for");
        assert_eq!(sim.errors(), (0, 0));

        // 3. Without the wait, the slow writer loses the race in bytes too.
        result::stream::launch_host_function(sa, sleep_20ms, std::ptr::null_mut()).unwrap();
        result::memset_d8_async(dev, 11, n, sa).unwrap();
        assert_eq!(sys::cuMemcpyDtoHAsync_v2(pinned as *mut c_void, dev, n, sb), sys::CUresult::CUDA_SUCCESS);
        b.synchronize().unwrap_or_default();
        assert!(host.iter().all(|x| *x == 9), "the unordered copy should have run first");
        a.synchronize().unwrap_or_default();
        assert_eq!(sim.errors().0, 1);
        sim.clear();
        ev
    }
}

/// Parts 4-5: a device pointer where a call wants host memory is refused; the legacy NULL stream
/// orders blocking streams (flags 0) but not non-blocking ones. The blocking stream made.
///
/// # Safety
/// As [`streams_race_unless_ordered`].
unsafe fn null_stream_orders_blocking_streams(sim: &Sim, sa: sys::CUstream, dev: u64, pinned: *mut u8, n: usize) -> sys::CUstream {
    unsafe {
        let host = std::slice::from_raw_parts_mut(pinned, n);
        // 4. A device pointer where the call wants host memory is refused, not dereferenced.
        let rc = sys::cuMemcpyHtoDAsync_v2(dev, dev as *const c_void, 16, sa);
        assert_eq!(rc, sys::CUresult::CUDA_ERROR_INVALID_VALUE);

        // 5. The legacy NULL stream orders blocking streams (flags 0) but not non-blocking ones.
        let mut blocking: sys::CUstream = std::ptr::null_mut();
        assert_eq!(sys::cuStreamCreate(&mut blocking, 0), sys::CUresult::CUDA_SUCCESS);
        result::stream::launch_host_function(std::ptr::null_mut(), sleep_20ms, std::ptr::null_mut()).unwrap();
        result::memset_d8_async(dev, 13, n, std::ptr::null_mut()).unwrap();
        assert_eq!(sys::cuMemcpyDtoHAsync_v2(pinned as *mut c_void, dev, n, blocking), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuStreamSynchronize(blocking), sys::CUresult::CUDA_SUCCESS);
        assert!(host.iter().all(|x| *x == 13));
        assert_eq!(sim.errors(), (0, 0));
        blocking
    }
}

/// Part 6: freeing memory that queued work still uses: the work faults (sticky, as on a GPU).
/// The executor's calls then fail as a lost device, the one that sees it and every later one,
/// its pools' too.
///
/// # Safety
/// Stream `a` is live on the bound context `ctx`.
unsafe fn freed_memory_loses_the_device(sim: &Sim, ctx: &Arc<CudaContext>, a: &CudaStream, n: usize) {
    let device = hicache_io::Device::open(hicache_io::exec::ExecutorKind::Cuda).unwrap();
    let dc = hicache_io::DevicePoolConfig {
        kind: hicache_io::PoolKind::Mla,
        bytes_per_token: 64,
        slots: 16,
        page_size: 4,
        layers: hicache_io::LayerMap::new(2),
    };
    let pool = hicache_io::DevicePool::new(&device, &dc).unwrap();
    let hc = hicache_io::HostPoolConfig {
        layout: hicache_io::Layout::LayerFirst,
        size: 16,
        head_num: 1,
        profile: hicache_io::Profile::Extended,
        integrity: None,
    };
    let mut hpool = hicache_io::HostPool::new(&pool, &hc).unwrap();
    let kernel = hicache_io::IoBackend::Kernel;
    hpool.backup_from_device_all_layer(&pool, &[0, 1], &[2, 3], kernel).unwrap();
    device.synchronize().unwrap();
    ctx.bind_to_thread().unwrap();
    let sa = a.cu_stream();
    unsafe {
        let doomed = result::malloc_sync(n).unwrap();
        result::stream::launch_host_function(sa, sleep_20ms, std::ptr::null_mut()).unwrap();
        result::memset_d8_async(doomed, 1, n, sa).unwrap();
        result::free_sync(doomed).unwrap();
    }
    let rc = code(a.synchronize());
    assert_eq!(rc, sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
    assert_eq!(sim.errors().1, 1);
    let lost = |r: hicache_io::Result<()>, what: &str| match r {
        Err(hicache_io::TransferError::DeviceLost { backend: "cuda", cause }) => {
            assert!(cause.contains("ILLEGAL_ADDRESS"), "{what}: {cause}")
        }
        other => panic!("{what}: expected a lost device, got {other:?}"),
    };
    lost(device.synchronize(), "synchronize");
    lost(hpool.backup_from_device_all_layer(&pool, &[0, 1], &[2, 3], kernel), "a backup");
    lost(hpool.backup_from_device_all_layer(&pool, &[4, 5], &[6, 7], kernel), "a later backup");
    lost(pool.read_buffer(0, 0).map(|_| ()), "a pool read");
    sim.clear();
    drop(hpool);
    drop(pool);
    ctx.bind_to_thread().unwrap();
}
