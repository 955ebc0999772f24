//! Caller memory: what an engine hands an op — tensors ([`RawTensor`]) in host or CUDA memory,
//! index lists ([`Indices`]) and tables of layer addresses ([`LayerTable`]). Below the executors,
//! which read it, and the ops of [`crate::kvcacheio`], which check it; it names no executor.

use crate::plan::TableGuard;

/// sglang's table of layer base addresses as a layer argument, read by the executor
/// ([`CudaExecutor::layer_table`](crate::exec::cuda::CudaExecutor::layer_table) for a table in
/// device memory): its entries, the allocation the driver says each lies in, and the device
/// check that the caller's table still holds these entries when a call runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerTable {
    entries: Vec<u64>,
    ranges: Vec<Option<(u64, u64)>>,
    guard: Option<TableGuard>,
    memory: Memory,
}

impl LayerTable {
    /// A table of layer addresses `entries` in `memory`, with the allocation `(start, bytes)`
    /// each lies in where known, and the device check of the caller's table.
    ///
    /// # Safety
    /// Each entry addresses a layer that stays valid while calls use it, as for
    /// [`RawTensor::new`], within its allocation; `guard` names a table and a copy of `entries`
    /// in device memory of the executor that runs the calls.
    pub unsafe fn new(entries: Vec<u64>, ranges: Vec<Option<(u64, u64)>>, guard: Option<TableGuard>, memory: Memory) -> Self {
        LayerTable { entries, ranges, guard, memory }
    }
    /// Layers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// True when it names no layer.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// The layer addresses.
    pub fn entries(&self) -> &[u64] {
        &self.entries
    }
    pub(crate) fn guard(&self) -> Option<TableGuard> {
        self.guard
    }
    pub(crate) fn memory(&self) -> Memory {
        self.memory
    }
}

/// Each layer's bytes in the tables of page rows (`(table, stride)`: rows of `row` bytes every
/// `stride` bytes), where they can be known without reading an index: up to the end of its
/// allocation (as the driver says), and up to the next address above it in its table whose
/// rows would meet its own (the layers of one slab: each ends where the next begins). Layers
/// whose rows interleave without touching (sglang's page_first host views, `row` bytes apart)
/// bound nothing. `None` where the driver does not say.
pub fn page_row_extents(tables: &[(&LayerTable, u64)], row: u64) -> Vec<Vec<Option<u64>>> {
    tables
        .iter()
        .map(|&(t, stride)| {
            // Rows `d` bytes apart meet unless `d` is at least a row away from a whole stride.
            let meet = |d: u64| match d.checked_rem(stride) {
                Some(r) if stride >= row => r < row || stride - r < row,
                _ => true,
            };
            t.entries
                .iter()
                .zip(&t.ranges)
                .map(|(&addr, range)| {
                    let end = range.and_then(|(start, len)| start.checked_add(len))?;
                    let next = t.entries.iter().filter(|&&a| a > addr && meet(a - addr)).min().copied();
                    end.min(next.unwrap_or(end)).checked_sub(addr)
                })
                .collect()
        })
        .collect()
}

/// Each layer's bytes in the tables of one call, where they can be known without reading an
/// index: up to the nearest of the end of its allocation (as the driver says), the next layer
/// address above it in any of the tables, and, in a table of evenly spaced addresses (the
/// layers of one buffer), that spacing. `None` where none of them is known.
pub fn table_extents(tables: &[&LayerTable]) -> Vec<Vec<Option<u64>>> {
    let mut all: Vec<u64> = tables.iter().flat_map(|t| t.entries.iter().copied()).collect();
    all.sort_unstable();
    all.dedup();
    tables
        .iter()
        .map(|t| {
            let e = &t.entries;
            let spacing =
                (e.len() >= 2 && e[1] > e[0]).then(|| e[1] - e[0]).filter(|&d| e.windows(2).all(|w| w[1].checked_sub(w[0]) == Some(d)));
            e.iter()
                .zip(&t.ranges)
                .map(|(&addr, range)| {
                    let ends = [
                        range.and_then(|(start, len)| start.checked_add(len)),
                        all.get(all.partition_point(|&a| a <= addr)).copied(),
                        spacing.and_then(|d| addr.checked_add(d)),
                    ];
                    ends.into_iter().flatten().min().map(|end| end - addr)
                })
                .collect()
        })
        .collect()
}

/// A layer argument: a list of arrays, or a table of layer addresses.
#[derive(Debug, Clone, Copy)]
pub enum Layers<'a> {
    /// One array per layer (every index is bounds-checked against its layer).
    List(&'a [RawTensor]),
    /// sglang's table of layer base addresses.
    Table(&'a LayerTable),
}

impl<'a> From<&'a [RawTensor]> for Layers<'a> {
    fn from(v: &'a [RawTensor]) -> Self {
        Layers::List(v)
    }
}

impl<'a> From<&'a Vec<RawTensor>> for Layers<'a> {
    fn from(v: &'a Vec<RawTensor>) -> Self {
        Layers::List(v)
    }
}

impl<'a, const N: usize> From<&'a [RawTensor; N]> for Layers<'a> {
    fn from(v: &'a [RawTensor; N]) -> Self {
        Layers::List(v)
    }
}

impl<'a> From<&'a LayerTable> for Layers<'a> {
    fn from(t: &'a LayerTable) -> Self {
        Layers::Table(t)
    }
}

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
    pub(crate) addr: u64,
    pub(crate) len: u64,
    dims: Vec<u64>,
    pub(crate) memory: Memory,
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
    pub(crate) fn row_bytes(&self) -> u64 {
        match self.dims.first() {
            Some(&rows) if rows > 0 => self.len / rows,
            _ => self.len,
        }
    }
}

/// An index list: `i64` values on the host, or in CUDA memory ([`CudaIndices`]). Host lists
/// are checked before anything is enqueued; CUDA lists (the `kernel` ops on the cuda executor)
/// are checked on the device, without a host round trip: a failing list moves nothing, and the
/// error ([`crate::TransferError::DeviceIndexCheck`], naming the op) comes from the next
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
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) call: &'static str,
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
    pub(crate) fn call(self, call: &'static str) -> Self {
        match self {
            Indices::Cuda(c) => Indices::Cuda(CudaIndices { call, ..c }),
            host => host,
        }
    }
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
