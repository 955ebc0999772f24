//! The host pool: one buffer per component in the host layout, and its sglang-shaped calls.

use std::marker::PhantomData;
use std::sync::Arc;

use super::*;
use crate::error::{Result, TransferError};
use crate::exec::{Bindings, Buffer, Device};
use crate::geometry::{HostGeometry, IoBackend, Layout, PoolPair, Profile};
use crate::plan::{self, Direction, Op, Plan, Request};

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
    pub(super) pair: Arc<PoolPair>,
    profile: Profile,
    pub(super) device: Device,
    pub(super) buffers: Vec<Buffer>,
    /// Item checksums, when the pool keeps them.
    pub(super) checksums: Option<Arc<crate::integrity::ChecksumTable>>,
    _memory: PhantomData<&'m mut [u8]>,
}

impl HostPool<'static> {
    /// A host pool for `device_pool`: same kind, item and page size; `L` = live target layers
    /// plus drafts. Owns its buffers (pinned and mapped on cuda).
    pub fn new(device_pool: &DevicePool, config: &HostPoolConfig) -> Result<HostPool<'static>> {
        HostPool::new_padded(device_pool, config, device_pool.geometry.padding())
    }

    /// [`HostPool::new`] with the host's own padded pages (`None`: items packed), whatever the
    /// device's are.
    pub(crate) fn new_padded(
        device_pool: &DevicePool,
        config: &HostPoolConfig,
        padding: Option<crate::geometry::PagePadding>,
    ) -> Result<HostPool<'static>> {
        let pair = PoolPair::with_host_padding(device_pool.geometry.clone(), config.layout, config.size, config.head_num, padding)?;
        let device = device_pool.device.clone();
        let host = pair.host();
        let count = host.buffers() as u64;
        check_budget("host pool", host.buffer_bytes().saturating_mul(count), device.capabilities().max_host_pool_bytes)?;
        let checksums = checksum_table_for(&device, &pair, config)?;
        let buffers = (0..count).map(|_| device.alloc_pool(host.buffer_bytes(), host.chunk_bytes(), true)).collect::<Result<Vec<_>>>()?;
        Ok(HostPool { pair: Arc::new(pair), profile: config.profile, device, buffers, checksums, _memory: PhantomData })
    }

    /// Wraps existing buffers of the device pool's executor, one per component (e.g. an
    /// engine's registered host region on cuda, or `wgpu::Buffer`s). Each must hold at least the
    /// layout's bytes.
    pub fn from_buffers(device_pool: &DevicePool, config: &HostPoolConfig, buffers: Vec<Buffer>) -> Result<HostPool<'static>> {
        HostPool::wrap(device_pool, config, buffers)
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
        let padding = device_pool.geometry.padding();
        HostPool::wrap_padded(device_pool, config, buffers, padding)
    }

    /// Wraps existing buffers with the host's own padded pages (see [`PoolPair::with_host_padding`]).
    pub(crate) fn wrap_padded(
        device_pool: &DevicePool,
        config: &HostPoolConfig,
        buffers: Vec<Buffer>,
        padding: Option<crate::geometry::PagePadding>,
    ) -> Result<HostPool<'m>> {
        let pair = PoolPair::with_host_padding(device_pool.geometry.clone(), config.layout, config.size, config.head_num, padding)?;
        let device = device_pool.device.clone();
        let nested = vec![buffers];
        check_wrapped(&device, &nested, 1, pair.host().buffers(), pair.host().buffer_bytes(), "host buffer")?;
        let buffers = nested.into_iter().next().unwrap_or_default();
        let checksums = checksum_table_for(&device, &pair, config)?;
        Ok(HostPool { pair: Arc::new(pair), profile: config.profile, device, buffers, checksums, _memory: PhantomData })
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
        let caps = self.device.capabilities_for(req.io_backend);
        plan::plan(self.profile, &caps, self.device.id(), &self.pair, req)?.with_checksums(self.checksums.is_some(), &caps)
    }

    /// The device pool is of the same executor instance and the geometry this pool was built
    /// for.
    pub(super) fn check_pair(&self, device_pool: &DevicePool) -> Result<()> {
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
    pub(super) fn bindings<'a>(&'a self, device_pool: &'a DevicePool, plan: &Plan) -> Bindings<'a, Buffer> {
        let integrity = self.checksums.as_ref().and_then(|table| {
            if plan.settles_checksums() {
                return Some(crate::exec::ChecksumBinding { table: table.clone(), sink: Default::default() });
            }
            if plan.direction() == Direction::DeviceToHost {
                // In order with what is queued: a queued backup that records the same items must
                // not record after this forgets. (Only plans made for a pool without checksums
                // get here: this pool's own plans settle checksums on every path.)
                if let Err(e) = self.device.wait_idle() {
                    log::error!("waiting before forgetting checksums: {e}");
                }
                self.forget_written(table, plan);
            } else if let Some(units) = plan.host_units() {
                // Loads read these items unverified.
                let live = units.iter().filter(|u| **u >= 0).count() as u64;
                let layers = plan.layers().len() as u64;
                table.count([0, 0, live * layers * self.pair.host().kind().components() as u64, 0]);
            }
            None
        });
        Bindings {
            host: self.buffers.iter().collect(),
            device: device_pool.buffers.iter().map(|c| c.iter().collect()).collect(),
            integrity,
        }
    }

    fn forget_written(&self, table: &crate::integrity::ChecksumTable, plan: &Plan) {
        let Some(units) = plan.host_units() else {
            table.forget_all();
            return;
        };
        let comps = self.pair.host().kind().components() as u8;
        for l in plan.layers() {
            for c in 0..comps {
                for &u in units.iter().filter(|u| **u >= 0) {
                    if let Some(slot) = table.slot(u as u64, l, c) {
                        table.forget(slot);
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

    /// Runs an accepted plan made for these pools (as [`HostPool::plan`] makes it, so the checks
    /// of [`HostPool::execute_load`] hold); callers hold `&mut` on its destination pool, or its
    /// claims ([`super::shared`]), or own both pools.
    pub(crate) fn execute(&self, device_pool: &DevicePool, plan: &Plan) -> Result<()> {
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

    /// Raw bytes of host buffer `comp` (0 = K or the only buffer, 1 = V; page_unified has one,
    /// holding K and V).
    pub fn read_buffer(&self, comp: usize) -> Result<Vec<u8>> {
        let buf = self.buffer(comp)?;
        let mut out = alloc_bytes("host buffer copy", self.pair.host().buffer_bytes())?;
        self.device.read(buf, 0, &mut out)?;
        Ok(out)
    }
    /// Replaces the whole host buffer `comp` (`data` must be exactly its size). The pool's item
    /// checksums are forgotten (loads read the new bytes as unverified until backed up again).
    pub fn write_buffer(&mut self, comp: usize, data: &[u8]) -> Result<()> {
        self.write_host_buffer(comp, data)
    }
    /// [`HostPool::write_buffer`] for callers that hold the whole pool otherwise.
    pub(super) fn write_host_buffer(&self, comp: usize, data: &[u8]) -> Result<()> {
        let buf = self.buffer(comp)?;
        exact_size("host buffer", self.pair.host().buffer_bytes(), data)?;
        let written = self.device.write(buf, 0, data);
        if let Some(s) = &self.checksums {
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
pub(super) fn checksum_table_for(
    device: &Device,
    pair: &PoolPair,
    config: &HostPoolConfig,
) -> Result<Option<Arc<crate::integrity::ChecksumTable>>> {
    let wanted = config.integrity.unwrap_or(config.profile == Profile::Extended);
    if !wanted || !device.capabilities().checksums {
        return Ok(None);
    }
    let h = pair.host();
    let table =
        crate::integrity::ChecksumTable::new(h.slots(), h.layer_num(), h.kind().components() as u64, h.chunk_bytes(), h.head_num())?;
    Ok(Some(Arc::new(table)))
}
