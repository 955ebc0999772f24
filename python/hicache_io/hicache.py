"""sglang's JIT HiCache entry points (``sglang.kernels.ops.kvcache.hicache`` in sglang 0.5.23,
formerly ``sglang.jit_kernel.hicache``) under the same names, argument order and keywords, on
hicache-io, so a host pool that calls them can be pointed here unchanged
(:func:`hicache_io.sglang.install` does it for a whole sglang process).

Unlike :mod:`hicache_io.kvcacheio` these put the **destination first**:
``transfer_hicache_one_layer(k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src,
indices_src, *, element_dim=None, unroll=None, block_quota=None, page_size=None)``. Caches are
viewed as rows of ``element_dim`` elements (``(-1, element_dim)``, by default ``dst.shape[-1]``); a
cache may be a strided view whose row stride is a whole number of rows, as sglang's page_first
pools pass ``k_buffer.transpose(0, 1)[layer]`` (its rows are then addressed inside the buffer it
views). The all-layer copies take uint64 tables of layer addresses and byte strides per side
(``kv_cache_src_stride_bytes`` / ``kv_cache_dst_stride_bytes``): a side whose stride is the row
itself is a set of layer_first layers; a side with a larger stride must be the layers of one
page_first host buffer (the table sglang builds from ``buffer.transpose(0, 1)[layer]`` views, every
layer of it), as sglang's K-only and page_first pools pass them.

Indices are int32 or int64 (converted to int64 on their device). ``unroll``, ``block_quota`` and
``page_size`` tune or gate sglang's kernels and never change the bytes: ``block_quota`` sizes
hicache-io's cuda launch, ``page_size`` only decides sglang's TMA path (hicache-io has none, so
:func:`use_hicache_tma_kernel` answers ``False``), ``unroll`` is checked and otherwise unused.

The calls run on the executor of their arrays like every hicache-io op: host arrays on the cpu
executor, CUDA arrays on the cuda executor, enqueued on the caller's current stream. Checks
carry sglang's messages where it has them (``HicacheKernel: cache dimension mismatch.``) and
hicache-io's range and uniqueness checks beyond them; a call that raises has moved no byte.

Why these entry points are written by hand rather than made from the op catalogue, as
:mod:`hicache_io.kvcacheio`'s are: none is a plain op. Each takes sglang's destination-first
arguments and reads what the catalogue's ops take as explicit numbers (item bytes, layer, layer
stride, layer count, page size) from the shapes, strides and views of sglang's tensors, then moves
the bytes through one of the catalogue's ops in :mod:`hicache_io.kvcacheio`, whose checks and
planner are the same as every other caller's.
"""

import ctypes
import sys
from typing import Any, List, Optional, Tuple

from . import _native, kvcacheio

__all__ = [
    "DEFAULT_BLOCK_QUOTA",
    "COPY_GROUP_THREADS",
    "GROUP_BYTES",
    "TMA_STAGE_BYTES",
    "TMA_NUM_STAGES",
    "TMA_STORE_WARPS",
    "TMA_BLOCK_QUOTA",
    "hicache_tma_rows_per_chunk",
    "use_hicache_tma_kernel",
    "can_use_hicache_jit_kernel",
    "can_use_write_back_jit_kernel",
    "transfer_hicache_one_layer",
    "transfer_hicache_all_layer",
    "transfer_hicache_one_layer_mla",
    "transfer_hicache_all_layer_mla",
    "transfer_hicache_all_layer_staged_lf_pf",
    "transfer_hicache_all_layer_mla_staged_lf_pf",
    "can_use_page_unified_load_back_jit_kernel",
    "transfer_hicache_one_layer_page_unified_lf",
    "transfer_hicache_one_layer_mla_page_unified_lf",
    "transfer_hicache_all_layer_staged_lf_page_unified",
    "transfer_hicache_all_layer_mla_staged_lf_page_unified",
]

# sglang 0.5.23's module constants (CUDA values), for code that reads them.
DEFAULT_BLOCK_QUOTA = 2
COPY_GROUP_THREADS = 32
GROUP_BYTES = (128,)
TMA_STAGE_BYTES = 32768
TMA_NUM_STAGES = 6
TMA_STORE_WARPS = 4
TMA_BLOCK_QUOTA = 4


def hicache_tma_rows_per_chunk(element_size: int) -> int:
    """Rows sglang's TMA kernel moves per stage: the largest power of two at most
    ``min(TMA_STAGE_BYTES // element_size, 128)`` (sglang's formula; at least 1)."""
    if element_size <= 0:
        raise ValueError(f"element_size must be positive, got {element_size}")
    rows = 1
    while rows * 2 <= TMA_STAGE_BYTES // element_size and rows * 2 <= 128:
        rows *= 2
    return rows


