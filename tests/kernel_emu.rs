//! The cuda kernel's logic without a GPU. `kernels/transfer.cu` is compiled for the host with
//! g++ (`-DHICACHE_HOST_EMULATION`: `kernels/host_emulation.h` supplies the CUDA built-ins and
//! checked plain loads and stores for the inline PTX), loaded with `libloading`, and launched
//! with exactly what the cuda executor launches for a plan: the launch description of
//! `exec::cuda_launch::gather_launch` (the `Launch` table, the word that picks
//! `hicache_gather_w8` / `hicache_gather_w4`, the grid) and the eight kernel arguments, passed
//! as cuLaunchKernel takes them. The buffers are the test's own copies of the pools' contents;
//! the result must equal the oracle's byte for byte, and every byte the plan moves must be
//! loaded and stored exactly once, in bounds, aligned, from a source and into a destination.
//! Every supported `kernel` cell of both profiles, random geometry and indices, sglang's grid
//! and odd grids that exercise the strided item mapping.
//!
//! Without g++ (or `$CXX`) the tests print why and pass, unless `CI` is set: then they fail.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use hicache_io::check::{random_case, supported_cells, Case, Rng};
use hicache_io::exec::cuda_launch::{gather_launch, GatherLaunch, LaunchC, LaunchTuning};
use hicache_io::geometry::BufRef;
use hicache_io::oracle::{self, OracleBuffers};
use hicache_io::plan::StepKind;
use hicache_io::{Device, DevicePool, HostPool, IoBackend, Profile, Request};

/// sglang's grid, the executor's default.
const SGLANG_GRID: LaunchTuning = LaunchTuning { block_quota: 2, num_warps_per_block: 32 };
/// The kernels' `__launch_bounds__`, what `CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK` reports.
const MAX_THREADS_PER_BLOCK: u32 = 1024;

// ------------------------------------------------------------------------------------------
// The emulator: kernels/transfer.cu built for the host
// ------------------------------------------------------------------------------------------

/// `hicache_emu_range`: memory the kernel may touch.
#[repr(C)]
struct Range {
    start: u64,
    len: u64,
    flags: u64,
    /// Where the range lives for the host: the same address here.
    host: u64,
}

const READ: u64 = 1;
const WRITE: u64 = 2;

/// `hicache_emu_report`: what one launch did.
#[repr(C)]
#[derive(Debug, Default)]
struct Report {
    faults: u64,
    first_fault_addr: u64,
    first_fault_size: u64,
    first_fault_flags: u64,
    bytes_loaded: u64,
    bytes_stored: u64,
}

/// `hicache_gather_w8` / `hicache_gather_w4`, compiled for the host.
type Kernel = unsafe extern "C" fn(*const LaunchC, i32, *const i64, *const i64, i64, u64, u64, i64);
/// `hicache_emu_launch(kernel, grid, block, params, ranges, n_ranges, report)`.
type LaunchFn = unsafe extern "C" fn(Kernel, u32, u32, *mut *mut c_void, *const Range, i32, *mut Report) -> i32;

struct Emulator {
    launch: LaunchFn,
    w8: Kernel,
    w4: Kernel,
    // Keeps the functions above loaded (the emulator lives in a static: never unloaded).
    _lib: libloading::Library,
}

/// The emulator, built once per test process; `None` (with a printed reason) when there is no
/// C++ compiler and `CI` is not set.
fn emulator() -> Option<&'static Emulator> {
    static EMU: OnceLock<Option<Emulator>> = OnceLock::new();
    EMU.get_or_init(build_emulator).as_ref()
}

fn build_emulator() -> Option<Emulator> {
    let cxx = std::env::var("CXX").ok().filter(|v| !v.is_empty()).unwrap_or_else(|| "g++".into());
    if !Command::new(&cxx).arg("--version").output().is_ok_and(|o| o.status.success()) {
        let why = format!("no C++ compiler ({cxx}): the host emulation of kernels/transfer.cu needs one");
        if std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0") {
            panic!("{why}; CI is set, so this is a failure (install g++)");
        }
        eprintln!("skipping the kernel emulation: {why}");
        return None;
    }
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/transfer.cu");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kernel_emu");
    std::fs::create_dir_all(&dir).expect("creating the emulator's build folder");
    let so = dir.join(format!("libtransfer_emu-{}.so", std::process::id()));
    let out = Command::new(&cxx)
        .args(["-O1", "-std=c++17", "-Wall", "-Wextra", "-shared", "-fPIC", "-DHICACHE_HOST_EMULATION", "-x", "c++"])
        .arg(&source)
        .arg("-o")
        .arg(&so)
        .output()
        .expect("running the C++ compiler");
    assert!(
        out.status.success(),
        "{cxx} could not build the host emulation of {}:\n{}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    // SAFETY: the library was just built from kernels/transfer.cu; it has no initializers
    // beyond zeroed thread-locals.
    let lib = unsafe { libloading::Library::new(&so) }.expect("loading the host emulation");
    let _ = std::fs::remove_file(&so);
    // SAFETY: the types above are the C signatures of these symbols (kernels/host_emulation.h,
    // kernels/transfer.cu); the library stays loaded for as long as the pointers are used.
    unsafe {
        let launch = *lib.get::<LaunchFn>(b"hicache_emu_launch\0").expect("hicache_emu_launch");
        let w8 = *lib.get::<Kernel>(b"hicache_gather_w8\0").expect("hicache_gather_w8");
        let w4 = *lib.get::<Kernel>(b"hicache_gather_w4\0").expect("hicache_gather_w4");
        Some(Emulator { launch, w8, w4, _lib: lib })
    }
}

