//! A host tier for an engine's block tensors (vLLM's offloading): the engine keeps its KV cache
//! as tensors of `rows` blocks, one block `stride` bytes apart, of which the first `row_bytes`
//! are data (the rest padding, or other views' bytes); the tier keeps host rows of `row_bytes`,
//! packed, in host pools of its own executor, one pool per engine tensor, with item checksums.
//!
//! Its own room, beside `kvcacheio` (sglang's ops): the engine block tiers (vLLM's offloading).
//!
//! Stores and loads are pool calls like every other op (one validation table): a tensor is wrapped
//! as a one-layer device pool of `rows` one-token pages padded to `stride`, paired with the
//! tensor's host pool (layer_first, `host_rows` rows). A store (a backup) records each row's
//! checksum inside its copy; a load verifies each row inside its copy and answers
//! [`TransferError::Integrity`] naming every row that no longer matches, after the call's other
//! rows landed. Nothing moves unless every tensor's call is accepted.

use crate::error::{Result, TransferError};
use crate::exec::caller::{Memory, RawTensor};
use crate::exec::Device;
use crate::geometry::{DeviceGeometry, IoBackend, LayerMap, PagePadding, PoolKind};
use crate::integrity::ItemMismatch;
use crate::plan::{Op, Request};
use crate::pool::{DevicePool, HostPool, HostPoolConfig};
use crate::Layout;
use crate::Profile;

/// The shape of one engine tensor: `rows` blocks, `stride` bytes apart, `row_bytes` of data each.
/// Its memory is `rows × stride` bytes, or as little as ends with the last block's data (a
/// strided view whose blocks are narrower than their stride); only data bytes are read or written.
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

