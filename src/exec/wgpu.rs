//! The portable executor: wgpu on Vulkan, Metal or DX12 (lavapipe in CI).
//!
//! Memory model: every pool buffer, host pool included, is a wgpu storage buffer
//! (`STORAGE | COPY_SRC | COPY_DST`). The host pool is "host" in the sglang sense (its layout,
//! its role); the CPU reaches it through `queue.write_buffer` and a `MAP_READ` staging copy.
//! That works on every adapter; on integrated GPUs and lavapipe the buffer already lives in
//! system memory. Buffers are capped at `min(max_buffer_size, 4 GiB)` so byte offsets fit the
//! shader's u32 arithmetic; larger pools are rejected with a typed error at allocation.
//!
//! `kernel` = `shaders/gather.wgsl`, one dispatch per (layer, component) address pair and per
//! pair of binding windows: buffers larger than `max_storage_buffer_binding_size` are bound by
//! range, in windows of whole item chunks aligned to `min_storage_buffer_offset_alignment`.
//! The index table is one binding and one dispatch, so the planner splits calls with more
//! pairs than [`Capabilities::max_gather_items`] into several steps.
//! `direct` = one `copy_buffer_to_buffer` per coalesced run.
//!
//! Item checksums: a checksumming `kernel` step runs the gather's checksum pipelines, which sum
//! each item as they copy it into a two-word entry per (index pair, address pair) of a buffer
//! the step's submission copies into a mappable one. Once that submission has completed (any
//! wait or poll that sees it), the entries are read and recorded into the host pool's table
//! (backups) or compared with it (loads), in submission order. `direct` copies
//! (`copy_buffer_to_buffer`) cannot sum: their items are settled as unknown in the same order (a
//! backup forgets their checksums, a load counts them unverified), without waiting.
//!
//! Each step is its own submission. A synchronous plan returns after the queue has finished all
//! of them. An asynchronous one is encoded on the caller's thread and submitted by the
//! executor's submit thread (started on first use): some drivers, lavapipe among them, run the
//! work inside `vkQueueSubmit`, and the caller's thread is meant to be free meanwhile. Every
//! synchronous operation (a plan, a read, a write) first waits until the submit thread has
//! submitted what it was given, so the queue keeps program order.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use wgpu::util::DeviceExt;

use super::{Bindings, Executor, IntegrityBinding};
use crate::error::{Result, TransferError};
use crate::geometry::Addr;
use crate::plan::{lcm, Capabilities, ChecksumMode, GatherStep, Plan, StepKind};

const SHADER: &str = include_str!("../../shaders/gather.wgsl");
const WAIT: Duration = Duration::from_secs(120);

fn err(message: impl Into<String>) -> TransferError {
    TransferError::Executor { backend: "wgpu", message: message.into() }
}

/// Options for opening the executor.
#[derive(Debug, Clone, Default)]
pub struct WgpuOptions {
    /// Largest binding window in bytes (default: the adapter's storage binding limit). Tests
    /// set it tiny so that every window edge is crossed.
    pub max_window: Option<u64>,
    /// Most index pairs per gather step (default: what one index binding and one dispatch
    /// hold). Tests set it tiny so that calls are split.
    pub max_gather_items: Option<u64>,
    /// Largest buffer per pool segment (default: the adapter's largest buffer). Tests set it
    /// tiny so that every segment edge is crossed.
    pub max_segment: Option<u64>,
    /// Host pools in host-visible memory (`MAPPABLE_PRIMARY_BUFFERS`): `None` uses it where the
    /// adapter has it, unless `HICACHE_WGPU_MAPPED_HOST=0`; `Some(false)` never does.
    pub mapped_host: Option<bool>,
    /// 64-bit integers in the checksumming gather (`SHADER_INT64`): `None` uses them where the
    /// adapter has them, unless `HICACHE_WGPU_INT64=0`; `Some(false)` never does (16-bit halves,
    /// the same bits).
    pub int64: Option<bool>,
}

/// Where a pool's memory is, as `info` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMemory {
    /// GPU memory the CPU cannot map (a discrete GPU's VRAM).
    DeviceLocal,
    /// System memory the GPU reaches over the bus (a mapped `MAPPABLE_PRIMARY_BUFFERS` buffer).
    HostVisible,
    /// One memory for both (integrated GPUs, CPU adapters such as lavapipe).
    Unified,
}

impl PoolMemory {
    /// `device-local`, `host-visible` or `unified`.
    pub fn name(self) -> &'static str {
        match self {
            PoolMemory::DeviceLocal => "device-local",
            PoolMemory::HostVisible => "host-visible",
            PoolMemory::Unified => "unified",
        }
    }
}

/// Above this many runs in one step, `direct` (one `copy_buffer_to_buffer` each) is far slower
/// than `kernel` on wgpu; a warning says so once.
const MANY_RUNS: usize = 100_000;