// ------------------------------------------------------------------------------------------
// Buffers: the pools' contents at cuMemAlloc's 256-byte alignment
// ------------------------------------------------------------------------------------------

struct Aligned {
    raw: Vec<u8>,
    off: usize,
    len: usize,
}

impl Aligned {
    fn new(bytes: &[u8]) -> Aligned {
        let mut raw = vec![0u8; bytes.len() + 256];
        let off = raw.as_ptr().align_offset(256);
        raw[off..off + bytes.len()].copy_from_slice(bytes);
        Aligned { raw, off, len: bytes.len() }
    }
    /// The address the kernel writes through (taken from a unique borrow).
    fn addr(&mut self) -> u64 {
        self.raw[self.off..].as_mut_ptr() as u64
    }
    fn bytes(&self) -> &[u8] {
        &self.raw[self.off..self.off + self.len]
    }
}

/// Random pool contents: host `[comp]`, device `[comp][slot]`.
struct Contents {
    host: Vec<Vec<u8>>,
    device: Vec<Vec<Vec<u8>>>,
}

impl Contents {
    fn random(dev: &DevicePool, host: &HostPool, seed: u64) -> Contents {
        let mut rng = Rng::new(seed);
        let g = dev.geometry();
        let comps = g.kind().components();
        let mut fill = |len: u64| {
            let mut v = vec![0u8; len as usize];
            rng.fill(&mut v);
            v
        };
        let device = (0..comps).map(|_| (0..g.buffer_count()).map(|_| fill(g.layer_bytes())).collect()).collect();
        let host = (0..comps).map(|_| fill(host.geometry().buffer_bytes())).collect();
        Contents { host, device }
    }
}

// ------------------------------------------------------------------------------------------
// One case
// ------------------------------------------------------------------------------------------

/// What a case ran.
#[derive(Debug, Default)]
struct Ran {
    cells: u64,
    cases: u64,
    launches: u64,
    w8: u64,
    w4: u64,
    bytes: u64,
}

