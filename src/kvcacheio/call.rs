//! An op's sides and plans: the caller's tensors wrapped once per call as the buffers a plan runs
//! over, with the pool geometry they hold (no pool pair is built: an op needs its geometry and
//! bindings, not a pool's state), the launcher checks, and calls run all or nothing.

use std::sync::Arc;

use super::*;
use crate::exec::{Bindings, Buffer, Device};
use crate::geometry::{DeviceGeometry, IoBackend, LayerMap, Layout, PagePadding, PoolKind, PoolPair, Profile};
use crate::plan::{DeviceIndexLists, Op, Plan, Request};
use crate::pool::check_wrapped;
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

/// The layer-first side of one call: the caller's tensors `[component][slot]`, wrapped, and the
/// device geometry they hold.
pub(super) struct DeviceSide {
    device: Device,
    geometry: DeviceGeometry,
    buffers: Vec<Vec<Buffer>>,
}

impl DeviceSide {
    /// `buffers` as a device side of `geometry`: the count and sizes a device pool checks when
    /// it wraps buffers (the same check, so the same errors).
    pub(super) fn new(device: &Device, geometry: DeviceGeometry, buffers: Vec<Vec<Buffer>>) -> Result<DeviceSide> {
        let (comps, count) = (geometry.kind().components(), geometry.buffer_count());
        check_wrapped(device, &buffers, comps, count, geometry.layer_bytes(), "device layer buffer")?;
        Ok(DeviceSide { device: device.clone(), geometry, buffers })
    }

    /// The host side against this one, as a host pool would be built: `size` token slots (rounded
    /// up to `(size / P + 1) × P`), the host's own padded pages `padding`, `buffers` one per host
    /// component.
    pub(super) fn with_host(
        self,
        layout: Layout,
        size: u64,
        head_num: u64,
        profile: Profile,
        padding: Option<PagePadding>,
        buffers: Vec<Buffer>,
    ) -> Result<Sides> {
        let pair = PoolPair::with_host_padding(self.geometry, layout, size, head_num, padding)?;
        let nested = vec![buffers];
        check_wrapped(&self.device, &nested, 1, pair.host().buffers(), pair.host().buffer_bytes(), "host buffer")?;
        let host = nested.into_iter().next().unwrap_or_default();
        Ok(Sides { device: self.device, pair: Arc::new(pair), profile, dev: self.buffers, host })
    }
}

/// Both sides of one call: the pair geometry a plan is made for and the buffers it runs over.
pub(super) struct Sides {
    device: Device,
    pair: Arc<PoolPair>,
    profile: Profile,
    dev: Vec<Vec<Buffer>>,
    host: Vec<Buffer>,
}

/// The layer-first side: `layers[comp][slot]` (every slot of a component may be the same tensor
/// when the op touches one layer only; the plan then addresses that slot alone).
pub(super) fn device_side(device: &Device, kind: PoolKind, item: u64, page_size: u64, layers: &[Vec<&Arg<'_>>]) -> Result<DeviceSide> {
    let all: Vec<&Arg<'_>> = layers.iter().flatten().copied().collect();
    let slots = common_slots(&all, item)?;
    let count = layers.first().map_or(0, |c| c.len());
    let buffers = layers.iter().map(|c| c.iter().map(|a| wrap(device, a)).collect::<Result<Vec<_>>>()).collect::<Result<Vec<_>>>()?;
    DeviceSide::new(device, DeviceGeometry::new(kind, item, slots, page_size, LayerMap::new(count))?, buffers)
}

/// The layout side: one tensor per component holding `slots` token slots (a multiple of the
/// device side's page size).
pub(super) fn host_side(dev: DeviceSide, layout: Layout, head_num: u64, profile: Profile, comps: &[&Arg<'_>], slots: u64) -> Result<Sides> {
    let p = dev.geometry.page_size();
    if slots < p || !slots.is_multiple_of(p) {
        return Err(bad(&comps[0].name, format!("holds {slots} token slots, not a positive multiple of the page size {p}")));
    }
    let buffers = comps.iter().map(|a| wrap(&dev.device, a)).collect::<Result<Vec<_>>>()?;
    // A host side holds (size / P + 1) × P slots: ask for one page less.
    let padding = dev.geometry.padding();
    dev.with_host(layout, slots - p, head_num, profile, padding, buffers)
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
/// 8-byte item), before any tensor is looked at: sglang's order needs them ahead of the tensor
/// checks; the planner's own (the same outcome) come after them. Returns the item in bytes.
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

/// One call's sides and its validated plan.
pub(super) struct Call {
    sides: Sides,
    plan: Plan,
}

impl Call {
    pub(super) fn new(sides: Sides, op: Op, io: IoBackend, hi: Indices<'_>, di: Indices<'_>) -> Result<Call> {
        // sglang's words for the lists: the op's source and destination.
        let (h, d) = match op.direction() {
            crate::plan::Direction::HostToDevice => ("source", "destination"),
            crate::plan::Direction::DeviceToHost => ("destination", "source"),
        };
        let mut call = Call::planned(sides, op, io, hi, di).map_err(|e| e.with_sides(h, d))?;
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

    /// The one planner, as a host pool plans (its pair check holds by construction: one
    /// executor, one geometry; no item checksums, which would outlive nothing).
    fn planned(sides: Sides, op: Op, io: IoBackend, hi: Indices<'_>, di: Indices<'_>) -> Result<Call> {
        let device = &sides.device;
        let plan = match (hi, di) {
            (Indices::Host(hi), Indices::Host(di)) => {
                let caps = device.capabilities_for(io);
                let req = Request { op, io_backend: io, host_indices: hi, device_indices: di };
                crate::plan::plan(sides.profile, &caps, device.id(), &sides.pair, &req)?
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
                let caps = device.capabilities();
                crate::plan::plan_device_lists(sides.profile, &caps, device.id(), &sides.pair, op, io, lists, h.call)?
            }
            _ => return Err(bad("indices", "both index lists in CUDA memory, or both on the host")),
        };
        Ok(Call { sides, plan })
    }

    /// Runs the plan over the call's buffers (planned for exactly them a moment ago).
    fn execute(&self) -> Result<()> {
        let s = &self.sides;
        let bindings =
            Bindings { host: s.host.iter().collect(), device: s.dev.iter().map(|c| c.iter().collect()).collect(), integrity: None };
        s.device.execute(&self.plan, &bindings)
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
    let Some(device) = calls.first().map(|c| c.sides.device.clone()) else { return Ok(()) };
    device.index_check_reports(false)?;
    if !checks.is_empty() {
        return device.with_shared_index_check(|| run_calls(calls));
    }
    run_calls(calls)
}

pub(super) fn run_calls(calls: Vec<Call>) -> Result<()> {
    let total = calls.len();
    for (k, c) in calls.into_iter().enumerate() {
        let r = c.execute();
        if let Err(e) = r {
            if k == 0 {
                return Err(e);
            }
            // The calls before it were enqueued, not waited for: they have landed once the
            // executor drains, unless their copies wait on a device check of CUDA index lists
            // whose verdict the host has not read (the next synchronize reports it): then none
            // is known to have landed.
            let landed = c.plan.device_check().is_none() && c.sides.device.wait_idle().is_ok();
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
