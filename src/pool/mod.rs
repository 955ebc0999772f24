//! sglang-shaped pools: a device pool (layer_first, one buffer per live layer and component)
//! and a host pool built against it, with `load_to_device_per_layer`,
//! `backup_from_device_all_layer` (layer-sharded when the device pool is) and the storage
//! helpers (`get_data_page` and friends, with their per-layout byte order).
//!
//! Every pool belongs to one executor instance; a call that mixes pools, buffers or plans of
//! two instances is an `ExecutorMismatch` error before anything moves.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::error::{Result, TransferError};
use crate::exec::{Bindings, Buffer, Completion, Device};
use crate::geometry::{mul, DeviceGeometry, HostGeometry, IoBackend, LayerMap, Layout, PoolKind, PoolPair, Profile};
use crate::plan::{self, Direction, Op, Plan, Request};

mod checksums;
mod pipeline;
mod storage;

pub use pipeline::{Pipeline, Ticket};

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
    /// Pool kind.
    pub kind: PoolKind,
    /// Token stride (MHA: `H × D × dtype` per K or V; MLA: the record), or for the DSA indexer
    /// the bytes per token per layer (`dsa_bytes_per_token`); the item becomes `P ×` that.
    pub bytes_per_token: u64,
    /// Tokens (pages for the DSA indexer: tokens / P) per layer buffer.
    pub slots: u64,
    /// Tokens per page `P`.
    pub page_size: u64,
    /// Which layers the pool holds.
    pub layers: LayerMap,
}

impl DevicePoolConfig {
    /// The checked geometry this configuration describes.
    pub fn geometry(&self) -> Result<DeviceGeometry> {
        let item_bytes = match self.kind {
            PoolKind::DsaIndexer => mul(self.bytes_per_token, self.page_size, "DSA indexer item (bytes per token × P)")?,
            _ => self.bytes_per_token,
        };
        DeviceGeometry::new(self.kind, item_bytes, self.slots, self.page_size, self.layers.clone())
    }
}

/// Refuses a pool larger than the executor can ever back, before anything is allocated.
fn check_budget(what: &str, requested: u64, limit: u64) -> Result<()> {
    if requested > limit {
        return Err(TransferError::OutOfMemory { what: what.into(), requested, limit: format!("the executor has at most {limit} bytes") });
    }
    Ok(())
}

impl DevicePool<'static> {
    /// A pool that owns its buffers, allocated on `device` (zeroed).
    pub fn new(device: &Device, config: &DevicePoolConfig) -> Result<DevicePool<'static>> {
        DevicePool::with_geometry(device, config.geometry()?)
    }

    /// A pool of `geometry`, owning its buffers.
    pub fn with_geometry(device: &Device, geometry: DeviceGeometry) -> Result<DevicePool<'static>> {
        check_budget("device pool", geometry.total_bytes(), device.capabilities().max_pool_bytes)?;
        let buffers = (0..geometry.kind().components())
            .map(|_| {
                (0..geometry.buffer_count())
                    .map(|_| device.alloc_pool(geometry.layer_bytes(), geometry.item_bytes(), false))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DevicePool { geometry, device: device.clone(), buffers, _memory: PhantomData })
    }

    /// Wraps existing buffers of `device` `[component][buffer]` (K, then V for MHA; live target
    /// layers in order, then drafts), e.g. an engine's `wgpu::Buffer`s via
    /// [`Buffer::Wgpu`]. Each must hold at least `slots × item` bytes.
    pub fn from_buffers(device: &Device, config: &DevicePoolConfig, buffers: Vec<Vec<Buffer>>) -> Result<DevicePool<'static>> {
        DevicePool::wrap(device, config, buffers)
    }
}

