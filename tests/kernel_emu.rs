//! The cuda kernel's logic without a GPU. `kernels/transfer.cu` is compiled for the host with
//! g++ (`-DHICACHE_HOST_EMULATION`: `kernels/host_emulation.h` supplies the CUDA built-ins and
//! checked plain loads and stores for the inline PTX), loaded with `libloading`, and launched
//! with exactly what the cuda executor launches for a plan: the launch description of
//! `exec::cuda_launch::gather_launch` (the `Launch` table, the word that picks
//! `hicache_gather_w16` / `_w8` / `_w4`, the grid) and the nine kernel arguments, passed
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

use hicache_io::exec::cuda_launch::{gather_launch, CheckArgs, GatherLaunch, LaunchC, LaunchTuning};
use hicache_io::geometry::BufRef;
use hicache_io::plan::{GatherStep, StepKind};
use hicache_io::tools::check::{random_case, supported_cells, Case, Rng};
use hicache_io::tools::oracle::{self, OracleBuffers};
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

/// A kernel's host entry point (`hicache_emu_gather_w16` / `_w8` / `_w4`,
/// `hicache_emu_check_indices`): its parameters as cuLaunchKernel takes them.
type Kernel = unsafe extern "C" fn(*mut *mut c_void);
/// `hicache_emu_launch(kernel, grid, block, params, ranges, n_ranges, report)`.
type LaunchFn = unsafe extern "C" fn(Kernel, u32, u32, *mut *mut c_void, *const Range, i32, *mut Report) -> i32;

struct Emulator {
    launch: LaunchFn,
    w16: Kernel,
    w8: Kernel,
    w4: Kernel,
    sum_w16: Kernel,
    sum_w8: Kernel,
    sum_w4: Kernel,
    check: Kernel,
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
        let w16 = *lib.get::<Kernel>(b"hicache_emu_gather_w16\0").expect("hicache_emu_gather_w16");
        let w8 = *lib.get::<Kernel>(b"hicache_emu_gather_w8\0").expect("hicache_emu_gather_w8");
        let w4 = *lib.get::<Kernel>(b"hicache_emu_gather_w4\0").expect("hicache_emu_gather_w4");
        let sum_w16 = *lib.get::<Kernel>(b"hicache_emu_gather_sum_w16\0").expect("hicache_emu_gather_sum_w16");
        let sum_w8 = *lib.get::<Kernel>(b"hicache_emu_gather_sum_w8\0").expect("hicache_emu_gather_sum_w8");
        let sum_w4 = *lib.get::<Kernel>(b"hicache_emu_gather_sum_w4\0").expect("hicache_emu_gather_sum_w4");
        let check = *lib.get::<Kernel>(b"hicache_emu_check_indices\0").expect("hicache_emu_check_indices");
        Some(Emulator { launch, w16, w8, w4, sum_w16, sum_w8, sum_w4, check, _lib: lib })
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
    w16: u64,
    w8: u64,
    w4: u64,
    bytes: u64,
}

/// How a case launches: the plain kernels, or the checksumming ones (`Sum`, with the key stream's
/// base flipped in its low bit when `wrong_base`, to show that a wrong stream is caught).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Plain,
    Sum { wrong_base: bool },
}

/// Plans `case` on cpu pools, runs every gather step of the plan on the emulated kernel with
/// the executor's launch description (`tamper` may edit it, to show that mistakes are caught)
/// and compares with the oracle; in `Mode::Sum` also every item's checksum with the crate's own
/// (`integrity::item_part` of the source bytes).
fn run_case(emu: &Emulator, case: &Case, tuning: LaunchTuning, tamper: impl Fn(&mut GatherLaunch)) -> Result<Ran, String> {
    run_case_in(emu, case, tuning, tamper, Mode::Plain)
}

