//! A host tier for an engine's block tensors (vLLM's offloading): the engine keeps its KV cache
//! as tensors of `rows` blocks, one block `stride` bytes apart, of which the first `row_bytes`
//! are data (the rest padding); the tier keeps host rows of `row_bytes` in host pools of its own
//! executor, one pool per engine tensor, with item checksums.
//!
//! Stores and loads are pool calls like every other op (one validation table): a tensor is wrapped
//! as a one-layer device pool of `rows` one-token pages padded to `stride`, paired with the
//! tensor's host pool (layer_first, `host_rows` rows). A store (a backup) records each row's
//! checksum inside its copy; a load verifies each row inside its copy and answers
//! [`TransferError::Integrity`] naming every row that no longer matches, after the call's other
//! rows landed. Nothing moves unless every tensor's call is accepted.

use super::tensors::{arg, check_overlaps, wrap, Arg};
use super::{Memory, RawTensor};
use crate::error::{Result, TransferError};
use crate::exec::Device;
use crate::geometry::{DeviceGeometry, IoBackend, LayerMap, PagePadding, PoolKind};
use crate::integrity::ItemMismatch;
use crate::plan::{Op, Request};
use crate::pool::{DevicePool, HostPool, HostPoolConfig};
use crate::Layout;
use crate::Profile;

/// The shape of one engine tensor: `rows` blocks, `stride` bytes apart, `row_bytes` of data each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockShape {
    /// Data bytes of a block (vLLM's un-padded page size).
    pub row_bytes: u64,
    /// Bytes from one block to the next in the tensor (its padded page size).
    pub stride: u64,
    /// Blocks in the tensor.
    pub rows: u64,
}

struct TierTensor {
    shape: BlockShape,
    geometry: DeviceGeometry,
    host: HostPool<'static>,
}

/// Host rows for each of an engine's block tensors, on one executor (see the module docs).
pub struct BlockTier {
    device: Device,
    host_rows: u64,
    tensors: Vec<TierTensor>,
}

/// Which direction a call moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockMove {
    /// Engine blocks to host rows (recording each row's checksum).
    Store,
    /// Host rows to engine blocks (verifying each row's checksum).
    Load,
}

impl BlockTier {
    /// A tier of `host_rows` rows for each tensor of `tensors` (the engine's, as they will be
    /// passed to [`BlockTier::run`]) on `device`, zero-initialised.
    pub fn new(device: &Device, tensors: &[(BlockShape, RawTensor)], host_rows: u64) -> Result<BlockTier> {
        if host_rows == 0 {
            return Err(TransferError::InvalidConfig("a block tier needs at least one host row".into()));
        }
        let mut out = Vec::with_capacity(tensors.len());
        for (j, (shape, raw)) in tensors.iter().enumerate() {
            let geometry = geometry_of(j, shape)?;
            let pool = device_pool(device, &geometry, shape, j, raw)?;
            let config = HostPoolConfig {
                layout: Layout::LayerFirst,
                // sglang's rounding makes `size + 1` rows of one-token pages.
                size: host_rows - 1,
                head_num: 1,
                profile: Profile::Extended,
                integrity: Some(true),
            };
            let host = HostPool::new(&pool, &config)?;
            out.push(TierTensor { shape: *shape, geometry, host });
        }
        Ok(BlockTier { device: device.clone(), host_rows, tensors: out })
    }

    /// The executor the tier's host rows live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Host rows per tensor.
    pub fn host_rows(&self) -> u64 {
        self.host_rows
    }

    /// The shape of each tensor, in tier order.
    pub fn shapes(&self) -> Vec<BlockShape> {
        self.tensors.iter().map(|t| t.shape).collect()
    }

    /// Moves, for each `(j, tensor)` of `calls`, block `blocks[i]` of `tensor` (tier tensor `j`)
    /// and host row `rows[i]` in direction `dir`. Every call is validated before any byte moves
    /// (lengths, ranges, duplicate destinations, the tensor's size and memory; a negative index
    /// skips its pair, as in sglang's ops); a load whose rows
    /// fail their checksums lands the other rows and answers one [`TransferError::Integrity`]
    /// for the whole move, each mismatch's `layer` being the tier tensor `j`.
    pub fn run(&mut self, dir: BlockMove, calls: &[(usize, RawTensor)], blocks: &[i64], rows: &[i64]) -> Result<()> {
        let op = match dir {
            BlockMove::Store => Op::Backup,
            BlockMove::Load => Op::Load { layer_id: 0, is_draft: false },
        };
        if dir == BlockMove::Load {
            // Two tensors sharing bytes would both be written, in an order executors differ on.
            let writes: Vec<Arg<'_>> = calls.iter().map(|(j, raw)| arg(format!("tensor[{j}]"), raw)).collect();
            check_overlaps(&[], &writes)?;
        }
        let mut planned = Vec::with_capacity(calls.len());
        let mut seen = vec![false; self.tensors.len()];
        for (j, raw) in calls {
            let t = self.tensor(*j)?;
            // Two calls on one tensor would write its rows twice, in an order executors differ on.
            if std::mem::replace(&mut seen[*j], true) {
                return Err(TransferError::BadArgument {
                    arg: "tensor",
                    value: *j as i64,
                    message: format!("tier tensor {j} is named twice in one move"),
                });
            }
            let pool = device_pool(&self.device, &t.geometry, &t.shape, *j, raw)?;
            let plan = t.host.plan(&pool, &Request { op, io_backend: IoBackend::Kernel, host_indices: rows, device_indices: blocks })?;
            planned.push((*j, pool, plan));
        }
        let mut mismatches: Vec<ItemMismatch> = Vec::new();
        let total = planned.len();
        for (k, (j, mut pool, plan)) in planned.into_iter().enumerate() {
            let host = &mut self.tensors[j].host;
            let r = match dir {
                BlockMove::Store => host.execute_backup(&pool, &plan),
                BlockMove::Load => host.execute_load(&mut pool, &plan),
            };
            match r {
                Ok(()) => {}
                Err(TransferError::Integrity { items, .. }) => {
                    mismatches.extend(items.into_iter().map(|m| ItemMismatch { layer: j as u64, ..m }));
                }
                Err(e) if k == 0 => return Err(e),
                Err(e) => return Err(TransferError::partial(k, total, Vec::new(), e)),
            }
        }
        crate::integrity::mismatch_error(mismatches).map_or(Ok(()), Err)
    }