/// Host rows the caller owns, for [`BlockTier::over_host`] (whose safety contract the region
/// must meet): `region` holds `rows × row_stride` bytes or more, row `r` of tier tensor `j` being the `row_bytes` of that tensor at
/// `r × row_stride + offsets[j]` (each tensor's rows interleaved with the others', as in a region
/// other processes share chunk by chunk).
#[derive(Debug, Clone)]
pub struct HostRows {
    /// The caller's host memory (host memory registered with the driver on cuda).
    pub region: RawTensor,
    /// Bytes from one host row to the next.
    pub row_stride: u64,
    /// Where each tier tensor's bytes start inside a row.
    pub offsets: Vec<u64>,
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
        // Rows packed: a block's padding (or the other views between a strided view's blocks)
        // is not the tier's to keep.
        BlockTier::build(device, tensors, host_rows, |_, pool, config| HostPool::new_padded(pool, config, None))
    }

    /// A tier of `host_rows` rows for each tensor of `tensors`, as [`BlockTier::new`], whose
    /// rows are the caller's memory laid out as `host` says, not zeroed and not owned: row
    /// checksums are the tier's own until [`BlockTier::set_row_checksums`] takes them from
    /// wherever the caller keeps them. Refused before anything is wrapped: a region that is not
    /// host memory or is too small for `host_rows` rows, an offset count other than the tensor
    /// count, a tensor's bytes leaving the row, or two tensors' bytes overlapping.
    ///
    /// # Safety
    /// `host.region` must stay valid for reads and writes for as long as the tier lives (not only
    /// during one move, as [`RawTensor::new`] asks), and nothing else may write a row while a
    /// move of the tier reads or writes it.
    pub unsafe fn over_host(device: &Device, tensors: &[(BlockShape, RawTensor)], host_rows: u64, host: &HostRows) -> Result<BlockTier> {
        if host_rows == 0 {
            return Err(TransferError::InvalidConfig("a block tier needs at least one host row".into()));
        }
        if host.region.memory != Memory::Host {
            return Err(TransferError::BadTensor { arg: "host".into(), reason: "the tier's rows are host memory".into() });
        }
        let bad = |value: i64, message: String| TransferError::BadArgument { arg: "host", value, message };
        if host.offsets.len() != tensors.len() {
            return Err(bad(host.offsets.len() as i64, format!("{} row offsets for {} tensors", host.offsets.len(), tensors.len())));
        }
        let need = crate::geometry::mul(host_rows, host.row_stride, "host region bytes (rows × row stride)")?;
        if host.region.len < need {
            return Err(TransferError::BufferSize { what: "host region".into(), expected: need, actual: host.region.len });
        }
        let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(tensors.len());
        for (j, ((shape, _), &offset)) in tensors.iter().zip(&host.offsets).enumerate() {
            let end = crate::geometry::add(offset, shape.row_bytes, "row offset + row bytes")?;
            if end > host.row_stride {
                return Err(bad(
                    j as i64,
                    format!("tensor {j}: {} bytes at offset {offset} leave a {}-byte row", shape.row_bytes, host.row_stride),
                ));
            }
            spans.push((offset, end, j));
        }
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(bad(w[1].2 as i64, format!("tensors {} and {} overlap inside the row", w[0].2, w[1].2)));
        }
        BlockTier::build(device, tensors, host_rows, |j, pool, config| {
            let buffer = device.wrap_raw(&host.region, "host")?;
            let padding = PagePadding { page_bytes: host.row_stride, offset: host.offsets[j] };
            HostPool::wrap_padded(pool, config, vec![buffer], Some(padding))
        })
    }

    /// The tier of `tensors` whose host pool for tensor `j` `host_pool(j, device pool, config)`
    /// makes (`host_rows ≥ 1`).
    fn build(
        device: &Device,
        tensors: &[(BlockShape, RawTensor)],
        host_rows: u64,
        mut host_pool: impl FnMut(usize, &DevicePool<'static>, &HostPoolConfig) -> Result<HostPool<'static>>,
    ) -> Result<BlockTier> {
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
            let host = host_pool(j, &pool, &config)?;
            out.push(TierTensor { shape: *shape, geometry, host });
        }
        Ok(BlockTier { device: device.clone(), host_rows, tensors: out })
    }

    /// The checksums recorded for host rows `rows` of tensor `j` (`None`: none recorded), once
    /// queued moves are done: what a caller keeping the rows' checksums beside them stores.
    pub fn row_checksums(&self, j: usize, rows: &[i64]) -> Result<Vec<Option<u64>>> {
        let t = self.tensor(j)?;
        self.check_rows(rows)?;
        self.device.settle_checksums()?;
        rows.iter().map(|&r| t.host.item_checksum(r as u64, 0, 0)).collect()
    }

    /// Records `sums[i]` as the checksum of host row `rows[i]` of tensor `j` (`None` forgets
    /// it: the row loads unverified): rows written by someone else (another process sharing the
    /// host region) carry theirs in, and the next load verifies the bytes against them inside
    /// its copy. Every row is checked before one is recorded.
    pub fn set_row_checksums(&self, j: usize, rows: &[i64], sums: &[Option<u64>]) -> Result<()> {
        let t = self.tensor(j)?;
        if rows.len() != sums.len() {
            return Err(TransferError::BadArgument {
                arg: "checksums",
                value: sums.len() as i64,
                message: format!("{} checksums for {} rows", sums.len(), rows.len()),
            });
        }
        self.check_rows(rows)?;
        t.host.set_item_checksums(rows.iter().map(|&r| r as u64).zip(sums.iter().copied()))
    }

    /// Two tensors a load writes must not share a data byte: both would be written, in an
    /// order executors differ on. Spans may interleave (strided views of one buffer, each
    /// block's data inside the others' gaps): with one stride, their data windows must be
    /// disjoint in every block; otherwise their spans must be.
    fn check_load_overlaps(&self, calls: &[(usize, RawTensor)]) -> Result<()> {
        for (a, (ja, ra)) in calls.iter().enumerate() {
            for (jb, rb) in &calls[a + 1..] {
                let (Ok(ta), Ok(tb)) = (self.tensor(*ja), self.tensor(*jb)) else { continue }; // refused later
                let (sa, sb) = (&ta.shape, &tb.shape);
                let spans_meet =
                    ra.memory == rb.memory && ra.addr < rb.addr.saturating_add(rb.len) && rb.addr < ra.addr.saturating_add(ra.len);
                if !spans_meet || ra.len == 0 || rb.len == 0 {
                    continue;
                }
                let interleaved = sa.stride == sb.stride && sa.rows == sb.rows && {
                    // The later view's data starts `r` bytes into each of the earlier one's blocks.
                    let ((first, d1), (second, d2)) = if ra.addr <= rb.addr {
                        ((ra, sa.row_bytes), (rb, sb.row_bytes))
                    } else {
                        ((rb, sb.row_bytes), (ra, sa.row_bytes))
                    };
                    let r = (second.addr - first.addr) % sa.stride;
                    d1 <= r && r + d2 <= sa.stride
                };
                if !interleaved {
                    return Err(TransferError::BadTensor {
                        arg: format!("tensor[{ja}]"),
                        reason: format!("destination overlaps tensor[{jb}]"),
                    });
                }
            }
        }
        Ok(())
    }

    fn check_rows(&self, rows: &[i64]) -> Result<()> {
        match rows.iter().find(|&&r| r < 0 || r as u64 >= self.host_rows) {
            Some(&r) => Err(TransferError::BadArgument {
                arg: "rows",
                value: r,
                message: format!("host row {r} is out of range (the tier holds {} rows)", self.host_rows),
            }),
            None => Ok(()),
        }
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
            self.check_load_overlaps(calls)?;
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
        let buf = t.host.read_buffer(0)?;
        let (stride, offset) = host_row_span(t);
        let (row, stride, offset) = (t.shape.row_bytes as usize, stride as usize, offset as usize);
        Ok((0..self.host_rows as usize).flat_map(|r| &buf[r * stride + offset..r * stride + offset + row]).copied().collect())
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
        let (stride, first) = host_row_span(t);
        t.host.inject_host_corruption(0, row * stride + first + offset, bytes)
    }

    fn tensor(&self, j: usize) -> Result<&TierTensor> {
        self.tensors.get(j).ok_or(TransferError::BadArgument {
            arg: "tensor",
            value: j as i64,
            message: format!("the tier has {} tensors", self.tensors.len()),
        })
    }
}

