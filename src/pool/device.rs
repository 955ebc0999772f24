//! The device pool: layer_first, one buffer per live layer and component.

use std::marker::PhantomData;

use super::*;
use crate::error::{Result, TransferError};
use crate::exec::{Buffer, Device};
use crate::geometry::{mul, DeviceGeometry, LayerMap, PoolKind};

/// Device pool: `[comp][buffer]`, each buffer `slots × item` bytes; buffers are the live target
/// layers in order, then one per draft (MTP) pool.
///
/// `'m` is the lifetime of borrowed memory (`'static` for pools that own their buffers): a
/// pool wrapping an engine's slices cannot outlive them.
pub struct DevicePool<'m> {
    pub(super) geometry: DeviceGeometry,
    pub(super) device: Device,
    pub(super) buffers: Vec<Vec<Buffer>>,
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
pub(super) fn check_budget(what: &str, requested: u64, limit: u64) -> Result<()> {
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
        DevicePool::wrap_geometry(device, config.geometry()?, buffers)
    }

    /// Wraps existing buffers of `device` as a pool of `geometry` (e.g. one with padded pages).
    pub(crate) fn wrap_geometry(device: &Device, geometry: DeviceGeometry, buffers: Vec<Vec<Buffer>>) -> Result<DevicePool<'m>> {
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
        self.write_device_buffer(comp, slot, data)
    }
    /// [`DevicePool::write_buffer`] for callers that hold the whole pool otherwise.
    pub(super) fn write_device_buffer(&self, comp: usize, slot: usize, data: &[u8]) -> Result<()> {
        let buf = self.buffer(comp, slot)?;
        exact_size("device layer buffer", self.geometry.layer_bytes(), data)?;
        self.device.write(buf, 0, data)
    }
}