impl<'m> DevicePool<'m> {
    /// Wraps an engine's host-memory layer buffers on a new cpu executor:
    /// `layers[component][buffer]`. The pool borrows them for `'m`; sizes are checked before
    /// anything moves.
    pub fn from_cpu_slices(config: &DevicePoolConfig, layers: Vec<Vec<&'m mut [u8]>>) -> Result<DevicePool<'m>> {
        let device = Device::cpu();
        #[allow(irrefutable_let_patterns)] // the cpu executor alone (no GPU features)
        let Device::Cpu(exec) = &device
        else {
            unreachable!("Device::cpu is a cpu executor")
        };
        let buffers = layers.into_iter().map(|c| c.into_iter().map(|s| crate::exec::borrow_cpu_slice(exec, s)).collect()).collect();
        DevicePool::wrap(&device, config, buffers)
    }

    fn wrap(device: &Device, config: &DevicePoolConfig, buffers: Vec<Vec<Buffer>>) -> Result<DevicePool<'m>> {
        let geometry = config.geometry()?;
        let (comps, count) = (geometry.kind().components(), geometry.buffer_count());
        check_wrapped(device, &buffers, comps, count, geometry.layer_bytes(), "device layer buffer")?;
        Ok(DevicePool { geometry, device: device.clone(), buffers, _memory: PhantomData })
    }

    /// The pool's geometry.
    pub fn geometry(&self) -> &DeviceGeometry {
        &self.geometry
    }
    /// The executor the pool lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// Buffer of component `comp` (0 = K or the only buffer, 1 = V) at `slot`.
    pub fn buffer(&self, comp: usize, slot: usize) -> Result<&Buffer> {
        self.buffers.get(comp).and_then(|c| c.get(slot)).ok_or(TransferError::NoSuchBuffer {
            comp,
            slot: Some(slot),
            components: self.buffers.len(),
            slots: self.geometry.buffer_count(),
        })
    }
    /// A copy of one whole layer buffer.
    pub fn read_buffer(&self, comp: usize, slot: usize) -> Result<Vec<u8>> {
        let buf = self.buffer(comp, slot)?;
        let mut out = alloc_bytes("device layer buffer copy", self.geometry.layer_bytes())?;
        self.device.read(buf, 0, &mut out)?;
        Ok(out)
    }
    /// Replaces the whole buffer (`data` must be exactly `slots × item` bytes).
    pub fn write_buffer(&mut self, comp: usize, slot: usize, data: &[u8]) -> Result<()> {
        let buf = self.buffer(comp, slot)?;
        exact_size("device layer buffer", self.geometry.layer_bytes(), data)?;
        self.device.write(buf, 0, data)
    }
}

/// Parameters of a host pool (the rest comes from the device pool).
#[derive(Debug, Clone)]
pub struct HostPoolConfig {
    /// Host layout.
    pub layout: Layout,
    /// Requested token slots (sglang rounds to `(size / P + 1) × P`).
    pub size: u64,
    /// `H` for page_head, `HG` (head groups) for page_first_direct_hg (MHA only); ignored
    /// otherwise.
    pub head_num: u64,
    /// Which table to obey.
    pub profile: Profile,
    /// Item checksums (see [`crate::integrity`]): `None` takes the profile's default (on for
    /// `extended`, off for `sglang`, whose behaviour it then matches byte for byte); `Some(false)`
    /// turns them off, `Some(true)` on. Computed where the executor's copies can
    /// ([`crate::Capabilities::checksums`]); elsewhere the pool has none.
    pub integrity: Option<bool>,
}

/// Host pool: one buffer per component in the host layout.
///
/// `'m` is the lifetime of borrowed memory (`'static` when the pool owns its buffers).
pub struct HostPool<'m> {
    pair: Arc<PoolPair>,
    profile: Profile,
    device: Device,
    buffers: Vec<Buffer>,
    /// Item checksums, when the pool keeps them.
    sidecar: Option<Arc<crate::integrity::Sidecar>>,
    _memory: PhantomData<&'m mut [u8]>,
}

