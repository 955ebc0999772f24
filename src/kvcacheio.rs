//! sglang's `sgl_kernel.kvcacheio` transfer ops over caller memory, with the same names and
//! argument order, on the cpu and cuda executors.
//!
//! Each op is a pool call in disguise: its tensors are wrapped as a device pool (the layer-first
//! side) and a host pool (the layout side) of exactly their sizes, and the call goes through the
//! one planner, so it obeys the same table, order of checks and messages as the pools, and adds
//! what sglang's ops lack: every index is range-checked against the tensor it addresses, and
//! destinations must be unique and must not overlap another argument. Nothing moves unless every
//! check of every layer passes.
//!
//! Sizes are in bytes (`item_size`, `src_layout_dim`, `dst_layout_dim`), as in sgl-kernel since
//! its layer-table refactor. The launch tuning arguments (`block_quota`, `num_warps_per_block`)
//! are the executor's business and are not taken here.
//!
//! | op | device side | host side | call |
//! |---|---|---|---|
//! | [`transfer_kv_per_layer`], [`transfer_kv_per_layer_mla`] | `dst` layer | `src` layer (layer_first, one layer) | load |
//! | [`transfer_kv_per_layer_pf_lf`], [`transfer_kv_per_layer_mla_pf_lf`] | `dst` layer | `src` page_first | load of `layer_id` |
//! | [`transfer_kv_per_layer_ph_lf`] | `dst` layer | `src` page_head | load of `layer_id` |
//! | [`transfer_kv_all_layer`], [`transfer_kv_all_layer_mla`], [`transfer_kv_direct`] | `dst[j]` | `src[j]` | one load per layer |
//! | [`transfer_kv_all_layer_lf_pf`], [`transfer_kv_all_layer_mla_lf_pf`] | `src` layers | `dst` page_first | backup |
//! | [`transfer_kv_all_layer_lf_ph`] | `src` layers | `dst` page_head | backup |
//! | [`transfer_kv_per_layer_pfdhg_lf`] | `dst` layer | `src` page_first_direct_hg | load of `layer_id` |
//! | [`transfer_kv_all_layer_lf_pfdhg`] | `src` layers | `dst` page_first_direct_hg | backup |
//! | [`transfer_kv_per_layer_direct_pf_lf`] | `dst` layers | `src` page_first_direct | load of `layer_id` |
//! | [`transfer_kv_all_layer_direct_lf_pf`] | `src` layers | `dst` page_first_direct | backup |
//! | [`transfer_kv_per_layer_lf_pf`], [`transfer_kv_per_layer_mla_lf_pf`], [`transfer_kv_per_layer_direct_lf_pf`] | `src` layer | `dst` page_first / page_first_direct | per-layer backup (not in sglang) |
//!
//! The last row is what sglang lacks (its seed error): a one-layer backup into page_first or
//! page_first_direct, for layer-sharded and layer-wise backups. It runs under profile
//! `extended`; the thirteen sglang ops run under profile `sglang`.

#![allow(clippy::too_many_arguments)] // sglang's signatures

use std::ptr::NonNull;

use crate::exec::{Buffer, Device};
use crate::geometry::{IoBackend, LayerMap, Layout, PoolKind, Profile};
use crate::plan::{DeviceIndexLists, Op, Plan, Request};
use crate::pool::{DevicePool, DevicePoolConfig, HostPool, HostPoolConfig};
use crate::{Result, TransferError};

/// Where a tensor's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Host memory (pinned or mapped for the cuda executor).
    Host,
    /// CUDA device memory.
    CudaDevice,
}

/// One tensor argument: `len` contiguous bytes at `addr`, with its shape in elements (the
/// direct ops slice along dimension 0, and read page_first_direct pages from dimensions 1–2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTensor {
    addr: u64,
    len: u64,
    dims: Vec<u64>,
    memory: Memory,
}

impl RawTensor {
    /// Describes caller memory.
    ///
    /// # Safety
    /// `addr..addr + len` must be valid for reads and writes, in `memory`, and nothing else may
    /// access it while the op's copies run. On the cpu executor the op returns after its copies.
    /// On the cuda executor it returns once they are enqueued on the executor's stream, as
    /// sgl-kernel's ops do on torch's current stream: the memory must stay valid until that
    /// stream reaches them, and work on other streams must be ordered with it by the caller
    /// (an executor made with `CudaExecutor::from_stream` on the caller's stream needs nothing
    /// more).
    pub unsafe fn new(addr: u64, len: u64, dims: Vec<u64>, memory: Memory) -> RawTensor {
        RawTensor { addr, len, dims, memory }
    }
    /// Bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// True when it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Shape in elements.
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Bytes of one row along dimension 0 (the whole tensor for a scalar).
    fn row_bytes(&self) -> u64 {
        match self.dims.first() {
            Some(&rows) if rows > 0 => self.len / rows,
            _ => self.len,
        }
    }
}

/// An index list: `i64` values on the host, or in CUDA memory ([`CudaIndices`]). Host lists
/// are checked before anything is enqueued; CUDA lists (the `kernel` ops on the cuda executor)
/// are checked on the device, without a host round trip: a failing list moves nothing, and the
/// error ([`TransferError::DeviceIndexCheck`], naming the op) comes from the next
/// `CudaExecutor::synchronize` or the next op on that executor — which then does not run (it
/// returns the earlier op's error; issue it again). The layers of one all-layer op share one
/// check: all of them move, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Indices<'a> {
    /// Host values.
    Host(&'a [i64]),
    /// Values in CUDA device memory.
    Cuda(CudaIndices),
}

/// `len` `i64` indices at device address `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaIndices {
    addr: u64,
    len: usize,
    call: &'static str,
}

impl CudaIndices {
    /// Describes an index list in CUDA memory.
    ///
    /// # Safety
    /// `addr..addr + 8 × len` must be device memory of the executor's context, holding `i64`s,
    /// valid and unchanged until the executor's stream has run the op (as for [`RawTensor`]).
    pub unsafe fn new(addr: u64, len: usize) -> CudaIndices {
        CudaIndices { addr, len, call: "" }
    }
}

impl Indices<'_> {
    /// Entries.
    pub fn len(&self) -> usize {
        match self {
            Indices::Host(v) => v.len(),
            Indices::Cuda(c) => c.len,
        }
    }
    /// True when it has no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// This list as an argument of op `call` (named in its device check's error).
    fn call(self, call: &'static str) -> Self {
        match self {
            Indices::Cuda(c) => Indices::Cuda(CudaIndices { call, ..c }),
            host => host,
        }
    }
}

/// The two index lists of op `call`.
fn op_lists<'i>(call: &'static str, src: impl Into<Indices<'i>>, dst: impl Into<Indices<'i>>) -> (Indices<'i>, Indices<'i>) {
    (src.into().call(call), dst.into().call(call))
}

impl<'a> From<&'a [i64]> for Indices<'a> {
    fn from(v: &'a [i64]) -> Self {
        Indices::Host(v)
    }
}

impl<'a> From<&'a Vec<i64>> for Indices<'a> {
    fn from(v: &'a Vec<i64>) -> Self {
        Indices::Host(v)
    }
}

