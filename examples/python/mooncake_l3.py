"""A layer-sharded DSA indexer pool (layers 2..6 of 8 plus one MTP draft layer, page_first: the
backup sglang refuses) backed up to Mooncake Store, and read back by a second process, as a rank
on another machine would reuse the prefix.

Uses the master at ``MOONCAKE_MASTER`` (host:port) when set, else starts one on loopback. Run:

    pip install mooncake-transfer-engine-non-cuda   # plus libibverbs1 libnl-3-200 libnl-route-3-200
    python examples/python/mooncake_l3.py
"""

import os
import subprocess
import sys
import textwrap

import numpy as np

import hicache_io
from hicache_io.storage import HiCacheStorageConfig, LocalMaster, MooncakeStore

PAGE, PAGES, LAYERS, SHARD = 64, 8, 8, (2, 6)


def pools():
    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), "dsa", 132, PAGES, PAGE, LAYERS, layer_shard=SHARD, drafts=1)
    host = hicache_io.HostPool(dev, "page_first", PAGES * PAGE, profile="extended")
    return dev, host


def store_for(master):
    cfg = HiCacheStorageConfig(model_name="example/dsa", extra_config={"master_server_address": master, "global_segment_size": 64 << 20})
    return MooncakeStore(cfg, {})


READER = textwrap.dedent(
    """
    import sys, numpy as np
    sys.path.insert(0, {here!r})
    from mooncake_l3 import pools, store_for, PAGE
    dev, host = pools()
    store = store_for({master!r})
    store.register_mem_pool_host(host)
    keys, want = {keys!r}, np.load({want!r})
    tokens = np.arange(4 * PAGE, 7 * PAGE)  # other host pages than the writer used
    assert store.batch_exists(keys) == 3
    assert store.batch_get_v1(keys, tokens) == [True] * 3, store.last_error
    got = np.concatenate([host.get_data_page(int(t)) for t in tokens[::PAGE]])
    assert np.array_equal(got, want), "the second process read other bytes"
    store.close()
    print(f"reader: 3 pages, {{got.size}} bytes, equal to what the writer backed up")
    """
)


def main(master):
    dev, host = pools()
    rng = np.random.default_rng(0)
    for b in range(dev.buffer_count):
        dev.write_buffer(0, b, rng.integers(0, 256, dev.slots * dev.item_bytes, dtype=np.uint8))
    device_tokens, host_tokens = np.arange(5 * PAGE, 8 * PAGE), np.arange(1 * PAGE, 4 * PAGE)
    host.backup_from_device_all_layer(dev, host_tokens, device_tokens, "kernel")
    store = store_for(master)
    store.register_mem_pool_host(host)
    keys = ["page-hash-a", "page-hash-b", "page-hash-c"]
    assert store.batch_set_v1(keys, host_tokens) == [True] * 3, store.last_error
    print("writer: keys", store.object_keys(keys[0]))
    want = np.concatenate([host.get_data_page(int(t)) for t in host_tokens[::PAGE]])
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mooncake_l3_{os.getpid()}.npy")
    np.save(path, want)
    try:
        code = READER.format(here=os.path.dirname(os.path.abspath(__file__)), master=master, keys=keys, want=path)
        subprocess.run([sys.executable, "-c", code], check=True)
    finally:
        os.remove(path)
        store.close()  # the objects go with this client's segment; nothing else on the master is touched


if __name__ == "__main__":
    if os.environ.get("MOONCAKE_MASTER"):
        main(os.environ["MOONCAKE_MASTER"])
    else:
        with LocalMaster() as m:
            main(m.address)