fn run_case_in(emu: &Emulator, case: &Case, tuning: LaunchTuning, tamper: impl Fn(&mut GatherLaunch), mode: Mode) -> Result<Ran, String> {
    let device = Device::cpu();
    let dev = DevicePool::new(&device, &case.device).map_err(|e| format!("device pool: {e}"))?;
    let host = HostPool::new(&dev, &case.host).map_err(|e| format!("host pool: {e}"))?;
    let req =
        Request { op: case.op, io_backend: IoBackend::Kernel, host_indices: &case.host_indices, device_indices: &case.device_indices };
    let plan = host.plan(&dev, &req).map_err(|e| format!("planner rejected a supported cell: {e}"))?;

    let contents = Contents::random(&dev, &host, case.seed);
    let bufs = Bufs::new(&contents);
    let mut ran = Ran::default();
    let (mut loaded, mut stored) = (0u64, 0u64);
    for (k, step) in plan.steps().iter().enumerate() {
        let StepKind::Gather(g) = step.kind() else {
            return Err(format!("step {k} of a kernel plan is not a gather: {:?}", step.kind()));
        };
        let (report, word) = launch_step(emu, &bufs, (k, g), tuning, &tamper, mode)?;
        ran.launches += 1;
        match word {
            16 => ran.w16 += 1,
            8 => ran.w8 += 1,
            _ => ran.w4 += 1,
        }
        loaded += report.bytes_loaded;
        stored += report.bytes_stored;
    }
    check_oracle(&host, case, contents, &bufs)?;
    check_traffic(mode, plan.bytes(), loaded, stored)?;
    ran.bytes = stored;
    Ok(ran)
}

/// A case's buffers as the kernel sees them (the pools' contents at cuMemAlloc's alignment) and
/// where each lies.
struct Bufs {
    host: Vec<Aligned>,
    device: Vec<Vec<Aligned>>,
    at: HashMap<BufRef, (u64, u64)>,
}

impl Bufs {
    fn new(contents: &Contents) -> Bufs {
        let mut host: Vec<Aligned> = contents.host.iter().map(|b| Aligned::new(b)).collect();
        let mut device: Vec<Vec<Aligned>> = contents.device.iter().map(|c| c.iter().map(|b| Aligned::new(b)).collect()).collect();
        let mut at: HashMap<BufRef, (u64, u64)> = HashMap::new();
        for (c, b) in host.iter_mut().enumerate() {
            at.insert(BufRef::Host { comp: c as u8 }, (b.addr(), b.len as u64));
        }
        for (c, bufs) in device.iter_mut().enumerate() {
            for (s, b) in bufs.iter_mut().enumerate() {
                at.insert(BufRef::Device { comp: c as u8, slot: s as u32 }, (b.addr(), b.len as u64));
            }
        }
        Bufs { host, device, at }
    }

    /// Where `addr` lies, for a message.
    fn where_is(&self, addr: u64) -> String {
        self.at
            .iter()
            .find(|(_, &(start, len))| addr >= start && addr < start + len)
            .map_or_else(|| format!("{addr:#x}, outside every buffer"), |(buf, &(start, _))| format!("{buf:?} + {}", addr - start))
    }

    fn bytes_of(&self, b: BufRef) -> &[u8] {
        match b {
            BufRef::Host { comp } => self.host[comp as usize].bytes(),
            BufRef::Device { comp, slot } => self.device[comp as usize][slot as usize].bytes(),
        }
    }
}