impl HostPool<'static> {
    /// A host pool for `device_pool`: same kind, item and page size; `L` = live target layers
    /// plus drafts. Owns its buffers (pinned and mapped on cuda).
    pub fn new(device_pool: &DevicePool, config: &HostPoolConfig) -> Result<HostPool<'static>> {
        let pair = PoolPair::new(device_pool.geometry.clone(), config.layout, config.size, config.head_num)?;
        let device = device_pool.device.clone();
        let host = pair.host();
        let comps = host.kind().components() as u64;
        check_budget("host pool", host.buffer_bytes().saturating_mul(comps), device.capabilities().max_host_pool_bytes)?;
        let sidecar = sidecar_for(&device, &pair, config)?;
        let buffers = (0..comps).map(|_| device.alloc_pool(host.buffer_bytes(), host.chunk_bytes(), true)).collect::<Result<Vec<_>>>()?;
        Ok(HostPool { pair: Arc::new(pair), profile: config.profile, device, buffers, sidecar, _memory: PhantomData })
    }

    /// Wraps existing buffers of the device pool's executor, one per component (e.g. an
    /// engine's registered host region on cuda, or `wgpu::Buffer`s). Each must hold at least the
    /// layout's bytes.
    pub fn from_buffers(device_pool: &DevicePool, config: &HostPoolConfig, buffers: Vec<Buffer>) -> Result<HostPool<'static>> {
        HostPool::wrap(device_pool, config, buffers)
    }
}

/// A transfer in flight (see [`HostPool::load_to_device_per_layer_async`]). It keeps the pools
/// it moves between borrowed until it is waited on, so safe code cannot read or write them
/// mid-transfer; dropping it waits too.
///
/// ```compile_fail
/// # use hicache_io::*;
/// # fn f(host: &HostPool<'static>, dev: &mut DevicePool<'static>) -> Result<()> {
/// let t = host.load_to_device_per_layer_async(dev, &[0], &[1], 0, IoBackend::Kernel)?;
/// let bytes = dev.read_buffer(0, 0)?; // refused: the transfer still borrows the device pool
/// t.wait()
/// # }
/// ```
#[must_use = "a transfer is waited on when dropped; keep it to overlap work with it"]
pub struct Transfer<'a> {
    completion: Option<Completion>,
    _pools: PhantomData<&'a mut ()>,
}

impl Transfer<'_> {
    /// Blocks until the transfer has landed.
    pub fn wait(mut self) -> Result<()> {
        self.completion.take().map_or(Ok(()), |c| c.wait())
    }
    /// `Ok(true)` once landed, `Ok(false)` while in flight.
    pub fn is_done(&self) -> Result<bool> {
        self.completion.as_ref().map_or(Ok(true), |c| c.is_done())
    }
}

impl Drop for Transfer<'_> {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.completion.take().map(|c| c.wait()) {
            log::error!("a transfer dropped without waiting failed: {e}");
        }
    }
}

/// Every owned layer (and draft) of a device pool loaded in order, one completion per layer
/// (see [`HostPool::load_layers`]). Waiting for layer `i` never waits for layer `i + 1`.
/// Keeps both pools borrowed until every layer has landed; dropping it waits for all of them.
#[must_use = "dropping the loads waits for all of them"]
pub struct LayerLoads<'a> {
    layers: Vec<(usize, Completion)>,
    /// The device pool's layer map, for errors.
    map: LayerMap,
    _pools: PhantomData<&'a mut ()>,
}

