//! sglang-shaped pools: a device pool (layer_first, one buffer per live layer and component)
//! and a host pool built against it, with `load_to_device_per_layer`,
//! `backup_from_device_all_layer` (layer-sharded when the device pool is) and the storage
//! helpers of page_first layouts.

use std::marker::PhantomData;

use crate::error::{Result, TransferError};
use crate::exec::{Bindings, Buffer, Device};
use crate::geometry::{DeviceGeometry, HostGeometry, IoBackend, LayerMap, Layout, PoolKind, PoolPair, Profile};
use crate::plan::{self, Direction, Op, Plan, Request};

/// Device pool: `[comp][buffer]`, each buffer `slots × item` bytes; buffers are the live target
/// layers in order, then one per draft (MTP) pool.
///
/// `'m` is the lifetime of borrowed memory (`'static` for pools that own their buffers): a
/// pool wrapping an engine's slices cannot outlive them.
pub struct DevicePool<'m> {
    geometry: DeviceGeometry,
    device: Device,
    buffers: Vec<Vec<Buffer>>,
    _memory: PhantomData<&'m mut [u8]>,
}

/// Parameters of a device pool.
#[derive(Debug, Clone)]
pub struct DevicePoolConfig {
    pub kind: PoolKind,
    /// Token stride (MHA: `H × D × dtype` per K or V; MLA: the record), or for the DSA indexer
    /// the bytes per token per layer (`dsa_bytes_per_token`); the item becomes `P ×` that.
    pub bytes_per_token: u64,
    /// Tokens (pages for the DSA indexer: tokens / P) per layer buffer.
    pub slots: u64,
    pub page_size: u64,
    pub layers: LayerMap,
}

impl DevicePoolConfig {
    pub fn geometry(&self) -> DeviceGeometry {
        let item_bytes = match self.kind {
            PoolKind::DsaIndexer => self.bytes_per_token * self.page_size,
            _ => self.bytes_per_token,
        };
        DeviceGeometry { kind: self.kind, item_bytes, slots: self.slots, page_size: self.page_size, layers: self.layers.clone() }
    }
}

impl DevicePool<'static> {
    /// A pool that owns its buffers, allocated on `device` (zeroed).
    pub fn new(device: &Device, config: &DevicePoolConfig) -> Result<DevicePool<'static>> {
        DevicePool::with_geometry(device, config.geometry())
    }

    pub fn with_geometry(device: &Device, geometry: DeviceGeometry) -> Result<DevicePool<'static>> {
        geometry.validate()?;
        let buffers = (0..geometry.kind.components())
            .map(|_| (0..geometry.buffer_count()).map(|_| device.alloc(geometry.layer_bytes())).collect::<Result<Vec<_>>>())
            .collect::<Result<Vec<_>>>()?;
        Ok(DevicePool { geometry, device: device.clone(), buffers, _memory: PhantomData })
    }

    /// Wraps existing executor buffers `[component][buffer]` (K, then V for MHA; live target
    /// layers in order, then drafts), e.g. an engine's `wgpu::Buffer`s via
    /// [`Buffer::Wgpu`]. Each must hold at least `slots × item` bytes.
    pub fn from_buffers(device: &Device, config: &DevicePoolConfig, buffers: Vec<Vec<Buffer>>) -> Result<DevicePool<'static>> {
        DevicePool::wrap(device, config, buffers)
    }
}

impl<'m> DevicePool<'m> {
    /// Wraps an engine's host-memory layer buffers on the cpu executor: `layers[component][buffer]`.
    /// The pool borrows them for `'m`; sizes are checked before anything moves.
    pub fn from_cpu_slices(config: &DevicePoolConfig, layers: Vec<Vec<&'m mut [u8]>>) -> Result<DevicePool<'m>> {
        let buffers = layers
            .into_iter()
            .map(|c| {
                c.into_iter()
                    // SAFETY: the slice is borrowed mutably for 'm, which the pool's lifetime carries.
                    .map(|s| {
                        Buffer::Cpu(unsafe { crate::exec::cpu::CpuBuffer::from_raw(std::ptr::NonNull::from(&mut *s).cast(), s.len()) })
                    })
                    .collect()
            })
            .collect();
        DevicePool::wrap(&Device::cpu(), config, buffers)
    }

    fn wrap(device: &Device, config: &DevicePoolConfig, buffers: Vec<Vec<Buffer>>) -> Result<DevicePool<'m>> {
        let geometry = config.geometry();
        geometry.validate()?;
        check_wrapped(
            device,
            &buffers,
            geometry.kind.components(),
            geometry.buffer_count(),
            geometry.layer_bytes(),
            "device layer buffer",
        )?;
        Ok(DevicePool { geometry, device: device.clone(), buffers, _memory: PhantomData })
    }