/// Plans `case` on cpu pools, runs every gather step of the plan on the emulated kernel with
/// the executor's launch description (`tamper` may edit it, to show that mistakes are caught)
/// and compares with the oracle.
fn run_case(emu: &Emulator, case: &Case, tuning: LaunchTuning, tamper: impl Fn(&mut GatherLaunch)) -> Result<Ran, String> {
    let device = Device::cpu();
    let dev = DevicePool::new(&device, &case.device).map_err(|e| format!("device pool: {e}"))?;
    let host = HostPool::new(&dev, &case.host).map_err(|e| format!("host pool: {e}"))?;
    let req =
        Request { op: case.op, io_backend: IoBackend::Kernel, host_indices: &case.host_indices, device_indices: &case.device_indices };
    let plan = host.plan(&dev, &req).map_err(|e| format!("planner rejected a supported cell: {e}"))?;

    let contents = Contents::random(&dev, &host, case.seed);
    let mut host_bufs: Vec<Aligned> = contents.host.iter().map(|b| Aligned::new(b)).collect();
    let mut dev_bufs: Vec<Vec<Aligned>> = contents.device.iter().map(|c| c.iter().map(|b| Aligned::new(b)).collect()).collect();
    let mut at: HashMap<BufRef, (u64, u64)> = HashMap::new();
    for (c, b) in host_bufs.iter_mut().enumerate() {
        at.insert(BufRef::Host { comp: c as u8 }, (b.addr(), b.len as u64));
    }
    for (c, bufs) in dev_bufs.iter_mut().enumerate() {
        for (s, b) in bufs.iter_mut().enumerate() {
            at.insert(BufRef::Device { comp: c as u8, slot: s as u32 }, (b.addr(), b.len as u64));
        }
    }
    let where_is = |addr: u64| {
        at.iter()
            .find(|(_, &(start, len))| addr >= start && addr < start + len)
            .map_or_else(|| format!("{addr:#x}, outside every buffer"), |(buf, &(start, _))| format!("{buf:?} + {}", addr - start))
    };

    let mut ran = Ran::default();
    let (mut loaded, mut stored) = (0u64, 0u64);
    for (k, step) in plan.steps().iter().enumerate() {
        let StepKind::Gather(g) = step.kind() else {
            return Err(format!("step {k} of a kernel plan is not a gather: {:?}", step.kind()));
        };
        let mut launch =
            gather_launch(g, |b| at[&b].0, tuning, MAX_THREADS_PER_BLOCK).map_err(|e| format!("step {k}: gather_launch: {e}"))?;
        tamper(&mut launch);
        // The kernel reads `n_items` entries of each index list, the emulator reads them from
        // the plan's own slices: a longer count would read past them.
        if launch.n_items < 0 || launch.n_items as usize > g.src_indices().len().min(g.dst_indices().len()) {
            return Err(format!("step {k}: n_items {} for {} index pairs", launch.n_items, g.src_indices().len()));
        }
        // Sources readable, destinations writable, nothing else.
        let mut ranges: Vec<Range> = Vec::new();
        for p in g.pairs() {
            for (buf, flags) in [(p.src().buf(), READ), (p.dst().buf(), WRITE)] {
                let (start, len) = at[&buf];
                ranges.push(Range { start, len, flags, host: start });
            }
        }
        // The eight kernel arguments, built by the executor's own code.
        let mut args = launch.args(launch.table.as_ptr() as u64, g.src_indices().as_ptr() as u64, g.dst_indices().as_ptr() as u64);
        let mut params = args.params();
        let kernel = match launch.word {
            8 => emu.w8,
            4 => emu.w4,
            w => return Err(format!("step {k}: word {w}")),
        };
        let mut report = Report::default();
        // SAFETY: `params` points at live arguments of the kernel's types; the table and the
        // index lists outlive the call; every global access is checked against `ranges`, which
        // lie inside this case's own buffers.
        let rc = unsafe {
            (emu.launch)(
                kernel,
                launch.blocks,
                launch.threads_per_block,
                params.as_mut_ptr(),
                ranges.as_ptr(),
                ranges.len() as i32,
                &mut report,
            )
        };
        if rc != 0 {
            return Err(format!("step {k}: launch refused: {} blocks x {} threads", launch.blocks, launch.threads_per_block));
        }
        if report.faults > 0 {
            let (addr, size, need) = (report.first_fault_addr, report.first_fault_size, report.first_fault_flags);
            let access = if need == READ { "load" } else { "store" };
            let why = if addr % size != 0 {
                "misaligned"
            } else if ranges.iter().any(|r| addr >= r.start && addr + size <= r.start + r.len) {
                "the wrong side: a load from a destination or a store into a source"
            } else {
                "outside the step's buffers"
            };
            return Err(format!("step {k}: {} bad accesses; the first: {size}-byte {access} at {} ({why})", report.faults, where_is(addr)));
        }
        ran.launches += 1;
        if launch.word == 8 {
            ran.w8 += 1;
        } else {
            ran.w4 += 1;
        }
        loaded += report.bytes_loaded;
        stored += report.bytes_stored;
    }

    let mut want = contents;
    oracle::apply(
        host.pair(),
        case.op,
        &case.host_indices,
        &case.device_indices,
        OracleBuffers { host: &mut want.host, device: &mut want.device },
    );
    for (c, w) in want.host.iter().enumerate() {
        if let Some(off) = first_diff(host_bufs[c].bytes(), w) {
            return Err(format!("host component {c} differs from the oracle at byte {off}"));
        }
    }
    for (c, bufs) in want.device.iter().enumerate() {
        for (s, w) in bufs.iter().enumerate() {
            if let Some(off) = first_diff(dev_bufs[c][s].bytes(), w) {
                return Err(format!("device component {c} buffer {s} differs from the oracle at byte {off}"));
            }
        }
    }
    // Equal bytes could still hide a duplicated or a missing-but-unchanged copy: every byte the
    // plan moves is loaded and stored exactly once.
    if loaded != plan.bytes() || stored != plan.bytes() {
        return Err(format!("the plan moves {} bytes; the kernel loaded {loaded} and stored {stored}", plan.bytes()));
    }
    ran.bytes = stored;
    Ok(ran)
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// `seeds` random cases of every supported `kernel` cell of `profile` under `tuning`; panics
/// with the failures, else returns what ran.
fn sweep(emu: &Emulator, profile: Profile, tuning: LaunchTuning, seed: u64, seeds: u64) -> Ran {
    let cells: Vec<_> = supported_cells(profile).into_iter().filter(|c| c.io == IoBackend::Kernel).collect();
    assert!(!cells.is_empty(), "{profile}: no supported kernel cell");
    let mut rng = Rng::new(seed);
    let (mut total, mut failures) = (Ran::default(), Vec::new());
    total.cells = cells.len() as u64;
    for cell in cells {
        let mut moved = 0;
        for _ in 0..seeds {
            let case = random_case(cell, profile, &mut rng);
            match run_case(emu, &case, tuning, |_| {}) {
                Ok(r) => {
                    moved += r.bytes;
                    total.cases += 1;
                    total.launches += r.launches;
                    total.w8 += r.w8;
                    total.w4 += r.w4;
                    total.bytes += r.bytes;
                }
                Err(e) => failures.push(format!("{profile} {cell} {tuning:?} seed {}: {e}\n  {case:?}", case.seed)),
            }
        }
        // Some loads are defined no-ops (a layer this pool does not own); not every case.
        if moved == 0 {
            failures.push(format!("{profile} {cell}: none of {seeds} cases moved a byte"));
        }
    }
    assert!(failures.is_empty(), "{} failure(s), the first ones:\n{}", failures.len(), failures[..failures.len().min(6)].join("\n"));
    total
}

// ------------------------------------------------------------------------------------------
// Tests
// ------------------------------------------------------------------------------------------

#[test]
fn sglang_profile_kernel_cells_match_the_oracle() {
    let Some(emu) = emulator() else { return };
    let ran = sweep(emu, Profile::Sglang, SGLANG_GRID, 1, 40);
    // sglang's 8-byte word: every copy is hicache_gather_w8.
    assert!(ran.w8 > 0 && ran.w4 == 0, "{ran:?}");
    eprintln!("sglang profile: {ran:?}");
}

#[test]
fn extended_profile_kernel_cells_match_the_oracle() {
    let Some(emu) = emulator() else { return };
    let ran = sweep(emu, Profile::Extended, SGLANG_GRID, 2, 40);
    // 4-byte items and chunks run hicache_gather_w4; the others hicache_gather_w8.
    assert!(ran.w8 > 0 && ran.w4 > 0, "{ran:?}");
    eprintln!("extended profile: {ran:?}");
}

#[test]
fn strided_grids_match_the_oracle() {
    let Some(emu) = emulator() else { return };
    // One warp doing everything, odd block and warp counts, more warps than items, and a warp
    // count past the launch bounds (clamped to 32 warps).
    let tunings = [(1, 1), (3, 7), (5, 3), (1, 32), (16, 2), (7, 64)];
    for (i, (block_quota, num_warps_per_block)) in tunings.into_iter().enumerate() {
        let tuning = LaunchTuning { block_quota, num_warps_per_block };
        for profile in [Profile::Sglang, Profile::Extended] {
            sweep(emu, profile, tuning, 100 + i as u64, 8);
        }
    }
}

/// A named edit of a launch description.
type Edit = (&'static str, fn(&mut GatherLaunch));

/// The harness itself: launch descriptions that are off by a word, a chunk, an item or a block
/// are caught (page_head cells: several heads per item, pages of several tokens).
#[test]
fn a_wrong_launch_description_is_caught() {
    let Some(emu) = emulator() else { return };
    let cell = supported_cells(Profile::Extended)
        .into_iter()
        .find(|c| c.io == IoBackend::Kernel && c.layout == hicache_io::Layout::PageHead)
        .expect("a page_head kernel cell");
    let edits: [Edit; 4] = [
        ("destination base + 4 bytes", |l| l.table.iter_mut().for_each(|p| p.dst.base += 4)),
        ("source base + one chunk", |l| l.table.iter_mut().for_each(|p| p.src.base += l.chunk_bytes)),
        ("one item fewer", |l| l.n_items -= 1),
        ("one block fewer", |l| l.blocks -= 1),
    ];
    // Single-warp blocks: two items or more always take two blocks or more.
    let tuning = LaunchTuning { block_quota: 4, num_warps_per_block: 1 };
    let mut rng = Rng::new(7);
    let mut tried = 0;
    for _ in 0..64 {
        let case = random_case(cell, Profile::Extended, &mut rng);
        let plain = run_case(emu, &case, tuning, |_| {}).expect("the executor's own launch matches");
        // Every edit changes bytes when the last index pair is live and there are two pairs.
        let live = |v: &[i64]| v.last().is_some_and(|i| *i >= 0);
        if plain.bytes == 0 || !live(&case.host_indices) || !live(&case.device_indices) || case.host_indices.len() < 2 {
            continue;
        }
        for (what, edit) in edits {
            assert!(run_case(emu, &case, tuning, edit).is_err(), "{what} went unnoticed: {case:?}");
        }
        tried += 1;
    }
    assert!(tried >= 8, "only {tried} usable cases");
}