impl LayerLoads<'_> {
    /// Layer ids in load order: owned live target layers, then `layer_num + k` per draft.
    pub fn layer_ids(&self) -> Vec<usize> {
        self.layers.iter().map(|(l, _)| *l).collect()
    }
    fn find(&self, layer_id: usize) -> Result<&Completion> {
        self.layers.iter().find(|(l, _)| *l == layer_id).map(|(_, c)| c).ok_or_else(|| TransferError::LayerNotLoaded {
            layer_id,
            loaded: self.layer_ids(),
            target_layers: self.map.layer_num,
            owned: self.map.owned(),
            draft_layers: self.map.drafts,
        })
    }
    /// Blocks until layer `layer_id` has landed (and the layers loaded before it).
    pub fn wait_layer(&self, layer_id: usize) -> Result<()> {
        self.find(layer_id)?.wait()
    }
    /// Makes `stream` (an engine's compute stream) wait for layer `layer_id` on the device,
    /// without blocking the host (see [`Completion::wait_on_stream`]).
    #[cfg(feature = "cuda")]
    pub fn wait_layer_on_stream(&self, layer_id: usize, stream: &cudarc::driver::CudaStream) -> Result<()> {
        self.find(layer_id)?.wait_on_stream(stream)
    }
    /// Whether layer `layer_id` has landed.
    pub fn is_layer_done(&self, layer_id: usize) -> Result<bool> {
        self.find(layer_id)?.is_done()
    }
    /// Blocks until every layer has landed; an executor's error, else the items of every layer
    /// that failed their checksums (one [`TransferError::Integrity`]).
    pub fn wait(mut self) -> Result<()> {
        let layers = std::mem::take(&mut self.layers);
        wait_layers(&layers)
    }
}

impl Drop for LayerLoads<'_> {
    fn drop(&mut self) {
        if let Err(e) = wait_layers(&self.layers) {
            log::error!("layer loads dropped without waiting failed: {e}");
        }
    }
}

/// Waits for the last layer (the stream runs them in order), then gathers every layer's
/// checksum mismatches: each layer's completion holds only its own.
fn wait_layers(layers: &[(usize, Completion)]) -> Result<()> {
    let Some((_, last)) = layers.last() else { return Ok(()) };
    match last.wait() {
        Ok(()) | Err(TransferError::Integrity { .. }) => {}
        Err(e) => return Err(e),
    }
    let items: Vec<crate::integrity::ItemMismatch> = layers
        .iter()
        .filter_map(|(_, c)| match c.integrity_error() {
            Err(TransferError::Integrity { items, .. }) => Some(items),
            _ => None,
        })
        .flatten()
        .collect();
    crate::integrity::mismatch_error(items).map_or(Ok(()), Err)
}

/// Asynchronous transfers: only for pools that own their memory (`'static`), so a transfer in
/// flight can never outlive memory it writes, whatever happens to its handle.
impl HostPool<'static> {
    /// [`HostPool::load_to_device_per_layer`] without waiting: the load is enqueued on the
    /// executor (cpu: its worker thread; wgpu: a queue submission; cuda: its stream) and the
    /// handle completes when it has landed. Validation happens before this returns, as for the
    /// synchronous call.
    pub fn load_to_device_per_layer_async<'a>(
        &'a self,
        device_pool: &'a mut DevicePool<'static>,
        host_indices: &[i64],
        device_indices: &[i64],
        layer_id: usize,
        io_backend: IoBackend,
    ) -> Result<Transfer<'a>> {
        self.run_async(device_pool, Op::Load { layer_id, is_draft: false }, io_backend, host_indices, device_indices)
    }

    /// [`HostPool::backup_from_device_all_layer`] without waiting.
    pub fn backup_from_device_all_layer_async<'a>(
        &'a mut self,
        device_pool: &'a DevicePool<'static>,
        host_indices: &[i64],
        device_indices: &[i64],
        io_backend: IoBackend,
    ) -> Result<Transfer<'a>> {
        self.run_async(device_pool, Op::Backup, io_backend, host_indices, device_indices)
    }

    /// Plans, then enqueues; the public wrappers give the handle the borrows it must hold.
    fn run_async<'a>(
        &self,
        device_pool: &DevicePool,
        op: Op,
        io_backend: IoBackend,
        host_indices: &[i64],
        device_indices: &[i64],
    ) -> Result<Transfer<'a>> {
        let plan = self.plan(device_pool, &Request { op, io_backend, host_indices, device_indices })?;
        let completion = self.device.execute_async(&plan, &self.bindings(device_pool, &plan))?;
        Ok(Transfer { completion: Some(completion), _pools: PhantomData })
    }

    /// Layer-wise loading, as sglang's loader overlaps it with the forward pass: loads the same
    /// indices into every owned live layer in order, then every draft pool, each its own
    /// transfer, and returns at once. Every layer is validated before the first one moves.
    pub fn load_layers<'a>(
        &'a self,
        device_pool: &'a mut DevicePool<'static>,
        host_indices: &[i64],
        device_indices: &[i64],
        io_backend: IoBackend,
    ) -> Result<LayerLoads<'a>> {
        let plans = layer_load_plans(self, device_pool, host_indices, device_indices, io_backend)?;
        let mut layers = Vec::with_capacity(plans.len());
        for (l, _, plan) in &plans {
            match self.device.execute_async(plan, &self.bindings(device_pool, plan)) {
                Ok(c) => layers.push((*l, c)),
                Err(e) => {
                    // Layers already enqueued still land: wait for them so the error is final
                    // (items that failed their checksums landed too).
                    let Some((_, c)) = layers.last() else { return Err(e) };
                    let landed = matches!(c.wait(), Ok(()) | Err(TransferError::Integrity { .. }));
                    return Err(partial_layers(&plans[..layers.len()], landed, e, plans.len()));
                }
            }
        }
        Ok(LayerLoads { layers, map: device_pool.geometry.layers().clone(), _pools: PhantomData })
    }
}