/// Runs gather step `k` of a plan on the emulated kernel (its launch description edited by
/// `tamper`), checking its accesses and, in `Mode::Sum`, its sums: what it did, and its word.
fn launch_step(
    emu: &Emulator,
    bufs: &Bufs,
    (k, g): (usize, &GatherStep),
    tuning: LaunchTuning,
    tamper: &impl Fn(&mut GatherLaunch),
    mode: Mode,
) -> Result<(Report, u32), String> {
    let mut launch =
        gather_launch(g, |b| bufs.at[&b].0, tuning, MAX_THREADS_PER_BLOCK).map_err(|e| format!("step {k}: gather_launch: {e}"))?;
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
            let (start, len) = bufs.at[&buf];
            ranges.push(Range { start, len, flags, host: start });
        }
    }
    // The nine kernel arguments, built by the executor's own code (no device check: status 0);
    // the summing kernels' eleven, with the key stream's base and zeroed sums.
    let (table, si, di) = (launch.table.as_ptr() as u64, g.src_indices().as_ptr() as u64, g.dst_indices().as_ptr() as u64);
    let mut args = launch.args(table, si, di, 0);
    let (mut sums, mut sum_args) = (None, None);
    if let Mode::Sum { wrong_base } = mode {
        let key_base = hicache_io::integrity::key_base(hicache_io::integrity::STORAGE_SEED, 0) ^ u32::from(wrong_base);
        let entries = launch.sum_entries().map_err(|e| format!("step {k}: {e}"))? as usize;
        let s_buf: &mut Aligned = sums.insert(Aligned::new(&vec![0u8; entries * 8]));
        let sa = s_buf.addr();
        ranges.push(Range { start: sa, len: s_buf.len as u64, flags: READ | WRITE, host: sa });
        sum_args = Some(launch.sum_args(table, si, di, 0, key_base, sa));
    }
    let mut params: Vec<*mut c_void> = match sum_args.as_mut() {
        Some(a) => a.params().to_vec(),
        None => args.params().to_vec(),
    };
    let report = launch_kernel(emu, k, &launch, mode, &mut params, &ranges)?;
    if report.faults > 0 {
        return Err(fault_message(k, &report, &ranges, bufs));
    }
    if let (Some(sums), Mode::Sum { .. }) = (&sums, mode) {
        check_sums(bufs, (k, g), &launch, bytemuck::cast_slice(sums.bytes()))?;
    }
    Ok((report, launch.word))
}