struct Inner {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    layout: wgpu::BindGroupLayout,
    /// Pipelines for 4-byte (u32) and 16-byte (vec4<u32>) words.
    pipe4: wgpu::ComputePipeline,
    pipe16: wgpu::ComputePipeline,
    /// The checksumming ones (`sum_layout`: also the item keys and the sums).
    sum_layout: wgpu::BindGroupLayout,
    sum4: wgpu::ComputePipeline,
    sum16: wgpu::ComputePipeline,
    /// Whether the checksumming gathers use 64-bit integers (else 16-bit halves).
    int64: bool,
    /// Item keys on the device, per `(seed, words)`.
    keys: Mutex<std::collections::HashMap<(u64, usize), wgpu::Buffer>>,
    /// Checksum readbacks of submitted steps, in submission order (pushed under this lock
    /// together with the submission).
    /// (Shared with the submit thread, which must never hold the executor itself: its last
    /// reference would then drop the device there.)
    pending: Arc<Mutex<PendingQueue>>,
    max_window: u64,
    max_buffer: u64,
    /// Largest segment of a pool buffer (at most `max_buffer`).
    max_segment: u64,
    /// Invocations per item, at most: 64 on GPUs (coalesced words); 1 on CPU adapters such as
    /// lavapipe, where one SIMD lane per item measured about 2× faster (`HICACHE_WGPU_LANES`).
    max_lanes: u64,
    max_gather_items: u64,
    /// Host pools are allocated mappable (host-visible); their CPU reads and writes map them.
    mapped_host: bool,
    lost: Arc<Mutex<Option<String>>>,
    id: u64,
    submitter: Arc<Submitter>,
    /// Mapping a host pool excludes submissions (a buffer mapped for the CPU must not be used
    /// by a submitted command): submissions hold it shared, a mapping exclusively.
    map_lock: Arc<std::sync::RwLock<()>>,
    /// The submit thread, joined on drop so that it never outlives the device (it holds a queue
    /// handle; dropping the last one on another thread while the process exits can crash the
    /// driver).
    submit_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has submitted what it holds.
        self.submitter.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.submit_thread.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// The submit thread's state: tickets given and submitted, and their submission indices.
#[derive(Default)]
struct Submitter {
    state: Mutex<SubmitState>,
    submitted_cv: std::sync::Condvar,
    tx: Mutex<Option<std::sync::mpsc::Sender<Handed>>>,
}

/// Checksum readbacks in submission order, and how many were ever pushed and settled (entry
/// `k`, counting from 0, is settled once `settled > k`).
#[derive(Default)]
struct PendingQueue {
    entries: std::collections::VecDeque<PendingSums>,
    pushed: u64,
    settled: u64,
    /// Submissions made so far, and (set by `on_submitted_work_done`) the newest one known
    /// complete: what `is_done` reads instead of a zero-timeout wait, which wgpu-core asserts
    /// on when another thread's poll retires the submission first.
    submissions: u64,
    completed: Arc<std::sync::atomic::AtomicU64>,
}

/// Out-of-memory and validation error scopes around one submission, popped once (the inner
/// one first; later pops give `None`).
struct Scopes(Option<(wgpu::ErrorScopeGuard, wgpu::ErrorScopeGuard)>);

impl Scopes {
    fn push(device: &wgpu::Device) -> Scopes {
        let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        Scopes(Some((device.push_error_scope(wgpu::ErrorFilter::Validation), oom)))
    }
    /// The first error either scope caught.
    fn pop(&mut self) -> Option<String> {
        let (val, oom) = self.0.take()?;
        let v = pollster::block_on(val.pop());
        let o = pollster::block_on(oom.pop());
        v.or(o).map(|e| e.to_string())
    }
}

/// A submission: wgpu's index, the checksum readbacks pushed up to it, and its number in
/// [`PendingQueue::submissions`].
#[derive(Clone)]
struct Submitted {
    index: wgpu::SubmissionIndex,
    pushed: u64,
    seq: u64,
}

/// What the submit thread is given: a ticket, its command buffer and its checksum readbacks.
type Handed = (u64, wgpu::CommandBuffer, Vec<PendingSums>);

/// The checksums of one step, settled in submission order: a gather's sums on their way back
/// (its sums buffers' mappable copies, and what the host needs to record or verify them), or
/// the items of `direct` copies, which cannot sum (settled as unknown).
struct PendingSums {
    staging: Vec<wgpu::Buffer>,
    /// Staging buffers mapped so far, and whether a mapping failed.
    mapped: Arc<std::sync::atomic::AtomicUsize>,
    failed: Arc<std::sync::atomic::AtomicBool>,
    what: Settles,
    mode: ChecksumMode,
    binding: IntegrityBinding,
}

enum Settles {
    /// A gather's sums, an entry of two u32 per index pair and address pair.
    Sums { layout: SumsLayout, src_indices: Arc<[i64]>, dst_indices: Arc<[i64]>, items: Vec<(u64, u8)> },
    /// Items copied without a checksum: `(host index, device index, host layer, component)`.
    Unknown(Vec<(u64, u64, u64, u8)>),
}

impl PendingSums {
    /// Starts mapping the staging buffers: called right after the submission that fills them.
    fn map(&self) {
        use std::sync::atomic::Ordering::Release;
        for b in &self.staging {
            let (mapped, failed) = (self.mapped.clone(), self.failed.clone());
            b.map_async(wgpu::MapMode::Read, .., move |r| match r {
                Ok(()) => _ = mapped.fetch_add(1, Release),
                Err(_) => failed.store(true, Release),
            });
        }
    }
    fn is_ready(&self) -> bool {
        use std::sync::atomic::Ordering::Acquire;
        self.failed.load(Acquire) || self.mapped.load(Acquire) == self.staging.len()
    }
    /// The items of `direct` copies, which cannot sum: settled as unknown.
    fn unknown(mode: ChecksumMode, binding: IntegrityBinding, runs: &[crate::plan::Run]) -> PendingSums {
        let items = runs.iter().flat_map(|r| (0..r.items).map(move |k| (r.host_unit + k, r.device_unit + k, r.host_layer, r.comp)));
        PendingSums {
            staging: Vec::new(),
            mapped: Default::default(),
            failed: Default::default(),
            what: Settles::Unknown(items.collect()),
            mode,
            binding,
        }
    }
    /// Records or verifies every live item's checksum; unknown ones (copies that cannot sum, or
    /// a failed readback) are forgotten by a backup and count as unverified for a load.
    fn settle(&self) {
        let mut n = [0u64; 4];
        let unknown =
            |(host, layer, comp): (u64, u64, u8), n: &mut [u64; 4]| match (self.mode, self.binding.sidecar.slot(host, layer, comp)) {
                (ChecksumMode::Record, Some(slot)) => self.binding.sidecar.forget(slot),
                (ChecksumMode::Verify, Some(_)) => n[2] += 1,
                (_, None) => {}
            };
        let (layout, src_indices, dst_indices, items) = match &self.what {
            Settles::Sums { layout, src_indices, dst_indices, items } => (*layout, src_indices, dst_indices, items),
            Settles::Unknown(items) => {
                for &(host, _, layer, comp) in items {
                    unknown((host, layer, comp), &mut n);
                }
                self.binding.sidecar.count(n);
                return;
            }
        };
        let live: Vec<(usize, i64, i64)> = (src_indices.iter().zip(dst_indices.iter()))
            .enumerate()
            .filter(|(_, (s, d))| **s >= 0 && **d >= 0)
            .map(|(i, (s, d))| (i, *s, *d))
            .collect();
        let views: Option<Vec<wgpu::BufferView>> = match self.failed.load(std::sync::atomic::Ordering::Acquire) {
            true => None,
            false => self.staging.iter().map(|b| b.get_mapped_range(..).ok()).collect(),
        };
        for (li, &(layer, comp)) in items.iter().enumerate() {
            let entries = views.as_ref().map(|v| {
                let (b, at) = layout.at(li);
                &v[b][at as usize..]
            });
            for &(i, s, d) in &live {
                let (host, device) = match self.mode {
                    ChecksumMode::Record => (d as u64, s as u64),
                    ChecksumMode::Verify => (s as u64, d as u64),
                };
                match entries {
                    Some(e) => {
                        let word = |k: usize| u32::from_le_bytes([e[4 * k], e[4 * k + 1], e[4 * k + 2], e[4 * k + 3]]) as u64;
                        let sum = word(2 * i) | word(2 * i + 1) << 32;
                        self.binding.settle(self.mode, (host, device, layer, comp), sum, &mut n);
                    }
                    None => unknown((host, layer, comp), &mut n),
                }
            }
        }
        if views.is_some() {
            drop(views);
            for b in &self.staging {
                b.unmap();
            }
        }
        self.binding.sidecar.count(n);
    }
}

#[derive(Default)]
struct SubmitState {
    queued: u64,
    submitted: u64,
    /// Recent tickets' submissions (see [`Submitted`]; pruned to the last 4096).
    indices: std::collections::BTreeMap<u64, Submitted>,
    /// Tickets whose submission failed, and why (pruned likewise).
    failed: std::collections::BTreeMap<u64, String>,
}

impl Submitter {
    fn lock(&self) -> std::sync::MutexGuard<'_, SubmitState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Waits until every command buffer given so far has been submitted (not what others give
    /// meanwhile).
    fn drain(&self) {
        let mut st = self.lock();
        let target = st.queued;
        while st.submitted < target {
            st = self.submitted_cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
    /// Waits until ticket `t` is submitted; its submission and the checksum readbacks pushed up
    /// to it (`Err` when it failed, `None` when it is too old to be remembered).
    fn index_of(&self, t: u64) -> Result<Option<Submitted>> {
        let mut st = self.lock();
        while st.submitted < t {
            st = self.submitted_cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(e) = st.failed.get(&t) {
            return Err(err(format!("submitting a queued transfer: {e}")));
        }
        Ok(st.indices.get(&t).cloned())
    }
    fn is_submitted(&self, t: u64) -> bool {
        self.lock().submitted >= t
    }
}

/// The wgpu executor (one device and queue).
#[derive(Clone)]
pub struct WgpuExecutor {
    inner: Arc<Inner>,
}

/// A pool buffer of one executor instance: one storage buffer, or for a pool larger than the
/// adapter's largest buffer, segments of `seg` bytes (the last one shorter) that hold whole copy
/// chunks, so that no chunk straddles two. Sizes are rounded up to 4 bytes; `len` is the
/// requested size.
pub struct WgpuBuffer {
    segments: Vec<wgpu::Buffer>,
    seg: u64,
    len: u64,
    owner: u64,
}

impl WgpuBuffer {
    /// The (first) wgpu buffer; [`WgpuBuffer::segments`] lists all of a segmented pool's.
    pub fn raw(&self) -> &wgpu::Buffer {
        &self.segments[0]
    }
    /// The segments, in order: byte `o` of the pool is byte `o % seg` of segment `o / seg`.
    pub fn segments(&self) -> &[wgpu::Buffer] {
        &self.segments
    }
    /// Bytes per segment (every segment but the last).
    pub fn segment_bytes(&self) -> u64 {
        self.seg
    }
    fn usage(&self) -> wgpu::BufferUsages {
        self.segments[0].usage()
    }
    /// `[offset, offset + len)` split at segment edges: `(segment, offset in it, bytes, offset
    /// in the span)`.
    fn pieces(&self, offset: u64, len: u64) -> Vec<(usize, u64, u64, u64)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < len {
            let o = offset + at;
            let (k, within) = ((o / self.seg) as usize, o % self.seg);
            let n = (self.seg - within).min(len - at);
            out.push((k, within, n, at));
            at += n;
        }
        out
    }
    /// Wraps a caller's buffer created on `exec`'s device (a shared handle: the engine keeps
    /// using it). It needs `STORAGE | COPY_SRC | COPY_DST`; pools check that when they wrap it.
    /// Pools then refuse to mix it with any other executor instance.
    ///
    /// # Safety
    /// `buffer` must have been created by the `wgpu::Device` of `exec` (`exec.device()`). wgpu
    /// has no way to ask a buffer for its device, so this is the caller's promise, and a broken
    /// one is not caught: a buffer of another device makes wgpu-core panic, or writes land in
    /// an unrelated buffer of this device.
    pub unsafe fn wrap(exec: &WgpuExecutor, buffer: wgpu::Buffer) -> WgpuBuffer {
        let len = buffer.size();
        WgpuBuffer { segments: vec![buffer], seg: len.max(1), len, owner: exec.inner.id }
    }
}

/// The gather shader for words of type `word` (`u32` or `vec4<u32>`), with item checksums
/// (`sum`: the lines between `//<sum` and `//sum>`) or without (those between `//<plain` and
/// `//plain>`); the lines tagged `w4` or `w16` are for one word type only.
fn shader_source(word: &str, sum: bool, int64: bool) -> String {
    let drop = [if sum { "plain" } else { "sum" }, if word == "u32" { "w16" } else { "w4" }, if int64 { "i16" } else { "i64" }];
    let mut out = String::with_capacity(SHADER.len());
    // Tagged sections nest (`w4` inside `sum`): a line is kept when no open tag is dropped.
    let mut open: Vec<&str> = Vec::new();
    for line in SHADER.lines() {
        let t = line.trim();
        if let Some(tag) = t.strip_prefix("//<") {
            open.push(tag);
            continue;
        }
        if let Some(tag) = t.strip_prefix("//").and_then(|t| t.strip_suffix('>')).filter(|t| !t.contains(' ')) {
            if open.last() == Some(&tag) {
                open.pop();
                continue;
            }
        }
        if !open.iter().any(|t| drop.contains(t)) {
            out.push_str(line);
            out.push('\n');
        }
    }
    let wide = if word == "u32" { "u64" } else { "vec4<u64>" };
    out.replace("WIDE", wide).replace("WORD", word)
}

/// Whether the checksumming gathers may use 64-bit integers where the device has them
/// (SHADER_INT64): [`WgpuOptions::int64`], else unless `HICACHE_WGPU_INT64=0` (to compare the
/// two in benchmarks).
fn int64_wanted(opts: &WgpuOptions) -> bool {
    opts.int64.unwrap_or_else(|| std::env::var("HICACHE_WGPU_INT64").map_or(true, |v| v != "0"))
}

/// Loop iterations one invocation of the gather shader may run, all its loops together: Mesa's
/// llvmpipe (lavapipe) stops an invocation's loops after 65,535 iterations without a word,
/// which silently truncated chunks of more than 65,535 words per lane.
const GATHER_MAX_TRIPS: u64 = 65_535;

/// The usages every pool buffer needs: storage for the shader, copy source and destination for
/// `direct` runs and host reads/writes.
pub const REQUIRED_USAGES: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

/// Default backends: the native APIs. `WGPU_BACKEND` overrides; GL is not compiled in, so a
/// missing Vulkan driver is reported instead of silently falling back.
fn backends() -> wgpu::Backends {
    (wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12).with_env()
}

impl WgpuExecutor {
    /// The default adapter (`WGPU_BACKEND`, `WGPU_ADAPTER_NAME` choose another).
    pub fn new() -> Result<WgpuExecutor> {
        WgpuExecutor::with_options(WgpuOptions::default())
    }

    /// The default adapter with options.
    pub fn with_options(opts: WgpuOptions) -> Result<WgpuExecutor> {
        let unavailable = |reason: String| TransferError::Unavailable { backend: "wgpu", reason };
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        desc.backends = backends();
        let instance = wgpu::Instance::new(desc);
        let adapter = match std::env::var("WGPU_ADAPTER_NAME") {
            // Filter ourselves: wgpu's own helper panics when the name matches nothing.
            Ok(name) if !name.is_empty() => {
                let adapters = pollster::block_on(instance.enumerate_adapters(backends()));
                let want = name.to_lowercase();
                adapters
                    .into_iter()
                    .find(|a| a.get_info().name.to_lowercase().contains(&want))
                    .ok_or_else(|| unavailable(format!("no adapter matches WGPU_ADAPTER_NAME={name:?}")))?
            }
            _ => pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                force_fallback_adapter: false,
                compatible_surface: None,
                apply_limit_buckets: false,
            }))
            .map_err(|e| {
                let hint = if cfg!(target_os = "linux") {
                    "; no Vulkan driver? on Debian/Ubuntu: apt-get install mesa-vulkan-drivers"
                } else {
                    ""
                };
                unavailable(format!("{e}{hint}"))
            })?,
        };
        let info = adapter.get_info();
        let limits = adapter.limits();
        let mapped = wgpu::Features::MAPPABLE_PRIMARY_BUFFERS;
        let want_mapped = opts.mapped_host.unwrap_or_else(|| std::env::var("HICACHE_WGPU_MAPPED_HOST").map_or(true, |v| v != "0"));
        let mut features = if want_mapped && adapter.features().contains(mapped) { mapped } else { wgpu::Features::empty() };
        // 64-bit integers make the checksumming gather one multiply-add per word.
        if int64_wanted(&opts) && adapter.features().contains(wgpu::Features::SHADER_INT64) {
            features |= wgpu::Features::SHADER_INT64;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("hicache-io"),
            required_features: features,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| unavailable(format!("request_device on {}: {e}", info.name)))?;
        let lost = Arc::new(Mutex::new(None));
        let lost2 = lost.clone();
        device.set_device_lost_callback(move |reason, msg| {
            *lost2.lock().unwrap() = Some(format!("device lost ({reason:?}): {msg}"));
        });
        // Errors are caught with error scopes; never let a stray one panic the process.
        device.on_uncaptured_error(Arc::new(|e: wgpu::Error| log::error!("wgpu uncaptured error: {e}")));
        WgpuExecutor::from_parts(device, queue, opts, lost)
    }

