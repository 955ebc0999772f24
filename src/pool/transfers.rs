//! Calls in flight: a [`Transfer`], a layer-wise load's [`LayerLoads`], and the asynchronous
//! calls that make them.

use std::marker::PhantomData;

use super::*;
use crate::error::{Result, TransferError};
use crate::exec::Completion;
use crate::geometry::{IoBackend, LayerMap};
use crate::plan::{Op, Plan, Request};

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
pub(super) fn wait_layers(layers: &[(usize, Completion)]) -> Result<()> {
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

/// The plans of a layer-wise load, validated together: `(layer id, op, plan)` for every owned
/// live layer in order, then every draft pool (`layer_num + k`).
pub(super) fn layer_load_plans(
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
pub(super) fn partial_layers(enqueued: &[(usize, Op, Plan)], landed: bool, err: TransferError, total: usize) -> TransferError {
    let completed_layers = if landed { crate::plan::layers_of(enqueued.iter().flat_map(|(_, _, p)| p.steps())) } else { Vec::new() };
    TransferError::partial(enqueued.len(), total, completed_layers, err)
}