/// `(bytes from one host row to the next, where a row's data starts)`: packed for the tier's own
/// rows, the caller's layout for [`BlockTier::over_host`].
fn host_row_span(t: &TierTensor) -> (u64, u64) {
    match t.host.geometry().padding() {
        Some(p) => (p.page_bytes, p.offset),
        None => (t.shape.row_bytes, 0),
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
    // Exactly the registered blocks: a larger tensor would be another tensor's memory. Its last
    // block may end after its data (a strided view, whose rows are narrower than their stride,
    // ends there: the bytes after it are another view's).
    let whole = crate::geometry::mul(shape.rows, shape.stride, "block tensor bytes (rows × stride)")?;
    // `geometry_of` checked `row_bytes ≤ stride` and `rows ≥ 1`: `least ≥ row_bytes`.
    let least = shape.stride.checked_sub(shape.row_bytes).and_then(|gap| whole.checked_sub(gap)).unwrap_or(whole);
    if raw.len < least || raw.len > whole {
        return Err(TransferError::BadTensor {
            arg: name,
            reason: format!(
                "{} bytes, but the tier's tensor {j} is {least} to {whole} ({} blocks {} bytes apart, {} of data each)",
                raw.len, shape.rows, shape.stride, shape.row_bytes
            ),
        });
    }
    let buffer = device.wrap_raw(raw, &name)?;
    DevicePool::wrap_geometry(device, geometry.clone(), vec![vec![buffer]])
}