/// One launch of the kernel of `launch`'s word (and `mode`) with `params`, its accesses checked
/// against `ranges`.
fn launch_kernel(
    emu: &Emulator,
    k: usize,
    launch: &GatherLaunch,
    mode: Mode,
    params: &mut [*mut c_void],
    ranges: &[Range],
) -> Result<Report, String> {
    let kernel = match (launch.word, mode) {
        (16, Mode::Plain) => emu.w16,
        (8, Mode::Plain) => emu.w8,
        (4, Mode::Plain) => emu.w4,
        (16, Mode::Sum { .. }) => emu.sum_w16,
        (8, Mode::Sum { .. }) => emu.sum_w8,
        (4, Mode::Sum { .. }) => emu.sum_w4,
        (w, _) => return Err(format!("step {k}: word {w}")),
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
    Ok(report)
}

/// What the first of a launch's bad accesses was.
fn fault_message(k: usize, report: &Report, ranges: &[Range], bufs: &Bufs) -> String {
    let (addr, size, need) = (report.first_fault_addr, report.first_fault_size, report.first_fault_flags);
    let access = if need == READ { "load" } else { "store" };
    let why = if addr % size != 0 {
        "misaligned"
    } else if ranges.iter().any(|r| addr >= r.start && addr + size <= r.start + r.len) {
        "the wrong side: a load from a destination or a store into a source"
    } else {
        "outside the step's buffers"
    };
    format!("step {k}: {} bad accesses; the first: {size}-byte {access} at {} ({why})", report.faults, bufs.where_is(addr))
}

/// Every live pair's item of every address pair of step `k`: its sum in `got` is the crate's
/// checksum of its source bytes (the kernel loaded them; a step never writes its own sources).
fn check_sums(bufs: &Bufs, (k, g): (usize, &GatherStep), launch: &GatherLaunch, got: &[u64]) -> Result<(), String> {
    let keys =
        hicache_io::integrity::Keys::new(hicache_io::integrity::STORAGE_SEED, launch.item_words() as usize).map_err(|e| e.to_string())?;
    let n_pairs = g.pairs().len();
    for (i, (&si, &di)) in g.src_indices().iter().zip(g.dst_indices()).enumerate().take(launch.n_items as usize) {
        for (l, p) in g.pairs().iter().enumerate() {
            let entry = got[i * n_pairs + l];
            let want = if si < 0 || di < 0 {
                0
            } else {
                let src = bufs.bytes_of(p.src().buf());
                (0..g.heads()).fold(0u64, |sum, h| {
                    let off = p.src().offset(si as u64, h) as usize;
                    sum.wrapping_add(hicache_io::integrity::item_part(&src[off..off + g.chunk_bytes() as usize], h, &keys))
                })
            };
            if entry != want {
                return Err(format!("step {k}: the sum of index pair {i}, address pair {l} is {entry:#x}, the item's checksum {want:#x}"));
            }
        }
    }
    Ok(())
}

/// The buffers after the plan ran equal the oracle's result on the same contents.
fn check_oracle(host: &HostPool, case: &Case, contents: Contents, bufs: &Bufs) -> Result<(), String> {
    let mut want = contents;
    oracle::apply(
        host.pair(),
        case.op,
        &case.host_indices,
        &case.device_indices,
        OracleBuffers { host: &mut want.host, device: &mut want.device },
    );
    for (c, w) in want.host.iter().enumerate() {
        if let Some(off) = first_diff(bufs.host[c].bytes(), w) {
            return Err(format!("host component {c} differs from the oracle at byte {off}"));
        }
    }
    for (c, dev) in want.device.iter().enumerate() {
        for (s, w) in dev.iter().enumerate() {
            if let Some(off) = first_diff(bufs.device[c][s].bytes(), w) {
                return Err(format!("device component {c} buffer {s} differs from the oracle at byte {off}"));
            }
        }
    }
    Ok(())
}

/// Equal bytes could still hide a duplicated or a missing-but-unchanged copy: every byte the
/// plan moves (`moved`) is loaded and stored exactly once. The summing kernels also load and
/// store each atomic add, and load nothing else: their keys are computed, not read.
fn check_traffic(mode: Mode, moved: u64, loaded: u64, stored: u64) -> Result<(), String> {
    let atomics = match mode {
        Mode::Plain => 0,
        Mode::Sum { .. } => stored.saturating_sub(moved),
    };
    if atomics % 8 != 0 {
        return Err(format!("{atomics} bytes of sums stored: not whole 8-byte entries"));
    }
    if loaded != moved + atomics || stored != moved + atomics {
        return Err(format!("the plan moves {moved} bytes; the kernel loaded {loaded} and stored {stored}"));
    }
    Ok(())
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
    sweep_in(emu, profile, tuning, seed, seeds, Mode::Plain)
}

fn sweep_in(emu: &Emulator, profile: Profile, tuning: LaunchTuning, seed: u64, seeds: u64, mode: Mode) -> Ran {
    let cells: Vec<_> = supported_cells(profile).into_iter().filter(|c| c.io == IoBackend::Kernel).collect();
    assert!(!cells.is_empty(), "{profile}: no supported kernel cell");
    let mut rng = Rng::new(seed);
    let (mut total, mut failures) = (Ran::default(), Vec::new());
    total.cells = cells.len() as u64;
    for cell in cells {
        let mut moved = 0;
        for _ in 0..seeds {
            let case = random_case(cell, profile, &mut rng);
            match run_case_in(emu, &case, tuning, |_| {}, mode) {
                Ok(r) => {
                    moved += r.bytes;
                    total.cases += 1;
                    total.launches += r.launches;
                    total.w16 += r.w16;
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
    // sglang's 8-byte items: 16-byte words where items, bases and strides allow, else 8.
    assert!(ran.w16 > 0 && ran.w8 > 0 && ran.w4 == 0, "{ran:?}");
    eprintln!("sglang profile: {ran:?}");
}

#[test]
fn extended_profile_kernel_cells_match_the_oracle() {
    let Some(emu) = emulator() else { return };
    let ran = sweep(emu, Profile::Extended, SGLANG_GRID, 2, 40);
    // 4-byte items and chunks run hicache_gather_w4; the others the widest word they allow.
    assert!(ran.w16 > 0 && ran.w8 > 0 && ran.w4 > 0, "{ran:?}");
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

/// The checksumming kernels copy exactly what the plain ones copy, and every item's sum is the
/// crate's checksum of it: every kernel cell of both profiles (every word size), sglang's grid
/// and strided ones.
#[test]
fn summing_kernels_match_the_oracle_and_the_checksums() {
    let Some(emu) = emulator() else { return };
    let ran = sweep_in(emu, Profile::Extended, SGLANG_GRID, 3, 30, Mode::Sum { wrong_base: false });
    assert!(ran.w16 > 0 && ran.w8 > 0 && ran.w4 > 0, "{ran:?}");
    sweep_in(emu, Profile::Sglang, SGLANG_GRID, 4, 20, Mode::Sum { wrong_base: false });
    for (i, (block_quota, num_warps_per_block)) in [(1, 1), (3, 7), (16, 2)].into_iter().enumerate() {
        let tuning = LaunchTuning { block_quota, num_warps_per_block };
        sweep_in(emu, Profile::Extended, tuning, 200 + i as u64, 6, Mode::Sum { wrong_base: false });
    }
    eprintln!("summing kernels: {ran:?}");
}

/// The harness's sum check can fail: another key stream gives other sums.
#[test]
fn a_wrong_key_stream_is_caught() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng::new(9);
    let mut caught = 0;
    for cell in supported_cells(Profile::Extended).into_iter().filter(|c| c.io == IoBackend::Kernel) {
        let case = random_case(cell, Profile::Extended, &mut rng);
        let ok = run_case_in(emu, &case, SGLANG_GRID, |_| {}, Mode::Sum { wrong_base: false }).expect("the right keys match");
        if ok.bytes == 0 {
            continue;
        }
        let err =
            run_case_in(emu, &case, SGLANG_GRID, |_| {}, Mode::Sum { wrong_base: true }).expect_err("another key stream went unnoticed");
        assert!(err.contains("the item's checksum"), "{err}");
        caught += 1;
    }
    assert!(caught >= 4, "only {caught} cells moved bytes");
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

// ------------------------------------------------------------------------------------------
// Offsets past 4 GiB, the device checks of CUDA index lists, a failed check
// ------------------------------------------------------------------------------------------

/// Runs `kernel` with `params` over `ranges`; panics on a refused launch, returns the report.
fn launch_raw(emu: &Emulator, kernel: Kernel, blocks: u32, threads: u32, params: &mut [*mut c_void], ranges: &[Range]) -> Report {
    let mut report = Report::default();
    // SAFETY: `params` point at live arguments of the kernel's types; every global access the
    // kernel makes is checked against `ranges` (the gathers' table and index lists excepted,
    // which the callers keep alive).
    let rc = unsafe { (emu.launch)(kernel, blocks, threads, params.as_mut_ptr(), ranges.as_ptr(), ranges.len() as i32, &mut report) };
    assert_eq!(rc, 0, "launch refused");
    report
}

/// Every byte offset the kernel forms is 64-bit: items 3 and 4 GiB into a sparse source (its
/// pages untouched but the ones written here), two heads 2 GiB apart, every word size. Truncating
/// any term to 32 bits would read another place (zeros) or fault.
#[test]
fn byte_offsets_past_4_gib() {
    let Some(emu) = emulator() else { return };
    const GIB: u64 = 1 << 30;
    // calloc'd: the kernel touches a few pages of it, the rest is never committed.
    let mut src = vec![0u8; (7 * GIB) as usize];
    let (page_stride, head_stride) = (GIB + 4096, 2 * GIB);
    let src_idx: Vec<i64> = vec![4, 3, 0, 2];
    for chunk in [1152u64, 1160, 1156] {
        let at = |i: u64, h: u64| (i * page_stride + h * head_stride) as usize;
        for (j, &i) in src_idx.iter().enumerate() {
            for h in 0..2 {
                for b in 0..chunk as usize {
                    src[at(i as u64, h) + b] = (j * 7 + h as usize * 3 + b * 13 % 251) as u8 | 1;
                }
            }
        }
        let mut dst = Aligned::new(&vec![0u8; (4 * 2 * chunk) as usize]);
        let table = [LaunchC {
            src: hicache_io::exec::cuda_launch::SideC {
                ptr: src.as_ptr() as u64,
                base: 0,
                page: 1,
                page_stride,
                row_stride: 0,
                head_stride,
            },
            dst: hicache_io::exec::cuda_launch::SideC {
                ptr: dst.addr(),
                base: 0,
                page: 1,
                page_stride: 2 * chunk,
                row_stride: 0,
                head_stride: chunk,
            },
        }];
        let dst_idx: Vec<i64> = vec![0, 1, 2, 3];
        let word = if chunk % 16 == 0 {
            16
        } else if chunk % 8 == 0 {
            8
        } else {
            4
        };
        let kernel = match word {
            16 => emu.w16,
            8 => emu.w8,
            _ => emu.w4,
        };
        let launch = GatherLaunch {
            table: table.to_vec(),
            word,
            blocks: 1,
            threads_per_block: 64,
            n_items: 4,
            heads: 2,
            chunk_bytes: chunk,
            items_per_warp: 2,
        };
        let mut args = launch.args(table.as_ptr() as u64, src_idx.as_ptr() as u64, dst_idx.as_ptr() as u64, 0);
        let ranges = [
            Range { start: src.as_ptr() as u64, len: src.len() as u64, flags: READ, host: src.as_ptr() as u64 },
            Range { start: dst.addr(), len: dst.len as u64, flags: WRITE, host: dst.addr() },
        ];
        let report = launch_raw(emu, kernel, 1, 64, &mut args.params(), &ranges);
        assert_eq!(report.faults, 0, "chunk {chunk}: {report:?}");
        for (j, &i) in src_idx.iter().enumerate() {
            for h in 0..2u64 {
                let got = &dst.bytes()[(j as u64 * 2 * chunk + h * chunk) as usize..][..chunk as usize];
                let want = &src[at(i as u64, h)..][..chunk as usize];
                assert!(
                    got == want,
                    "chunk {chunk} ({word}-byte words): item {j} (index {i}) head {h} differs at byte {:?}",
                    first_diff(got, want)
                );
            }
        }
        assert_eq!(report.bytes_stored, 4 * 2 * chunk);
    }
}

/// The device checks of CUDA index lists (`hicache_check_indices`, three launches) find what the
/// planner finds on the same lists, as the same error: random lists with negatives, indices out
/// of range on either side and duplicate destinations, every `kernel` cell but the DSA indexer's
/// (whose lists stay on the host); the claim words are all released afterwards.
#[test]
fn device_index_checks_find_what_the_planner_finds() {
    let Some(emu) = emulator() else { return };
    let cells: Vec<_> = supported_cells(Profile::Extended)
        .into_iter()
        .filter(|c| c.io == IoBackend::Kernel && c.kind != hicache_io::PoolKind::DsaIndexer)
        .collect();
    let mut rng = Rng::new(77);
    let (mut accepted, mut refused) = (0, 0);
    let device = Device::cpu();
    for round in 0..400 {
        let cell = cells[round % cells.len()];
        let case = random_case(cell, Profile::Extended, &mut rng);
        let dev = DevicePool::new(&device, &case.device).expect("device pool");
        let host = HostPool::new(&dev, &case.host).expect("host pool");
        let (hb, db) = (host.geometry().slots(), dev.geometry().slots());
        // Distinct in-range lists, then one kind of damage (or none) at random places.
        let n = 1 + rng.below(hb.min(db).min(32)) as usize;
        let mut distinct = |bound: u64| -> Vec<i64> {
            let mut v: Vec<i64> = (0..bound.min(64) as i64).collect();
            for i in (1..v.len()).rev() {
                v.swap(i, rng.below(i as u64 + 1) as usize);
            }
            v.truncate(n);
            v
        };
        let (mut hi, mut di) = (distinct(hb), distinct(db));
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(n as u64) as usize;
            let other = rng.below(n as u64) as usize;
            match rng.below(6) {
                0 => hi[at] = -1 - rng.below(2) as i64,
                1 => di[at] = -1,
                2 => hi[at] = (hb + rng.below(3)) as i64,
                3 => di[at] = (db + rng.below(3)) as i64,
                4 => hi[at] = hi[other],
                _ => di[at] = di[other],
            }
            if rng.below(3) == 0 {
                break;
            }
        }
        let req = Request { op: case.op, io_backend: IoBackend::Kernel, host_indices: &hi, device_indices: &di };
        let planned = host.plan(&dev, &req);
        // A no-op call (a layer this pool does not own) checks nothing.
        if planned.as_ref().is_ok_and(|p| p.is_empty()) {
            continue;
        }
        let dst_is_host = case.op.direction() == hicache_io::plan::Direction::DeviceToHost;
        let check = hicache_io::plan::DeviceIndexCheck {
            lists: hicache_io::plan::DeviceIndexLists { host: hi.as_ptr() as u64, device: di.as_ptr() as u64, len: n },
            host_bound: hb,
            device_bound: db,
            dst_is_host,
            unit: "slots",
            call: "test",
            sides: ["host", "device"],
            tables: Default::default(),
        };
        let mut owner = vec![u32::MAX; if dst_is_host { hb } else { db } as usize];
        let mut status = [u64::MAX; 4];
        let ranges = [
            Range { start: hi.as_ptr() as u64, len: n as u64 * 8, flags: READ, host: hi.as_ptr() as u64 },
            Range { start: di.as_ptr() as u64, len: n as u64 * 8, flags: READ, host: di.as_ptr() as u64 },
            Range { start: owner.as_mut_ptr() as u64, len: owner.len() as u64 * 4, flags: READ | WRITE, host: owner.as_mut_ptr() as u64 },
            Range { start: status.as_mut_ptr() as u64, len: 32, flags: READ | WRITE, host: status.as_mut_ptr() as u64 },
        ];
        // Grids of one small block and of several: the grid-stride loop covers every pair.
        let (blocks, threads) = if round % 2 == 0 { (1, 32) } else { (3, 8) };
        for phase in 0..3 {
            // The arguments the executor launches with (`CheckArgs`, shared with it).
            let mut args = CheckArgs::new(&check, owner.as_mut_ptr() as u64, status.as_mut_ptr() as u64, phase);
            let mut params = args.params();
            let report = launch_raw(emu, emu.check, blocks, threads, &mut params, &ranges);
            assert_eq!(report.faults, 0, "phase {phase}: {report:?}");
        }
        assert!(owner.iter().all(|w| *w == u32::MAX), "claims left behind: {hi:?} {di:?}");
        let found = (status[0] != u64::MAX).then(|| check.error(status[0] >> 56, status[0] & ((1 << 56) - 1), status[1] as i64, status[2]));
        match (&planned, found) {
            (Ok(_), None) => accepted += 1,
            (Err(want), Some(hicache_io::TransferError::DeviceIndexCheck { source, .. })) => {
                assert_eq!(source.to_string(), want.to_string(), "{cell}: {hi:?} → {di:?}");
                refused += 1;
            }
            (p, f) => panic!("{cell}: planner {p:?}, device {f:?}: {hi:?} → {di:?}"),
        }
    }
    assert!(accepted > 40 && refused > 100, "accepted {accepted}, refused {refused}");
}

/// Phase 3 of the device checks compares each caller's layer table with the copy taken when the
/// call was planned: equal tables leave the status passed; the first entry that differs, at its
/// position among the call's tables, fails it as check 3 (the table rewritten), which the plan's
/// check names with the table's address.
#[test]
fn the_table_check_finds_a_rewritten_table() {
    let Some(emu) = emulator() else { return };
    let kept: Vec<u64> = (0..5).map(|l| 0x7000_0000 + l * 0x1000).collect();
    let (mut k_now, mut v_now) = (kept.clone(), kept.iter().map(|a| a + 0x10_0000).collect::<Vec<u64>>());
    let v_kept = v_now.clone();
    let mut guards = hicache_io::plan::TableGuards::default();
    for (now, was) in [(&k_now, &kept), (&v_now, &v_kept)] {
        guards.push(hicache_io::plan::TableGuard { table: now.as_ptr() as u64, expected: was.as_ptr() as u64, len: 5 }).unwrap();
    }
    let check = hicache_io::plan::DeviceIndexCheck {
        lists: hicache_io::plan::DeviceIndexLists { host: 0, device: 0, len: 0 },
        host_bound: 1,
        device_bound: 1,
        dst_is_host: true,
        unit: "slots",
        call: "test",
        sides: ["host", "device"],
        tables: guards,
    };
    for damage in [None, Some((1usize, 3usize)), Some((0, 4))] {
        k_now.copy_from_slice(&kept);
        v_now.copy_from_slice(&v_kept);
        if let Some((table, entry)) = damage {
            let t = if table == 0 { &mut k_now } else { &mut v_now };
            t[entry] ^= 0x40;
        }
        let mut status = [u64::MAX; 4];
        let mut ranges = vec![Range { start: status.as_mut_ptr() as u64, len: 32, flags: READ | WRITE, host: status.as_mut_ptr() as u64 }];
        for v in [&k_now, &v_now, &kept, &v_kept] {
            ranges.push(Range { start: v.as_ptr() as u64, len: 40, flags: READ, host: v.as_ptr() as u64 });
        }
        for (first, g) in check.tables.iter() {
            let mut args = CheckArgs::table(g, first, status.as_mut_ptr() as u64);
            let report = launch_raw(emu, emu.check, 2, 4, &mut args.params(), &ranges);
            assert_eq!(report.faults, 0, "{report:?}");
            assert_eq!(report.bytes_stored > 0, damage.is_some_and(|(t, _)| t == (first / 5) as usize), "only a differing entry writes");
        }
        match damage {
            None => assert_eq!(status[0], u64::MAX),
            Some((table, entry)) => {
                assert_eq!(status[0], (3u64 << 56) | (table * 5 + entry) as u64);
                let e = check.error(status[0] >> 56, status[0] & ((1 << 56) - 1), 0, 0);
                let want_table = if table == 0 { k_now.as_ptr() } else { v_now.as_ptr() } as u64;
                assert!(
                    matches!(&e, hicache_io::TransferError::DeviceIndexCheck { source, .. }
                        if matches!(**source, hicache_io::TransferError::LayerTableChanged { table, entry: en } if table == want_table && en == entry as u64)),
                    "{e}"
                );
            }
        }
    }
}

/// A gather whose call failed its device check copies nothing; one whose check passed copies.
#[test]
fn a_failed_device_check_moves_nothing() {
    let Some(emu) = emulator() else { return };
    let src: Vec<u64> = (1..=64).collect();
    let mut dst = Aligned::new(&[0u8; 512]);
    let side = |ptr: u64| hicache_io::exec::cuda_launch::SideC { ptr, base: 0, page: 1, page_stride: 64, row_stride: 0, head_stride: 0 };
    let table = [LaunchC { src: side(src.as_ptr() as u64), dst: side(dst.addr()) }];
    let (si, di): (Vec<i64>, Vec<i64>) = (vec![0, 1, 2, 3], vec![3, 2, 1, 0]);
    for (key, copies) in [(0u64, false), ((2u64 << 56) | 3, false), (u64::MAX, true)] {
        let status = [key, 0, 0, 0];
        let launch = GatherLaunch {
            table: table.to_vec(),
            word: 16,
            blocks: 1,
            threads_per_block: 64,
            n_items: 4,
            heads: 1,
            chunk_bytes: 64,
            items_per_warp: 2,
        };
        let mut args = launch.args(table.as_ptr() as u64, si.as_ptr() as u64, di.as_ptr() as u64, status.as_ptr() as u64);
        let ranges = [
            Range { start: src.as_ptr() as u64, len: 512, flags: READ, host: src.as_ptr() as u64 },
            Range { start: dst.addr(), len: 512, flags: WRITE, host: dst.addr() },
            Range { start: status.as_ptr() as u64, len: 32, flags: READ, host: status.as_ptr() as u64 },
        ];
        let report = launch_raw(emu, emu.w16, 1, 64, &mut args.params(), &ranges);
        assert_eq!(report.faults, 0);
        assert_eq!(report.bytes_stored, if copies { 256 } else { 0 }, "status {key:#x}");
    }
    // Destination item 0 is source item 3: words 25..=32.
    assert_eq!(u64::from_ne_bytes(dst.bytes()[..8].try_into().unwrap()), 25);
}
