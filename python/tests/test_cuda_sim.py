"""The Python CUDA path on the simulated driver (``scripts/cuda-sim.sh python -m pytest ...``):
CUDA arrays (``kDLCUDA`` through DLPack) over simulated device memory, pinned host arrays, CUDA
index arrays, and the kvcacheio ops on the cuda executor, compared with numpy fancy indexing.

A tiny DLPack producer stands in for torch: ``DevArray`` allocates with ``cuMemAlloc`` through
ctypes and exports itself as a ``dltensor`` capsule. Skips unless ``HICACHE_CUDA_SIM=1`` (set by
the script), and then fails if the loaded driver is not the simulator."""

import ctypes
import os

import numpy as np
import pytest

if os.environ.get("HICACHE_CUDA_SIM") != "1":
    pytest.skip("not under scripts/cuda-sim.sh", allow_module_level=True)

from common import pages  # noqa: E402
from hicache_io import kvcacheio as kv  # noqa: E402

cu = ctypes.CDLL("libcuda.so.1")
assert hasattr(cu, "hicache_cuda_sim_errors"), "HICACHE_CUDA_SIM=1 but libcuda.so.1 is not the simulator"


def check(rc, what):
    assert rc == 0, f"{what}: CUresult {rc}"


check(cu.cuInit(0), "cuInit")
_ctx = ctypes.c_void_p()
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(_ctx), 0), "cuDevicePrimaryCtxRetain")
check(cu.cuCtxSetCurrent(_ctx), "cuCtxSetCurrent")
cu.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
cu.cuMemFreeHost.argtypes = [ctypes.c_void_p]
cu.cuStreamSynchronize.argtypes = [ctypes.c_void_p]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_DL_CODES = {"i": 0, "u": 1, "f": 2}


class DevArray:
    """A C-contiguous array in simulated device memory that speaks DLPack (kDLCUDA, device 0)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        ptr = ctypes.c_uint64()
        check(cu.cuMemAlloc_v2(ctypes.byref(ptr), max(self.nbytes, 1)), "cuMemAlloc")
        self.ptr = ptr.value
        self._keep = []

    @classmethod
    def of(cls, a):
        a = np.ascontiguousarray(a)
        d = cls(a.shape, a.dtype)
        check(cu.cuMemcpyHtoD_v2(d.ptr, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")
        # A copy from pageable memory may return before its DMA lands.
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        return d

    def numpy(self):
        out = np.empty(self.shape, self.dtype)
        check(cu.cuMemcpyDtoH_v2(out.ctypes.data, self.ptr, self.nbytes), "cuMemcpyDtoH")
        return out

    device_id = 0

    def __len__(self):
        return self.shape[0]

    def __dlpack_device__(self):
        return (2, self.device_id)

    def __dlpack__(self, stream=None, max_version=None):
        shape = (ctypes.c_int64 * len(self.shape))(*self.shape)
        m = DLManagedTensor()
        m.dl_tensor.data = self.ptr
        m.dl_tensor.device = DLDevice(2, self.device_id)
        m.dl_tensor.ndim = len(self.shape)
        m.dl_tensor.dtype = DLDataType(_DL_CODES[self.dtype.kind], self.dtype.itemsize * 8, 1)
        m.dl_tensor.shape = shape
        self._keep.append((m, shape))
        return _capsule_new(ctypes.addressof(m), b"dltensor", None)

    def __del__(self):
        cu.cuCtxSynchronize()
        cu.cuMemFree_v2(self.ptr)


_pinned = []


def pinned(shape, dtype, fill=None):
    """A numpy array over cuMemHostAlloc memory (what torch's pin_memory gives)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    p = ctypes.c_void_p()
    check(cu.cuMemHostAlloc(ctypes.byref(p), n, 1 | 2), "cuMemHostAlloc")
    _pinned.append(p.value)
    a = np.frombuffer((ctypes.c_uint8 * n).from_address(p.value), dtype=dtype).reshape(shape)
    a[...] = 0 if fill is None else fill
    return a


def sync():
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize (a race or fault on the simulated device?)")


def sim_errors():
    r, f = ctypes.c_uint64(), ctypes.c_uint64()
    cu.hicache_cuda_sim_errors(ctypes.byref(r), ctypes.byref(f))
    return r.value, f.value


SLOTS, LAYERS, ITEM = 1024, 3, 256
rng = np.random.default_rng(7)


@pytest.mark.parametrize("cuda_indices", [False, True])
def test_per_layer_load_from_pinned_host(cuda_indices):
    host = pinned((SLOTS, ITEM), np.uint8, rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8))
    dev = DevArray.of(np.zeros((SLOTS, ITEM), np.uint8))
    hi, di = pages(256, 16, SLOTS, 1), pages(256, 16, SLOTS, 2)
    idx = (DevArray.of(hi), DevArray.of(di)) if cuda_indices else (hi, di)
    kv.transfer_kv_per_layer_mla(host, dev, idx[0], idx[1], ITEM)
    sync()
    ref = np.zeros((SLOTS, ITEM), np.uint8)
    ref[di] = host[hi]
    assert np.array_equal(dev.numpy(), ref)
    assert sim_errors() == (0, 0)