impl<'m> HostPool<'m> {
    /// Wraps an engine's host region(s) on the device pool's cpu executor, one slice per
    /// component.
    pub fn from_cpu_slices(device_pool: &DevicePool, config: &HostPoolConfig, components: Vec<&'m mut [u8]>) -> Result<HostPool<'m>> {
        #[allow(irrefutable_let_patterns)] // the cpu executor alone (no GPU features)
        let Device::Cpu(exec) = &device_pool.device
        else {
            return Err(TransferError::ExecutorMismatch { expected: device_pool.device.label(), found: "host memory slices (cpu)".into() });
        };
        let buffers = components.into_iter().map(|s| crate::exec::borrow_cpu_slice(exec, s)).collect();
        HostPool::wrap(device_pool, config, buffers)
    }

    fn wrap(device_pool: &DevicePool, config: &HostPoolConfig, buffers: Vec<Buffer>) -> Result<HostPool<'m>> {
        let pair = PoolPair::new(device_pool.geometry.clone(), config.layout, config.size, config.head_num)?;
        let device = device_pool.device.clone();
        let nested = vec![buffers];
        check_wrapped(&device, &nested, 1, pair.host().kind().components(), pair.host().buffer_bytes(), "host buffer")?;
        let buffers = nested.into_iter().next().unwrap_or_default();
        let sidecar = sidecar_for(&device, &pair, config)?;
        Ok(HostPool { pair: Arc::new(pair), profile: config.profile, device, buffers, sidecar, _memory: PhantomData })
    }

    /// The host geometry.
    pub fn geometry(&self) -> &HostGeometry {
        self.pair.host()
    }
    /// Host and device geometry together.
    pub fn pair(&self) -> &PoolPair {
        &self.pair
    }
    /// The table this pool obeys.
    pub fn profile(&self) -> Profile {
        self.profile
    }
    /// The executor the pool lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Validates and lowers one call without running it (plan once, run many).
    pub fn plan(&self, device_pool: &DevicePool, req: &Request<'_>) -> Result<Plan> {
        self.check_pair(device_pool)?;
        let caps = if req.io_backend == IoBackend::Auto { self.device.calibrated_capabilities() } else { self.device.capabilities() };
        Ok(plan::plan(self.profile, &caps, self.device.id(), &self.pair, req)?.with_checksums(self.sidecar.is_some(), &caps))
    }

    /// [`HostPool::plan`] for index lists in CUDA memory: the value checks are the plan's
    /// device check, made on the device before anything moves (`kernel` only).
    pub(crate) fn plan_device_lists(
        &self,
        device_pool: &DevicePool,
        op: Op,
        io_backend: IoBackend,
        lists: plan::DeviceIndexLists,
        call: &'static str,
    ) -> Result<Plan> {
        self.check_pair(device_pool)?;
        plan::plan_device_lists(self.profile, &self.device.capabilities(), self.device.id(), &self.pair, op, io_backend, lists, call)
    }

