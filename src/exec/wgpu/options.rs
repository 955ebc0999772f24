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
/// Default backends: the native APIs. `WGPU_BACKEND` overrides; GL is not compiled in, so a
/// missing Vulkan driver is reported instead of silently falling back.
pub(super) fn backends() -> wgpu::Backends {
    (wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12).with_env()
}