def test_mha_per_layer_load_and_all_layer_backup_page_first():
    k = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    v = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    hk, hv = pinned((SLOTS, LAYERS, ITEM), np.uint8), pinned((SLOTS, LAYERS, ITEM), np.uint8)
    di, hi = pages(128, 16, SLOTS, 3), pages(128, 16, SLOTS, 4)
    kv.transfer_kv_all_layer_lf_pf(k, hk, v, hv, DevArray.of(di), DevArray.of(hi), ITEM, ITEM * LAYERS, LAYERS)
    sync()
    for layer in range(LAYERS):
        assert np.array_equal(hk[hi, layer], k[layer].numpy()[di])
        assert np.array_equal(hv[hi, layer], v[layer].numpy()[di])
    # And back into fresh device layers, one layer at a time.
    back_k = DevArray.of(np.zeros((SLOTS, ITEM), np.uint8))
    back_v = DevArray.of(np.zeros((SLOTS, ITEM), np.uint8))
    kv.transfer_kv_per_layer_pf_lf(hk, back_k, hv, back_v, hi, di, 1, ITEM, ITEM * LAYERS)
    sync()
    assert np.array_equal(back_k.numpy()[di], k[1].numpy()[di])
    assert np.array_equal(back_v.numpy()[di], v[1].numpy()[di])


def test_direct_and_per_layer_lf_pf():
    dev = DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8))
    host = pinned((SLOTS, LAYERS, ITEM), np.uint8)
    di, hi = pages(128, 16, SLOTS, 5), pages(128, 16, SLOTS, 6)
    kv.transfer_kv_per_layer_mla_lf_pf(dev, host, di, hi, 2, ITEM, ITEM * LAYERS)
    back = DevArray.of(np.zeros((SLOTS, ITEM), np.uint8))
    kv.transfer_kv_direct([dev], [back], di, hi, 16)
    sync()
    assert np.array_equal(host[hi, 2], dev.numpy()[di])
    assert np.array_equal(back.numpy()[hi], dev.numpy()[di])


def test_bad_input_moves_nothing():
    dev = DevArray.of(rng.integers(0, 256, (64, ITEM), dtype=np.uint8))
    before = dev.numpy()
    host = pinned((64, ITEM), np.uint8, 5)
    with pytest.raises(IndexError):
        kv.transfer_kv_per_layer_mla(host, dev, np.array([1, 2]), DevArray.of(np.array([3, 64], np.int64)), ITEM)
    with pytest.raises(RuntimeError, match="^Source and destination indices must have the same length$"):
        kv.transfer_kv_per_layer_mla(host, dev, np.array([1, 2]), np.array([3]), ITEM)
    # Unpinned host memory next to CUDA arrays: the driver has no device address for it.
    with pytest.raises(RuntimeError, match="not mapped for the device"):
        kv.transfer_kv_per_layer_mla(np.zeros((64, ITEM), np.uint8), dev, np.array([1]), np.array([3]), ITEM)
    sync()
    assert np.array_equal(dev.numpy(), before)
    assert sim_errors() == (0, 0)


