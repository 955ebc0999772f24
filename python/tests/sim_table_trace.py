"""sglang 0.5.23's backup sequence on CUDA with ``io_backend=kernel`` (and the Mamba pool's and
DeepSeek-V4's token-granular one and MiniMax M3's NVFP4 page rows), run twice on the simulated
driver with its call trace on (``HICACHE_CUDA_SIM_TRACE``, read at the driver's first call, so
this runs in its own process: ``test_cuda_sim.py`` starts it). The first round reads each layer
table once; the second must make no driver call that blocks the calling thread. Every byte of
the second round is compared with numpy. Exits non-zero on any failure."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import pages  # noqa: E402
from test_cuda_sim import DevArray, LAYERS, SLOTS, registered, sim_errors, sync, table  # noqa: E402

from hicache_io import hicache, kvcacheio as kv  # noqa: E402

ITEM = 256
PAGE = 16
ROW = 64 * 132  # the DSA indexer: a page row of 64 tokens x 132 bytes
PAGES = 16
C4 = 37440  # a DeepSeek-V4 C4 page: 64 tokens, 576-byte values then 8-byte scales
NV_ROW = 512  # a MiniMax M3 NVFP4 page row


def c4_token(buf, t):
    """Token ``t`` of a C4 layer buffer: its value and its scale, as one array."""
    page, slot = divmod(int(t), 64)
    return np.concatenate([buf[page * C4 + slot * 576: page * C4 + (slot + 1) * 576],
                           buf[page * C4 + 36864 + slot * 8: page * C4 + 36864 + (slot + 1) * 8]])


def main(trace: str) -> None:
    rng = np.random.default_rng(3)
    # Device pools: per-layer K/V (MHA), per-layer latent (MLA), per-layer indexer page rows.
    dk = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    dv = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    dm = [DevArray.of(rng.integers(0, 256, (SLOTS, ITEM), dtype=np.uint8)) for _ in range(LAYERS)]
    dx = [DevArray.of(rng.integers(0, 256, (PAGES, ROW), dtype=np.uint8)) for _ in range(LAYERS)]
    dc = [DevArray.of(rng.integers(0, 256, (2 * C4,), dtype=np.uint8)) for _ in range(LAYERS)]  # DeepSeek-V4 C4
    dr = [DevArray.of(rng.integers(0, 256, (PAGES, NV_ROW), dtype=np.uint8)) for _ in range(LAYERS)]  # NVFP4 page rows
    dk_t, dv_t, dm_t, dx_t, dc_t, dr_t = (table([d.ptr for d in ds]) for ds in (dk, dv, dm, dx, dc, dr))
    # Host pools, registered in chunks as sglang allocates them: layer_first (MHA, MLA; tables of
    # device-accessible layer views) and page_first (MHA, MLA, indexer).
    lf_k, lf_v, lf_m = (registered((LAYERS, SLOTS, ITEM), np.uint8, cuts=(SLOTS * ITEM,)) for _ in range(3))
    lf_tables = [table([kv.get_device_accessible_ptr(h[layer], 0) for layer in range(LAYERS)]) for h in (lf_k, lf_v, lf_m)]
    pf_k, pf_v, pf_m = (registered((SLOTS, LAYERS, ITEM), np.uint8) for _ in range(3))
    pf_x = registered((PAGES, LAYERS, ROW), np.uint8)
    pf_s = registered((SLOTS, LAYERS, ITEM), np.uint8)  # Mamba state slots (MambaPoolHost, page_first)
    # DeepSeek-V4 C4 host pool (layer_first, 3 pages a layer) and its table of layer views.
    lf_c = registered((LAYERS, 3 * C4), np.uint8, cuts=tuple(3 * C4 * (j + 1) for j in range(LAYERS - 1)))
    c4_table = table([kv.get_device_accessible_ptr(lf_c[layer], 0) for layer in range(LAYERS)])
    dev_tok, host_tok = np.array([5, 64, 127, 3, 90], np.int64), np.array([191, 0, 70, 64, 33], np.int64)
    d_tok, h_tok = DevArray.of(dev_tok), DevArray.of(host_tok)
    # MiniMax M3 NVFP4 host pool, page_first (pages, L, 1, row): a table of strided layer views.
    pf_r = registered((PAGES, LAYERS, 1, NV_ROW), np.uint8)
    nv_table = table([kv.get_device_accessible_ptr(pf_r[:, layer, 0], 0) for layer in range(LAYERS)])

    dev_rows, host_rows = pages(6 * PAGE, PAGE, SLOTS, 1), pages(6 * PAGE, PAGE, SLOTS, 2)
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
        # DeepSeek-V4: HiSparse's token-granular backup (tables on both sides).
        kv.transfer_cache_dsv4_mla(dc_t, c4_table, d_tok, h_tok)
        # MiniMax M3 NVFP4: page rows from the device slab's rows into the host's strided views.
        kv.transfer_page_rows(nv_table, dr_t, h_pages, d_pages, host_stride=LAYERS * NV_ROW, device_stride=NV_ROW, row_bytes=NV_ROW, load=False)

    backups()  # the first use of each table reads it
    sync()
    kv.synchronize(0)
    for h in (lf_k, lf_v, lf_m, pf_k, pf_v, pf_m, pf_x, pf_s, lf_c, pf_r):
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
        c = dc[layer].numpy()
        want = np.zeros(3 * C4, np.uint8)
        for ht, dt in zip(host_tok, dev_tok):
            page, slot = divmod(int(ht), 64)
            tok = c4_token(c, dt)
            want[page * C4 + slot * 576: page * C4 + (slot + 1) * 576] = tok[:576]
            want[page * C4 + 36864 + slot * 8: page * C4 + 36864 + (slot + 1) * 8] = tok[576:]
        assert np.array_equal(lf_c[layer], want), f"DeepSeek-V4 C4 layer {layer}"
        assert np.array_equal(pf_r[host_pages, layer, 0], dr[layer].numpy()[dev_pages]), f"NVFP4 layer {layer}"
    # MiniMax M3's device pool as sglang allocates it: every layer's rows in one slab
    # (L, pages, row), loaded from the host's strided views. Each layer ends where the next
    # begins (rows of one stride would meet), so the slab's layers are not refused as overlapping.
    slab = DevArray.of(np.zeros((LAYERS, PAGES, NV_ROW), np.uint8))
    slab_t = table([slab.ptr + layer * PAGES * NV_ROW for layer in range(LAYERS)])
    kv.transfer_page_rows(nv_table, slab_t, h_pages, d_pages, host_stride=LAYERS * NV_ROW, device_stride=NV_ROW, row_bytes=NV_ROW, load=True)
    sync()
    got = slab.numpy().reshape(LAYERS, PAGES, NV_ROW)
    for layer in range(LAYERS):
        assert np.array_equal(got[layer][dev_pages], pf_r[host_pages, layer, 0]), f"NVFP4 slab layer {layer}"
        assert not got[layer][np.setdiff1d(np.arange(PAGES), dev_pages)].any(), f"NVFP4 slab layer {layer}: other rows"
    assert sim_errors() == (0, 0)
    print(f"ok: {len(issued)} driver calls, {len(launches)} launches, none blocking")


if __name__ == "__main__":
    main(os.environ["HICACHE_CUDA_SIM_TRACE"])
