//! What a caller may choose when opening the wgpu executor.

/// Options for opening the executor.
#[derive(Debug, Clone, Default)]
pub struct WgpuOptions {
    /// Largest binding window in bytes (default: the adapter's storage binding limit). Tests
    /// set it tiny so that every window edge is crossed.
    pub max_window: Option<u64>,
    /// Most index pairs per gather step (default: what one index binding and one dispatch
    /// hold). Tests set it tiny so that calls are split.
    pub max_gather_items: Option<u64>,
    /// Most buffer copies (`direct` runs) in one queue submission (default 65,536): a larger
    /// step is submitted in parts, each waiting for the one before, so that the memory the
    /// queue holds is bounded by a part, not by the call. Tests set it tiny.
    pub max_copies_per_submission: Option<u64>,
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
    /// Plan within the limits and features of a class of adapter, whatever this one offers
    /// (`None`: unless `HICACHE_WGPU_LIMITS` names one, the adapter's own). See [`AdapterClass`].
    pub adapter_class: Option<AdapterClass>,
}

/// A class of adapter whose limits and features the executor can request and plan within, to
/// show on any machine what a user's Metal, DX12 or WebGPU adapter would do.
///
/// Figures, from wgpu-types 30: limits are `Limits::defaults()` (WebGPU's guaranteed limits:
/// 128 MiB storage bindings, 256 MiB buffers, 8 storage buffers per stage, 256 invocations per
/// workgroup; every Metal and DX12 adapter wgpu opens meets them) or `Limits::downlevel_defaults()`
/// (what GLES 3.1 and D3D11 guarantee: 4 storage buffers per stage), each lowered further where
/// this adapter offers less. Features, from wgpu's `Features` docs: `SHADER_INT64` on Metal (MSL
/// 2.3+) but on DX12 only with the DXC compiler (not assumed), `MAPPABLE_PRIMARY_BUFFERS` on Metal
/// and DX12; neither on WebGPU or downlevel adapters. No class has 64-bit atomic adds (none is
/// used).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterClass {
    /// An Apple GPU through Metal.
    Metal,
    /// A Windows GPU through DX12 (FXC shaders).
    Dx12,
    /// A browser's WebGPU adapter (the specification's defaults).
    WebGpu,
    /// GLES 3.1 / D3D11-class adapters.
    Downlevel,
}

impl AdapterClass {
    /// Every class, in the order `metal`, `dx12`, `webgpu`, `downlevel`.
    pub const ALL: [AdapterClass; 4] = [AdapterClass::Metal, AdapterClass::Dx12, AdapterClass::WebGpu, AdapterClass::Downlevel];

    /// The name `HICACHE_WGPU_LIMITS` takes.
    pub fn name(self) -> &'static str {
        match self {
            AdapterClass::Metal => "metal",
            AdapterClass::Dx12 => "dx12",
            AdapterClass::WebGpu => "webgpu",
            AdapterClass::Downlevel => "downlevel",
        }
    }

    /// The limits the class guarantees (see the type's docs for the figures).
    pub fn limits(self) -> wgpu::Limits {
        match self {
            AdapterClass::Downlevel => wgpu::Limits::downlevel_defaults(),
            _ => wgpu::Limits::defaults(),
        }
    }

    /// The optional features the class may have that the executor uses.
    pub fn features(self) -> wgpu::Features {
        match self {
            AdapterClass::Metal => wgpu::Features::SHADER_INT64 | wgpu::Features::MAPPABLE_PRIMARY_BUFFERS,
            AdapterClass::Dx12 => wgpu::Features::MAPPABLE_PRIMARY_BUFFERS,
            AdapterClass::WebGpu | AdapterClass::Downlevel => wgpu::Features::empty(),
        }
    }

    /// [`WgpuOptions::adapter_class`], else `HICACHE_WGPU_LIMITS` (empty or unset: none).
    pub(super) fn chosen(opts: &WgpuOptions) -> crate::Result<Option<AdapterClass>> {
        if opts.adapter_class.is_some() {
            return Ok(opts.adapter_class);
        }
        match std::env::var("HICACHE_WGPU_LIMITS") {
            Ok(v) if !v.trim().is_empty() => v.parse().map(Some),
            _ => Ok(None),
        }
    }
}

impl std::str::FromStr for AdapterClass {
    type Err = crate::TransferError;
    fn from_str(s: &str) -> crate::Result<AdapterClass> {
        let want = s.trim().to_ascii_lowercase();
        AdapterClass::ALL.into_iter().find(|c| c.name() == want).ok_or_else(|| crate::TransferError::Unavailable {
            backend: "wgpu",
            reason: format!("HICACHE_WGPU_LIMITS={s:?} names no adapter class (metal, dx12, webgpu or downlevel)"),
        })
    }
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
/// Whether the checksumming gathers may use 64-bit integers where the device has them
/// (SHADER_INT64): [`WgpuOptions::int64`], else unless `HICACHE_WGPU_INT64=0` (to compare the
/// two in benchmarks).
pub(super) fn int64_wanted(opts: &WgpuOptions) -> bool {
    opts.int64.unwrap_or_else(|| std::env::var("HICACHE_WGPU_INT64").map_or(true, |v| v != "0"))
}
/// Default backends: the native APIs. `WGPU_BACKEND` overrides (`WGPU_BACKEND=gl`: OpenGL ES
/// through EGL, for machines without Vulkan); GL is never chosen on its own, so a missing Vulkan
/// driver is reported instead of silently falling back.
pub(super) fn backends() -> wgpu::Backends {
    (wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12).with_env()
}
