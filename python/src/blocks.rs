//! `BlockTier`: host rows for an engine's block tensors, with item checksums (the core of
//! `hicache_io.vllm`'s offloading worker).

use std::sync::Mutex;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use hicache_io::blocks::{BlockMove, BlockShape, BlockTier, HostRows};
use hicache_io::kvcacheio::RawTensor;

use crate::*;

/// Host rows for each of an engine's block tensors: tensor `j` is `rows` blocks (2-D, 1-byte
/// elements: vLLM's canonical int8 views; contiguous, or strided `(S, 1)` with blocks narrower
/// than `S`), of which the first `row_bytes[j]` of each block are data; only data bytes move. The rows live on the executor of the tensors: host tensors on the
/// cpu executor (in host memory), CUDA tensors on the cuda executor of their device, on
/// `stream` (pinned host memory; moves are enqueued there, not waited for).
///
/// `store(ids, tensors, blocks, rows)` copies block `blocks[i]` of each tensor into its host row
/// `rows[i]`, recording the row's checksum inside the copy; `load(ids, tensors, rows, blocks)`
/// copies back, verifying each row inside the copy: rows that no longer match raise
/// `IntegrityError` (after the other rows landed), `e.items` naming `(tensor, 0, row, block, …)`.
/// Every call is checked (lengths, ranges, duplicate destinations, the tensors' shapes) before
/// a byte moves. On cuda a move returns once enqueued on `stream`: the tensors must stay
/// allocated (and unwritten by other streams) until it ran, e.g. until `synchronize()`; and a
/// mismatch's tensor field is 0 there (the executor reports per call, naming row and block).
///
/// With `host` (a contiguous, writable host array of at least `host_rows × host_row_stride`
/// bytes, e.g. a region other processes map too; registered with the driver on cuda) the rows are
/// that memory instead: row `r` of tensor `j` is its `row_bytes[j]` at `r × host_row_stride +
/// host_offsets[j]`. The tier keeps `host` referenced; it neither zeroes nor owns it, and the
/// rows' checksums travel through `row_checksums` / `set_row_checksums`. Other processes sharing
/// the memory must not write a row while a move of the tier reads or writes it.
#[pyclass(name = "BlockTier", module = "hicache_io", frozen)]
pub(crate) struct PyBlockTier {
    inner: Mutex<BlockTier>,
    stream: Option<u64>,
    /// The caller's host rows, kept alive as long as the tier.
    _host: Option<Py<PyAny>>,
}

/// A tensor of the tier as `(shape, raw)`, checked against the shape it was registered with.
/// Its blocks may lie further apart than their width (strides `(S, 1)`): `S` is the stride.
fn block_tensor(obj: &Bound<'_, PyAny>, name: &str, row_bytes: Option<u64>, ctx: Ctx) -> PyResult<(Held, BlockShape)> {
    let (h, shape) = view_rows(obj, name, ctx)?;
    let Some((rows, width, stride)) = shape.filter(|_| h.dtype.1 == 8) else {
        return Err(PyTypeError::new_err(format!(
            "{name}: expected a 2-D tensor of 1-byte elements (blocks × page bytes), got {} dimensions of {}-bit elements",
            h.raw.dims().len(),
            h.dtype.1
        )));
    };
    if !h.writable {
        return Err(PyValueError::new_err(format!("{name}: read-only (loads write it)")));
    }
    let row_bytes = row_bytes.unwrap_or(width);
    if row_bytes > width {
        return Err(PyValueError::new_err(format!("{name}: {row_bytes} data bytes in blocks {width} bytes wide")));
    }
    Ok((h, BlockShape { row_bytes, stride, rows }))
}

#[pymethods]
impl PyBlockTier {
    #[new]
    #[pyo3(signature = (tensors, row_bytes, host_rows, *, stream = None, host = None, host_row_stride = None, host_offsets = None))]
    #[allow(clippy::too_many_arguments)] // Python keywords
    fn new(
        py: Python<'_>,
        tensors: &Bound<'_, PyList>,
        row_bytes: Vec<u64>,
        host_rows: u64,
        stream: Option<u64>,
        host: Option<&Bound<'_, PyAny>>,
        host_row_stride: Option<u64>,
        host_offsets: Option<Vec<u64>>,
    ) -> PyResult<Self> {
        if row_bytes.len() != tensors.len() {
            return Err(PyValueError::new_err(format!("{} tensors but {} row sizes", tensors.len(), row_bytes.len())));
        }
        let ctx = Ctx { stream };
        let mut held = Vec::with_capacity(tensors.len());
        for (j, (t, rb)) in tensors.iter().zip(&row_bytes).enumerate() {
            held.push(block_tensor(&t, &format!("tensors[{j}]"), Some(*rb), ctx)?);
        }
        let refs: Vec<&Held> = held.iter().map(|(h, _)| h).collect();
        let device = executor_for(&refs, Ctx { stream })?;
        let pairs: Vec<(BlockShape, RawTensor)> = held.iter().map(|(h, s)| (*s, h.raw.clone())).collect();
        let region = match (host, host_row_stride, host_offsets) {
            (None, None, None) => None,
            (Some(h), Some(row_stride), Some(offsets)) => {
                let held = view(h, "host", ctx)?;
                if !held.writable {
                    return Err(PyValueError::new_err("host: read-only (stores write it)"));
                }
                if held.device_type == DL_CUDA {
                    return Err(PyValueError::new_err("host: device memory; the tier's rows are host memory"));
                }
                Some((HostRows { region: held.raw.clone(), row_stride, offsets }, held))
            }
            _ => return Err(PyTypeError::new_err("host, host_row_stride and host_offsets go together")),
        };
        let tier = match &region {
            None => py.detach(|| BlockTier::new(&device, &pairs, host_rows)),
            // SAFETY: the region's owner is kept by the tier (`_host`) for its whole life; the
            // caller's contract (the class docs) is that nothing else writes rows during a move.
            Some((rows, _)) => py.detach(|| unsafe { BlockTier::over_host(&device, &pairs, host_rows, rows) }),
        }
        .py()?;
        let keep = region.map(|(_, held)| held._keep);
        Ok(PyBlockTier { inner: Mutex::new(tier), stream, _host: keep })
    }