def use_hicache_tma_kernel(*, element_size: int, block_quota: int, page_size: Optional[int] = None) -> bool:
    """Whether the copies go through sglang's TMA bulk-copy kernel: never here. hicache-io's
    cuda executor moves rows with its own gather kernels (and copy-engine copies for ``direct``),
    whatever the page size."""
    return False


def can_use_hicache_jit_kernel(*, element_size: int, unroll: Optional[int] = None, block_quota: Optional[int] = None, page_size: Optional[int] = None) -> bool:
    """Whether rows of ``element_size`` bytes can move through these entry points: any positive
    multiple of 8 bytes, on every executor (sglang's own kernel needs multiples of 128 on CUDA).
    ``page_size`` only gates sglang's TMA path and is accepted for its callers; ``unroll`` and
    ``block_quota`` must be positive when given (``0`` and ``None`` mean the default)."""
    return element_size > 0 and element_size % 8 == 0 and (unroll is None or unroll >= 0) and (block_quota is None or block_quota >= 0)


def can_use_write_back_jit_kernel(*, element_size: int, unroll: Optional[int] = None, block_quota: Optional[int] = None) -> bool:
    """Whether the staged page_first write-back takes rows of ``element_size`` bytes: multiples of
    16 bytes, as in sglang."""
    return element_size > 0 and element_size % 16 == 0 and can_use_hicache_jit_kernel(element_size=element_size, unroll=unroll, block_quota=block_quota)


# ---- arrays, whatever library made them ---------------------------------------------------


def _lib(t: Any) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        return "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(t, cupy.ndarray):
        return "cupy"
    return "numpy"