    /// The device pool is of the same executor instance and the geometry this pool was built
    /// for.
    fn check_pair(&self, device_pool: &DevicePool) -> Result<()> {
        if device_pool.device.id() != self.device.id() {
            return Err(TransferError::ExecutorMismatch {
                expected: format!("a device pool on {} (the host pool's executor)", self.device.label()),
                found: format!("a device pool on {}", device_pool.device.label()),
            });
        }
        if device_pool.geometry != *self.pair.device() {
            return Err(TransferError::PoolMismatch(format!("built for {:?}, called with {:?}", self.pair.device(), device_pool.geometry)));
        }
        Ok(())
    }

    /// The buffers `plan` runs over, with the checksum table when its steps settle checksums
    /// (computed, or unknown in queue order). A backup by a plan that does neither (made for a
    /// pool without checksums, device index lists) first forgets the checksums of the items it
    /// writes, so that a later load reads them as unverified, never as corrupt.
    fn bindings<'a>(&'a self, device_pool: &'a DevicePool, plan: &Plan) -> Bindings<'a, Buffer> {
        let integrity = self.sidecar.as_ref().and_then(|sidecar| {
            if plan.settles_checksums() {
                return Some(crate::exec::IntegrityBinding { sidecar: sidecar.clone(), sink: Default::default() });
            }
            if plan.direction() == Direction::DeviceToHost {
                // In order with what is queued: a queued backup that records the same items must
                // not record after this forgets. (Only plans made for a pool without checksums
                // get here: this pool's own plans settle checksums on every path.)
                if let Err(e) = self.device.wait_idle() {
                    log::error!("waiting before forgetting checksums: {e}");
                }
                self.forget_written(sidecar, plan);
            } else if let Some(units) = plan.host_units() {
                // Loads read these items unverified.
                let live = units.iter().filter(|u| **u >= 0).count() as u64;
                let layers = plan.layers().len() as u64;
                sidecar.count([0, 0, live * layers * self.pair.host().kind().components() as u64, 0]);
            }
            None
        });
        Bindings {
            host: self.buffers.iter().collect(),
            device: device_pool.buffers.iter().map(|c| c.iter().collect()).collect(),
            integrity,
        }
    }