    pub fn geometry(&self) -> &DeviceGeometry {
        &self.geometry
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// Buffer of component `comp` (0 = K or the only buffer, 1 = V) at `slot`.
    pub fn buffer(&self, comp: usize, slot: usize) -> &Buffer {
        &self.buffers[comp][slot]
    }
    pub fn read_buffer(&self, comp: usize, slot: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.geometry.layer_bytes() as usize];
        self.device.read(self.buffer_checked(comp, slot)?, 0, &mut out)?;
        Ok(out)
    }
    /// Replaces the whole buffer (`data` must be exactly `slots × item` bytes).
    pub fn write_buffer(&mut self, comp: usize, slot: usize, data: &[u8]) -> Result<()> {
        let buf = self.buffer_checked(comp, slot)?;
        exact_size("device layer buffer", self.geometry.layer_bytes(), data)?;
        self.device.write(buf, 0, data)
    }
    fn buffer_checked(&self, comp: usize, slot: usize) -> Result<&Buffer> {
        self.buffers
            .get(comp)
            .and_then(|c| c.get(slot))
            .ok_or_else(|| TransferError::Geometry(format!("no device buffer (component {comp}, slot {slot})")))
    }
}

/// Parameters of a host pool (the rest comes from the device pool).
#[derive(Debug, Clone)]
pub struct HostPoolConfig {
    pub layout: Layout,
    /// Requested token slots (sglang rounds to `(size / P + 1) × P`).
    pub size: u64,
    /// `H` for page_head (MHA); ignored otherwise.
    pub head_num: u64,
    pub profile: Profile,
}

/// Host pool: one buffer per component in the host layout.
///
/// `'m` is the lifetime of borrowed memory (`'static` when the pool owns its buffers).
pub struct HostPool<'m> {
    pair: PoolPair,
    profile: Profile,
    device: Device,
    buffers: Vec<Buffer>,
    _memory: PhantomData<&'m mut [u8]>,
}

impl HostPool<'static> {
    /// A host pool for `device_pool`: same kind, item and page size; `L` = live target layers
    /// plus drafts. Owns its buffers (pinned and mapped on cuda).
    pub fn new(device_pool: &DevicePool, config: &HostPoolConfig) -> Result<HostPool<'static>> {
        let pair = PoolPair::new(device_pool.geometry.clone(), config.layout, config.size, config.head_num)?;
        let device = device_pool.device.clone();
        let buffers = (0..pair.host.kind.components()).map(|_| device.alloc_host(pair.host.buffer_bytes())).collect::<Result<Vec<_>>>()?;
        Ok(HostPool { pair, profile: config.profile, device, buffers, _memory: PhantomData })
    }

    /// Wraps existing executor buffers, one per component (e.g. an engine's registered host
    /// region on cuda, or `wgpu::Buffer`s). Each must hold at least the layout's bytes.
    pub fn from_buffers(device_pool: &DevicePool, config: &HostPoolConfig, buffers: Vec<Buffer>) -> Result<HostPool<'static>> {
        HostPool::wrap(device_pool, config, buffers)
    }
}

impl<'m> HostPool<'m> {
    /// Wraps an engine's host region(s) on the cpu executor, one slice per component.
    pub fn from_cpu_slices(device_pool: &DevicePool, config: &HostPoolConfig, components: Vec<&'m mut [u8]>) -> Result<HostPool<'m>> {
        let buffers = components
            .into_iter()
            // SAFETY: borrowed mutably for 'm, carried by the pool's lifetime.
            .map(|s| Buffer::Cpu(unsafe { crate::exec::cpu::CpuBuffer::from_raw(std::ptr::NonNull::from(&mut *s).cast(), s.len()) }))
            .collect();
        HostPool::wrap(device_pool, config, buffers)
    }

    fn wrap(device_pool: &DevicePool, config: &HostPoolConfig, buffers: Vec<Buffer>) -> Result<HostPool<'m>> {
        let pair = PoolPair::new(device_pool.geometry.clone(), config.layout, config.size, config.head_num)?;
        let device = device_pool.device.clone();
        let nested = vec![buffers];
        check_wrapped(&device, &nested, 1, pair.host.kind.components(), pair.host.buffer_bytes(), "host buffer")?;
        let buffers = nested.into_iter().next().unwrap_or_default();
        Ok(HostPool { pair, profile: config.profile, device, buffers, _memory: PhantomData })
    }