    /// Runs on the caller's device and queue (an engine's own). Its callbacks stay the
    /// caller's: errors are caught with error scopes, device loss shows up as a failed wait.
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue, opts: WgpuOptions) -> Result<WgpuExecutor> {
        WgpuExecutor::from_parts(device, queue, opts, Arc::new(Mutex::new(None)))
    }

    fn from_parts(device: wgpu::Device, queue: wgpu::Queue, opts: WgpuOptions, lost: Arc<Mutex<Option<String>>>) -> Result<WgpuExecutor> {
        let unavailable = |reason: String| TransferError::Unavailable { backend: "wgpu", reason };
        let info = device.adapter_info();
        let limits = device.limits();

        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("hicache-io gather"),
            entries: &[
                bgl_entry(0, wgpu::BufferBindingType::Uniform, true),
                bgl_entry(1, wgpu::BufferBindingType::Storage { read_only: true }, false),
                bgl_entry(2, wgpu::BufferBindingType::Storage { read_only: true }, false),
                bgl_entry(3, wgpu::BufferBindingType::Storage { read_only: false }, false),
            ],
        });
        let sum_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("hicache-io gather with checksums"),
            entries: &[
                bgl_entry(0, wgpu::BufferBindingType::Uniform, true),
                bgl_entry(1, wgpu::BufferBindingType::Storage { read_only: true }, false),
                bgl_entry(2, wgpu::BufferBindingType::Storage { read_only: true }, false),
                bgl_entry(3, wgpu::BufferBindingType::Storage { read_only: false }, false),
                bgl_entry(4, wgpu::BufferBindingType::Storage { read_only: true }, false),
                bgl_entry(5, wgpu::BufferBindingType::Storage { read_only: false }, false),
            ],
        });
        let pipeline_layout = |layout: &wgpu::BindGroupLayout| {
            device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some("hicache-io gather"),
                bind_group_layouts: &[Some(layout)],
                immediate_size: 0,
            })
        };
        let (pl, sum_pl) = (pipeline_layout(&layout), pipeline_layout(&sum_layout));
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        // naga's bounds checks stay: dropping them (`create_shader_module_trusted`) measured no
        // faster on lavapipe, so the shader keeps wgpu's guarantee.
        let int64 = int64_wanted(&opts) && device.features().contains(wgpu::Features::SHADER_INT64);
        let make = |word: &str, sum: bool| {
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("gather.wgsl"),
                source: wgpu::ShaderSource::Wgsl(shader_source(word, sum, int64).into()),
            });
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some("hicache-io gather"),
                layout: Some(if sum { &sum_pl } else { &pl }),
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            })
        };
        let (pipe4, pipe16) = (make("u32", false), make("vec4<u32>", false));
        let (sum4, sum16) = (make("u32", true), make("vec4<u32>", true));
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(unavailable(format!("shader compilation failed on {}: {e}", info.name)));
        }
        // At most 2^31 bytes: the shader's window-relative offsets are 32-bit and wrap, which is
        // exact while a window plus two unit strides stays below 2^32.
        let max_window = opts.max_window.unwrap_or(u64::MAX).min(limits.max_storage_buffer_binding_size).min(1 << 31);
        // One index pair is 8 bytes of one binding; a dispatch holds u32::MAX invocations at up
        // to 64 per item.
        let max_gather_items =
            (limits.max_storage_buffer_binding_size / 8).min(u32::MAX as u64 >> 6).min(opts.max_gather_items.unwrap_or(u64::MAX)).max(1);
        let max_buffer = limits.max_buffer_size.min(u32::MAX as u64) & !3;
        let max_segment = opts.max_segment.unwrap_or(max_buffer).min(max_buffer);
        let default_lanes = if info.device_type == wgpu::DeviceType::Cpu { 1 } else { 64 };
        let max_lanes = std::env::var("HICACHE_WGPU_LANES")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|v| v.is_power_of_two() && *v <= 64)
            .unwrap_or(default_lanes);
        // `from_device`: the caller's device decides; `with_options` asked for the feature only
        // where wanted and present.
        let mapped_host = opts.mapped_host != Some(false) && device.features().contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
        log::info!("wgpu: {} ({:?}, {:?}, driver {} {})", info.name, info.backend, info.device_type, info.driver, info.driver_info);
        Ok(WgpuExecutor {
            inner: Arc::new(Inner {
                device,
                queue,
                info,
                limits,
                layout,
                pipe4,
                pipe16,
                sum_layout,
                sum4,
                sum16,
                int64,
                keys: Default::default(),
                pending: Default::default(),
                max_window,
                max_buffer,
                max_segment,
                max_lanes,
                max_gather_items,
                mapped_host,
                lost,
                id: super::next_executor_id(),
                submitter: Arc::new(Submitter::default()),
                map_lock: Arc::new(std::sync::RwLock::new(())),
                submit_thread: Mutex::new(None),
            }),
        })
    }

    /// Where device pools live: unified memory on integrated and CPU adapters, else the GPU's.
    pub fn device_pool_memory(&self) -> PoolMemory {
        match self.inner.info.device_type {
            wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::Cpu => PoolMemory::Unified,
            _ => PoolMemory::DeviceLocal,
        }
    }
    /// Where host pools live: host-visible when mapped (`MAPPABLE_PRIMARY_BUFFERS`), unified
    /// on integrated and CPU adapters, else the GPU's memory (the adapter cannot map storage
    /// buffers: host pools then take VRAM, and their CPU reads and writes go through staging
    /// copies).
    pub fn host_pool_memory(&self) -> PoolMemory {
        match self.device_pool_memory() {
            PoolMemory::Unified => PoolMemory::Unified,
            _ if self.inner.mapped_host => PoolMemory::HostVisible,
            m => m,
        }
    }

    /// The wgpu device.
    pub fn device(&self) -> &wgpu::Device {
        &self.inner.device
    }
    /// The wgpu queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.inner.queue
    }
    /// The adapter.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.inner.info
    }

    fn check_lost(&self) -> Result<()> {
        match self.inner.lost.lock().unwrap().clone() {
            Some(m) => Err(err(m)),
            None => Ok(()),
        }
    }

    /// Waits for everything submitted so far, checksums settled.
    fn wait(&self) -> Result<()> {
        self.inner.submitter.drain();
        let pushed = self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).pushed;
        self.wait_index(None)?;
        self.settle_until(pushed)
    }

    /// Waits for submission `index` (all of them: `None`), then settles the checksums of what
    /// has completed.
    fn wait_index(&self, index: Option<wgpu::SubmissionIndex>) -> Result<()> {
        let waited = self.inner.device.poll(wgpu::PollType::Wait { submission_index: index, timeout: Some(WAIT) });
        self.settle();
        waited.map_err(|e| err(format!("waiting for the queue: {e}")))?;
        self.check_lost()
    }

    /// Waits for the transfers up to ticket `t` of the submit thread, checksums settled.
    pub(crate) fn wait_for(&self, t: u64) -> Result<()> {
        match self.inner.submitter.index_of(t)? {
            Some(s) => {
                self.wait_index(Some(s.index))?;
                self.settle_until(s.pushed)
            }
            None => self.wait(),
        }
    }

    /// Settles checksum readbacks until the first `pushed` are: their submissions have
    /// completed, but another thread's poll may have taken their mapping callbacks and not run
    /// them yet.
    fn settle_until(&self, pushed: u64) -> Result<()> {
        let start = std::time::Instant::now();
        loop {
            self.settle();
            if self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).settled >= pushed {
                return Ok(());
            }
            self.check_lost()?;
            if start.elapsed() > WAIT {
                return Err(err("waiting for checksum readbacks timed out"));
            }
            std::thread::yield_now();
            self.inner.device.poll(wgpu::PollType::Poll).map_err(|e| err(format!("polling the queue: {e}")))?;
        }
    }

    /// Whether the transfers up to ticket `t` have completed (polls without blocking).
    pub(crate) fn is_done(&self, t: u64) -> Result<bool> {
        self.check_lost()?;
        if !self.inner.submitter.is_submitted(t) {
            return Ok(false);
        }
        let status = self.inner.device.poll(wgpu::PollType::Poll).map_err(|e| err(format!("polling the queue: {e}")))?;
        let completed = self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).completed.clone();
        let (done, pushed) = match self.inner.submitter.index_of(t)? {
            // A poll that leaves the queue non-empty does not say which submissions are done;
            // the completion callbacks the poll ran do.
            Some(s) => (status.is_queue_empty() || completed.load(std::sync::atomic::Ordering::Acquire) >= s.seq, s.pushed),
            // Too old to be remembered: done once the queue is empty (and, below, every readback
            // pushed so far settled).
            None => (status.is_queue_empty(), self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).pushed),
        };
        if !done {
            return Ok(false);
        }
        // Done once its checksums are settled too (their callbacks may still be on their way).
        self.settle();
        Ok(self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).settled >= pushed)
    }

    /// Hands an encoded command buffer to the submit thread (started on first use).
    fn submit_later(&self, cb: wgpu::CommandBuffer, sums: Vec<PendingSums>) -> Result<u64> {
        let sub = &self.inner.submitter;
        let mut tx = sub.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (send, recv) = std::sync::mpsc::channel::<Handed>();
            let queue = self.inner.queue.clone();
            let pending = self.inner.pending.clone();
            let device = self.inner.device.clone();
            let map_lock = self.inner.map_lock.clone();
            let shared = Arc::downgrade(sub);
            let handle = std::thread::Builder::new()
                .name("hicache-io wgpu submit".into())
                .spawn(move || {
                    for (ticket, cb, sums) in recv {
                        // Error scopes are per thread: these catch what the submission of this
                        // command buffer reports (its readbacks are then marked failed), and its
                        // waiters get it as an error. A panic inside wgpu must not leave them
                        // hanging either.
                        let mut scopes = Scopes::push(&device);
                        let mut pop = || scopes.pop();
                        let index = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            let _no_mapping = map_lock.read().unwrap_or_else(|e| e.into_inner());
                            submit_with(&queue, &pending, cb, sums, &mut pop)
                        }));
                        // A panic before the scope was popped: pop it now.
                        let late = pop();
                        let Some(s) = shared.upgrade() else { return };
                        let mut st = s.lock();
                        let (index, error) = match index {
                            Ok((submitted, error)) => (Ok(submitted), error.or(late)),
                            Err(e) => (Err(e), late),
                        };
                        match (index, error) {
                            (Ok(index), None) => {
                                st.indices.insert(ticket, index);
                            }
                            (Ok(_), Some(e)) => {
                                st.failed.insert(ticket, e.to_string());
                            }
                            (Err(_), _) => {
                                st.failed.insert(ticket, "the queue submission panicked".into());
                            }
                        }
                        while st.failed.len() > 4096 {
                            st.failed.pop_first();
                        }
                        while st.indices.len() > 4096 {
                            st.indices.pop_first();
                        }
                        st.submitted = ticket;
                        s.submitted_cv.notify_all();
                    }
                })
                .map_err(|e| err(format!("starting the submit thread: {e}")))?;
            *self.inner.submit_thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
            *tx = Some(send);
        }
        let ticket = {
            let mut st = sub.lock();
            st.queued += 1;
            st.queued
        };
        if tx.as_ref().map(|t| t.send((ticket, cb, sums)).is_err()).unwrap_or(true) {
            // The thread is gone: count the ticket as submitted-nothing so nobody waits forever.
            let mut st = sub.lock();
            st.submitted = st.submitted.max(ticket);
            sub.submitted_cv.notify_all();
            return Err(err("the submit thread is gone"));
        }
        Ok(ticket)
    }

    /// Submits `encoder` inside validation and out-of-memory scopes and waits.
    fn submit(&self, build: impl FnOnce(&mut wgpu::CommandEncoder) -> Result<()>) -> Result<()> {
        self.encode_and_submit(false, |enc, _| build(enc))?;
        self.wait()
    }

    /// Submits `encoder` inside validation and out-of-memory scopes; with `later`, hands it to
    /// the submit thread instead (encoding errors are still caught here).
    /// `build` may add checksum readbacks, settled once the submission has completed.
    fn encode_and_submit(
        &self,
        later: bool,
        build: impl FnOnce(&mut wgpu::CommandEncoder, &mut Vec<PendingSums>) -> Result<()>,
    ) -> Result<()> {
        self.check_lost()?;
        if !later {
            // Program order: what the submit thread holds goes first.
            self.inner.submitter.drain();
        }
        let dev = &self.inner.device;
        // Popped after the submission when there is one, so that its checksum readbacks are
        // marked failed before anyone can settle them.
        let mut scopes = Scopes::push(dev);
        let mut pop = || scopes.pop();
        let mut enc = dev.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("hicache-io") });
        let mut sums = Vec::new();
        let built = build(&mut enc, &mut sums);
        let mut handed = Ok(());
        let mut error = None;
        if built.is_ok() {
            let cb = enc.finish();
            if later {
                // The submit thread's own scope catches what its submission reports.
                handed = self.submit_later(cb, sums).map(|_| ());
            } else {
                let _no_mapping = self.inner.map_lock.read().unwrap_or_else(|e| e.into_inner());
                error = submit_with(&self.inner.queue, &self.inner.pending, cb, sums, &mut pop).1;
            }
        }
        let error = error.or_else(&mut pop);
        built?;
        handed?;
        if let Some(e) = error {
            return Err(err(e));
        }
        Ok(())
    }

    /// Encodes one gather step: an index table, one parameter record per dispatch, one
    /// dispatch per (address pair, window pair) that holds an item.
    fn gather(
        &self,
        g: &GatherStep,
        bufs: &Bindings<'_, WgpuBuffer>,
        enc: &mut wgpu::CommandEncoder,
        out: &mut Vec<PendingSums>,
    ) -> Result<()> {
        let inner = &self.inner;
        let (word, lanes_log2) = self.word_and_lanes(g, bufs);
        // The planner bounds indices by `max_index` (i32) and counts by `max_gather_items`.
        let pairs: Vec<[i32; 2]> =
            g.src_indices.iter().zip(g.dst_indices.iter()).map(|(&s, &d)| [s.max(-1) as i32, d.max(-1) as i32]).collect();
        let index_buf = inner.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("hicache-io indices"),
            contents: bytemuck::cast_slice(&pairs),
            usage: wgpu::BufferUsages::STORAGE,
        });
        let dispatches = self.dispatches(g, bufs, word, lanes_log2)?;
        // One Params record per dispatch, at the uniform offset alignment.
        let stride = (std::mem::size_of::<Params>() as u64).next_multiple_of(inner.limits.min_uniform_buffer_offset_alignment as u64);
        let mut params = vec![0u8; (stride * dispatches.len() as u64) as usize];
        for (i, (_, p, _, _)) in dispatches.iter().enumerate() {
            let at = i * stride as usize;
            params[at..at + std::mem::size_of::<Params>()].copy_from_slice(bytemuck::bytes_of(p));
        }
        let param_buf = inner.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("hicache-io params"),
            contents: &params,
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let sums = match (g.checksum, &bufs.integrity) {
            (Some(mode), Some(b)) => Some(self.sum_buffers(g, mode, b)?),
            _ => None,
        };
        let groups: Vec<wgpu::BindGroup> = dispatches
            .iter()
            .map(|(li, _, sw, dw)| {
                let l = &g.pairs[*li];
                let mut entries = vec![
                    entry(0, &param_buf, 0, std::mem::size_of::<Params>() as u64),
                    entry(1, &index_buf, 0, index_buf.size()),
                    entry(2, &bufs.get(l.src.buf).segments[sw.seg], sw.start, sw.len),
                    entry(3, &bufs.get(l.dst.buf).segments[dw.seg], dw.start, dw.len),
                ];
                if let Some(s) = &sums {
                    let (b, at) = s.layout.at(*li);
                    entries.push(entry(4, &s.keys, 0, s.keys.size()));
                    entries.push(entry(5, &s.buffers[b], at, 8 * pairs.len() as u64));
                }
                let layout = if sums.is_some() { &inner.sum_layout } else { &inner.layout };
                inner.device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout, entries: &entries })
            })
            .collect();
        let workgroups = ((pairs.len() as u64) << lanes_log2).div_ceil(64);
        let max_x = inner.limits.max_compute_workgroups_per_dimension as u64;
        let (x, y) = (workgroups.min(max_x), workgroups.div_ceil(max_x));
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("hicache-io gather"), timestamp_writes: None });
        pass.set_pipeline(match (word, sums.is_some()) {
            (16, false) => &inner.pipe16,
            (_, false) => &inner.pipe4,
            (16, true) => &inner.sum16,
            (_, true) => &inner.sum4,
        });
        for (i, bg) in groups.iter().enumerate() {
            pass.set_bind_group(0, bg, &[(i as u64 * stride) as u32]);
            pass.dispatch_workgroups(x as u32, y as u32, 1);
        }
        drop(pass);
        if let Some(s) = sums {
            for (b, staging) in s.buffers.iter().zip(&s.pending.staging) {
                enc.copy_buffer_to_buffer(b, 0, staging, 0, b.size());
            }
            out.push(s.pending);
        }
        // wgpu keeps the index, parameter and sums buffers alive until the submission completes.
        Ok(())
    }

    /// The device buffers of a checksumming gather: the item keys, zeroed sums (two u32 per
    /// index pair and address pair, each address pair's at a binding offset, packed into as
    /// few buffers as the buffer size allows) and their mappable copies.
    fn sum_buffers(&self, g: &GatherStep, mode: ChecksumMode, b: &IntegrityBinding) -> Result<SumBuffers> {
        let inner = &self.inner;
        let n = g.src_indices.len() as u64;
        let align = inner.limits.min_storage_buffer_offset_alignment as u64;
        let stride = (8 * n.max(1)).next_multiple_of(align);
        // Within one binding (the planner bounds `n` by it) and one buffer.
        let per_buffer = (inner.max_buffer.min(1 << 28) / stride).max(1) as usize;
        let pairs = g.pairs.len();
        let make = |label: &'static str, size: u64, usage: wgpu::BufferUsages| {
            inner.device.create_buffer(&wgpu::BufferDescriptor { label: Some(label), size, usage, mapped_at_creation: false })
        };
        let layout = SumsLayout { per_buffer, stride };
        let (mut buffers, mut staging) = (Vec::new(), Vec::new());
        for first in (0..pairs).step_by(per_buffer) {
            let size = stride * (pairs - first).min(per_buffer) as u64;
            // New buffers are zeroed (WebGPU guarantees it).
            buffers.push(make("hicache-io sums", size, wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC));
            staging.push(make("hicache-io sums readback", size, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST));
        }
        let keys = self.keys_buffer(b.sidecar.keys());
        Ok(SumBuffers {
            keys,
            buffers,
            layout,
            pending: PendingSums {
                staging,
                mapped: Default::default(),
                failed: Default::default(),
                what: Settles::Sums {
                    layout,
                    src_indices: g.src_indices.clone(),
                    dst_indices: g.dst_indices.clone(),
                    items: g.items.clone(),
                },
                mode,
                binding: b.clone(),
            },
        })
    }

    /// The item keys of `keys` on the device (uploaded once per key table).
    fn keys_buffer(&self, keys: &crate::integrity::Keys) -> wgpu::Buffer {
        let mut cache = self.inner.keys.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .entry((keys.seed(), keys.words()))
            .or_insert_with(|| {
                // Whole 16-byte words for the vec4 pipeline.
                let mut table = keys.table().to_vec();
                table.resize(table.len().max(1).next_multiple_of(4), 0);
                self.inner.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("hicache-io item keys"),
                    contents: bytemuck::cast_slice(&table),
                    usage: wgpu::BufferUsages::STORAGE,
                })
            })
            .clone()
    }

    /// Records or verifies the checksums of every completed checksumming step, oldest first
    /// (mappings complete in submission order, so the settled ones are a prefix).
    fn settle(&self) {
        let mut q = self.inner.pending.lock().unwrap_or_else(|e| e.into_inner());
        while q.entries.front().is_some_and(|p| p.is_ready()) {
            if let Some(p) = q.entries.pop_front() {
                p.settle();
                q.settled += 1;
            }
        }
    }

    /// The shader's word (16 bytes when every offset, size and the window allow, else 4) and
    /// invocations per item (the plan step's `lanes_log2`).
    fn word_and_lanes(&self, g: &GatherStep, bufs: &Bindings<'_, WgpuBuffer>) -> (u64, u32) {
        let inner = &self.inner;
        let base_granule = self.capabilities().window_granule(g.chunk_bytes);
        let fits16 = |a: &Addr| aligned16(a) && bufs.get(a.buf).segments.iter().all(|b| b.size().is_multiple_of(16));
        let word: u64 = if g.chunk_bytes.is_multiple_of(16)
            && lcm(base_granule, 16) <= inner.max_window
            && g.pairs.iter().all(|l| fits16(&l.src) && fits16(&l.dst))
        {
            16
        } else {
            4
        };
        (word, g.lanes_log2())
    }

    /// One dispatch per address pair and per pair of binding windows that holds an item (one
    /// pair for pools that fit one binding, the common case). Windows tile each segment in whole
    /// granules (`lcm(chunk, offset alignment, word)`), so an item chunk never straddles an edge.
    fn dispatches(&self, g: &GatherStep, bufs: &Bindings<'_, WgpuBuffer>, word: u64, lanes_log2: u32) -> Result<Vec<Dispatch>> {
        let inner = &self.inner;
        let granule = lcm(lcm(g.chunk_bytes, inner.limits.min_storage_buffer_offset_alignment as u64), word);
        // The planner checked that one granule fits the window (`Capabilities::max_binding`).
        let win = (inner.max_window / granule * granule).max(granule);
        let mut out = Vec::new();
        for (li, l) in g.pairs.iter().enumerate() {
            let (sb, db) = (bufs.get(l.src.buf), bufs.get(l.dst.buf));
            let (sws, dws) = (windows(sb, win), windows(db, win));
            let mut used: Vec<(usize, usize)> = if sws.len() == 1 && dws.len() == 1 {
                vec![(0, 0)]
            } else {
                let live = g.src_indices.iter().zip(g.dst_indices.iter()).filter(|(s, d)| **s >= 0 && **d >= 0);
                live.flat_map(|(&s, &d)| {
                    (0..g.heads)
                        .map(move |h| (window_of(sb, win, l.src.offset(s as u64, h)), window_of(db, win, l.dst.offset(d as u64, h))))
                })
                .collect()
            };
            used.sort_unstable();
            used.dedup();
            for (si, di) in used {
                let (sw, dw) = (sws[si], dws[di]);
                let p = Params {
                    src: side(&l.src, &sw)?,
                    dst: side(&l.dst, &dw)?,
                    n_items: g.src_indices.len() as u32,
                    heads: g.heads as u32,
                    words_per_chunk: (g.chunk_bytes / word) as u32,
                    word_shift: word.trailing_zeros(),
                    lanes_log2,
                    _pad: [0; 3],
                };
                out.push((li, p, sw, dw));
            }
        }
        Ok(out)
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SideParams {
    rel0: u32,
    page: u32,
    page_stride: u32,
    row_stride: u32,
    head_stride: u32,
    unit_lo: u32,
    unit_hi: u32,
    win_len: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    src: SideParams,
    dst: SideParams,
    n_items: u32,
    heads: u32,
    words_per_chunk: u32,
    word_shift: u32,
    lanes_log2: u32,
    _pad: [u32; 3],
}

/// One binding window: `len` bytes at `start` of segment `seg`, `abs` bytes into the pool.
#[derive(Debug, Clone, Copy)]
struct Window {
    seg: usize,
    start: u64,
    len: u64,
    abs: u64,
}

/// A checksumming gather's device buffers (see [`WgpuExecutor::sum_buffers`]).
struct SumBuffers {
    keys: wgpu::Buffer,
    buffers: Vec<wgpu::Buffer>,
    layout: SumsLayout,
    pending: PendingSums,
}

/// Where a gather's sums lie: `per_buffer` address pairs per sums buffer, `stride` bytes each
/// (a binding offset alignment).
#[derive(Clone, Copy)]
struct SumsLayout {
    per_buffer: usize,
    stride: u64,
}

impl SumsLayout {
    /// The buffer and byte offset of address pair `li`'s entries.
    fn at(&self, li: usize) -> (usize, u64) {
        (li / self.per_buffer, (li % self.per_buffer) as u64 * self.stride)
    }
}

/// Submits `cb` and queues its checksum readbacks in submission order (the lock covers both):
/// mapped, or marked failed when `errors` (popping the submission's error scopes) reports one,
/// so that a submission that did not run never settles zeroed sums. Returns the submission and
/// the error.
fn submit_with(
    queue: &wgpu::Queue,
    pending: &Mutex<PendingQueue>,
    cb: wgpu::CommandBuffer,
    sums: Vec<PendingSums>,
    errors: impl FnOnce() -> Option<String>,
) -> (Submitted, Option<String>) {
    let mut q = pending.lock().unwrap_or_else(|e| e.into_inner());
    let index = queue.submit([cb]);
    q.submissions += 1;
    let (seq, completed) = (q.submissions, q.completed.clone());
    queue.on_submitted_work_done(move || {
        completed.fetch_max(seq, std::sync::atomic::Ordering::Release);
    });
    let error = errors();
    for s in sums {
        match error {
            Some(_) => s.failed.store(true, std::sync::atomic::Ordering::Release),
            None => s.map(),
        }
        q.entries.push_back(s);
        q.pushed += 1;
    }
    let pushed = q.pushed;
    (Submitted { index, pushed, seq }, error)
}

/// One dispatch: address pair index, parameters, source and destination windows.
type Dispatch = (usize, Params, Window, Window);

/// A side's parameters for one window: the units (`idx / page`) whose bytes can touch it and
/// the window-relative offset of the first (wrapped when negative). A unit's bytes for one
/// address lie within `page_stride` bytes of its start, so the range holds every unit with a
/// chunk inside the window, and relative offsets stay within a few windows of zero.
fn side(a: &Addr, w: &Window) -> Result<SideParams> {
    let u = |v: u64| u32::try_from(v).map_err(|_| err(format!("stride {v} exceeds u32")));
    let ps = a.page_stride.max(1);
    let (lo_b, hi_b) = (w.abs, w.abs + w.len);
    let unit_lo = if lo_b > a.base { (lo_b - a.base) / ps } else { 0 };
    let unit_hi = if hi_b > a.base { (hi_b - a.base).div_ceil(ps) } else { 0 };
    let cap = |v: u64| v.min(u32::MAX as u64) as u32;
    if w.len.saturating_add(ps.saturating_mul(2)) > 1 << 32 {
        return Err(err(format!("a {}-byte window with {ps}-byte units exceeds 32-bit offsets", w.len)));
    }
    let rel0 = (a.base as i128 + unit_lo as i128 * ps as i128 - lo_b as i128) as u32;
    Ok(SideParams {
        rel0,
        page: u(a.page)?,
        page_stride: u(a.page_stride)?,
        row_stride: u(a.row_stride)?,
        head_stride: u(a.head_stride)?,
        unit_lo: cap(unit_lo),
        unit_hi: cap(unit_hi),
        win_len: u(w.len)?,
    })
}

fn aligned16(a: &Addr) -> bool {
    [a.base, a.page_stride, a.row_stride, a.head_stride].iter().all(|v| v % 16 == 0)
}

/// One `direct` run, split where either side crosses a segment edge.
fn copy_run(enc: &mut wgpu::CommandEncoder, src: &WgpuBuffer, src_offset: u64, dst: &WgpuBuffer, dst_offset: u64, len: u64) {
    let mut at = 0;
    while at < len {
        let (so, d_o) = (src_offset + at, dst_offset + at);
        let n = (src.seg - so % src.seg).min(dst.seg - d_o % dst.seg).min(len - at);
        enc.copy_buffer_to_buffer(
            &src.segments[(so / src.seg) as usize],
            so % src.seg,
            &dst.segments[(d_o / dst.seg) as usize],
            d_o % dst.seg,
            n,
        );
        at += n;
    }
}

/// Binding windows of `win` bytes tiling each segment of `b` (the last of each shorter).
fn windows(b: &WgpuBuffer, win: u64) -> Vec<Window> {
    let mut out = Vec::new();
    for (k, seg) in b.segments.iter().enumerate() {
        let size = seg.size();
        out.extend((0..size.div_ceil(win)).map(|j| Window {
            seg: k,
            start: j * win,
            len: win.min(size - j * win),
            abs: k as u64 * b.seg + j * win,
        }));
    }
    out
}

/// Index (into [`windows`]) of the window holding byte `offset` of `b`.
fn window_of(b: &WgpuBuffer, win: u64, offset: u64) -> usize {
    let per_seg = b.seg.div_ceil(win) as usize;
    (offset / b.seg) as usize * per_seg + ((offset % b.seg) / win) as usize
}

fn bgl_entry(binding: u32, ty: wgpu::BufferBindingType, dynamic: bool) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer { ty, has_dynamic_offset: dynamic, min_binding_size: None },
        count: None,
    }
}

