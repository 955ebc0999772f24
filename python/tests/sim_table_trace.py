"""sglang 0.5.23's backup sequence on CUDA with ``io_backend=kernel`` (and the Mamba pool's), run twice on the simulated
driver with its call trace on (``HICACHE_CUDA_SIM_TRACE``, read at the driver's first call, so
this runs in its own process: ``test_cuda_sim.py`` starts it). The first round reads each layer
table once; the second must make no driver call that blocks the calling thread. Every byte of
the second round is compared with numpy. Exits non-zero on any failure."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from test_cuda_sim import DevArray, LAYERS, SLOTS, registered, sim_errors, sync, table  # noqa: E402

from hicache_io import hicache, kvcacheio as kv  # noqa: E402

ITEM = 256
PAGE = 16
ROW = 64 * 132  # the DSA indexer: a page row of 64 tokens x 132 bytes
PAGES = 16


def main(trace: str) -> None:
    rng = np.random.default_rng(3)
    # Device pools: per-layer K/V (MHA), per-layer latent (MLA), per-layer indexer page rows.
    dk = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    dv = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    dm = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    dx = [DevArray.of(rng.integers(0, 256, (PAGES, ROW), dtype=np.uint8)) for _ in range(LAYERS)]
    dk_t, dv_t, dm_t, dx_t = (table([d.ptr for d in ds]) for ds in (dk, dv, dm, dx))
    # Host pools, registered in chunks as sglang allocates them: layer_first (MHA, MLA; tables of
    # device-accessible layer views) and page_first (MHA, MLA, indexer).
    lf_k, lf_v, lf_m = (registered((LAYERS, SLOTS, ITEM), np.uint8, cuts=(SLOTS * ITEM,)) for _ in range(3))
    lf_tables = [table([kv.get_device_accessible_ptr(h[layer], 0) for layer in range(LAYERS)]) for h in (lf_k, lf_v, lf_m)]
    pf_k, pf_v, pf_m = (registered((SLOTS, LAYERS, ITEM), np.uint8) for _ in range(3))
    pf_x = registered((PAGES, LAYERS, ROW), np.uint8)
    pf_s = registered((SLOTS, LAYERS, ITEM), np.uint8)  # Mamba state slots (MambaPoolHost, page_first)

    def pages(seed):
        p = np.random.default_rng(seed).permutation(SLOTS // PAGE)[:6]
        return (p[:, None] * PAGE + np.arange(PAGE)).reshape(-1).astype(np.int64)

    dev_rows, host_rows = pages(1), pages(2)
    dev_pages, host_pages = np.array([3, 9, 0], np.int64), np.array([7, 1, 12], np.int64)
    d_rows, h_rows, d_pages, h_pages = (DevArray.of(a) for a in (dev_rows, host_rows, dev_pages, host_pages))

    def backups():
        # MHA layer_first: AOT, then the JIT name (sglang's two routes), into host tables.
        kv.transfer_kv_all_layer(dk_t, lf_tables[0], dv_t, lf_tables[1], d_rows, h_rows, ITEM, LAYERS)
        hicache.transfer_hicache_all_layer(lf_tables[0], lf_tables[1], h_rows, dk_t, dv_t, d_rows,
                                           kv_cache_src_stride_bytes=ITEM, kv_cache_dst_stride_bytes=ITEM)
        # MLA layer_first (JIT), MHA and MLA page_first (AOT), the indexer's page rows (AOT).
        hicache.transfer_hicache_all_layer_mla(lf_tables[2], h_rows, dm_t, d_rows,
                                               cache_src_stride_bytes=ITEM, cache_dst_stride_bytes=ITEM)
        kv.transfer_kv_all_layer_lf_pf(dk_t, pf_k, dv_t, pf_v, d_rows, h_rows, ITEM, LAYERS * ITEM, LAYERS)
        kv.transfer_kv_all_layer_mla_lf_pf(dm_t, pf_m, d_rows, h_rows, ITEM, LAYERS * ITEM, LAYERS)
        kv.transfer_kv_all_layer_mla_lf_pf(dx_t, pf_x, d_pages, h_pages, ROW, LAYERS * ROW, LAYERS)
        # Mamba: the JIT state backup from the table of per-layer state tensors.
        kv.transfer_kv_mamba_lf_pf(dm_t, pf_s, d_rows, h_rows, ITEM, LAYERS * ITEM, LAYERS)

    backups()  # the first use of each table reads it
    sync()
    kv.synchronize(0)
    for h in (lf_k, lf_v, lf_m, pf_k, pf_v, pf_m, pf_x, pf_s):
        h[...] = 0
    before = len(open(trace).read().splitlines())
    backups()
    issued = open(trace).read().splitlines()[before:]
    sync()
    kv.synchronize(0)
    launches = [line for line in issued if " cuLaunchKernel " in line]
    blocking = [line for line in issued if "blocked=1" in line]
    assert launches, "the backups launched nothing"
    assert not blocking, "host-blocking driver calls while issuing:\n" + "\n".join(blocking)
    for layer in range(LAYERS):
        k, v, m, x = dk[layer].numpy(), dv[layer].numpy(), dm[layer].numpy(), dx[layer].numpy()
        assert np.array_equal(lf_k[layer][host_rows], k[dev_rows]), f"MHA lf K layer {layer}"
        assert np.array_equal(lf_v[layer][host_rows], v[dev_rows]), f"MHA lf V layer {layer}"
        assert np.array_equal(lf_m[layer][host_rows], m[dev_rows]), f"MLA lf layer {layer}"
        assert np.array_equal(pf_k[host_rows, layer], k[dev_rows]), f"MHA pf K layer {layer}"
        assert np.array_equal(pf_v[host_rows, layer], v[dev_rows]), f"MHA pf V layer {layer}"
        assert np.array_equal(pf_m[host_rows, layer], m[dev_rows]), f"MLA pf layer {layer}"
        assert np.array_equal(pf_x[host_pages, layer], x[dev_pages]), f"indexer layer {layer}"
        assert np.array_equal(pf_s[host_rows, layer], m[dev_rows]), f"Mamba layer {layer}"
    assert sim_errors() == (0, 0)
    print(f"ok: {len(issued)} driver calls, {len(launches)} launches, none blocking")


if __name__ == "__main__":
    main(os.environ["HICACHE_CUDA_SIM_TRACE"])