impl<'a, const N: usize> From<&'a [i64; N]> for Indices<'a> {
    fn from(v: &'a [i64; N]) -> Self {
        Indices::Host(v)
    }
}

impl From<CudaIndices> for Indices<'_> {
    fn from(c: CudaIndices) -> Self {
        Indices::Cuda(c)
    }
}

/// A named argument.
#[derive(Clone)]
struct Arg<'a> {
    name: String,
    t: &'a RawTensor,
}

fn arg(name: impl Into<String>, t: &RawTensor) -> Arg<'_> {
    Arg { name: name.into(), t }
}

fn bad(arg: &str, reason: impl Into<String>) -> TransferError {
    TransferError::BadTensor { arg: arg.into(), reason: reason.into() }
}

/// Wraps one tensor as a buffer of `device`, without owning it.
fn wrap(device: &Device, a: &Arg<'_>) -> Result<Buffer> {
    let t = a.t;
    let Some(ptr) = NonNull::new(t.addr as *mut u8) else { return Err(bad(&a.name, "null data pointer")) };
    let len = usize::try_from(t.len).map_err(|_| bad(&a.name, "larger than the address space"))?;
    if t.addr.checked_add(t.len).is_none() {
        return Err(bad(&a.name, "address range wraps"));
    }
    match device {
        Device::Cpu(e) => {
            if t.memory != Memory::Host {
                return Err(bad(&a.name, "the cpu executor moves host memory only"));
            }
            // SAFETY: the caller of `RawTensor::new` vouches for the span; the buffer is dropped
            // before the op returns.
            Ok(Buffer::Cpu(unsafe { crate::exec::cpu::CpuBuffer::from_raw(ptr, len, e) }))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(e) => {
            // SAFETY: as above, and the op's copies are ordered on the executor's stream (the
            // caller's, for an executor made with `CudaExecutor::from_stream`); host memory must
            // be pinned or registered (refused otherwise).
            let b = unsafe { crate::exec::cuda::CudaBuffer::stream_ordered(e, t.addr, t.len, t.memory == Memory::CudaDevice)? };
            Ok(Buffer::Cuda(b))
        }
        #[cfg(feature = "wgpu")]
        Device::Wgpu(_) => Err(bad(&a.name, "the wgpu executor moves between its own pools only (use DevicePool / HostPool)")),
    }
}

/// Refuses a destination that overlaps any other argument (the result would depend on the
/// order of the copies, and differ between executors).
fn check_overlaps(reads: &[Arg<'_>], writes: &[Arg<'_>]) -> Result<()> {
    overlaps(reads, writes, false)
}

/// [`check_overlaps`] for the `kernel` ops, where `reads[i]` pairs with `writes[i]` (K and V,
/// layer by layer): two destinations that are exactly the same tensor (span and shape), read
/// from sources that are exactly the same tensor too, receive the same bytes twice, and are
/// accepted (sglang's own tests pass `dst_k` as `dst_v` that way). Safe because a gather writes
/// every pair of one index from the same lane or thread, in order; `direct` copies split runs
/// across threads, so the `direct` ops keep the strict check.
fn check_overlaps_kernel(reads: &[Arg<'_>], writes: &[Arg<'_>]) -> Result<()> {
    overlaps(reads, writes, true)
}

fn overlaps(reads: &[Arg<'_>], writes: &[Arg<'_>], same_bytes_twice_ok: bool) -> Result<()> {
    let span = |t: &RawTensor| (t.memory, t.addr, t.addr.saturating_add(t.len));
    let same = |a: &RawTensor, b: &RawTensor| span(a) == span(b) && a.dims == b.dims;
    let paired = same_bytes_twice_ok && reads.len() == writes.len();
    let same_bytes_twice = |i: usize, j: usize| paired && same(writes[i].t, writes[j].t) && same(reads[i].t, reads[j].t);
    for (i, w) in writes.iter().enumerate() {
        let (wm, ws, we) = span(w.t);
        let others = reads.iter().chain(writes.iter().enumerate().filter(|&(j, _)| j != i && !same_bytes_twice(i, j)).map(|(_, a)| a));
        for o in others {
            let (om, os, oe) = span(o.t);
            if wm == om && ws < oe && os < we && w.t.len > 0 && o.t.len > 0 {
                return Err(bad(&w.name, format!("destination overlaps {}", o.name)));
            }
        }
    }
    Ok(())
}

/// Slots of `item` bytes that every tensor holds (the smallest).
fn common_slots(args: &[&Arg<'_>], item: u64) -> Result<u64> {
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
fn device_pool(device: &Device, kind: PoolKind, item: u64, page_size: u64, layers: &[Vec<&Arg<'_>>]) -> Result<DevicePool<'static>> {
    let all: Vec<&Arg<'_>> = layers.iter().flatten().copied().collect();
    let slots = common_slots(&all, item)?;
    let count = layers.first().map_or(0, |c| c.len());
    let buffers = layers.iter().map(|c| c.iter().map(|a| wrap(device, a)).collect::<Result<Vec<_>>>()).collect::<Result<Vec<_>>>()?;
    let config = DevicePoolConfig { kind, bytes_per_token: item, slots, page_size, layers: LayerMap::new(count) };
    DevicePool::from_buffers(device, &config, buffers)
}

/// The layout side: one tensor per component holding `slots` token slots (a multiple of the
/// device pool's page size).
fn host_pool(
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
fn layers_of(name: &str, layout_dim: i64, item: u64) -> Result<u64> {
    let dim = positive(name, layout_dim)?;
    if dim % item != 0 {
        return Err(bad(name, format!("{dim} is not a multiple of item_size {item}")));
    }
    Ok(dim / item)
}

fn positive(name: &str, v: i64) -> Result<u64> {
    u64::try_from(v).ok().filter(|&v| v > 0).ok_or_else(|| bad(name, format!("must be positive, got {v}")))
}

/// `item_size` as bytes; zero and negative sizes are refused.
fn item_bytes(item_size: i64) -> Result<u64> {
    positive("item_size", item_size)
}

/// sgl-kernel's launcher checks of the `kernel` ops, in its order (equal lengths, then the
/// 8-byte item), before any tensor is looked at; the planner makes them again, with the same
/// outcome, for the pools it builds. Returns the item in bytes.
fn launcher(hi: Indices<'_>, di: Indices<'_>, item_size: i64) -> Result<u64> {
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
struct Call {
    dev: DevicePool<'static>,
    host: HostPool<'static>,
    plan: Plan,
}

impl Call {
    fn new(dev: DevicePool<'static>, host: HostPool<'static>, op: Op, io: IoBackend, hi: Indices<'_>, di: Indices<'_>) -> Result<Call> {
        // sglang's words for the lists: the op's source and destination.
        let (h, d) = match op.direction() {
            crate::plan::Direction::HostToDevice => ("source", "destination"),
            crate::plan::Direction::DeviceToHost => ("destination", "source"),
        };
        let mut call = Call::planned(dev, host, op, io, hi, di).map_err(|e| e.with_sides(h, d))?;
        call.plan.name_sides(h, d);
        Ok(call)
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
fn earlier_reports(device: &Device) -> Result<()> {
    device.index_check_reports(false)
}

/// Runs calls that were all validated first, in order. A failure after the first call (an
/// executor error, never a validation error) is `Partial`, naming the calls (one per layer)
/// that completed. Calls with CUDA index lists are checked on the device, all with the same
/// checks (so that all of them or none move), and an earlier call's failed device check is
/// reported first.
fn run_all(calls: Vec<Call>) -> Result<()> {
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

fn run_calls(calls: Vec<Call>) -> Result<()> {
    let total = calls.len();
    for (k, mut c) in calls.into_iter().enumerate() {
        let r = match c.plan.direction() {
            crate::plan::Direction::HostToDevice => c.host.execute_load(&mut c.dev, &c.plan),
            crate::plan::Direction::DeviceToHost => c.host.execute_backup(&c.dev, &c.plan),
        };
        if let Err(e) = r {
            if k == 0 {
                return Err(e);
            }
            return Err(TransferError::partial(k, total, (0..k as u64).collect(), e));
        }
    }
    Ok(())
}

/// The K and V components of an MHA op.
fn kv<'a>(k: &'a RawTensor, v: &'a RawTensor, k_name: &str, v_name: &str) -> [Arg<'a>; 2] {
    [arg(k_name, k), arg(v_name, v)]
}

// ---- one-layer loads ---------------------------------------------------------------------

/// `transfer_kv_per_layer`: one layer, layer_first to layer_first. `src_k[s]`, `src_v[s]`
/// (items of `item_size` bytes) → `dst_k[d]`, `dst_v[d]`; negative indices are skipped.
pub fn transfer_kv_per_layer<'i>(
    device: &Device,
    src_k: &RawTensor,
    dst_k: &RawTensor,
    src_v: &RawTensor,
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer", src_indices, dst_indices);
    let item = launcher(src_indices, dst_indices, item_size)?;
    let src = kv(src_k, src_v, "src_k", "src_v");
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    check_overlaps_kernel(&src, &dst)?;
    let call = lf_pair(device, PoolKind::Mha, item, &[&src[0], &src[1]], &[&dst[0], &dst[1]], IoBackend::Kernel, src_indices, dst_indices)?;
    run_all(vec![call])
}

/// `transfer_kv_per_layer_mla`: [`transfer_kv_per_layer`] with one buffer.
pub fn transfer_kv_per_layer_mla<'i>(
    device: &Device,
    src: &RawTensor,
    dst: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_mla", src_indices, dst_indices);
    let item = launcher(src_indices, dst_indices, item_size)?;
    let (s, d) = (arg("src", src), arg("dst", dst));
    check_overlaps(std::slice::from_ref(&s), std::slice::from_ref(&d))?;
    let call = lf_pair(device, PoolKind::Mla, item, &[&s], &[&d], IoBackend::Kernel, src_indices, dst_indices)?;
    run_all(vec![call])
}

/// One layer_first layer to another: the source as a one-layer layer_first host pool, the
/// destination as a one-layer device pool.
fn lf_pair(
    device: &Device,
    kind: PoolKind,
    item: u64,
    src: &[&Arg<'_>],
    dst: &[&Arg<'_>],
    io: IoBackend,
    hi: Indices<'_>,
    di: Indices<'_>,
) -> Result<Call> {
    let dev = device_pool(device, kind, item, 1, &dst.iter().map(|a| vec![*a]).collect::<Vec<_>>())?;
    let slots = common_slots(src, item)?;
    let host = host_pool(&dev, Layout::LayerFirst, 1, Profile::Sglang, src, slots)?;
    Call::new(dev, host, Op::Load { layer_id: 0, is_draft: false }, io, hi, di)
}

/// A device pool of `layers` slots per component where every slot is the caller's one layer
/// (the plan of a one-layer call addresses slot `layer_id` alone).
fn one_layer_device(device: &Device, kind: PoolKind, item: u64, page: u64, layers: u64, comps: &[&Arg<'_>]) -> Result<DevicePool<'static>> {
    let n = usize::try_from(layers)
        .ok()
        .filter(|&n| n <= crate::geometry::MAX_LAYERS)
        .ok_or_else(|| bad(&comps[0].name, format!("{layers} layers exceed the limit of {}", crate::geometry::MAX_LAYERS)))?;
    device_pool(device, kind, item, page, &comps.iter().map(|a| vec![*a; n]).collect::<Vec<_>>())
}

fn layer_index(layer_id: i64) -> Result<usize> {
    usize::try_from(layer_id).map_err(|_| bad("layer_id", format!("must not be negative, got {layer_id}")))
}

/// `transfer_kv_per_layer_pf_lf`: layer `layer_id` of a page_first host buffer
/// (`[slots][L][item]`, `src_layout_dim = L × item_size`) → one layer_first device layer.
pub fn transfer_kv_per_layer_pf_lf<'i>(
    device: &Device,
    src_k: &RawTensor,
    dst_k: &RawTensor,
    src_v: &RawTensor,
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    src_layout_dim: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_pf_lf", src_indices, dst_indices);
    let src = kv(src_k, src_v, "src_k", "src_v");
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    paged_load(device, PoolKind::Mha, Layout::PageFirst, &src, &dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, 1, 1)
}

/// `transfer_kv_per_layer_mla_pf_lf`: [`transfer_kv_per_layer_pf_lf`] with one buffer.
pub fn transfer_kv_per_layer_mla_pf_lf<'i>(
    device: &Device,
    src: &RawTensor,
    dst: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    src_layout_dim: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_mla_pf_lf", src_indices, dst_indices);
    let (s, d) = ([arg("src", src)], [arg("dst", dst)]);
    paged_load(device, PoolKind::Mla, Layout::PageFirst, &s, &d, src_indices, dst_indices, layer_id, item_size, src_layout_dim, 1, 1)
}

/// `transfer_kv_per_layer_ph_lf`: layer `layer_id` of a page_head host buffer
/// (`[pages][head_num][page_size][L][item / head_num]`) → one layer_first device layer.
pub fn transfer_kv_per_layer_ph_lf<'i>(
    device: &Device,
    src_k: &RawTensor,
    dst_k: &RawTensor,
    src_v: &RawTensor,
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    src_layout_dim: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_ph_lf", src_indices, dst_indices);
    let src = kv(src_k, src_v, "src_k", "src_v");
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    paged_load(
        device,
        PoolKind::Mha,
        Layout::PageHead,
        &src,
        &dst,
        src_indices,
        dst_indices,
        layer_id,
        item_size,
        src_layout_dim,
        page_size,
        head_num,
    )
}

/// The checks of sglang's head-group kernels on their integers, before any tensor is looked
/// at: a positive page and group count, groups that split the item evenly into whole 8-byte
/// words, and a layout dimension of whole items.
fn head_group_args(item_size: i64, layout_dim_name: &'static str, layout_dim: i64, page_size: i64, head_num: i64) -> Result<()> {
    let arg = |arg: &'static str, value: i64, message: String| TransferError::BadArgument { arg, value, message };
    if page_size <= 0 {
        return Err(arg("page_size", page_size, format!("page_size must be positive, got {page_size}")));
    }
    if head_num <= 0 {
        return Err(arg("head_num", head_num, format!("head_num (head groups) must be positive, got {head_num}")));
    }
    if item_size <= 0 || item_size % head_num != 0 {
        return Err(arg("item_size", item_size, format!("item_size {item_size} must be a positive multiple of head_num {head_num}")));
    }
    let group = item_size / head_num;
    if group % 8 != 0 {
        return Err(arg(
            "head_num",
            head_num,
            format!("Per-head-group bytes {group} (item_size {item_size} / head_num {head_num}) must be a multiple of 8"),
        ));
    }
    if layout_dim <= 0 || layout_dim % item_size != 0 {
        return Err(arg(
            layout_dim_name,
            layout_dim,
            format!("{layout_dim_name} {layout_dim} must be a positive multiple of item_size {item_size}"),
        ));
    }
    Ok(())
}

/// `transfer_kv_per_layer_pfdhg_lf`: layer `layer_id` of a head-group-major page_first_direct
/// host buffer (`[pages][head_num][L][page_size][item / head_num]`, `src_layout_dim = L ×
/// item_size`; `head_num` counts head groups) → one layer_first device layer. Empty index lists
/// are a no-op once the integers pass.
pub fn transfer_kv_per_layer_pfdhg_lf<'i>(
    device: &Device,
    src_k: &RawTensor,
    dst_k: &RawTensor,
    src_v: &RawTensor,
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    src_layout_dim: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_pfdhg_lf", src_indices, dst_indices);
    head_group_args(item_size, "src_layout_dim", src_layout_dim, page_size, head_num)?;
    launcher(src_indices, dst_indices, item_size)?;
    if src_indices.is_empty() {
        return earlier_reports(device);
    }
    let src = kv(src_k, src_v, "src_k", "src_v");
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    paged_load(
        device,
        PoolKind::Mha,
        Layout::PageFirstDirectHeadGroups,
        &src,
        &dst,
        src_indices,
        dst_indices,
        layer_id,
        item_size,
        src_layout_dim,
        page_size,
        head_num,
    )
}

/// Host slots of a page_first / page_head buffer: whole pages of `P × layout_dim` bytes.
fn paged_slots(comps: &[&Arg<'_>], layout_dim: u64, p: u64) -> Result<u64> {
    let page = layout_dim.checked_mul(p).ok_or_else(|| bad(&comps[0].name, "page bytes overflow"))?;
    Ok(common_slots(comps, page)? * p)
}

/// A load of `layer_id` from a page_first / page_head host buffer (`kernel`).
fn paged_load(
    device: &Device,
    kind: PoolKind,
    layout: Layout,
    src: &[Arg<'_>],
    dst: &[Arg<'_>],
    hi: Indices<'_>,
    di: Indices<'_>,
    layer_id: i64,
    item_size: i64,
    src_layout_dim: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let item = launcher(hi, di, item_size)?;
    let (page, heads) = (positive("page_size", page_size)?, positive("head_num", head_num)?);
    let layers = layers_of("src_layout_dim", src_layout_dim, item)?;
    let layer_id = layer_index(layer_id)?;
    check_overlaps_kernel(src, dst)?;
    let dst_refs: Vec<&Arg<'_>> = dst.iter().collect();
    let src_refs: Vec<&Arg<'_>> = src.iter().collect();
    let dev = one_layer_device(device, kind, item, page, layers, &dst_refs)?;
    let slots = paged_slots(&src_refs, item * layers, page)?;
    let host = host_pool(&dev, layout, heads, Profile::Sglang, &src_refs, slots)?;
    run_all(vec![Call::new(dev, host, Op::Load { layer_id, is_draft: false }, IoBackend::Kernel, hi, di)?])
}

// ---- all-layer copies between layer lists ------------------------------------------------

/// sgl-kernel's first check of the all-layer `kernel` ops: the source layer table holds
/// `num_layers` entries (`mla`: the MLA ops' wording). Bindings that read their arguments
/// before calling an op make it first too, so that it keeps its place in sglang's order.
pub fn check_num_layers(mla: bool, num_layers: i64, table_len: usize) -> Result<()> {
    if num_layers != table_len as i64 {
        return Err(TransferError::NumLayersMismatch { which: if mla { "" } else { "k " }, num_layers, table_len });
    }
    Ok(())
}

/// `transfer_kv_all_layer`: every layer `j < num_layers`, `src_*_layers[j]` → `dst_*_layers[j]`
/// (layer_first both sides; sglang passes device tables of layer base pointers).
pub fn transfer_kv_all_layer<'i>(
    device: &Device,
    src_k_layers: &[RawTensor],
    dst_k_layers: &[RawTensor],
    src_v_layers: &[RawTensor],
    dst_v_layers: &[RawTensor],
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    num_layers: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer", src_indices, dst_indices);
    check_num_layers(false, num_layers, src_k_layers.len())?;
    let lists =
        [("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers), ("dst_k_layers", dst_k_layers), ("dst_v_layers", dst_v_layers)];
    layer_lists(device, PoolKind::Mha, &lists, IoBackend::Kernel, src_indices, dst_indices, Some(item_size))
}

/// `transfer_kv_all_layer_mla`: [`transfer_kv_all_layer`] with one buffer per layer.
pub fn transfer_kv_all_layer_mla<'i>(
    device: &Device,
    src_layers: &[RawTensor],
    dst_layers: &[RawTensor],
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    num_layers: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer_mla", src_indices, dst_indices);
    check_num_layers(true, num_layers, src_layers.len())?;
    let lists = [("src_layers", src_layers), ("dst_layers", dst_layers)];
    layer_lists(device, PoolKind::Mla, &lists, IoBackend::Kernel, src_indices, dst_indices, Some(item_size))
}

/// `transfer_kv_direct`: for every layer `j`, the coalesced runs of consecutive index pairs,
/// `src_layers[j]` → `dst_layers[j]` (rows along dimension 0). `page_size` only gates the
/// index count, as in sglang.
pub fn transfer_kv_direct(
    device: &Device,
    src_layers: &[RawTensor],
    dst_layers: &[RawTensor],
    src_indices: &[i64],
    dst_indices: &[i64],
    page_size: i64,
) -> Result<()> {
    if src_layers.len() != dst_layers.len() {
        return Err(TransferError::LayerListMismatch { src_len: src_layers.len(), dst_len: dst_layers.len() });
    }
    direct_counts(src_indices, dst_indices, page_size)?;
    let lists = [("src_layers", src_layers), ("dst_layers", dst_layers)];
    layer_lists(device, PoolKind::Mla, &lists, IoBackend::Direct, src_indices.into(), dst_indices.into(), None)
}

/// The checks of sglang's direct ops, in their order.
fn direct_counts(hi: &[i64], di: &[i64], page_size: i64) -> Result<()> {
    if hi.len() != di.len() {
        return Err(TransferError::LengthMismatch { src_len: hi.len(), dst_len: di.len() });
    }
    if page_size <= 0 {
        return Err(TransferError::PageSizeNotPositive);
    }
    if !(hi.len() as u64).is_multiple_of(page_size as u64) {
        return Err(TransferError::DirectCountNotPageMultiple { len: hi.len(), page_size: page_size as u64 });
    }
    Ok(())
}

/// Layer `j` of the source lists → layer `j` of the destination lists, one pool pair per layer
/// (`lists`: source components, then destination components).
fn layer_lists(
    device: &Device,
    kind: PoolKind,
    lists: &[(&str, &[RawTensor])],
    io: IoBackend,
    hi: Indices<'_>,
    di: Indices<'_>,
    item_size: Option<i64>,
) -> Result<()> {
    // `kernel`: sglang's item; `direct`: each layer's own row bytes.
    let item = match item_size {
        Some(size) => Some(launcher(hi, di, size)?),
        None => None,
    };
    let layers = lists[0].1.len();
    for (name, l) in lists {
        if l.len() != layers {
            return Err(bad(name, format!("has {} layers, the source has {layers}", l.len())));
        }
    }
    let comps = kind.components();
    let named: Vec<Vec<Arg<'_>>> =
        lists.iter().map(|(name, l)| l.iter().enumerate().map(|(j, t)| arg(format!("{name}[{j}]"), t)).collect()).collect();
    let (reads, writes): (Vec<&Vec<Arg<'_>>>, Vec<&Vec<Arg<'_>>>) = (named[..comps].iter().collect(), named[comps..].iter().collect());
    overlaps(
        &reads.iter().flat_map(|l| l.iter().cloned()).collect::<Vec<_>>(),
        &writes.iter().flat_map(|l| l.iter().cloned()).collect::<Vec<_>>(),
        io == IoBackend::Kernel,
    )?;
    if io == IoBackend::Direct {
        for j in 0..layers {
            for c in 0..comps {
                let (s, d) = (&reads[c][j], &writes[c][j]);
                if s.t.row_bytes() != d.t.row_bytes() {
                    return Err(bad(&d.name, format!("rows of {} bytes, the source's are {}", d.t.row_bytes(), s.t.row_bytes())));
                }
            }
        }
    }
    // Every layer is validated before the first one moves.
    let calls = (0..layers)
        .map(|j| {
            let src: Vec<&Arg<'_>> = reads.iter().map(|l| &l[j]).collect();
            let dst: Vec<&Arg<'_>> = writes.iter().map(|l| &l[j]).collect();
            let item = item.map_or_else(|| positive(&src[0].name, src[0].t.row_bytes() as i64), Ok)?;
            lf_pair(device, kind, item, &src, &dst, io, hi, di)
        })
        .collect::<Result<Vec<_>>>()?;
    run_all(calls)
}

// ---- all-layer backups into a layout -----------------------------------------------------

/// `transfer_kv_all_layer_lf_pf`: every layer of the source lists → its layer of a page_first
/// host buffer (`dst_layout_dim = num_layers × item_size`).
pub fn transfer_kv_all_layer_lf_pf<'i>(
    device: &Device,
    src_k_layers: &[RawTensor],
    dst_k: &RawTensor,
    src_v_layers: &[RawTensor],
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    dst_layout_dim: i64,
    num_layers: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer_lf_pf", src_indices, dst_indices);
    check_num_layers(false, num_layers, src_k_layers.len())?;
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    let src = [("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers)];
    layout_backup(device, PoolKind::Mha, Layout::PageFirst, &src, &dst, src_indices, dst_indices, item_size, dst_layout_dim, 1, 1)
}

/// `transfer_kv_all_layer_mla_lf_pf`: [`transfer_kv_all_layer_lf_pf`] with one buffer.
pub fn transfer_kv_all_layer_mla_lf_pf<'i>(
    device: &Device,
    src_layers: &[RawTensor],
    dst: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    dst_layout_dim: i64,
    num_layers: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer_mla_lf_pf", src_indices, dst_indices);
    check_num_layers(true, num_layers, src_layers.len())?;
    let d = [arg("dst", dst)];
    layout_backup(
        device,
        PoolKind::Mla,
        Layout::PageFirst,
        &[("src_layers", src_layers)],
        &d,
        src_indices,
        dst_indices,
        item_size,
        dst_layout_dim,
        1,
        1,
    )
}

/// `transfer_kv_all_layer_lf_ph`: every layer → its layer of a page_head host buffer.
pub fn transfer_kv_all_layer_lf_ph<'i>(
    device: &Device,
    src_k_layers: &[RawTensor],
    dst_k: &RawTensor,
    src_v_layers: &[RawTensor],
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    dst_layout_dim: i64,
    num_layers: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer_lf_ph", src_indices, dst_indices);
    check_num_layers(false, num_layers, src_k_layers.len())?;
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    let src = [("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers)];
    layout_backup(
        device,
        PoolKind::Mha,
        Layout::PageHead,
        &src,
        &dst,
        src_indices,
        dst_indices,
        item_size,
        dst_layout_dim,
        page_size,
        head_num,
    )
}

/// `transfer_kv_all_layer_lf_pfdhg`: every layer → its layer of a head-group-major
/// page_first_direct host buffer (`[pages][head_num][L][page_size][item / head_num]`,
/// `dst_layout_dim = num_layers × item_size`; `head_num` counts head groups). Empty index lists
/// are a no-op once the integers pass.
pub fn transfer_kv_all_layer_lf_pfdhg<'i>(
    device: &Device,
    src_k_layers: &[RawTensor],
    dst_k: &RawTensor,
    src_v_layers: &[RawTensor],
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    item_size: i64,
    dst_layout_dim: i64,
    num_layers: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_all_layer_lf_pfdhg", src_indices, dst_indices);
    check_num_layers(false, num_layers, src_k_layers.len())?;
    head_group_args(item_size, "dst_layout_dim", dst_layout_dim, page_size, head_num)?;
    launcher(src_indices, dst_indices, item_size)?;
    if src_indices.is_empty() {
        return earlier_reports(device);
    }
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    let src = [("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers)];
    layout_backup(
        device,
        PoolKind::Mha,
        Layout::PageFirstDirectHeadGroups,
        &src,
        &dst,
        src_indices,
        dst_indices,
        item_size,
        dst_layout_dim,
        page_size,
        head_num,
    )
}

/// An all-layer backup of layer lists into a page_first / page_head host buffer (`kernel`).
fn layout_backup(
    device: &Device,
    kind: PoolKind,
    layout: Layout,
    src: &[(&str, &[RawTensor])],
    dst: &[Arg<'_>],
    hi: Indices<'_>,
    di: Indices<'_>,
    item_size: i64,
    dst_layout_dim: i64,
    page_size: i64,
    head_num: i64,
) -> Result<()> {
    let item = launcher(hi, di, item_size)?;
    let (page, heads) = (positive("page_size", page_size)?, positive("head_num", head_num)?);
    let layers = layers_of("dst_layout_dim", dst_layout_dim, item)?;
    let named = named_lists(src, layers)?;
    check_overlaps(&named.iter().flatten().cloned().collect::<Vec<_>>(), dst)?;
    let dev = device_pool(device, kind, item, page, &named.iter().map(|l| l.iter().collect()).collect::<Vec<_>>())?;
    let dst_refs: Vec<&Arg<'_>> = dst.iter().collect();
    let slots = paged_slots(&dst_refs, item * layers, page)?;
    let host = host_pool(&dev, layout, heads, Profile::Sglang, &dst_refs, slots)?;
    let (h, d) = backup_lists(hi, di);
    run_all(vec![Call::new(dev, host, Op::Backup, IoBackend::Kernel, h, d)?])
}

/// A backup's (host, device) index lists from the op's (src = device, dst = host) lists.
fn backup_lists<T>(src_indices: T, dst_indices: T) -> (T, T) {
    (dst_indices, src_indices)
}

/// Source layer lists with their names; each must hold `layers` tensors (sglang's layout_dim
/// says how many layers the host buffer has).
fn named_lists<'a>(lists: &[(&str, &'a [RawTensor])], layers: u64) -> Result<Vec<Vec<Arg<'a>>>> {
    lists
        .iter()
        .map(|(name, l)| {
            if l.len() as u64 != layers {
                return Err(bad(name, format!("has {} layers, the layout dimension holds {layers}", l.len())));
            }
            Ok(l.iter().enumerate().map(|(j, t)| arg(format!("{name}[{j}]"), t)).collect())
        })
        .collect()
}

// ---- page_first_direct -------------------------------------------------------------------

/// A page_first_direct host buffer's geometry from its shape `[pages][L][P][...]`:
/// `(layers, token slots, bytes per token)`.
fn pfd_shape(a: &Arg<'_>, page_size: u64) -> Result<(u64, u64, u64)> {
    let d = a.t.dims();
    if d.len() < 3 || d[2] != page_size || d[..3].contains(&0) {
        return Err(bad(&a.name, format!("shape {d:?} is not [pages, layers, page_size = {page_size}, ...]")));
    }
    let tokens = d[0].checked_mul(d[1]).and_then(|x| x.checked_mul(d[2])).ok_or_else(|| bad(&a.name, "shape overflows"))?;
    if !a.t.len.is_multiple_of(tokens) {
        return Err(bad(&a.name, format!("{} bytes are not whole tokens of shape {d:?}", a.t.len)));
    }
    Ok((d[1], d[0] * d[2], a.t.len / tokens))
}

/// Splits sglang's direct pointer list `[K layers…, V layers…]` (or one MLA list) into
/// components; `mla` is decided from the other list's length, as sglang does.
fn split_layers<'a>(name: &str, list: &'a [RawTensor], mla: bool) -> Result<Vec<Vec<Arg<'a>>>> {
    let comps = if mla { 1 } else { 2 };
    if list.is_empty() || !list.len().is_multiple_of(comps) {
        return Err(bad(name, format!("{} tensors do not split into {comps} equal component lists", list.len())));
    }
    let n = list.len() / comps;
    Ok((0..comps).map(|c| (0..n).map(|j| arg(format!("{name}[{}]", c * n + j), &list[c * n + j])).collect()).collect())
}

/// The page_first_direct components: one (MLA) or two (MHA) host tensors of one shape.
fn pfd_host<'a>(name: &str, list: &'a [RawTensor], page: u64) -> Result<(Vec<Arg<'a>>, (u64, u64, u64))> {
    if list.is_empty() || list.len() > 2 {
        return Err(bad(name, format!("expected 1 (MLA) or 2 (K, V) page_first_direct buffers, got {}", list.len())));
    }
    let args: Vec<Arg<'a>> = list.iter().enumerate().map(|(i, t)| arg(format!("{name}[{i}]"), t)).collect();
    let shape = pfd_shape(&args[0], page)?;
    for a in &args[1..] {
        if pfd_shape(a, page)? != shape {
            return Err(bad(&a.name, format!("shape {:?} differs from {}'s", a.t.dims(), args[0].name)));
        }
    }
    Ok((args, shape))
}

/// The arguments of a page_first_direct op, checked in sglang's order (the counts first), then
/// ours: the host buffers' shape, the device layer list split into components with rows of one
/// host token, and no destination overlapping another argument.
struct Pfd<'a> {
    host: Vec<Arg<'a>>,
    /// Device layers `[component][layer]`.
    dev: Vec<Vec<Arg<'a>>>,
    /// Host layers, token slots and bytes per token.
    layers: u64,
    slots: u64,
    item: u64,
    page: u64,
    kind: PoolKind,
}

impl<'a> Pfd<'a> {
    /// `host_is_dst`: the op writes the host buffers (a backup) rather than the device layers.
    fn new(
        host: (&str, &'a [RawTensor]),
        dev: (&str, &'a [RawTensor]),
        src_indices: &[i64],
        dst_indices: &[i64],
        page_size: i64,
        host_is_dst: bool,
    ) -> Result<Pfd<'a>> {
        direct_counts(src_indices, dst_indices, page_size)?;
        let page = page_size as u64;
        let (host_args, (layers, slots, item)) = pfd_host(host.0, host.1, page)?;
        let dev_lists = split_layers(dev.0, dev.1, host_args.len() == 1)?;
        check_rows(&dev_lists, item)?;
        let dev_flat: Vec<Arg<'a>> = dev_lists.iter().flatten().cloned().collect();
        if host_is_dst {
            check_overlaps(&dev_flat, &host_args)?;
        } else {
            check_overlaps(&host_args, &dev_flat)?;
        }
        let kind = if host_args.len() == 1 { PoolKind::Mla } else { PoolKind::Mha };
        Ok(Pfd { host: host_args, dev: dev_lists, layers, slots, item, page, kind })
    }

    /// Device layers per component.
    fn dev_layers(&self) -> usize {
        self.dev[0].len()
    }

    /// Device layer `j` of every component.
    fn dev_layer(&self, j: usize) -> Vec<&Arg<'a>> {
        self.dev.iter().map(|l| &l[j]).collect()
    }

    /// The host pool over these buffers for `dev`.
    fn host_pool(&self, dev: &DevicePool, profile: Profile) -> Result<HostPool<'static>> {
        host_pool(dev, Layout::PageFirstDirect, 1, profile, &self.host.iter().collect::<Vec<_>>(), self.slots)
    }
}

/// `transfer_kv_per_layer_direct_pf_lf`: layer `layer_id + j` of a page_first_direct host buffer
/// → device layer `j` (`src_ptrs`: `[K]` or `[K, V]` host buffers `[pages][L][P][...]`;
/// `dst_ptrs`: the device layers, K then V). Whole pages only; page-aligned indices.
pub fn transfer_kv_per_layer_direct_pf_lf(
    device: &Device,
    src_ptrs: &[RawTensor],
    dst_ptrs: &[RawTensor],
    src_indices: &[i64],
    dst_indices: &[i64],
    layer_id: i64,
    page_size: i64,
) -> Result<()> {
    let a = Pfd::new(("src_ptrs", src_ptrs), ("dst_ptrs", dst_ptrs), src_indices, dst_indices, page_size, false)?;
    let layer_id = layer_index(layer_id)?;
    // Device layer j is host layer layer_id + j: one call per device layer, each validated first.
    let calls = (0..a.dev_layers())
        .map(|j| {
            let dev = one_layer_device(device, a.kind, a.item, a.page, a.layers, &a.dev_layer(j))?;
            let host = a.host_pool(&dev, Profile::Sglang)?;
            Call::new(
                dev,
                host,
                Op::Load { layer_id: layer_id + j, is_draft: false },
                IoBackend::Direct,
                src_indices.into(),
                dst_indices.into(),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    run_all(calls)
}

/// `transfer_kv_all_layer_direct_lf_pf`: every device layer → its layer of a page_first_direct
/// host buffer (`src_ptrs`: K layers then V layers, or the MLA layers; `dst_ptrs`: `[K]` or
/// `[K, V]` host buffers `[pages][L][P][...]`).
pub fn transfer_kv_all_layer_direct_lf_pf(
    device: &Device,
    src_ptrs: &[RawTensor],
    dst_ptrs: &[RawTensor],
    src_indices: &[i64],
    dst_indices: &[i64],
    page_size: i64,
) -> Result<()> {
    let a = Pfd::new(("dst_ptrs", dst_ptrs), ("src_ptrs", src_ptrs), src_indices, dst_indices, page_size, true)?;
    if a.dev_layers() as u64 != a.layers {
        return Err(bad("src_ptrs", format!("{} layers per component, the host buffers hold {}", a.dev_layers(), a.layers)));
    }
    let dev = device_pool(device, a.kind, a.item, a.page, &a.dev.iter().map(|l| l.iter().collect()).collect::<Vec<_>>())?;
    let host = a.host_pool(&dev, Profile::Sglang)?;
    let (hi, di) = backup_lists(src_indices, dst_indices);
    run_all(vec![Call::new(dev, host, Op::Backup, IoBackend::Direct, hi.into(), di.into())?])
}

fn check_rows(lists: &[Vec<Arg<'_>>], item: u64) -> Result<()> {
    for a in lists.iter().flatten() {
        if a.t.row_bytes() != item {
            return Err(bad(&a.name, format!("rows of {} bytes, the host's tokens are {item}", a.t.row_bytes())));
        }
    }
    Ok(())
}

// ---- what sglang lacks: one-layer backups into page_first / page_first_direct ------------

/// One device layer → layer `layer_id` of a page_first host buffer (`dst_layout_dim =
/// L × item_size`). sglang has no such op ("without a per-layer LF->PF kernel"); profile
/// `extended`.
pub fn transfer_kv_per_layer_lf_pf<'i>(
    device: &Device,
    src_k: &RawTensor,
    dst_k: &RawTensor,
    src_v: &RawTensor,
    dst_v: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    dst_layout_dim: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_lf_pf", src_indices, dst_indices);
    let src = kv(src_k, src_v, "src_k", "src_v");
    let dst = kv(dst_k, dst_v, "dst_k", "dst_v");
    layer_backup(device, PoolKind::Mha, &src, &dst, src_indices, dst_indices, layer_id, item_size, dst_layout_dim)
}

/// [`transfer_kv_per_layer_lf_pf`] with one buffer (MLA, and the DSA indexer with page items).
pub fn transfer_kv_per_layer_mla_lf_pf<'i>(
    device: &Device,
    src: &RawTensor,
    dst: &RawTensor,
    src_indices: impl Into<Indices<'i>>,
    dst_indices: impl Into<Indices<'i>>,
    layer_id: i64,
    item_size: i64,
    dst_layout_dim: i64,
) -> Result<()> {
    let (src_indices, dst_indices) = op_lists("transfer_kv_per_layer_mla_lf_pf", src_indices, dst_indices);
    let (s, d) = ([arg("src", src)], [arg("dst", dst)]);
    layer_backup(device, PoolKind::Mla, &s, &d, src_indices, dst_indices, layer_id, item_size, dst_layout_dim)
}

fn layer_backup(
    device: &Device,
    kind: PoolKind,
    src: &[Arg<'_>],
    dst: &[Arg<'_>],
    hi: Indices<'_>,
    di: Indices<'_>,
    layer_id: i64,
    item_size: i64,
    dst_layout_dim: i64,
) -> Result<()> {
    let item = launcher(hi, di, item_size)?;
    let layers = layers_of("dst_layout_dim", dst_layout_dim, item)?;
    let layer_id = layer_index(layer_id)?;
    check_overlaps_kernel(src, dst)?;
    let dev = one_layer_device(device, kind, item, 1, layers, &src.iter().collect::<Vec<_>>())?;
    let dst_refs: Vec<&Arg<'_>> = dst.iter().collect();
    let slots = paged_slots(&dst_refs, item * layers, 1)?;
    let host = host_pool(&dev, Layout::PageFirst, 1, Profile::Extended, &dst_refs, slots)?;
    let (h, d) = backup_lists(hi, di);
    run_all(vec![Call::new(dev, host, Op::BackupLayer { layer_id, is_draft: false }, IoBackend::Kernel, h, d)?])
}

/// One device layer → layer `layer_id` of a page_first_direct host buffer, whole pages
/// (`src_ptrs`: `[K, V]` or `[C]` device layer; `dst_ptrs`: `[K, V]` or `[C]` host buffers
/// `[pages][L][P][...]`). sglang only backs up all layers this way; profile `extended`.
pub fn transfer_kv_per_layer_direct_lf_pf(
    device: &Device,
    src_ptrs: &[RawTensor],
    dst_ptrs: &[RawTensor],
    src_indices: &[i64],
    dst_indices: &[i64],
    layer_id: i64,
    page_size: i64,
) -> Result<()> {
    let a = Pfd::new(("dst_ptrs", dst_ptrs), ("src_ptrs", src_ptrs), src_indices, dst_indices, page_size, true)?;
    if a.dev_layers() != 1 {
        return Err(bad("src_ptrs", format!("one device layer per component expected, got {}", a.dev_layers())));
    }
    let layer_id = layer_index(layer_id)?;
    let dev = one_layer_device(device, a.kind, a.item, a.page, a.layers, &a.dev_layer(0))?;
    let host = a.host_pool(&dev, Profile::Extended)?;
    let (hi, di) = backup_lists(src_indices, dst_indices);
    run_all(vec![Call::new(dev, host, Op::BackupLayer { layer_id, is_draft: false }, IoBackend::Direct, hi.into(), di.into())?])
}

// ---- whole rows: embedding ranges ----------------------------------------------------------

/// `transfer_embedding_ranges_direct`: for each range `k`, rows
/// `src[src_starts[k] .. src_starts[k] + lengths[k]]` → rows
/// `dst[dst_starts[k] .. dst_starts[k] + lengths[k]]` (rows along dimension 0, of equal bytes in
/// both tensors; any memory pair the executor moves). Copy engine only: one copy per range (or
/// per run of adjacent ranges). Beyond sglang: ranges must lie inside their tensors and
/// destination ranges must not overlap; nothing moves unless every range passes.
pub fn transfer_embedding_ranges_direct(
    device: &Device,
    src: &RawTensor,
    dst: &RawTensor,
    src_starts: &[i64],
    dst_starts: &[i64],
    lengths: &[i64],
) -> Result<()> {
    let argument = |arg: &'static str, value: i64, message: String| TransferError::BadArgument { arg, value, message };
    if src_starts.len() != lengths.len() || dst_starts.len() != lengths.len() {
        return Err(argument(
            "lengths",
            lengths.len() as i64,
            format!(
                "src_starts, dst_starts and lengths must have the same number of ranges, got {}, {} and {}",
                src_starts.len(),
                dst_starts.len(),
                lengths.len()
            ),
        ));
    }
    if lengths.iter().all(|&n| n == 0) && src_starts.iter().chain(dst_starts).all(|&v| v >= 0) {
        return Ok(());
    }
    let (s, d) = (arg("src", src), arg("dst", dst));
    if src.row_bytes() != dst.row_bytes() {
        return Err(bad("dst", format!("rows of {} bytes, src's are {}", dst.row_bytes(), src.row_bytes())));
    }
    let rows = |t: &RawTensor| t.dims().first().copied().unwrap_or(1);
    let mut total: u64 = 0;
    for (k, ((&ss, &ds), &n)) in src_starts.iter().zip(dst_starts).zip(lengths).enumerate() {
        for (name, v) in [("src_starts", ss), ("dst_starts", ds), ("lengths", n)] {
            if v < 0 {
                return Err(argument(name, v, format!("{name}[{k}] must not be negative, got {v}")));
            }
        }
        for (side, start, t) in [("source", ss, src), ("destination", ds, dst)] {
            let end = (start as u64).saturating_add(n as u64);
            if n > 0 && end > rows(t) {
                let bound = rows(t);
                let last = i64::try_from(end - 1).unwrap_or(i64::MAX);
                return Err(TransferError::IndexOutOfRange { side, index: last, position: k, bound, unit: "rows" });
            }
        }
        total = total.saturating_add(n as u64);
    }
    if total == 0 {
        return Ok(());
    }
    if total > MAX_ROWS {
        return Err(argument("lengths", total.min(i64::MAX as u64) as i64, format!("{total} rows in one call, at most {MAX_ROWS}")));
    }
    check_overlaps(std::slice::from_ref(&s), std::slice::from_ref(&d))?;
    // The ranges as row index pairs: the direct planner coalesces each range into one copy and
    // checks that no destination row is written twice.
    let (mut hi, mut di) = (Vec::new(), Vec::new());
    for v in [&mut hi, &mut di] {
        v.try_reserve_exact(total as usize).map_err(|_| TransferError::OutOfMemory {
            what: "embedding range row lists".into(),
            requested: total.saturating_mul(16),
            limit: "allocation failed".into(),
        })?;
    }
    for ((&ss, &ds), &n) in src_starts.iter().zip(dst_starts).zip(lengths) {
        hi.extend(ss..ss + n);
        di.extend(ds..ds + n);
    }
    let item = positive("src", src.row_bytes() as i64)?;
    let call = lf_pair(device, PoolKind::Mla, item, &[&s], &[&d], IoBackend::Direct, Indices::Host(&hi), Indices::Host(&di))?;
    run_all(vec![call])
}

/// Rows one embedding-range call may move (the row lists are made on the host).
pub const MAX_ROWS: u64 = 1 << 28;

// ---- rows inside the device pool: copy_all_layer_kv_cache ----------------------------------

/// sglang's `copy_all_layer_kv_cache_cpu`: in every buffer `b` (normally the 2·L K and V
/// layers), row `tgt_loc[i]` becomes what row `src_loc[i]` held before the call (rows of
/// `row_bytes[b]` bytes; the sources are all read before any target is written, so overlapping
/// and permuted moves behave as one simultaneous assignment). Host memory, on the calling
/// thread. Beyond sglang: every location must be a row inside its buffer (as large as the caller
/// describes it: sglang's address tables carry no sizes, so the Python binding sizes each buffer
/// by the largest location) and no target may appear twice; nothing moves unless all pass.
pub fn copy_all_layer_kv_cache(buffers: &[RawTensor], row_bytes: &[u64], tgt_loc: &[i64], src_loc: &[i64]) -> Result<()> {
    if buffers.len() != row_bytes.len() {
        return Err(TransferError::LayerListMismatch { src_len: buffers.len(), dst_len: row_bytes.len() });
    }
    if tgt_loc.len() != src_loc.len() {
        return Err(TransferError::LengthMismatch { src_len: src_loc.len(), dst_len: tgt_loc.len() });
    }
    for (b, (t, &row)) in buffers.iter().zip(row_bytes).enumerate() {
        let name = format!("data_ptrs[{b}]");
        if t.memory != Memory::Host {
            return Err(bad(&name, "must be host memory"));
        }
        if t.addr == 0 && t.len > 0 {
            return Err(bad(&name, "null data pointer"));
        }
        if t.addr.checked_add(t.len).is_none() {
            return Err(bad(&name, "address range wraps"));
        }
        if row == 0 {
            continue;
        }
        let rows = t.len / row;
        for (side, list) in [("source", src_loc), ("destination", tgt_loc)] {
            if let Some(position) = list.iter().position(|&x| x < 0 || x as u64 >= rows) {
                return Err(TransferError::IndexOutOfRange { side, index: list[position], position, bound: rows, unit: "rows" });
            }
        }
    }
    let mut seen = std::collections::HashMap::with_capacity(tgt_loc.len());
    for (i, &t) in tgt_loc.iter().enumerate() {
        if let Some(first) = seen.insert(t, i) {
            return Err(TransferError::DuplicateDestination { side: "destination", unit: "rows", index: t, first, second: i });
        }
    }
    let widest = row_bytes.iter().copied().max().unwrap_or(0);
    let stage_len = widest.checked_mul(src_loc.len() as u64).and_then(|n| usize::try_from(n).ok()).ok_or_else(|| {
        TransferError::OutOfMemory { what: "copy_all_layer_kv_cache staging".into(), requested: u64::MAX, limit: "size overflows".into() }
    })?;
    let mut stage: Vec<u8> = Vec::new();
    stage.try_reserve_exact(stage_len).map_err(|_| TransferError::OutOfMemory {
        what: "copy_all_layer_kv_cache staging".into(),
        requested: stage_len as u64,
        limit: "allocation failed".into(),
    })?;
    stage.resize(stage_len, 0);
    for (t, &row) in buffers.iter().zip(row_bytes) {
        let row = row as usize;
        if row == 0 || src_loc.is_empty() {
            continue;
        }
        let base = t.addr as *mut u8;
        // SAFETY: every location was checked to be a whole row inside `t`, whose span the
        // caller of `RawTensor::new` vouches for; `stage` is our own allocation.
        unsafe {
            for (i, &s) in src_loc.iter().enumerate() {
                std::ptr::copy_nonoverlapping(base.add(s as usize * row), stage.as_mut_ptr().add(i * row), row);
            }
            for (i, &d) in tgt_loc.iter().enumerate() {
                std::ptr::copy_nonoverlapping(stage.as_ptr().add(i * row), base.add(d as usize * row), row);
            }
        }
    }
    Ok(())
}