fn entry(binding: u32, buffer: &wgpu::Buffer, offset: u64, size: u64) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer, offset, size: wgpu::BufferSize::new(size) }),
    }
}

impl Executor for WgpuExecutor {
    type Buffer = WgpuBuffer;

    fn name(&self) -> &'static str {
        "wgpu"
    }
    fn id(&self) -> u64 {
        self.inner.id
    }
    fn buffer_owner(&self, buf: &WgpuBuffer) -> u64 {
        buf.owner
    }
    fn describe(&self) -> String {
        let i = &self.inner.info;
        format!(
            "{} ({:?}, {:?}, driver {} {}; storage binding {} MiB, buffer {} MiB, offset alignment {}; device pools {}, host pools {}{}{})",
            i.name,
            i.backend,
            i.device_type,
            i.driver,
            i.driver_info,
            self.inner.limits.max_storage_buffer_binding_size >> 20,
            self.inner.limits.max_buffer_size >> 20,
            self.inner.limits.min_storage_buffer_offset_alignment,
            self.device_pool_memory().name(),
            self.host_pool_memory().name(),
            if self.inner.mapped_host { ", mapped" } else { " (no MAPPABLE_PRIMARY_BUFFERS: staged host reads and writes)" },
            if self.inner.int64 { "; checksums in 64-bit integers" } else { "; checksums in 16-bit halves" }
        )
    }
    fn capabilities(&self) -> Capabilities {
        // copy_buffer_to_buffer needs 4-byte offsets and sizes; the shader copies u32 words.
        Capabilities {
            name: "wgpu",
            kernel_word: 4,
            direct_align: wgpu::COPY_BUFFER_ALIGNMENT,
            max_binding: self.inner.max_window,
            binding_align: self.inner.limits.min_storage_buffer_offset_alignment as u64,
            max_gather_items: self.inner.max_gather_items,
            max_index: i32::MAX as u64,
            // Pools larger than one buffer are segmented, so the bound is the memory behind
            // them: system memory for host-visible and unified pools, and no more than that
            // for VRAM (wgpu does not report its size; an allocation it refuses is an
            // out-of-memory error from its error scope).
            max_pool_bytes: super::cpu::host_memory_bytes(),
            max_host_pool_bytes: super::cpu::host_memory_bytes(),
            max_segment: self.inner.max_segment,
            max_lanes: self.inner.max_lanes,
            // Every adapter: which drivers stop long loops is not something wgpu reports.
            max_loop_trips: GATHER_MAX_TRIPS,
            device_index_lists: false,
            // The WGSL gather sums as it copies; buffer-to-buffer copies cannot.
            checksums: true,
            direct_checksums: false,
            auto: crate::plan::AutoTable::DEFAULT,
        }
    }
    fn alloc(&self, bytes: u64) -> Result<WgpuBuffer> {
        self.alloc_with(bytes, bytes, REQUIRED_USAGES)
    }
    fn alloc_host(&self, bytes: u64) -> Result<WgpuBuffer> {
        self.alloc_pool(bytes, bytes, true)
    }
    fn alloc_pool(&self, bytes: u64, segment: u64, host: bool) -> Result<WgpuBuffer> {
        let map = if host && self.inner.mapped_host {
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE
        } else {
            wgpu::BufferUsages::empty()
        };
        self.alloc_with(bytes, segment, REQUIRED_USAGES | map)
    }
    fn buffer_len(&self, buf: &WgpuBuffer) -> u64 {
        buf.len
    }
    fn check_buffer(&self, buf: &WgpuBuffer) -> Result<()> {
        let have = buf.usage();
        let missing = REQUIRED_USAGES - have;
        if !missing.is_empty() {
            return Err(TransferError::InvalidConfig(format!(
                "wgpu buffer lacks usage {missing:?} (has {have:?}; pools need STORAGE | COPY_SRC | COPY_DST)"
            )));
        }
        if let Some(big) = buf.segments.iter().find(|b| b.size() > self.inner.max_buffer) {
            return Err(TransferError::BufferSize {
                what: "wgpu buffer (u32 offsets)".into(),
                expected: self.inner.max_buffer,
                actual: big.size(),
            });
        }
        Ok(())
    }
    fn write(&self, buf: &WgpuBuffer, offset: u64, data: &[u8]) -> Result<()> {
        for (k, within, n, at) in buf.pieces(offset, data.len() as u64) {
            self.write_segment(&buf.segments[k], within, &data[at as usize..(at + n) as usize])?;
        }
        Ok(())
    }
    fn read(&self, buf: &WgpuBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        for (k, within, n, at) in buf.pieces(offset, out.len() as u64) {
            self.read_segment(&buf.segments[k], within, &mut out[at as usize..(at + n) as usize])?;
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        self.wait()
    }
    fn time_one_copy(&self, bytes: u64, budget: Duration) -> Result<f64> {
        let (a, b) = (self.alloc(bytes)?, self.alloc(bytes)?);
        let size = a.raw().size();
        crate::timing::time(budget, || {
            self.submit(|enc| {
                enc.copy_buffer_to_buffer(a.raw(), 0, b.raw(), 0, size);
                Ok(())
            })
        })
    }
    /// Both streams are the one queue: a pipeline's backups run in submission order with its
    /// loads (so no ordering between the streams is ever needed).
    fn execute_step(&self, plan: &Plan, k: usize, bufs: &Bindings<'_, WgpuBuffer>, enqueue: bool, _stream: super::Stream) -> Result<()> {
        self.encode_and_submit(enqueue, |enc, sums| {
            match plan.steps()[k].kind() {
                StepKind::Gather(g) => self.gather(g, bufs, enc, sums)?,
                StepKind::Copy(runs) => {
                    if runs.len() > MANY_RUNS {
                        static WARNED: std::sync::Once = std::sync::Once::new();
                        WARNED.call_once(|| {
                            log::warn!(
                                "wgpu: a direct step of {} runs issues one buffer copy per run; the kernel io backend is much faster for scattered items",
                                runs.len()
                            )
                        });
                    }
                    for r in runs {
                        copy_run(enc, bufs.get(r.src), r.src_offset, bufs.get(r.dst), r.dst_offset, r.len);
                    }
                    // Buffer-to-buffer copies cannot sum: their items settle as unknown, in order.
                    if let (Some(mode), Some(b)) = (plan.steps()[k].unsummed(), &bufs.integrity) {
                        sums.push(PendingSums::unknown(mode, b.clone(), runs));
                    }
                }
            }
            Ok(())
        })
    }
    fn finish(&self) -> Result<()> {
        self.wait()
    }
    fn completion(&self, _stream: super::Stream) -> Result<super::Completion> {
        // Called after an asynchronous plan, all of whose steps went to the submit thread: the
        // newest ticket (possibly another thread's later one: waiting for it waits no less).
        let newest = self.inner.submitter.lock().queued;
        Ok(super::Completion::wgpu(self.clone(), newest))
    }
}

