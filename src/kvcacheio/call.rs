//! An op's pools and plans: tensors wrapped as a device pool and a host pool of their sizes, the
//! launcher checks, and calls run all or nothing.

use super::*;
use crate::exec::Device;
use crate::geometry::{IoBackend, LayerMap, Layout, PoolKind, Profile};
use crate::plan::{DeviceIndexLists, Op, Plan, Request};
use crate::pool::{DevicePool, DevicePoolConfig, HostPool, HostPoolConfig};
use crate::{Result, TransferError};

/// Slots of `item` bytes that every tensor holds (the smallest).
pub(super) fn common_slots(args: &[&Arg<'_>], item: u64) -> Result<u64> {
    let mut slots = u64::MAX;
    for a in args {
        let n = a.t.len / item.max(1);
        if n == 0 {
            return Err(bad(&a.name, format!("{} bytes hold no {item}-byte item", a.t.len)));
        }
        slots = slots.min(n);
    }
    Ok(slots)
}

/// The layer-first side: `layers[comp][slot]` (every slot of a component may be the same tensor
/// when the op touches one layer only; the plan then addresses that slot alone).
pub(super) fn device_pool(
    device: &Device,
    kind: PoolKind,
    item: u64,
    page_size: u64,
    layers: &[Vec<&Arg<'_>>],
) -> Result<DevicePool<'static>> {
    let all: Vec<&Arg<'_>> = layers.iter().flatten().copied().collect();
    let slots = common_slots(&all, item)?;
    let count = layers.first().map_or(0, |c| c.len());
    let buffers = layers.iter().map(|c| c.iter().map(|a| wrap(device, a)).collect::<Result<Vec<_>>>()).collect::<Result<Vec<_>>>()?;
    let config = DevicePoolConfig { kind, bytes_per_token: item, slots, page_size, layers: LayerMap::new(count) };
    DevicePool::from_buffers(device, &config, buffers)
}

/// The layout side: one tensor per component holding `slots` token slots (a multiple of the
/// device pool's page size).
pub(super) fn host_pool(
    dev: &DevicePool,
    layout: Layout,
    head_num: u64,
    profile: Profile,
    comps: &[&Arg<'_>],
    slots: u64,
) -> Result<HostPool<'static>> {
    let p = dev.geometry().page_size();
    if slots < p || !slots.is_multiple_of(p) {
        return Err(bad(&comps[0].name, format!("holds {slots} token slots, not a positive multiple of the page size {p}")));
    }
    let buffers = comps.iter().map(|a| wrap(dev.device(), a)).collect::<Result<Vec<_>>>()?;
    // HostPool rounds a requested size up to (size / P + 1) × P: ask for one page less. No item
    // checksums: the pool wraps the caller's tensors for this one call, so a table of them would
    // outlive nothing.
    HostPool::from_buffers(dev, &HostPoolConfig { layout, size: slots - p, head_num, profile, integrity: Some(false) }, buffers)
}

/// A layout dimension in layers: `layout_dim / item`, which must be whole.
pub(super) fn layers_of(name: &str, layout_dim: i64, item: u64) -> Result<u64> {
    let dim = positive(name, layout_dim)?;
    if dim % item != 0 {
        return Err(bad(name, format!("{dim} is not a multiple of item_size {item}")));
    }
    Ok(dim / item)
}

pub(super) fn positive(name: &str, v: i64) -> Result<u64> {
    u64::try_from(v).ok().filter(|&v| v > 0).ok_or_else(|| bad(name, format!("must be positive, got {v}")))
}

/// `item_size` as bytes; zero and negative sizes are refused.
pub(super) fn item_bytes(item_size: i64) -> Result<u64> {
    positive("item_size", item_size)
}

/// sgl-kernel's launcher checks of the `kernel` ops, in its order (equal lengths, then the
/// 8-byte item), before any tensor is looked at; the planner makes them again, with the same
/// outcome, for the pools it builds. Returns the item in bytes.
pub(super) fn launcher(hi: Indices<'_>, di: Indices<'_>, item_size: i64) -> Result<u64> {
    if hi.len() != di.len() {
        return Err(TransferError::LengthMismatch { src_len: hi.len(), dst_len: di.len() });
    }
    let item = item_bytes(item_size)?;
    if !item.is_multiple_of(8) {
        return Err(TransferError::ItemNotWordAligned { item_bytes: item, word: 8 });
    }
    Ok(item)
}

/// One pool pair and its validated plan.
pub(super) struct Call {
    dev: DevicePool<'static>,
    host: HostPool<'static>,
    plan: Plan,
}

impl Call {
    pub(super) fn new(
        dev: DevicePool<'static>,
        host: HostPool<'static>,
        op: Op,
        io: IoBackend,
        hi: Indices<'_>,
        di: Indices<'_>,
    ) -> Result<Call> {
        // sglang's words for the lists: the op's source and destination.
        let (h, d) = match op.direction() {
            crate::plan::Direction::HostToDevice => ("source", "destination"),
            crate::plan::Direction::DeviceToHost => ("destination", "source"),
        };
        let mut call = Call::planned(dev, host, op, io, hi, di).map_err(|e| e.with_sides(h, d))?;
        call.plan.name_sides(h, d);
        Ok(call)
    }

    /// Gives the plan the call's own launch tuning.
    pub(super) fn tune(&mut self, tuning: Option<crate::plan::LaunchTuning>) {
        self.plan.set_tuning(tuning);
    }

    /// Makes the plan's device checks compare the caller's layer tables with what they held.
    pub(super) fn guard_tables(&mut self, tables: crate::plan::TableGuards) -> Result<()> {
        self.plan.guard_tables(tables)
    }

    fn planned(dev: DevicePool<'static>, host: HostPool<'static>, op: Op, io: IoBackend, hi: Indices<'_>, di: Indices<'_>) -> Result<Call> {
        let plan = match (hi, di) {
            (Indices::Host(hi), Indices::Host(di)) => {
                host.plan(&dev, &Request { op, io_backend: io, host_indices: hi, device_indices: di })?
            }
            (Indices::Cuda(h), Indices::Cuda(d)) => {
                if h.len != d.len {
                    return Err(TransferError::LengthMismatch { src_len: h.len, dst_len: d.len });
                }
                // A misaligned 8-byte load is a sticky device error that ends the context.
                if let Some(a) = [h.addr, d.addr].into_iter().find(|a| a % 8 != 0) {
                    return Err(bad("indices", format!("CUDA index list at {a:#x} is not 8-byte aligned")));
                }
                let lists = DeviceIndexLists { host: h.addr, device: d.addr, len: h.len };
                host.plan_device_lists(&dev, op, io, lists, h.call)?
            }
            _ => return Err(bad("indices", "both index lists in CUDA memory, or both on the host")),
        };
        Ok(Call { dev, host, plan })
    }
}

/// What an op that moves nothing still owes its caller: the report of an earlier call whose CUDA
/// index lists failed their device checks, as any other op on the executor gives it.
pub(super) fn earlier_reports(device: &Device) -> Result<()> {
    device.index_check_reports(false)
}

/// Runs calls that were all validated first, in order. A failure after the first call (an
/// executor error, never a validation error) is `Partial`, naming the calls (one per layer)
/// that completed. Calls with CUDA index lists are checked on the device, all with the same
/// checks (so that all of them or none move), and an earlier call's failed device check is
/// reported first.
pub(super) fn run_all(calls: Vec<Call>) -> Result<()> {
    let checks: Vec<_> = calls.iter().filter_map(|c| c.plan.device_check().map(|d| (d.host_bound, d.device_bound))).collect();
    if checks.windows(2).any(|w| w[0] != w[1]) {
        return Err(bad("indices", "CUDA index lists need layers of one size (their device checks must be the same); pass host indices"));
    }
    let Some(device) = calls.first().map(|c| c.dev.device().clone()) else { return Ok(()) };
    device.index_check_reports(false)?;
    if !checks.is_empty() {
        return device.with_shared_index_check(|| run_calls(calls));
    }
    run_calls(calls)
}

pub(super) fn run_calls(calls: Vec<Call>) -> Result<()> {
    let total = calls.len();
    for (k, c) in calls.into_iter().enumerate() {
        // Planned for exactly these pools a moment ago (`Call::new`): the pair, direction and
        // profile checks of `execute_load` / `execute_backup` hold by construction.
        let r = c.host.execute(&c.dev, &c.plan);
        if let Err(e) = r {
            if k == 0 {
                return Err(e);
            }
            // The calls before it were enqueued, not waited for: they have landed once the
            // executor drains, unless their copies wait on a device check of CUDA index lists
            // whose verdict the host has not read (the next synchronize reports it): then none
            // is known to have landed.
            let landed = c.plan.device_check().is_none() && c.dev.device().wait_idle().is_ok();
            let completed = if landed { (0..k as u64).collect() } else { Vec::new() };
            return Err(TransferError::partial(k, total, completed, e));
        }
    }
    Ok(())
}

/// The pool kind of an op with `components` source arrays or layer lists: one is MLA (and the
/// DSA indexer), two are MHA's K and V.
pub(super) fn kind_of(components: usize) -> PoolKind {
    if components == 1 {
        PoolKind::Mla
    } else {
        PoolKind::Mha
    }
}