    pub fn geometry(&self) -> &HostGeometry {
        &self.pair.host
    }
    pub fn pair(&self) -> &PoolPair {
        &self.pair
    }
    pub fn profile(&self) -> Profile {
        self.profile
    }
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Validates and lowers one call without running it.
    pub fn plan(&self, device_pool: &DevicePool, req: &Request<'_>) -> Result<Plan> {
        self.check_pair(device_pool)?;
        plan::plan(self.profile, &self.device.capabilities(), &self.pair, req)
    }

    fn check_pair(&self, device_pool: &DevicePool) -> Result<()> {
        if device_pool.device.kind() != self.device.kind() {
            return Err(TransferError::ExecutorMismatch { host: self.device.name().into(), device: device_pool.device.name().into() });
        }
        if device_pool.geometry != self.pair.device {
            return Err(TransferError::Geometry("host pool was built for a different device pool".into()));
        }
        Ok(())
    }

    fn bindings<'a>(&'a self, device_pool: &'a DevicePool) -> Bindings<'a, Buffer> {
        Bindings { host: self.buffers.iter().collect(), device: device_pool.buffers.iter().map(|c| c.iter().collect()).collect() }
    }

    /// sglang `load_to_device_per_layer`: host layer of `layer_id` → device layer `layer_id`.
    /// A layer the device pool does not own (layer sharding) or a DSA skip-topk layer is a
    /// no-op, as in sglang.
    pub fn load_to_device_per_layer(
        &self,
        device_pool: &mut DevicePool,
        host_indices: &[i64],
        device_indices: &[i64],
        layer_id: usize,
        io_backend: IoBackend,
    ) -> Result<()> {
        self.run(device_pool, Op::Load { layer_id, is_draft: false }, io_backend, host_indices, device_indices)
    }

    /// sglang `load_to_device_per_layer(..., is_draft=True)`: `layer_id = layer_num + k` loads
    /// draft pool `k` (host layer `live target layers + k`, device layer 0 of that pool).
    pub fn load_draft_to_device(
        &self,
        device_pool: &mut DevicePool,
        host_indices: &[i64],
        device_indices: &[i64],
        layer_id: usize,
        io_backend: IoBackend,
    ) -> Result<()> {
        self.run(device_pool, Op::Load { layer_id, is_draft: true }, io_backend, host_indices, device_indices)
    }

    /// sglang `backup_from_device_all_layer`: every live layer and draft, device → host; one
    /// step per layer when the device pool is layer-sharded.
    pub fn backup_from_device_all_layer(
        &mut self,
        device_pool: &DevicePool,
        host_indices: &[i64],
        device_indices: &[i64],
        io_backend: IoBackend,
    ) -> Result<()> {
        self.run(device_pool, Op::Backup, io_backend, host_indices, device_indices)
    }

    /// Plans, then executes; nothing moves unless the plan is accepted. Callers hold `&mut`
    /// on the destination pool (the public wrappers enforce it).
    fn run(&self, device_pool: &DevicePool, op: Op, io_backend: IoBackend, host_indices: &[i64], device_indices: &[i64]) -> Result<()> {
        let plan = self.plan(device_pool, &Request { op, io_backend, host_indices, device_indices })?;
        self.execute(device_pool, &plan)
    }

    /// Runs a load plan made by [`HostPool::plan`] for these pools (plan once, run many).
    pub fn execute_load(&self, device_pool: &mut DevicePool, plan: &Plan) -> Result<()> {
        self.check_plan(plan, Direction::HostToDevice)?;
        self.execute(device_pool, plan)
    }

    /// Runs a backup plan made by [`HostPool::plan`] for these pools.
    pub fn execute_backup(&mut self, device_pool: &DevicePool, plan: &Plan) -> Result<()> {
        self.check_plan(plan, Direction::DeviceToHost)?;
        self.execute(device_pool, plan)
    }

    fn check_plan(&self, plan: &Plan, direction: Direction) -> Result<()> {
        if plan.direction != direction || *plan.pair != self.pair || plan.profile != self.profile {
            return Err(TransferError::Geometry("plan was made for other pools, profile or direction".into()));
        }
        Ok(())
    }

    fn execute(&self, device_pool: &DevicePool, plan: &Plan) -> Result<()> {
        self.check_pair(device_pool)?;
        log::debug!(
            "{:?} via {} on {}: {} steps, {} bytes",
            plan.direction,
            plan.path.op,
            self.device.name(),
            plan.steps.len(),
            plan.bytes()
        );
        self.device.execute(plan, &self.bindings(device_pool))
    }