impl WgpuExecutor {
    /// A zeroed pool buffer of `bytes` (rounded up to 4) with `usage`, in segments of `segment`
    /// bytes (the pool's choice, [`Capabilities::segment_bytes`]; one buffer when it covers the
    /// pool).
    fn alloc_with(&self, bytes: u64, segment: u64, usage: wgpu::BufferUsages) -> Result<WgpuBuffer> {
        let inner = &self.inner;
        let size = bytes.max(4).checked_next_multiple_of(4).ok_or_else(|| err("buffer size overflows"))?;
        let seg = if segment >= bytes { size } else { segment };
        if seg > inner.max_buffer || !seg.is_multiple_of(4) {
            return Err(TransferError::OutOfMemory {
                what: format!("one wgpu buffer on {}", inner.info.name),
                requested: seg,
                limit: format!("the adapter's largest buffer is {} bytes", inner.max_buffer),
            });
        }
        let count = size.div_ceil(seg);
        let scope = inner.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let segments: Vec<wgpu::Buffer> = (0..count)
            .map(|k| {
                inner.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("hicache-io pool"),
                    size: seg.min(size - k * seg),
                    usage,
                    mapped_at_creation: false,
                })
            })
            .collect();
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(TransferError::OutOfMemory { what: "wgpu buffer".into(), requested: size, limit: e.to_string() });
        }
        if count > 1 {
            log::debug!("wgpu: a {size}-byte pool in {count} segments of {seg} bytes");
        }
        Ok(WgpuBuffer { segments, seg, len: bytes, owner: inner.id })
    }

    fn write_segment(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if buffer.usage().contains(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE) {
            return self.write_mapped(buffer, offset, data);
        }
        // `write_buffer` lands before the next submission: queued transfers go first.
        self.inner.submitter.drain();
        let start = offset / 4 * 4;
        let end = (offset + data.len() as u64).next_multiple_of(4);
        if start == offset && end == offset + data.len() as u64 {
            self.inner.queue.write_buffer(buffer, offset, data);
        } else {
            // write_buffer needs 4-byte spans: read-modify-write the edges.
            let mut span = vec![0u8; (end - start) as usize];
            self.read_raw(buffer, start, &mut span)?;
            span[(offset - start) as usize..][..data.len()].copy_from_slice(data);
            self.inner.queue.write_buffer(buffer, start, &span);
        }
        Ok(())
    }

    fn read_segment(&self, buffer: &wgpu::Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        if buffer.usage().contains(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE) {
            return self.read_mapped(buffer, offset, out);
        }
        let start = offset / 4 * 4;
        let end = (offset + out.len() as u64).next_multiple_of(4);
        let mut span = vec![0u8; (end - start) as usize];
        self.read_raw(buffer, start, &mut span)?;
        out.copy_from_slice(&span[(offset - start) as usize..][..out.len()]);
        Ok(())
    }

    /// Maps `[start, end)` of a mappable (host-visible) buffer (`start` a multiple of 8, `end`
    /// of 4), runs `f` on it and unmaps. The submit queue is drained first and submissions from
    /// every thread wait on the map lock meanwhile; `map_async` waits for the GPU work already
    /// submitted that uses the buffer. So a mapped pool is never bound for GPU work, and every
    /// path out of here leaves it unmapped.
    fn mapped<T>(
        &self,
        buffer: &wgpu::Buffer,
        start: u64,
        end: u64,
        mode: wgpu::MapMode,
        f: impl FnOnce(&wgpu::BufferSlice<'_>) -> Result<T>,
    ) -> Result<T> {
        self.inner.submitter.drain();
        let _exclusive = self.inner.map_lock.write().unwrap_or_else(|e| e.into_inner());
        let scope = self.inner.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let slice = buffer.slice(start..end);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(mode, move |r| {
            let _ = tx.send(r);
        });
        // Poll without draining the submit thread (it waits on the map lock).
        let mapped = self.wait_index(None).and_then(|_| rx.recv_timeout(WAIT).map_err(|e| err(format!("map_async: {e}"))));
        let r = match mapped {
            Ok(Ok(())) => {
                let r = f(&slice);
                buffer.unmap();
                r
            }
            // Never mapped: nothing to undo.
            Ok(Err(e)) => Err(err(format!("map_async: {e}"))),
            // Still pending: unmapping cancels it.
            Err(e) => {
                buffer.unmap();
                Err(e)
            }
        };
        let _ = pollster::block_on(scope.pop());
        r
    }

    /// The map-aligned span around `[offset, offset + len)`.
    fn map_span(buffer: &wgpu::Buffer, offset: u64, len: u64) -> (u64, u64) {
        let start = offset / wgpu::MAP_ALIGNMENT * wgpu::MAP_ALIGNMENT;
        (start, (offset + len).next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT).min(buffer.size()))
    }

    /// Reads through the mapping of a host-visible buffer (no staging copy).
    fn read_mapped(&self, buffer: &wgpu::Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        let (start, end) = Self::map_span(buffer, offset, out.len() as u64);
        self.mapped(buffer, start, end, wgpu::MapMode::Read, |slice| {
            let view = slice.get_mapped_range().map_err(|e| err(format!("get_mapped_range: {e}")))?;
            let at = (offset - start) as usize;
            out.copy_from_slice(&view[at..at + out.len()]);
            Ok(())
        })
    }

    /// Writes through the mapping of a host-visible buffer (no staging copy). The mapping is
    /// write-only: a span that does not start and end on map boundaries is read first and
    /// written whole.
    fn write_mapped(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        let (start, end) = Self::map_span(buffer, offset, data.len() as u64);
        let patched;
        let span: &[u8] = if start == offset && end == offset + data.len() as u64 {
            data
        } else {
            let mut whole = vec![0u8; (end - start) as usize];
            self.read_mapped(buffer, start, &mut whole)?;
            whole[(offset - start) as usize..][..data.len()].copy_from_slice(data);
            patched = whole;
            &patched
        };
        self.mapped(buffer, start, end, wgpu::MapMode::Write, |slice| {
            let mut view = slice.get_mapped_range_mut().map_err(|e| err(format!("get_mapped_range_mut: {e}")))?;
            view.copy_from_slice(span);
            Ok(())
        })
    }

    /// Reads a 4-byte aligned span through a MAP_READ staging buffer.
    fn read_raw(&self, buffer: &wgpu::Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        let size = out.len() as u64;
        let staging = self.inner.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("hicache-io readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.submit(|enc| {
            enc.copy_buffer_to_buffer(buffer, offset, &staging, 0, size);
            Ok(())
        })?;
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv_timeout(WAIT).map_err(|e| err(format!("map_async: {e}")))?.map_err(|e| err(format!("map_async: {e}")))?;
        {
            let view = staging.get_mapped_range(..).map_err(|e| err(format!("get_mapped_range: {e}")))?;
            out.copy_from_slice(&view);
        }
        staging.unmap();
        Ok(())
    }
}
