//! Opening the executor: adapter, device, pipelines and limits.

use std::sync::{Arc, Mutex};

use super::*;
use crate::error::{Result, TransferError};

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
        // Validation and debug info only when asked (WGPU_VALIDATION=1, WGPU_DEBUG=1): wgpu
        // turns them on in every debug build, which loads the Khronos layer wherever it is
        // installed and slows every call several times.
        desc.flags = wgpu::InstanceFlags::empty().with_env();
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
        // An adapter class (HICACHE_WGPU_LIMITS): its limits and features, never more than this
        // adapter's.
        let class = AdapterClass::chosen(&opts)?;
        let (limits, offered) = match class {
            Some(c) => (c.limits().or_worse_values_from(&adapter.limits()), adapter.features() & c.features()),
            None => (adapter.limits(), adapter.features()),
        };
        let mapped = wgpu::Features::MAPPABLE_PRIMARY_BUFFERS;
        let want_mapped = opts.mapped_host.unwrap_or_else(|| std::env::var("HICACHE_WGPU_MAPPED_HOST").map_or(true, |v| v != "0"));
        let mut features = if want_mapped && offered.contains(mapped) { mapped } else { wgpu::Features::empty() };
        // 64-bit integers make the checksumming gather one multiply-add per word.
        if int64_wanted(&opts) && offered.contains(wgpu::Features::SHADER_INT64) {
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
            *lost2.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{reason:?}: {msg}"));
        });
        // Errors are caught with error scopes; never let a stray one panic the process.
        device.on_uncaptured_error(Arc::new(|e: wgpu::Error| log::error!("wgpu uncaptured error: {e}")));
        WgpuExecutor::from_parts(device, queue, WgpuOptions { adapter_class: class, ..opts }, lost)
    }

    /// Runs on the caller's device and queue (an engine's own). Its callbacks stay the
    /// caller's: errors are caught with error scopes, device loss shows up as a failed wait.
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue, opts: WgpuOptions) -> Result<WgpuExecutor> {
        WgpuExecutor::from_parts(device, queue, opts, Arc::new(Mutex::new(None)))
    }

    fn from_parts(device: wgpu::Device, queue: wgpu::Queue, opts: WgpuOptions, lost: Arc<Mutex<Option<String>>>) -> Result<WgpuExecutor> {
        let info = device.adapter_info();
        let limits = device.limits();
        let Pipelines { layout, sum_layout, pipe4, pipe16, sum4, sum16, int64 } = compile_pipelines(&device, &info, &opts)?;
        let Sizes { max_window, max_gather_items, max_buffer, max_segment, max_lanes } = sizes(&opts, &limits, &info);
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
                class: opts.adapter_class,
                layout,
                pipe4,
                pipe16,
                sum_layout,
                sum4,
                sum16,
                int64,
                pending: Default::default(),
                max_window,
                max_buffer,
                max_segment,
                max_lanes,
                max_gather_items,
                max_copies: opts.max_copies_per_submission.unwrap_or(DEFAULT_COPIES_PER_SUBMISSION).clamp(1, 1 << 24) as usize,
                mapped_host,
                lost,
                id: next_executor_id(),
                auto: AutoSlot::default(),
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
}

/// The gather's bind group layouts and compute pipelines: 4- and 16-byte words, plain and
/// checksumming.
struct Pipelines {
    layout: wgpu::BindGroupLayout,
    sum_layout: wgpu::BindGroupLayout,
    pipe4: wgpu::ComputePipeline,
    pipe16: wgpu::ComputePipeline,
    sum4: wgpu::ComputePipeline,
    sum16: wgpu::ComputePipeline,
    /// Whether the checksumming pipelines use 64-bit integers.
    int64: bool,
}

/// The bind group layouts of the plain gather and of the checksumming one (which also binds
/// the sums).
fn gather_layouts(device: &wgpu::Device) -> (wgpu::BindGroupLayout, wgpu::BindGroupLayout) {
    let plain = [
        bgl_entry(0, wgpu::BufferBindingType::Uniform, true),
        bgl_entry(1, wgpu::BufferBindingType::Storage { read_only: true }, false),
        bgl_entry(2, wgpu::BufferBindingType::Storage { read_only: true }, false),
        bgl_entry(3, wgpu::BufferBindingType::Storage { read_only: false }, false),
    ];
    let mut summing = plain.to_vec();
    summing.push(bgl_entry(5, wgpu::BufferBindingType::Storage { read_only: false }, false));
    let layout = |label: &str, entries: &[wgpu::BindGroupLayoutEntry]| {
        device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(label), entries })
    };
    (layout("hicache-io gather", &plain), layout("hicache-io gather with checksums", &summing))
}

/// Builds the gather's layouts and compiles its shaders into pipelines, under a validation
/// error scope: a shader that does not compile makes the executor unavailable.
fn compile_pipelines(device: &wgpu::Device, info: &wgpu::AdapterInfo, opts: &WgpuOptions) -> Result<Pipelines> {
    let (layout, sum_layout) = gather_layouts(device);
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
    let int64 = int64_wanted(opts) && device.features().contains(wgpu::Features::SHADER_INT64);
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
        return Err(TransferError::Unavailable { backend: "wgpu", reason: format!("shader compilation failed on {}: {e}", info.name) });
    }
    Ok(Pipelines { layout, sum_layout, pipe4, pipe16, sum4, sum16, int64 })
}

/// The executor's size limits, from the device's limits, the options and the environment.
struct Sizes {
    max_window: u64,
    max_gather_items: u64,
    max_buffer: u64,
    max_segment: u64,
    max_lanes: u64,
}

/// The window, gather, buffer and segment sizes the device and the options allow, and the
/// invocations per item (`HICACHE_WGPU_LANES`, else by the adapter's type).
fn sizes(opts: &WgpuOptions, limits: &wgpu::Limits, info: &wgpu::AdapterInfo) -> Sizes {
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
    Sizes { max_window, max_gather_items, max_buffer, max_segment, max_lanes }
}