    /// Raw bytes of component `comp` (0 = K or the only buffer, 1 = V).
    pub fn read_buffer(&self, comp: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.pair.host.buffer_bytes() as usize];
        self.device.read(self.buffer_checked(comp)?, 0, &mut out)?;
        Ok(out)
    }
    /// Replaces the whole component buffer (`data` must be exactly its size).
    pub fn write_buffer(&mut self, comp: usize, data: &[u8]) -> Result<()> {
        let buf = self.buffer_checked(comp)?;
        exact_size("host buffer", self.pair.host.buffer_bytes(), data)?;
        self.device.write(buf, 0, data)
    }
    fn buffer_checked(&self, comp: usize) -> Result<&Buffer> {
        self.buffers.get(comp).ok_or_else(|| TransferError::Geometry(format!("no host component {comp}")))
    }

    // ---- storage helpers (page_first layouts) ----------------------------------------------

    /// The page holding token `index` (a multiple of `P`) as one flat span per component:
    /// `(component, byte offset, bytes)`. Only layouts where a page is contiguous have this
    /// (page_first, page_first_direct, page_head), like sglang's `get_page_buffer_meta`.
    pub fn page_span(&self, index: i64) -> Result<Vec<(usize, u64, u64)>> {
        let g = &self.pair.host;
        if g.layout == Layout::LayerFirst {
            return Err(TransferError::UnsupportedLayout { layout: g.layout.name().into() });
        }
        let p = g.page_size as i64;
        if index < 0 || index % p != 0 {
            return Err(TransferError::NotWholePage { side: "host", start: index, end: index, position: 0, page_size: g.page_size });
        }
        // Index-granular page: DSA slots are pages already.
        let page = (index / p) as u64;
        let page_count = g.index_pages();
        if page >= page_count {
            return Err(TransferError::IndexOutOfRange {
                side: "host",
                index,
                position: 0,
                bound: page_count * g.page_size,
                unit: "slots",
            });
        }
        let (offset, span) = g.page_span(page);
        Ok((0..g.kind.components()).map(|c| (c, offset, span)).collect())
    }

    /// sglang `get_page_buffer_meta`: spans of the pages whose first tokens are
    /// `indices[0], indices[P], …`.
    pub fn get_page_buffer_meta(&self, indices: &[i64]) -> Result<Vec<(usize, u64, u64)>> {
        let p = self.pair.host.page_size as usize;
        let mut out = Vec::new();
        for first in indices.iter().step_by(p) {
            out.extend(self.page_span(*first)?);
        }
        Ok(out)
    }

    /// sglang `get_data_page(index, flat=True)`: the page's bytes, K then V.
    pub fn get_data_page(&self, index: i64) -> Result<Vec<u8>> {
        let spans = self.page_span(index)?;
        let mut out = vec![0u8; spans.iter().map(|s| s.2 as usize).sum()];
        let mut at = 0;
        for (c, off, len) in spans {
            self.device.read(&self.buffers[c], off, &mut out[at..at + len as usize])?;
            at += len as usize;
        }
        Ok(out)
    }

    /// sglang `set_from_flat_data_page(index, data_page)`: the inverse of `get_data_page`.
    pub fn set_from_flat_data_page(&mut self, index: i64, data: &[u8]) -> Result<()> {
        let spans = self.page_span(index)?;
        let total: u64 = spans.iter().map(|s| s.2).sum();
        if data.len() as u64 != total {
            return Err(TransferError::BufferSize { what: "flat data page".into(), expected: total, actual: data.len() as u64 });
        }
        let mut at = 0;
        for (c, off, len) in spans {
            self.device.write(&self.buffers[c], off, &data[at..at + len as usize])?;
            at += len as usize;
        }
        Ok(())
    }
}

fn exact_size(what: &str, expected: u64, data: &[u8]) -> Result<()> {
    if data.len() as u64 != expected {
        return Err(TransferError::BufferSize { what: what.into(), expected, actual: data.len() as u64 });
    }
    Ok(())
}

/// Wrapped buffers: the right count, each at least `bytes` long, and of `device`'s executor.
fn check_wrapped(device: &Device, buffers: &[Vec<Buffer>], outer: usize, inner: usize, bytes: u64, what: &str) -> Result<()> {
    if buffers.len() != outer || buffers.iter().any(|c| c.len() != inner) {
        return Err(TransferError::Geometry(format!(
            "{what}s: expected {outer} × {inner}, got {:?}",
            buffers.iter().map(|c| c.len()).collect::<Vec<_>>()
        )));
    }
    for (i, c) in buffers.iter().enumerate() {
        for (j, b) in c.iter().enumerate() {
            let len = device.buffer_len(b)?;
            if len < bytes {
                return Err(TransferError::BufferSize { what: format!("{what} [{i}][{j}]"), expected: bytes, actual: len });
            }
            device.check_buffer(b)?;
        }
    }
    Ok(())
}
