"""The kvcacheio ops on CUDA tensors (torch): GPU layers, pinned host buffers, the caller's
current stream, CUDA index tensors; compared with torch fancy indexing. Skips without torch or a
GPU. Also runs as a script (``python test_cuda.py``) where pytest is not installed."""

import contextlib
import re

try:
    import pytest
except ImportError:  # run as a script on a machine without pytest: the two helpers used here

    class pytest:  # noqa: N801
        @staticmethod
        @contextlib.contextmanager
        def raises(exc, match=None):
            try:
                yield
            except exc as e:
                if match is not None and not re.search(match, str(e)):
                    raise AssertionError(f"{e!r} does not match {match!r}") from e
            else:
                raise AssertionError(f"{exc.__name__} not raised")

        class mark:
            @staticmethod
            def skipif(cond, reason):
                return lambda f: f

        @staticmethod
        def importorskip(name):
            return __import__(name)


torch = pytest.importorskip("torch")

from common import pages  # noqa: E402
from hicache_io import kvcacheio as kv  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")

SLOTS, LAYERS, ITEM_ELEMS = 4096, 4, 256
ITEM = ITEM_ELEMS * 2  # fp16 bytes


@needs_gpu
def test_per_layer_load_from_pinned_host_on_a_side_stream():
    host = torch.randn(SLOTS, ITEM_ELEMS, dtype=torch.float16).pin_memory()
    dev = torch.zeros(SLOTS, ITEM_ELEMS, dtype=torch.float16, device="cuda")
    hi, di = torch.from_numpy(pages(512, 16, SLOTS, 1)), torch.from_numpy(pages(512, 16, SLOTS, 2))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        kv.transfer_kv_per_layer_mla(host, dev, hi.cuda(), di.cuda(), ITEM)
    side.synchronize()
    ref = torch.zeros_like(dev)
    ref[di.cuda()] = host.cuda()[hi.cuda()]
    assert torch.equal(dev, ref)


@needs_gpu
def test_all_layer_backup_into_pinned_page_first():
    dev = [torch.randn(SLOTS, ITEM_ELEMS, dtype=torch.float16, device="cuda") for _ in range(LAYERS)]
    host = torch.zeros(SLOTS, LAYERS, ITEM_ELEMS, dtype=torch.float16).pin_memory()
    di, hi = torch.from_numpy(pages(256, 16, SLOTS, 3)), torch.from_numpy(pages(256, 16, SLOTS, 4))
    kv.transfer_kv_all_layer_mla_lf_pf(dev, host, di, hi, ITEM, ITEM * LAYERS, LAYERS)
    torch.cuda.current_stream().synchronize()
    for layer in range(LAYERS):
        assert torch.equal(host[hi, layer], dev[layer][di.cuda()].cpu())


@needs_gpu
def test_per_layer_lf_pf_and_direct():
    dev = torch.randn(SLOTS, ITEM_ELEMS, dtype=torch.float16, device="cuda")
    host = torch.zeros(SLOTS, LAYERS, ITEM_ELEMS, dtype=torch.float16).pin_memory()
    di, hi = torch.from_numpy(pages(256, 16, SLOTS, 5)), torch.from_numpy(pages(256, 16, SLOTS, 6))
    kv.transfer_kv_per_layer_mla_lf_pf(dev, host, di, hi, 2, ITEM, ITEM * LAYERS)
    back = [torch.zeros(SLOTS, ITEM_ELEMS, dtype=torch.float16, device="cuda")]
    kv.transfer_kv_direct([dev], back, di, hi, 16)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(host[hi, 2], dev[di.cuda()].cpu())
    assert torch.equal(back[0][hi.cuda()], dev[di.cuda()])


@needs_gpu
def test_bad_input_moves_nothing():
    dev = torch.randn(64, ITEM_ELEMS, dtype=torch.float16, device="cuda")
    before = dev.clone()
    host = torch.randn(64, ITEM_ELEMS, dtype=torch.float16).pin_memory()
    with pytest.raises(IndexError):
        kv.transfer_kv_per_layer_mla(host, dev, torch.tensor([1, 2]), torch.tensor([3, 64]), ITEM)
    with pytest.raises(RuntimeError, match="^Source and destination indices must have the same length$"):
        kv.transfer_kv_per_layer_mla(host, dev, torch.tensor([1, 2]), torch.tensor([3]), ITEM)
    # An unpinned host array next to CUDA arrays: the driver has no device address for it.
    with pytest.raises(RuntimeError, match="not mapped for the device"):
        kv.transfer_kv_per_layer_mla(torch.randn(64, ITEM_ELEMS, dtype=torch.float16), dev, torch.tensor([1]), torch.tensor([3]), ITEM)
    torch.cuda.synchronize()
    assert torch.equal(dev, before)


if __name__ == "__main__":
    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            try:
                fn()
                print(f"PASSED {name}")
            except Exception as e:  # report every test, then fail
                failed += 1
                print(f"FAILED {name}: {type(e).__name__}: {e}")
    raise SystemExit(1 if failed else 0)