def test_cuda_index_lists_are_checked_on_the_device():
    """Both index arrays on the GPU: the op is enqueued without reading them; a failing list moves
    nothing, and synchronize() raises what the host checks raise for the same lists."""
    host = pinned((64, ITEM), np.uint8, rng.integers(0, 256, (64, ITEM), dtype=np.uint8))
    dev = DevArray.of(np.zeros((64, ITEM), np.uint8))
    cases = [
        (np.array([1, 70, 3], np.int64), np.array([4, 5, 6], np.int64), IndexError),
        (np.array([1, 2, 3], np.int64), np.array([4, 5, 4], np.int64), ValueError),
    ]
    for hi, di, exc in cases:
        with pytest.raises(exc) as host_checked:
            kv.transfer_kv_per_layer_mla(host, dev, hi, di, ITEM)
        lists = (DevArray.of(hi), DevArray.of(di))
        kv.transfer_kv_per_layer_mla(host, dev, lists[0], lists[1], ITEM)
        with pytest.raises(exc) as device_checked:
            kv.synchronize()
        assert str(device_checked.value).startswith("transfer_kv_per_layer_mla (issued earlier")
        assert str(device_checked.value).endswith(str(host_checked.value))
        assert not dev.numpy().any(), "a refused call moved bytes"
        kv.synchronize()  # reported once
    # A valid pair of CUDA lists moves its bytes.
    hi, di = np.array([5, 0, 63], np.int64), np.array([1, 2, 3], np.int64)
    lists = (DevArray.of(hi), DevArray.of(di))
    kv.transfer_kv_per_layer_mla(host, dev, lists[0], lists[1], ITEM)
    kv.synchronize()
    assert np.array_equal(dev.numpy()[di], host[hi])
    assert sim_errors() == (0, 0)


def test_the_next_op_raises_an_earlier_failed_check():
    host = pinned((64, ITEM), np.uint8, 9)
    dev = DevArray.of(np.zeros((64, ITEM), np.uint8))
    bad = (DevArray.of(np.array([0, 1], np.int64)), DevArray.of(np.array([7, 7], np.int64)))
    good = (DevArray.of(np.array([2], np.int64)), DevArray.of(np.array([9], np.int64)))
    kv.transfer_kv_per_layer_mla(host, dev, bad[0], bad[1], ITEM)
    sync()
    with pytest.raises(ValueError, match="written twice"):
        kv.transfer_kv_per_layer_mla(host, dev, good[0], good[1], ITEM)
    sync()
    assert not dev.numpy().any()
    kv.transfer_kv_per_layer_mla(host, dev, good[0], good[1], ITEM)
    kv.synchronize()
    assert (dev.numpy()[9] == 9).all()


def test_index_arrays_on_another_device_are_refused():
    host = pinned((64, ITEM), np.uint8, 3)
    dev = DevArray.of(np.zeros((64, ITEM), np.uint8))
    hi, di = DevArray.of(np.array([1], np.int64)), DevArray.of(np.array([2], np.int64))
    di.device_id = 1
    with pytest.raises(ValueError, match="destination indices are on CUDA device 1, the data on device 0"):
        kv.transfer_kv_per_layer_mla(host, dev, hi, di, ITEM)
    sync()
    assert not dev.numpy().any()


@pytest.mark.parametrize("block_quota,num_warps_per_block", [(1, 1), (3, 7), (64, 32), (100000, 99)])
def test_launch_arguments_do_not_change_the_bytes(block_quota, num_warps_per_block):
    k = DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8))
    v = DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8))
    hk, hv = pinned((SLOTS, LAYERS, ITEM), np.uint8), pinned((SLOTS, LAYERS, ITEM), np.uint8)
    di, hi = pages(256, 16, SLOTS, 8), pages(256, 16, SLOTS, 9)
    lists = (DevArray.of(di), DevArray.of(hi))
    kv.transfer_kv_per_layer_lf_pf(k, hk, v, hv, lists[0], lists[1], 1, ITEM, ITEM * LAYERS,
                                   block_quota=block_quota, num_warps_per_block=num_warps_per_block)
    kv.synchronize()
    assert np.array_equal(hk[hi, 1], k.numpy()[di])
    assert np.array_equal(hv[hi, 1], v.numpy()[di])
    assert sim_errors() == (0, 0)