    /// The rows of earlier loads that failed their checksums, as one [`TransferError::Integrity`]
    /// (each mismatch's `layer` is 0: the executor reports them per call, not per tensor), without
    /// waiting. Only cuda has any: its moves return once enqueued, before their checksums are
    /// verified; other executors report them from [`BlockTier::run`].
    pub fn integrity_reports(&self) -> Result<()> {
        self.device.integrity_reports()
    }

    /// Waits for every queued move, then reports as [`BlockTier::integrity_reports`] does.
    pub fn synchronize(&self) -> Result<()> {
        self.device.synchronize()
    }

    /// A copy of tensor `j`'s host rows, `host_rows × row_bytes` bytes (row after row), once
    /// queued moves are done.
    pub fn read_rows(&self, j: usize) -> Result<Vec<u8>> {
        let t = self.tensor(j)?;
        // Host rows are `stride` apart, as the engine's blocks are (the last one unpadded).
        let buf = t.host.read_buffer(0)?;
        let (row, stride) = (t.shape.row_bytes as usize, t.shape.stride as usize);
        Ok((0..self.host_rows as usize).flat_map(|r| &buf[r * stride..r * stride + row]).copied().collect())
    }

    /// Fault injection: writes `bytes` into host row `row` of tensor `j` at byte `offset` of the
    /// row without touching its checksum, as a fault in host memory would.
    pub fn inject_host_corruption(&mut self, j: usize, row: u64, offset: u64, bytes: &[u8]) -> Result<()> {
        let host_rows = self.host_rows;
        self.tensor(j)?;
        let t = &mut self.tensors[j];
        let end = offset.checked_add(bytes.len() as u64);
        if row >= host_rows || end.is_none_or(|e| e > t.shape.row_bytes) {
            return Err(TransferError::BadArgument {
                arg: "row",
                value: row as i64,
                message: format!("{} bytes at {offset} are outside the tier's rows", bytes.len()),
            });
        }
        t.host.inject_host_corruption(0, row * t.shape.stride + offset, bytes)
    }

    fn tensor(&self, j: usize) -> Result<&TierTensor> {
        self.tensors.get(j).ok_or(TransferError::BadArgument {
            arg: "tensor",
            value: j as i64,
            message: format!("the tier has {} tensors", self.tensors.len()),
        })
    }
}

fn geometry_of(j: usize, s: &BlockShape) -> Result<DeviceGeometry> {
    let bad = |message: String| TransferError::BadArgument { arg: "shape", value: j as i64, message };
    if s.row_bytes == 0 || s.rows == 0 {
        return Err(bad(format!("tensor {j}: {} rows of {} bytes hold nothing", s.rows, s.row_bytes)));
    }
    if s.stride < s.row_bytes {
        return Err(bad(format!("tensor {j}: stride {} is less than its {} row bytes (rows would overlap)", s.stride, s.row_bytes)));
    }
    DeviceGeometry::new(PoolKind::Mla, s.row_bytes, s.rows, 1, LayerMap::new(1))?
        .with_padding(PagePadding { page_bytes: s.stride, offset: 0 })
}

fn device_pool(device: &Device, geometry: &DeviceGeometry, shape: &BlockShape, j: usize, raw: &RawTensor) -> Result<DevicePool<'static>> {
    if raw.memory == Memory::Host && device.name() == "cuda" {
        // The engine's blocks live on the device the tier's executor runs; host tensors there
        // would be read through the driver's mapping, which is not what a tier is for.
        return Err(TransferError::BadTensor { arg: format!("tensor[{j}]"), reason: "a cuda tier moves device memory".into() });
    }
    let name = format!("tensor[{j}]");
    // Exactly the registered blocks: a larger tensor would be another tensor's memory.
    let want = crate::geometry::mul(shape.rows, shape.stride, "block tensor bytes (rows × stride)")?;
    if raw.len != want {
        return Err(TransferError::BadTensor {
            arg: name,
            reason: format!("{} bytes, but the tier's tensor {j} is {want} ({} blocks of {})", raw.len, shape.rows, shape.stride),
        });
    }
    let buffer = wrap(device, &Arg { name, t: raw })?;
    DevicePool::wrap_geometry(device, geometry.clone(), vec![vec![buffer]])
}