    fn forget_written(&self, sidecar: &crate::integrity::Sidecar, plan: &Plan) {
        let Some(units) = plan.host_units() else {
            sidecar.forget_all();
            return;
        };
        let comps = self.pair.host().kind().components() as u8;
        for l in plan.layers() {
            for c in 0..comps {
                for &u in units.iter().filter(|u| **u >= 0) {
                    if let Some(slot) = sidecar.slot(u as u64, l, c) {
                        sidecar.forget(slot);
                    }
                }
            }
        }
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

    /// One layer of `backup_from_device_all_layer`, device → host (what sglang lacks: its
    /// per-layer LF→PF path). `is_draft` with `layer_id = layer_num + k` backs up draft pool
    /// `k`. It follows the layer-sharded backup's row of the table (profile `sglang` refuses
    /// what sglang's sharded backup refuses); a layer the device pool does not own is a no-op.
    pub fn backup_from_device_per_layer(
        &mut self,
        device_pool: &DevicePool,
        host_indices: &[i64],
        device_indices: &[i64],
        layer_id: usize,
        is_draft: bool,
        io_backend: IoBackend,
    ) -> Result<()> {
        self.run(device_pool, Op::BackupLayer { layer_id, is_draft }, io_backend, host_indices, device_indices)
    }

    /// Plans, then executes; nothing moves unless the plan is accepted. Callers hold `&mut`
    /// on the destination pool (the public wrappers enforce it).
    fn run(&self, device_pool: &DevicePool, op: Op, io_backend: IoBackend, host_indices: &[i64], device_indices: &[i64]) -> Result<()> {
        let plan = self.plan(device_pool, &Request { op, io_backend, host_indices, device_indices })?;
        self.execute(device_pool, &plan)
    }

    /// Runs a load plan made by [`HostPool::plan`] for these pools.
    pub fn execute_load(&self, device_pool: &mut DevicePool, plan: &Plan) -> Result<()> {
        self.check_plan(device_pool, plan, Direction::HostToDevice)?;
        self.execute(device_pool, plan)
    }

    /// Runs a backup plan made by [`HostPool::plan`] for these pools.
    pub fn execute_backup(&mut self, device_pool: &DevicePool, plan: &Plan) -> Result<()> {
        self.check_plan(device_pool, plan, Direction::DeviceToHost)?;
        self.execute(device_pool, plan)
    }

    fn check_plan(&self, device_pool: &DevicePool, plan: &Plan, direction: Direction) -> Result<()> {
        self.check_pair(device_pool)?;
        if plan.direction() != direction {
            return Err(TransferError::StalePlan(format!("{:?}, run as {direction:?}", plan.direction())));
        }
        if plan.profile() != self.profile {
            return Err(TransferError::StalePlan(format!("profile {}, the pool obeys {}", plan.profile(), self.profile)));
        }
        if plan.pair() != &*self.pair {
            return Err(TransferError::StalePlan("other pools".into()));
        }
        Ok(())
    }

    fn execute(&self, device_pool: &DevicePool, plan: &Plan) -> Result<()> {
        log::debug!(
            "{:?} via {} on {}: {} steps, {} bytes",
            plan.direction(),
            plan.path().op,
            self.device.name(),
            plan.steps().len(),
            plan.bytes()
        );
        self.device.execute(plan, &self.bindings(device_pool, plan))
    }

    /// Raw bytes of component `comp` (0 = K or the only buffer, 1 = V).
    pub fn read_buffer(&self, comp: usize) -> Result<Vec<u8>> {
        let buf = self.buffer(comp)?;
        let mut out = alloc_bytes("host buffer copy", self.pair.host().buffer_bytes())?;
        self.device.read(buf, 0, &mut out)?;
        Ok(out)
    }
    /// Replaces the whole component buffer (`data` must be exactly its size). The pool's item
    /// checksums are forgotten (loads read the new bytes as unverified until backed up again).
    pub fn write_buffer(&mut self, comp: usize, data: &[u8]) -> Result<()> {
        let buf = self.buffer(comp)?;
        exact_size("host buffer", self.pair.host().buffer_bytes(), data)?;
        let written = self.device.write(buf, 0, data);
        if let Some(s) = &self.sidecar {
            // After every queued transfer has settled its checksums (some executors land the
            // write before those transfers' checksums are recorded): nothing records over this.
            let waited = self.device.wait_idle();
            s.forget_all();
            waited?;
        }
        written
    }
    /// Buffer of component `comp`.
    pub fn buffer(&self, comp: usize) -> Result<&Buffer> {
        self.buffers.get(comp).ok_or(TransferError::NoSuchBuffer { comp, slot: None, components: self.buffers.len(), slots: 1 })
    }
    /// `(address, bytes)` of component `comp`'s buffer in this process's address space, when the
    /// executor keeps host pools there for good (cpu memory; cuda's pinned mapped memory), so
    /// another engine can read and write pages in place (an L3 store registering it for
    /// zero-copy I/O); `None` for host pools that live in executor buffers (wgpu's, mapped only
    /// between submissions). The address stays valid while the pool lives; queued transfers must
    /// be waited for ([`Device::synchronize`]) before others touch the memory.
    pub fn host_span(&self, comp: usize) -> Result<Option<(u64, u64)>> {
        let len = self.pair.host().buffer_bytes();
        Ok(match self.buffer(comp)? {
            Buffer::Cpu(b) => Some((b.as_ptr() as u64, len)),
            #[cfg(feature = "cuda")]
            Buffer::Cuda(b) => b.host_address().map(|a| (a, len)),
            #[cfg(feature = "wgpu")]
            Buffer::Wgpu(_) => None,
        })
    }
}

/// The checksum table a host pool of `config` keeps on `device`: when the config (or its
/// profile's default) asks for one and the executor's copies can compute it.
fn sidecar_for(device: &Device, pair: &PoolPair, config: &HostPoolConfig) -> Result<Option<Arc<crate::integrity::Sidecar>>> {
    let wanted = config.integrity.unwrap_or(config.profile == Profile::Extended);
    if !wanted || !device.capabilities().checksums {
        return Ok(None);
    }
    let h = pair.host();
    let table = crate::integrity::Sidecar::new(h.slots(), h.layer_num(), h.kind().components() as u64, h.chunk_bytes(), h.head_num())?;
    Ok(Some(Arc::new(table)))
}

/// The plans of a layer-wise load, validated together: `(layer id, op, plan)` for every owned
/// live layer in order, then every draft pool (`layer_num + k`).
fn layer_load_plans(
    host: &HostPool,
    device_pool: &DevicePool,
    host_indices: &[i64],
    device_indices: &[i64],
    io_backend: IoBackend,
) -> Result<Vec<(usize, Op, Plan)>> {
    let m = device_pool.geometry.layers().clone();
    m.live_layers()
        .into_iter()
        .map(|l| (l, Op::Load { layer_id: l, is_draft: false }))
        .chain((0..m.drafts).map(|k| (m.layer_num + k, Op::Load { layer_id: m.layer_num + k, is_draft: true })))
        .map(|(l, op)| host.plan(device_pool, &Request { op, io_backend, host_indices, device_indices }).map(|p| (l, op, p)))
        .collect()
}

/// The error of a layer-wise load that failed to issue layer `enqueued.len()` of `total`:
/// names the host layers of the enqueued plans (none unless `landed`: they were waited for).
fn partial_layers(enqueued: &[(usize, Op, Plan)], landed: bool, err: TransferError, total: usize) -> TransferError {
    let completed_layers = if landed { crate::plan::layers_of(enqueued.iter().flat_map(|(_, _, p)| p.steps())) } else { Vec::new() };
    TransferError::partial(enqueued.len(), total, completed_layers, err)
}

/// A zeroed byte vector, or `OutOfMemory` (never an abort).
fn alloc_bytes(what: &str, bytes: u64) -> Result<Vec<u8>> {
    let oom = || TransferError::OutOfMemory { what: what.into(), requested: bytes, limit: "the allocator refused it".into() };
    let n = usize::try_from(bytes).map_err(|_| oom())?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| oom())?;
    v.resize(n, 0);
    Ok(v)
}

fn exact_size(what: &str, expected: u64, data: &[u8]) -> Result<()> {
    if data.len() as u64 != expected {
        return Err(TransferError::BufferSize { what: what.into(), expected, actual: data.len() as u64 });
    }
    Ok(())
}

/// Wrapped buffers: the right count, each at least `bytes` long, and of `device`'s executor
/// instance.
fn check_wrapped(device: &Device, buffers: &[Vec<Buffer>], outer: usize, inner: usize, bytes: u64, what: &str) -> Result<()> {
    if buffers.len() != outer || buffers.iter().any(|c| c.len() != inner) {
        return Err(TransferError::InvalidConfig(format!(
            "{what}s: expected {outer} × {inner}, got {:?}",
            buffers.iter().map(|c| c.len()).collect::<Vec<_>>()
        )));
    }
    for (i, c) in buffers.iter().enumerate() {
        for (j, b) in c.iter().enumerate() {
            device.check_buffer(b)?;
            let len = device.buffer_len(b)?;
            if len < bytes {
                return Err(TransferError::BufferSize { what: format!("{what} [{i}][{j}]"), expected: bytes, actual: len });
            }
        }
    }
    Ok(())
}