def _layout(t: Any) -> Tuple[Tuple[int, ...], Tuple[int, ...], int, int]:
    """(shape, strides in elements, bytes per element, address of element 0)."""
    kind = _lib(t)
    if kind == "torch":
        return tuple(t.shape), tuple(t.stride()), t.element_size(), t.data_ptr()
    size = t.dtype.itemsize
    shape = tuple(t.shape)
    strides = getattr(t, "strides", None)
    if strides is None:
        # Another DLPack producer without strides: C order.
        strides, step = [], size
        for d in reversed(shape):
            strides.insert(0, step)
            step *= d
    ptr = t.data.ptr if kind == "cupy" else getattr(getattr(t, "ctypes", None), "data", 0)
    return shape, tuple(s // size for s in strides), size, ptr


def _dtype(t: Any) -> str:
    if not hasattr(t, "dtype"):
        raise TypeError(f"expected an array (numpy, torch or CuPy), got {type(t).__name__}")
    return str(t.dtype).replace("torch.", "")


def _rows(t: Any, element_dim: int, what: str) -> Tuple[int, int, int]:
    """A cache as rows of ``element_dim`` elements: (rows, row stride in bytes, bytes per row).
    A contiguous array is any whole number of rows (sglang's ``view(-1, element_dim)``); a strided
    one must hold exactly one row in its trailing dimensions, contiguously, and step evenly in
    the leading ones."""
    shape, strides, size, _ = _layout(t)
    if any(st <= 0 for d, st in zip(shape, strides) if d > 1):
        raise ValueError(f"{what}: strides {strides} for shape {shape}: broadcast or reversed arrays are not caches")
    count = 1
    for d, st in zip(reversed(shape), reversed(strides)):
        if d != 1 and st != count:
            break
        count *= d
    else:
        # Contiguous: sglang's view(-1, element_dim) applies, whatever the dimensions.
        if element_dim <= 0 or count % element_dim != 0:
            raise RuntimeError(f"{what}: cache dimension mismatch.")
        return count // element_dim, element_dim * size, element_dim * size
    inner, k = 1, len(shape)
    while k > 0 and inner < element_dim:
        k -= 1
        if shape[k] != 1 and strides[k] != inner:
            raise ValueError(f"{what}: the last dimensions of shape {shape} (strides {strides}) are not contiguous rows of {element_dim} elements")
        inner *= shape[k]
    if inner != element_dim:
        raise RuntimeError(f"{what}: cache dimension mismatch.")
    rows, stride = 1, element_dim
    outer = [(shape[i], strides[i]) for i in range(k) if shape[i] != 1]
    if outer:
        stride = outer[-1][1]
        for i in range(len(outer) - 1, -1, -1):
            if outer[i][1] != stride * rows:
                raise ValueError(f"{what}: shape {shape} with strides {strides} is not rows at one stride")
            rows *= outer[i][0]
    return rows, stride * size, element_dim * size


def _flat_parent(t: Any) -> Tuple[Any, int]:
    """The whole allocation ``t`` views, as a 1-D uint8 array, and its start address."""
    kind = _lib(t)
    if kind == "torch":
        import torch

        storage = t.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        return flat, storage.data_ptr()
    if kind == "cupy":
        import cupy

        mem = t.data.mem
        return cupy.ndarray((mem.size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)), mem.ptr
    import numpy as np

    root = t
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not root.flags.c_contiguous:
        raise ValueError("a strided cache must view a contiguous array")
    return root.reshape(-1).view(np.uint8), root.ctypes.data


def _row_view(t: Any, element_dim: int) -> Any:
    if len(t.shape) == 2 and t.shape[1] == element_dim:
        return t
    if not hasattr(t, "reshape") and not hasattr(t, "view"):
        raise ValueError(f"cannot view a {type(t).__name__} as rows of {element_dim} elements; pass it as (rows, {element_dim})")
    kind = _lib(t)
    if kind == "torch":
        return t.view(-1, element_dim)
    return t.reshape(-1, element_dim)


class _Cache:
    """One cache argument: contiguous rows (``flat`` is ``None``), or rows at a stride that are
    layer ``layer`` of a page_first buffer ``flat`` whose slots are ``stride`` bytes."""

    def __init__(self, t: Any, element_dim: int, what: str):
        if not (hasattr(t, "shape") and hasattr(t, "dtype") and (hasattr(t, "__dlpack__") or hasattr(t, "__array_interface__"))):
            raise TypeError(f"{what}: expected an array (numpy, torch or CuPy), got {type(t).__name__}")
        self.rows, self.stride, self.item = _rows(t, element_dim, what)
        self.t, self.what, self.flat, self.layer = t, what, None, 0
        if self.stride == self.item:
            self.view = _row_view(t, element_dim)
            return
        if self.stride % self.item != 0:
            raise ValueError(f"{what}: rows of {self.item} bytes at a stride of {self.stride}: not a layer of a page_first buffer")
        flat, base = _flat_parent(t)
        off = _layout(t)[3] - base
        within = off % self.stride
        if within % self.item != 0:
            raise ValueError(f"{what}: starts {within} bytes into a {self.stride}-byte slot, not on a row")
        start, end = off - within, off - within + self.rows * self.stride
        if start < 0 or end > flat.shape[0]:
            raise ValueError(f"{what}: its slots run past the buffer it views")
        self.flat, self.layer = flat[start:end], within // self.item


def _indices(idx: Any) -> Any:
    """int32 or int64 indices as int64, on their own device. Other dtypes are refused: a cast
    would truncate floats, take booleans for 0 and 1, and wrap unsigned values past int64."""
    if hasattr(idx, "dtype") and str(idx.dtype).replace("torch.", "") not in ("int32", "int64"):
        raise TypeError(f"indices must be int32 or int64, got {idx.dtype}")
    kind = _lib(idx)
    if kind == "torch":
        import torch

        return idx if idx.dtype == torch.int64 else idx.to(torch.int64)
    if hasattr(idx, "dtype"):
        return idx if str(idx.dtype) == "int64" else idx.astype("int64")
    return idx


def _beside(idx: Any, other: Any) -> Any:
    """``idx`` on ``other``'s CUDA device when ``other`` is a CUDA torch tensor and ``idx`` a host
    one (sglang's staged write-back passes device rows on the GPU and host rows on the CPU):
    copied from pinned memory on the current stream, so the op keeps both lists on the device
    and never waits for the stream to read one on the host."""
    if _lib(idx) != "torch" or _lib(other) != "torch" or not other.is_cuda or idx.is_cuda:
        return idx
    return idx.pin_memory().to(other.device, non_blocking=True)


def _tuning(unroll: Optional[int], block_quota: Optional[int]) -> int:
    """sglang's ``unroll or default`` and ``block_quota or DEFAULT_BLOCK_QUOTA``: 0 or ``None``
    means the default; a negative value is refused."""
    if unroll is not None and unroll < 0:
        raise RuntimeError(f"HicacheKernel: unroll must be positive, got {unroll}")
    quota = block_quota or DEFAULT_BLOCK_QUOTA
    if quota < 0:
        raise RuntimeError(f"HicacheKernel: block_quota must be positive, got {quota}")
    return quota


def _same_dtype(tag: str, *arrays: Any) -> None:
    dtypes = {_dtype(a) for a in arrays}
    if len(dtypes) > 1:
        raise RuntimeError(f"{tag}: source and destination caches must have the same dtype, got {sorted(dtypes)}")


# ---- one layer -----------------------------------------------------------------------------


def transfer_hicache_one_layer(k_cache_dst: Any, v_cache_dst: Any, indices_dst: Any, k_cache_src: Any, v_cache_src: Any, indices_src: Any, *, element_dim: Optional[int] = None, unroll: Optional[int] = None, block_quota: Optional[int] = None, page_size: Optional[int] = None) -> None:
    """Row ``indices_src[i]`` of the source K and V caches → row ``indices_dst[i]`` of the
    destination caches, for one layer (either side may be host or device memory, and either side,
    not both, a strided layer view of a page_first buffer)."""
    quota = _tuning(unroll, block_quota)
    tag = "HicacheKernel"
    _same_dtype(tag, k_cache_dst, v_cache_dst, k_cache_src, v_cache_src)
    dim = element_dim or k_cache_dst.shape[-1]
    kd, vd = _Cache(k_cache_dst, dim, tag), _Cache(v_cache_dst, dim, tag)
    ks, vs = _Cache(k_cache_src, dim, tag), _Cache(v_cache_src, dim, tag)
    si, di = _indices(indices_src), _indices(indices_dst)
    si, di = _beside(si, di), _beside(di, si)
    item = kd.item
    strided_src, strided_dst = ks.flat is not None or vs.flat is not None, kd.flat is not None or vd.flat is not None
    if not strided_src and not strided_dst:
        kvcacheio.transfer_kv_per_layer(ks.view, kd.view, vs.view, vd.view, si, di, item, block_quota=quota)
    elif strided_src and not strided_dst:
        layer, stride = _page_first_pair(ks, vs)
        kvcacheio.transfer_kv_per_layer_pf_lf(ks.flat, kd.view, vs.flat, vd.view, si, di, layer, item, stride, block_quota=quota)
    elif strided_dst and not strided_src:
        layer, stride = _page_first_pair(kd, vd)
        kvcacheio.transfer_kv_per_layer_lf_pf(ks.view, kd.flat, vs.view, vd.flat, si, di, layer, item, stride, block_quota=quota)
    else:
        raise ValueError("HicacheKernel: hicache-io moves between contiguous rows and one strided side, not two strided sides")


def _page_first_pair(k: _Cache, v: _Cache) -> Tuple[int, int]:
    if k.flat is None or v.flat is None or (k.layer, k.stride) != (v.layer, v.stride):
        raise ValueError("HicacheKernel: K and V must be the same layer of page_first buffers of one shape")
    return k.layer, k.stride


def transfer_hicache_one_layer_mla(cache_dst: Any, indices_dst: Any, cache_src: Any, indices_src: Any, *, element_dim: Optional[int] = None, unroll: Optional[int] = None, block_quota: Optional[int] = None, page_size: Optional[int] = None) -> None:
    """:func:`transfer_hicache_one_layer` with one cache per side (MLA, the DSA indexer)."""
    quota = _tuning(unroll, block_quota)
    tag = "HicacheKernel MLA"
    _same_dtype(tag, cache_dst, cache_src)
    dim = element_dim or cache_dst.shape[-1]
    d, s = _Cache(cache_dst, dim, tag), _Cache(cache_src, dim, tag)
    si, di = _indices(indices_src), _indices(indices_dst)
    si, di = _beside(si, di), _beside(di, si)
    if s.flat is None and d.flat is None:
        kvcacheio.transfer_kv_per_layer_mla(s.view, d.view, si, di, d.item, block_quota=quota)
    elif d.flat is None:
        kvcacheio.transfer_kv_per_layer_mla_pf_lf(s.flat, d.view, si, di, s.layer, d.item, s.stride, block_quota=quota)
    elif s.flat is None:
        kvcacheio.transfer_kv_per_layer_mla_lf_pf(s.view, d.flat, si, di, d.layer, d.item, d.stride, block_quota=quota)
    else:
        raise ValueError(f"{tag}: hicache-io moves between contiguous rows and one strided side, not two strided sides")


# ---- all layers through pointer tables -----------------------------------------------------


def _table_len(table: Any) -> int:
    return len(table) if isinstance(table, (list, tuple)) else int(table.shape[0])


def _table_entries(table: Any) -> List[int]:
    """A 1-D table of layer addresses as ints (a GPU table is copied to the host on the caller's
    stream, which this waits for)."""
    return [int(x) for x in _native.host_words(table, stream=kvcacheio._cuda_stream(table))]


def _rows_needed(idx: Any) -> int:
    """One more than the largest index (negative indices are skipped), at least 1."""
    if isinstance(idx, (list, tuple)):
        values = [int(v) for v in idx]
    else:
        values = [v if v < 1 << 63 else v - (1 << 64) for v in _native.host_words(idx, stream=kvcacheio._cuda_stream(idx))]
    return max(max(values, default=0) + 1, 1)


def _host_bytes(addr: int, nbytes: int) -> Any:
    """``nbytes`` of host memory at ``addr`` as a writable uint8 array (trusted, like a table)."""
    import numpy as np

    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _page_first_side(table: Any, stride: int, item: int, indices: Any, what: str) -> Any:
    """A side of an all-layer copy whose rows are ``stride`` bytes apart: it must be sglang's table
    of every layer of one page_first host buffer (entry ``l`` = the buffer's start + ``l * item``,
    ``stride`` = layers × ``item``). Returns that buffer's bytes, as far as the indices reach."""
    if isinstance(table, (list, tuple)):
        raise ValueError(f"{what}: rows at a stride of {stride} bytes need a table of layer addresses, not a list of arrays")
    entries = _table_entries(table)
    base = entries[0] if entries else 0
    if not entries or stride % item or stride // item != len(entries) or any(e != base + l * item for l, e in enumerate(entries)):
        raise ValueError(
            f"{what}: rows of {item} bytes at a stride of {stride} are taken as the layers of one page_first host buffer "
            f"(a table of every layer, entry l at its start + l * {item}); this table is not one"
        )
    return _host_bytes(base, _rows_needed(indices) * stride)


def _all_layer(tag: str, src_tables: List[Any], dst_tables: List[Any], indices_src: Any, indices_dst: Any, src_stride: int, dst_stride: int, element_size: Optional[int], quota: int) -> None:
    """The all-layer copy of :func:`transfer_hicache_all_layer` (two tables a side, K and V) or
    its MLA twin (one)."""
    if element_size is None:
        # sglang asserts this.
        assert src_stride == dst_stride, f"{tag}: element_size is required when the source and destination strides differ"
        element_size = src_stride
    item = element_size
    if src_stride != item:
        raise ValueError(
            f"{tag}: source rows at a stride of {src_stride} bytes for {item}-byte rows (strided device rows) are not supported; "
            "hicache-io's all-layer copies read layer_first layers"
        )
    if dst_stride < item:
        raise ValueError(f"{tag}: destination stride {dst_stride} is smaller than the {item}-byte rows")
    si, di = _indices(indices_src), _indices(indices_dst)
    si, di = _beside(si, di), _beside(di, si)
    layers = _table_len(src_tables[0])
    if dst_stride == item:
        if len(src_tables) == 2:
            kvcacheio.transfer_kv_all_layer(src_tables[0], dst_tables[0], src_tables[1], dst_tables[1], si, di, item, layers, block_quota=quota)
        else:
            kvcacheio.transfer_kv_all_layer_mla(src_tables[0], dst_tables[0], si, di, item, layers, block_quota=quota)
        return
    dst = [_page_first_side(t, dst_stride, item, di, f"{tag}: destination") for t in dst_tables]
    if len(src_tables) == 2:
        kvcacheio.transfer_kv_all_layer_lf_pf(src_tables[0], dst[0], src_tables[1], dst[1], si, di, item, dst_stride, layers, block_quota=quota)
    else:
        kvcacheio.transfer_kv_all_layer_mla_lf_pf(src_tables[0], dst[0], si, di, item, dst_stride, layers, block_quota=quota)


def transfer_hicache_all_layer(k_ptr_dst: Any, v_ptr_dst: Any, indices_dst: Any, k_ptr_src: Any, v_ptr_src: Any, indices_src: Any, *, kv_cache_src_stride_bytes: int, kv_cache_dst_stride_bytes: int, element_size: Optional[int] = None, unroll: Optional[int] = None, block_quota: Optional[int] = None, page_size: Optional[int] = None) -> None:
    """Every layer ``l`` of the uint64 pointer tables (or lists of arrays): ``element_size`` bytes
    at ``src[l] + indices_src[i] * kv_cache_src_stride_bytes`` → ``dst[l] + indices_dst[i] *
    kv_cache_dst_stride_bytes``, K then V. The source rows are packed (stride = element_size);
    the destination is layer_first rows, or every layer of a page_first host buffer (stride =
    layers × element_size). Tables are trusted as in sglang (each layer holds the rows its
    largest index needs)."""
    quota = _tuning(unroll, block_quota)
    _all_layer("HicacheKernel", [k_ptr_src, v_ptr_src], [k_ptr_dst, v_ptr_dst], indices_src, indices_dst, kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes, element_size, quota)


def transfer_hicache_all_layer_mla(ptr_dst: Any, indices_dst: Any, ptr_src: Any, indices_src: Any, *, cache_src_stride_bytes: int, cache_dst_stride_bytes: int, element_size: Optional[int] = None, unroll: Optional[int] = None, block_quota: Optional[int] = None, page_size: Optional[int] = None) -> None:
    """:func:`transfer_hicache_all_layer` with one table per side (MLA, K-only pools)."""
    quota = _tuning(unroll, block_quota)
    _all_layer("HicacheKernel MLA", [ptr_src], [ptr_dst], indices_src, indices_dst, cache_src_stride_bytes, cache_dst_stride_bytes, element_size, quota)


# ---- staged page_first write-back ----------------------------------------------------------


def _staged_checks(page_size: int, staging: Any, dst: Any, element_size: Optional[int], src_indices: Any, dst_indices: Any) -> Tuple[int, int]:
    """sglang's staged relayout checks; returns (element bytes, host layers). Like sglang, the
    buffers are viewed as ``(tokens, layers, -1)``: MHA passes ``(size, L, H, D)``, the DSA
    indexer ``(pages, L, 1, stride)``."""
    if page_size <= 0:
        raise RuntimeError("HiCache staged relayout: page_size must be positive")
    shape, _, size, _ = _layout(dst)
    if len(shape) < 3:
        raise RuntimeError(f"HiCache staged relayout: dst must be (tokens, layers, ...), got shape {shape}")
    row = size
    for d in shape[2:]:
        row *= d
    sshape, _, ssize, _ = _layout(staging)
    staged_row = ssize
    for d in sshape[2:]:
        staged_row *= d
    element_size = element_size or staged_row
    if element_size != row or staged_row != row or (len(sshape) >= 2 and sshape[1] != shape[1]):
        raise RuntimeError("HiCache staged relayout: element size mismatch")
    if row % 16 != 0:
        raise RuntimeError("HiCache staged relayout: element size must be 16-byte aligned")
    if _dtype(staging) != _dtype(dst):
        raise RuntimeError("Source and destination tensors must have the same dtype")
    if staging.shape[0] % page_size != 0:
        raise RuntimeError("HiCache staged relayout: staging token count mismatch")
    if _table_len(src_indices) != _table_len(dst_indices):
        raise RuntimeError("Source and destination page spans must match")
    if _table_len(src_indices) % page_size != 0:
        raise RuntimeError("hicache-io: the staged write-back moves whole pages; the index count must be a multiple of page_size")
    return row, shape[1]


def _whole_pages(idx: Any, page_size: int) -> Any:
    """The token rows of the pages that start at ``idx[::page_size]`` (what sglang's staged kernel
    reads: whole pages from each start)."""
    return _rows_from(_indices(idx)[::page_size], page_size)


def _rows_from(starts: Any, page_size: int) -> Any:
    """``page_size`` consecutive rows from each of ``starts`` (int64), start by start."""
    if _lib(starts) == "torch":
        import torch

        return (starts[:, None] + torch.arange(page_size, device=starts.device, dtype=torch.int64)).reshape(-1)
    if _lib(starts) == "cupy":
        import cupy as xp
    else:
        import numpy as xp
    return (xp.asarray(starts, dtype="int64")[:, None] + xp.arange(page_size, dtype="int64")).reshape(-1)


def transfer_hicache_all_layer_staged_lf_pf(k_ptr_src: Any, v_ptr_src: Any, src_indices: Any, dst_indices: Any, staging_k: Any, staging_v: Any, dst_k: Any, dst_v: Any, *, page_size: int, element_size: Optional[int] = None, unroll: Optional[int] = None, block_quota: Optional[int] = None) -> None:
    """Every device layer (uint64 pointer tables ``k_ptr_src``/``v_ptr_src``) into page_first host
    buffers ``dst_k``/``dst_v`` of shape ``(tokens, L, D)``, whole pages: the page starting at
    device row ``src_indices[p * page_size]`` lands at host row ``dst_indices[p * page_size]``.
    hicache-io writes the pages in place with no staging copy; ``staging_k``/``staging_v`` are
    checked as sglang checks them and left untouched."""
    quota = _tuning(unroll, block_quota)
    item, layers = _staged_checks(page_size, staging_k, dst_k, element_size, src_indices, dst_indices)
    _staged_checks(page_size, staging_v, dst_v, element_size, src_indices, dst_indices)
    si, di = _whole_pages(src_indices, page_size), _whole_pages(dst_indices, page_size)
    si, di = _beside(si, di), _beside(di, si)
    kvcacheio.transfer_kv_all_layer_lf_pf(k_ptr_src, dst_k, v_ptr_src, dst_v, si, di, item, layers * item, layers, block_quota=quota)


def transfer_hicache_all_layer_mla_staged_lf_pf(ptr_src: Any, src_indices: Any, dst_indices: Any, staging: Any, dst: Any, *, page_size: int, element_size: Optional[int] = None, unroll: Optional[int] = None, block_quota: Optional[int] = None) -> None:
    """:func:`transfer_hicache_all_layer_staged_lf_pf` with one buffer (MLA)."""
    quota = _tuning(unroll, block_quota)
    item, layers = _staged_checks(page_size, staging, dst, element_size, src_indices, dst_indices)
    si, di = _whole_pages(src_indices, page_size), _whole_pages(dst_indices, page_size)
    si, di = _beside(si, di), _beside(di, si)
    kvcacheio.transfer_kv_all_layer_mla_lf_pf(ptr_src, dst, si, di, item, layers * item, layers, block_quota=quota)


# ---- page_unified: one host buffer, K and V inside each layer ------------------------------
# MHA pages (pages, G, L, 2, P, H/G, D), MLA pages (pages, L, P, D); sglang 0.5.23 defines these
# entry points but no pool calls them yet.


def can_use_page_unified_load_back_jit_kernel(*, group_bytes: int, block_quota: Optional[int] = None) -> bool:
    """sglang's gate of its page_unified load-back kernel: head-group rows of a positive multiple
    of 16 bytes (hicache-io moves any size; the answer is sglang's, so pools choose as they would)."""
    return group_bytes > 0 and group_bytes % 16 == 0 and (block_quota is None or block_quota >= 0)


def _unified_shape(host: Any, mla: bool, what: str) -> Tuple[int, int, int, int, int]:
    """(groups, layers, page size, row bytes of one token and layer, bytes per element) of a
    page_unified host (or staging) array."""
    shape, _, size, _ = _layout(host)
    if mla:
        if len(shape) != 4:
            raise RuntimeError(f"HiCache page_unified: {what} must be (pages, layers, page_size, dim), got shape {shape}")
        return 1, shape[1], shape[2], shape[3] * size, size
    if len(shape) != 7 or shape[3] != 2:
        raise RuntimeError(f"HiCache page_unified: {what} must be (pages, groups, layers, 2, page_size, heads / groups, head_dim), got shape {shape}")
    return shape[1], shape[2], shape[4], shape[1] * shape[5] * shape[6] * size, size


def _flat(host: Any, what: str) -> Any:
    """A contiguous host array as one dimension (what the kvcacheio ops take); refuses others,
    which a reshape would copy (a write-back would then land in the copy)."""
    shape, strides, _, _ = _layout(host)
    step = 1
    for d, st in zip(reversed(shape), reversed(strides)):
        if d != 1 and st != step:
            raise RuntimeError(f"HiCache page_unified: {what} must be contiguous, got shape {shape} with strides {strides}")
        step *= d
    return host.reshape(-1)


def _rows_of(t: Any, element_dim: int, what: str) -> Any:
    """A device layer as contiguous rows of ``element_dim`` elements."""
    c = _Cache(t, element_dim, what)
    if c.flat is not None:
        raise ValueError(f"HiCache page_unified: {what} must be contiguous rows of {element_dim} elements")
    return c.view


def transfer_hicache_one_layer_page_unified_lf(k_cache_dst: Any, v_cache_dst: Any, src: Any, src_indices: Any, dst_indices: Any, layer_id: int, *, block_quota: Optional[int] = None) -> None:
    """Layer ``layer_id`` of a page_unified host buffer ``src`` (``(pages, G, L, 2, P, H/G, D)``)
    into the device layers ``k_cache_dst`` / ``v_cache_dst`` (rows of ``H × D``): host token
    ``src_indices[i]`` (page ``i // P``) to device row ``dst_indices[i]``."""
    quota = _tuning(None, block_quota)
    _same_dtype("HiCache page_unified", k_cache_dst, v_cache_dst, src)
    groups, layers, page, item, size = _unified_shape(src, False, "src")
    kd, vd = _rows_of(k_cache_dst, item // size, "k_cache_dst"), _rows_of(v_cache_dst, item // size, "v_cache_dst")
    si, di = _indices(src_indices), _indices(dst_indices)
    si, di = _beside(si, di), _beside(di, si)
    kvcacheio.transfer_kv_per_layer_pu_lf(_flat(src, "src"), kd, vd, si, di, layer_id, item, item * layers, page, groups, block_quota=quota)


def transfer_hicache_one_layer_mla_page_unified_lf(cache_dst: Any, src: Any, src_indices: Any, dst_indices: Any, layer_id: int, *, block_quota: Optional[int] = None) -> None:
    """:func:`transfer_hicache_one_layer_page_unified_lf` for MLA: ``src`` is ``(pages, L, P, D)``."""
    quota = _tuning(None, block_quota)
    _same_dtype("HiCache page_unified", cache_dst, src)
    _, layers, page, item, size = _unified_shape(src, True, "src")
    cd = _rows_of(cache_dst, item // size, "cache_dst")
    si, di = _indices(src_indices), _indices(dst_indices)
    si, di = _beside(si, di), _beside(di, si)
    kvcacheio.transfer_kv_per_layer_mla_pu_lf(_flat(src, "src"), cd, si, di, layer_id, item, item * layers, page, block_quota=quota)


def _unified_write_back(src_pages: Any, dst_pages: Any, staging: Any, dst: Any, mla: bool) -> Tuple[Any, Any, int, int, int, int]:
    """sglang's page_unified write-back checks; returns (device rows, host rows, groups, layers,
    page size, row bytes). ``staging`` is checked as sglang checks it and left untouched."""
    groups, layers, page, item, size = _unified_shape(dst, mla, "dst")
    sg = _unified_shape(staging, mla, "staging")
    if sg[:4] != (groups, layers, page, item) or sg[4] != size or _dtype(staging) != _dtype(dst):
        raise RuntimeError("HiCache page_unified write-back: element size mismatch")
    if (item // groups) % 16:
        raise RuntimeError("HiCache page_unified write-back: element size must be 16-byte aligned")
    if _table_len(src_pages) != _table_len(dst_pages):
        raise RuntimeError("Source and destination page spans must match")
    return _page_rows(src_pages, page), _page_rows(dst_pages, page), groups, layers, page, item


def _page_rows(pages: Any, page_size: int) -> Any:
    """The token rows of pages ``pages`` (page ids), page by page."""
    idx = _indices(pages)
    if _lib(idx) == "numpy":
        import numpy as np

        idx = np.asarray(idx, dtype="int64")
    return _rows_from(idx * page_size, page_size)


def transfer_hicache_all_layer_staged_lf_page_unified(k_ptr_src: Any, v_ptr_src: Any, src_pages: Any, dst_pages: Any, staging: Any, dst: Any) -> None:
    """Every device layer (uint64 pointer tables or lists ``k_ptr_src`` / ``v_ptr_src``) into the
    page_unified host buffer ``dst`` (``(pages, G, L, 2, P, H/G, D)``), whole pages: device page
    ``src_pages[i]`` to host page ``dst_pages[i]`` (page ids). hicache-io writes the pages in place
    with no staging copy; ``staging`` is checked as sglang checks it and left untouched."""
    si, di, groups, layers, page, item = _unified_write_back(src_pages, dst_pages, staging, dst, False)
    si, di = _beside(si, di), _beside(di, si)
    kvcacheio.transfer_kv_all_layer_lf_pu(k_ptr_src, v_ptr_src, _flat(dst, "dst"), si, di, item, item * layers, layers, page, groups, block_quota=DEFAULT_BLOCK_QUOTA)


def transfer_hicache_all_layer_mla_staged_lf_page_unified(ptr_src: Any, src_pages: Any, dst_pages: Any, staging: Any, dst: Any) -> None:
    """:func:`transfer_hicache_all_layer_staged_lf_page_unified` for MLA: ``dst`` is ``(pages, L, P, D)``."""
    si, di, _, layers, page, item = _unified_write_back(src_pages, dst_pages, staging, dst, True)
    si, di = _beside(si, di), _beside(di, si)
    kvcacheio.transfer_kv_all_layer_mla_lf_pu(ptr_src, _flat(dst, "dst"), si, di, item, item * layers, layers, page, block_quota=DEFAULT_BLOCK_QUOTA)