@pytest.mark.parametrize("cuda_indices", [False, True])
def test_head_group_major_load_and_backup(cuda_indices):
    """The pfdhg pair on the cuda executor: pinned head-group-major host pages, device layers."""
    heads, groups, layers, page, dim, npages = 8, 4, 3, 8, 16, 4
    rows, item = npages * page, heads * dim * 2
    shape = (npages, groups, layers, page, heads // groups, dim)
    hk = pinned(shape, np.float16, rng.standard_normal(shape).astype(np.float16))
    hv = pinned(shape, np.float16, rng.standard_normal(shape).astype(np.float16))
    dk, dv = DevArray.of(np.zeros((rows, heads, dim), np.float16)), DevArray.of(np.zeros((rows, heads, dim), np.float16))
    src = np.arange(rows, dtype=np.int64)
    dst = src[::-1].copy()
    idx = (DevArray.of(src), DevArray.of(dst)) if cuda_indices else (src, dst)
    kv.transfer_kv_per_layer_pfdhg_lf(hk.reshape(-1), dk, hv.reshape(-1), dv, idx[0], idx[1], 1, item, item * layers, page, groups)
    sync()
    for host, dev in ((hk, dk), (hv, dv)):
        assert np.array_equal(dev.numpy()[dst], host[src // page, :, 1, src % page].reshape(rows, heads, dim))
    # Every device layer back into fresh pinned pages, then compared through the 6-D view.
    lk = [DevArray.of(rng.standard_normal((rows, heads, dim)).astype(np.float16)) for _ in range(layers)]
    lv = [DevArray.of(rng.standard_normal((rows, heads, dim)).astype(np.float16)) for _ in range(layers)]
    bk, bv = pinned(shape, np.float16), pinned(shape, np.float16)
    b_idx = (DevArray.of(dst), DevArray.of(src)) if cuda_indices else (dst, src)
    kv.transfer_kv_all_layer_lf_pfdhg(lk, bk.reshape(-1), lv, bv.reshape(-1), b_idx[0], b_idx[1], item, item * layers, layers, page, groups)
    sync()
    for layer in range(layers):
        for host, dev in ((bk, lk), (bv, lv)):
            assert np.array_equal(host[src // page, :, layer, src % page].reshape(rows, heads, dim), dev[layer].numpy()[dst])
    assert sim_errors() == (0, 0)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_embedding_ranges_on_the_copy_engine(direction):
    host = pinned((28, 37), np.int16, rng.integers(0, 1 << 14, (28, 37)).astype(np.int16))
    dev = DevArray.of(np.full((16, 37), -1, np.int16))
    hs, ds, n = [1, 11, 23], [2, 6, 10], [4, 4, 2]
    if direction == "h2d":
        kv.transfer_embedding_ranges_direct(host, dev, hs, ds, n)
        sync()
        want = np.full((16, 37), -1, np.int16)
        for s, d, k in zip(hs, ds, n):
            want[d : d + k] = host[s : s + k]
        assert np.array_equal(dev.numpy(), want)
    else:
        before = dev.numpy()
        out = pinned((28, 37), np.int16, -1)
        kv.transfer_embedding_ranges_direct(dev, out, ds, hs, n)
        sync()
        want = np.full((28, 37), -1, np.int16)
        for s, d, k in zip(ds, hs, n):
            want[d : d + k] = before[s : s + k]
        assert np.array_equal(out, want)
    assert sim_errors() == (0, 0)


def test_jit_one_layer_on_cuda_arrays():
    from hicache_io import hicache

    host = pinned((SLOTS, ITEM), np.uint8, rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8))
    dk, dv = DevArray.of(np.zeros((SLOTS, ITEM), np.uint8)), DevArray.of(np.zeros((SLOTS, ITEM), np.uint8))
    hi, di = pages(64, 16, SLOTS, 8), pages(64, 16, SLOTS, 9)
    # DevArray is not a library hicache.py knows, so only contiguous rows (its only shape) apply.
    hicache.transfer_hicache_one_layer_mla(dk, DevArray.of(di), host, DevArray.of(hi), element_dim=ITEM)
    sync()
    ref = np.zeros((SLOTS, ITEM), np.uint8)
    ref[di] = host[hi]
    assert np.array_equal(dk.numpy(), ref)
    assert sim_errors() == (0, 0)


_registered = []
cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]


def registered(shape, dtype, cuts=(), fill=None, skip=()):
    """sglang's host pool memory: anonymous mmap (not cuMemHostAlloc), registered with
    ``cuMemHostRegister(ptr, size, 0)`` in chunks that end at the byte offsets ``cuts`` (sglang
    registers large pools chunk by chunk, on page boundaries); chunks numbered in ``skip`` are
    left unregistered (a hole)."""
    import mmap

    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    m = mmap.mmap(-1, n)
    a = np.frombuffer(m, dtype=dtype).reshape(shape)
    base = a.ctypes.data
    bounds = [0, *cuts, n]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if i not in skip:
            check(cu.cuMemHostRegister_v2(base + lo, hi - lo, 0), "cuMemHostRegister")
            _registered.append((m, base + lo))
    if fill is not None:
        a[...] = fill
    return a


def table(ptrs):
    """A uint64 layer table on the GPU, as sglang's ``make_kernel_ptr_table`` builds it."""
    return DevArray.of(np.array(ptrs, np.uint64))


def test_sglang_registered_host_pool_chunked_page_first():
    """sglang's page_first MLA pool on CUDA: mmap'd memory registered in two chunks split on a page
    boundary, a device table of ``get_device_accessible_ptr`` of every layer's strided view
    (``kv_buffer.transpose(0, 1)[l]``), backups through the JIT all-layer copy (the K-only pool's
    call) and AOT ``transfer_kv_all_layer_mla_lf_pf``, loads through the JIT one-layer copy from
    the strided views, every byte compared."""
    from hicache_io import hicache

    page = 16
    host = registered((SLOTS, LAYERS, ITEM), np.uint8, cuts=(SLOTS // 2 * LAYERS * ITEM,))
    views = [host.transpose(1, 0, 2)[layer] for layer in range(LAYERS)]
    ptrs = [kv.get_device_accessible_ptr(v, 0) for v in views]
    assert ptrs == [host.ctypes.data + layer * ITEM for layer in range(LAYERS)]
    dev = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    dev_table, host_table = table([d.ptr for d in dev]), table(ptrs)
    # Pages on both sides of the registration boundary.
    di, hi = pages(256, page, SLOTS, 11), pages(256, page, SLOTS, 12)
    hicache.transfer_hicache_all_layer_mla(host_table, DevArray.of(hi), dev_table, DevArray.of(di), cache_dst_stride_bytes=LAYERS * ITEM, cache_src_stride_bytes=ITEM, element_size=ITEM, page_size=page)
    sync()
    for layer in range(LAYERS):
        assert np.array_equal(host[hi, layer], dev[layer].numpy()[di])
    # The AOT op sglang's MLA pool uses when the JIT probe says no.
    host2 = registered((SLOTS, LAYERS, ITEM), np.uint8, cuts=(SLOTS // 4 * LAYERS * ITEM, SLOTS // 2 * LAYERS * ITEM))
    kv.transfer_kv_all_layer_mla_lf_pf(dev_table, host2, DevArray.of(di), DevArray.of(hi), ITEM, LAYERS * ITEM, LAYERS)
    sync()
    assert np.array_equal(host2[hi], host[hi])
    # Per-layer loads from the strided views, as sglang's pools pass them.
    for layer in range(LAYERS):
        back = DevArray.of(np.zeros((SLOTS, ITEM), np.uint8))
        hicache.transfer_hicache_one_layer_mla(back, DevArray.of(di), views[layer], DevArray.of(hi), element_dim=ITEM, page_size=page)
        sync()
        assert np.array_equal(back.numpy()[di], dev[layer].numpy()[di])
    assert sim_errors() == (0, 0)


def test_sglang_registered_host_pool_layer_first_tables():
    """sglang's layer_first MLA pool: per-layer views ``kv_buffer[l]`` of one registered buffer in
    host and device tables, both on the GPU (``transfer_kv_all_layer_mla`` and its JIT twin)."""
    from hicache_io import hicache

    host = registered((LAYERS, SLOTS, ITEM), np.uint8, cuts=(SLOTS * ITEM,))
    dev = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    host_table = table([kv.get_device_accessible_ptr(host[layer], 0) for layer in range(LAYERS)])
    dev_table = table([d.ptr for d in dev])
    di, hi = pages(128, 16, SLOTS, 13), pages(128, 16, SLOTS, 14)
    kv.transfer_kv_all_layer_mla(dev_table, host_table, DevArray.of(di), DevArray.of(hi), ITEM, LAYERS)
    sync()
    for layer in range(LAYERS):
        assert np.array_equal(host[layer][hi], dev[layer].numpy()[di])
    host[...] = 0
    hicache.transfer_hicache_all_layer_mla(host_table, DevArray.of(hi), dev_table, DevArray.of(di), cache_src_stride_bytes=ITEM, cache_dst_stride_bytes=ITEM)
    sync()
    for layer in range(LAYERS):
        assert np.array_equal(host[layer][hi], dev[layer].numpy()[di])
    assert sim_errors() == (0, 0)


def test_host_memory_with_an_unregistered_hole_is_refused_before_the_gpu_touches_it():
    """A host span whose middle chunk was never registered: a kernel touching it would fault the
    context (the simulator faults too); the op refuses it up front and moves nothing."""
    third = SLOTS // 3 // 16 * 16 * ITEM
    host = registered((SLOTS, ITEM), np.uint8, cuts=(third, 2 * third), fill=7, skip=(1,))
    dev = DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8))
    # Rows inside the hole: without the up-front check the copy kernel would write them.
    hole = np.arange(third // ITEM + 1, third // ITEM + 17, dtype=np.int64)
    with pytest.raises(RuntimeError, match="not pinned or registered"):
        kv.transfer_kv_per_layer_mla(dev, host, DevArray.of(np.arange(16, dtype=np.int64)), DevArray.of(hole), ITEM)
    sync()
    assert (host == 7).all()
    with pytest.raises(RuntimeError, match="not pinned or registered"):
        kv.get_device_accessible_ptr(host[third // ITEM + 1], 0)
    assert kv.get_device_accessible_ptr(host[3], 0) == host[3].ctypes.data
    assert sim_errors() == (0, 0)


def test_sglang_backups_with_gpu_tables_never_block_the_host(tmp_path):
    """sglang's backup sequence on CUDA (all-layer AOT ops and JIT names with GPU layer tables and
    CUDA index arrays, MHA, MLA and the DSA indexer's page rows): once each table has been read,
    no driver call blocks the calling thread (the simulator's call trace, in a process of its own:
    ``sim_table_trace.py``)."""
    import subprocess
    import sys

    trace = tmp_path / "trace.txt"
    script = os.path.join(os.path.dirname(__file__), "sim_table_trace.py")
    r = subprocess.run([sys.executable, script], env={**os.environ, "HICACHE_CUDA_SIM_TRACE": str(trace)}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "none blocking" in r.stdout


def test_a_table_freed_and_replaced_at_its_address_is_read_again():
    """The executors remember a GPU layer table by address, and the object that owned it: a new
    table object at a recycled address is read again (no false 'changed' report), while a table
    rewritten in place is refused on the device and moves nothing until forget_layer_tables()."""
    host = pinned((SLOTS, LAYERS * ITEM), np.uint8)
    a = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    b = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    si, di = DevArray.of(np.arange(8, dtype=np.int64)), DevArray.of(np.arange(8, 16, dtype=np.int64))
    for layers in (a, b):
        t = table([d.ptr for d in layers])
        kv.transfer_kv_all_layer_mla_lf_pf(t, host, si, di, ITEM, LAYERS * ITEM, LAYERS)
        kv.synchronize(0)
        got = host.reshape(SLOTS, LAYERS, ITEM)
        for layer in range(LAYERS):
            assert np.array_equal(got[8:16, layer], layers[layer].numpy()[:8])
        del t  # the next table may reuse its address
    t = table([d.ptr for d in a])
    kv.transfer_kv_all_layer_mla_lf_pf(t, host, si, di, ITEM, LAYERS * ITEM, LAYERS)
    kv.synchronize(0)
    swapped = np.array([d.ptr for d in b], np.uint64)
    check(cu.cuMemcpyHtoD_v2(t.ptr, swapped.ctypes.data, swapped.nbytes), "cuMemcpyHtoD")
    sync()
    before = host.copy()
    kv.transfer_kv_all_layer_mla_lf_pf(t, host, si, di, ITEM, LAYERS * ITEM, LAYERS)
    with pytest.raises(RuntimeError, match="changed after it was first read"):
        kv.synchronize(0)
    assert np.array_equal(host, before)
    kv.forget_layer_tables()
    kv.transfer_kv_all_layer_mla_lf_pf(t, host, si, di, ITEM, LAYERS * ITEM, LAYERS)
    kv.synchronize(0)
    got = host.reshape(SLOTS, LAYERS, ITEM)
    assert np.array_equal(got[8:16, 0], b[0].numpy()[:8])
    assert sim_errors() == (0, 0)


class _Prop(ctypes.Structure):
    """``CUmemAllocationProp``: pinned device memory on device 0."""

    _fields_ = [("type", ctypes.c_uint32), ("handle_types", ctypes.c_uint32), ("loc_type", ctypes.c_uint32), ("loc_id", ctypes.c_int32),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_uint64)]


class _Access(ctypes.Structure):
    """``CUmemAccessDesc``: read and write from device 0."""

    _fields_ = [("loc_type", ctypes.c_uint32), ("loc_id", ctypes.c_int32), ("flags", ctypes.c_uint32)]


CHUNK = 2 << 20


class SegmentArray(DevArray):
    """An array inside an expandable-segment style reservation (PyTorch's
    ``expandable_segments:True``): ``chunks`` physical chunks mapped side by side; the array
    starts at ``offset`` so it may straddle chunks."""

    def __init__(self, shape, dtype, chunks=2, offset=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        assert offset + self.nbytes <= chunks * CHUNK
        base = ctypes.c_uint64()
        check(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(chunks * CHUNK), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
        self.base, self.chunks, self.handles = base.value, chunks, []
        prop = _Prop(1, 0, 1, 0, None, 0)
        for i in range(chunks):
            h = ctypes.c_uint64()
            check(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(CHUNK), ctypes.byref(prop), ctypes.c_uint64(0)), "cuMemCreate")
            self.handles.append(h.value)
            self.map(i)
        self.ptr = self.base + offset
        self._keep = []

    def map(self, i):
        at = ctypes.c_uint64(self.base + i * CHUNK)
        check(cu.cuMemMap(at, ctypes.c_size_t(CHUNK), ctypes.c_size_t(0), ctypes.c_uint64(self.handles[i]), ctypes.c_uint64(0)), "cuMemMap")
        access = _Access(1, 0, 3)
        check(cu.cuMemSetAccess(at, ctypes.c_size_t(CHUNK), ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")

    def unmap(self, i):
        check(cu.cuMemUnmap(ctypes.c_uint64(self.base + i * CHUNK), ctypes.c_size_t(CHUNK)), "cuMemUnmap")

    @classmethod
    def of(cls, a, **kw):
        a = np.ascontiguousarray(a)
        d = cls(a.shape, a.dtype, **kw)
        check(cu.cuMemcpyHtoD_v2(d.ptr, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        return d

    def __del__(self):
        pass  # the reservation lives as long as the test process


def test_kv_layers_in_an_expandable_segment_and_the_memory_saver_cycle():
    """Three layers in one reservation of three chunks (the middle layers straddle chunk
    boundaries), backed up through the all-layer op and loaded back per layer, byte for byte;
    a chunk unmapped between two backups (the memory-saver cycle) is refused before anything
    moves, and once mapped again the same bytes move."""
    layer_bytes = SLOTS * ITEM  # 256 KiB: place them so two straddle boundaries
    seg = SegmentArray((3, SLOTS, ITEM), np.uint8, chunks=3, offset=2 * CHUNK - layer_bytes - 4096)
    data = rng.integers(0, 256, (3, SLOTS, ITEM), dtype=np.uint8)
    check(cu.cuMemcpyHtoD_v2(seg.ptr, data.ctypes.data, data.nbytes), "cuMemcpyHtoD")
    sync()

    class Layer(DevArray):
        def __init__(self, ptr):
            self.shape, self.dtype, self.nbytes, self.ptr, self._keep = (SLOTS, ITEM), np.dtype(np.uint8), layer_bytes, ptr, []

        def __del__(self):
            pass

    layers = [Layer(seg.ptr + l * layer_bytes) for l in range(3)]
    host = pinned((SLOTS, 3, ITEM), np.uint8)
    di, hi = pages(128, 16, SLOTS, 21), pages(128, 16, SLOTS, 22)
    kv.transfer_kv_all_layer_mla_lf_pf(layers, host.reshape(-1), DevArray.of(di), DevArray.of(hi), ITEM, 3 * ITEM, 3)
    kv.synchronize(0)
    for l in range(3):
        assert np.array_equal(host[hi, l], data[l][di])
    # The same through a GPU table of the layers (the executor bounds them by the chunks).
    host[...] = 0
    kv.transfer_kv_all_layer_mla_lf_pf(table([x.ptr for x in layers]), host.reshape(-1), DevArray.of(di), DevArray.of(hi), ITEM, 3 * ITEM, 3)
    kv.synchronize(0)
    for l in range(3):
        assert np.array_equal(host[hi, l], data[l][di])
    # Loads back into zeroed rows.
    zero = np.zeros((len(di), ITEM), np.uint8)
    for l in range(3):
        check(cu.cuMemcpyHtoD_v2(layers[l].ptr, np.zeros((SLOTS, ITEM), np.uint8).ctypes.data, layer_bytes), "zero")
    sync()
    for l in range(3):
        kv.transfer_kv_per_layer_mla_pf_lf(host.reshape(-1), layers[l], DevArray.of(hi), DevArray.of(di), l, ITEM, 3 * ITEM)
    kv.synchronize(0)
    for l in range(3):
        got = layers[l].numpy()
        assert np.array_equal(got[di], data[l][di])
        assert not np.array_equal(got[di], zero)
    # The memory-saver cycle: chunk 1 unmapped; a backup reaching it is refused; mapped again, it moves.
    seg.unmap(1)
    before = host.copy()
    with pytest.raises(RuntimeError, match="not mapped|not device memory|not memory the CUDA driver knows"):
        kv.transfer_kv_all_layer_mla_lf_pf(layers, host.reshape(-1), DevArray.of(di), DevArray.of(hi), ITEM, 3 * ITEM, 3)
    kv.synchronize(0)
    assert np.array_equal(host, before)
    seg.map(1)
    host[...] = 0
    kv.transfer_kv_all_layer_mla_lf_pf(layers, host.reshape(-1), DevArray.of(di), DevArray.of(hi), ITEM, 3 * ITEM, 3)
    kv.synchronize(0)
    for l in range(3):
        assert np.array_equal(host[hi, l], data[l][di])
    assert sim_errors() == (0, 0)


def test_kv_layers_from_a_stream_ordered_pool():
    """A layer from ``cuMemAllocAsync`` (PyTorch's ``backend:cudaMallocAsync``): no context of its
    own, the device ordinal decides; backed up and loaded byte for byte on the caller's stream."""
    ptr = ctypes.c_uint64()
    check(cu.cuMemAllocAsync(ctypes.byref(ptr), ctypes.c_size_t(SLOTS * ITEM), ctypes.c_void_p(0)), "cuMemAllocAsync")
    data = rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)
    check(cu.cuMemcpyHtoD_v2(ptr.value, data.ctypes.data, data.nbytes), "cuMemcpyHtoD")
    sync()

    class Pooled(DevArray):
        def __init__(self):
            self.shape, self.dtype, self.nbytes, self.ptr, self._keep = (SLOTS, ITEM), np.dtype(np.uint8), SLOTS * ITEM, ptr.value, []

        def __del__(self):
            pass

    dev = Pooled()
    host = pinned((SLOTS, ITEM), np.uint8)
    di, hi = pages(64, 16, SLOTS, 31), pages(64, 16, SLOTS, 32)
    kv.transfer_kv_per_layer_mla(dev, host, DevArray.of(di), DevArray.of(hi), ITEM)
    kv.synchronize(0)
    assert np.array_equal(host[hi], data[di])
    check(cu.cuMemFreeAsync(ctypes.c_uint64(ptr.value), ctypes.c_void_p(0)), "cuMemFreeAsync")
    sync()
    with pytest.raises(RuntimeError):
        kv.transfer_kv_per_layer_mla(dev, host, DevArray.of(di), DevArray.of(hi), ITEM)
    assert sim_errors() == (0, 0)