    /// The checksums recorded for host rows `rows` of tensor `j` (`None`: none), once queued
    /// moves are done.
    fn row_checksums(&self, py: Python<'_>, j: usize, rows: &Bound<'_, PyAny>) -> PyResult<Vec<Option<u64>>> {
        let rows = index_list(rows, "Host", Ctx { stream: self.stream })?;
        py.detach(|| self.lock().row_checksums(j, &rows)).py()
    }

    /// Records `sums[i]` (`None`: forgets) as the checksum of host row `rows[i]` of tensor `j`,
    /// which the next load verifies inside its copy.
    fn set_row_checksums(&self, py: Python<'_>, j: usize, rows: &Bound<'_, PyAny>, sums: Vec<Option<u64>>) -> PyResult<()> {
        let rows = index_list(rows, "Host", Ctx { stream: self.stream })?;
        py.detach(|| self.lock().set_row_checksums(j, &rows, &sums)).py()
    }

    /// Copies block `blocks[i]` of each `tensors[k]` (tier tensor `ids[k]`) into host row `rows[i]`.
    fn store(
        &self,
        py: Python<'_>,
        ids: Vec<usize>,
        tensors: &Bound<'_, PyList>,
        blocks: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.run(py, BlockMove::Store, ids, tensors, blocks, rows)
    }

    /// Copies host row `rows[i]` into block `blocks[i]` of each `tensors[k]` (tier tensor `ids[k]`).
    fn load(
        &self,
        py: Python<'_>,
        ids: Vec<usize>,
        tensors: &Bound<'_, PyList>,
        rows: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.run(py, BlockMove::Load, ids, tensors, blocks, rows)
    }

    /// Raises `IntegrityError` for rows of earlier loads that failed their checksums, without
    /// waiting (cuda only: its loads return once enqueued; `e.items[k][3]` is the block).
    fn integrity_reports(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.lock().integrity_reports()).py()
    }

    /// Waits for every queued move, then reports as `integrity_reports` does.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.lock().synchronize()).py()
    }

    /// A copy of tensor `j`'s host rows (`host_rows × row_bytes[j]` bytes).
    fn read_rows<'py>(&self, py: Python<'py>, j: usize) -> PyResult<Bound<'py, PyAny>> {
        let bytes = py.detach(|| self.lock().read_rows(j)).py()?;
        u8_array(py, &bytes)
    }

    /// Fault injection (tests): writes `data` into host row `row` of tensor `j` at byte
    /// `offset` of the row without touching its checksum, as a fault in host memory would.
    fn inject_host_corruption(&self, py: Python<'_>, j: usize, row: u64, offset: u64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let data = data_arg(data, "data")?;
        py.detach(|| self.lock().inject_host_corruption(j, row, offset, &data)).py()
    }

    /// The executor the rows live on (`"cpu"` or `"cuda"`).
    #[getter]
    fn device(&self) -> &'static str {
        self.lock().device().name()
    }

    /// Host rows per tensor.
    #[getter]
    fn host_rows(&self) -> u64 {
        self.lock().host_rows()
    }

    /// `(row_bytes, stride, rows)` of each tensor.
    #[getter]
    fn shapes(&self) -> Vec<(u64, u64, u64)> {
        self.lock().shapes().iter().map(|s| (s.row_bytes, s.stride, s.rows)).collect()
    }
}

impl PyBlockTier {
    fn lock(&self) -> std::sync::MutexGuard<'_, BlockTier> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn run(
        &self,
        py: Python<'_>,
        dir: BlockMove,
        ids: Vec<usize>,
        tensors: &Bound<'_, PyList>,
        blocks: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        if ids.len() != tensors.len() {
            return Err(PyValueError::new_err(format!("{} tensor ids but {} tensors", ids.len(), tensors.len())));
        }
        let ctx = Ctx { stream: self.stream };
        let mut calls = Vec::with_capacity(ids.len());
        let shapes = self.lock().shapes();
        for (k, (j, t)) in ids.iter().zip(tensors.iter()).enumerate() {
            let name = format!("tensors[{k}]");
            let want =
                shapes.get(*j).ok_or_else(|| PyValueError::new_err(format!("tensor id {j}: the tier has {} tensors", shapes.len())))?;
            let (h, shape) = block_tensor(&t, &name, Some(want.row_bytes), ctx)?;
            if shape != *want {
                return Err(PyValueError::new_err(format!(
                    "{name}: {} blocks of {} bytes, but tier tensor {j} was registered with {} blocks of {} bytes",
                    shape.rows, shape.stride, want.rows, want.stride
                )));
            }
            calls.push((h, *j));
        }
        let (blocks, rows) = (index_list(blocks, "Device", ctx)?, index_list(rows, "Host", ctx)?);
        let raw: Vec<(usize, RawTensor)> = calls.iter().map(|(h, j)| (*j, h.raw.clone())).collect();
        // The arrays stay referenced by `calls` (their `Held`) until the move returns (on cuda:
        // is enqueued; the caller keeps them allocated until it ran, see the class docs).
        let r = py.detach(|| self.lock().run(dir, &raw, &blocks, &rows)).py();
        drop(calls);
        r
    }
}
