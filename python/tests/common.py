"""Helpers shared by the Python suites: the executors a test runs on, and the pools and stores
of the L3 suites.

Executors, one policy: ``cpu`` always; ``wgpu`` where an adapter is found (under ``CI`` it must
be: CI has Mesa's lavapipe); ``cuda`` where a GPU or the simulated driver is found. Tests of the
zero-copy paths pass ``addressable=True`` to leave out executors whose host pools live in the
executor's own buffers (wgpu)."""

import os
import uuid

import numpy as np

import hicache_io

#: Tokens a page in the L3 suites' pools.
P = 8


def mooncake_problem():
    """Why Mooncake Store's client cannot be used here, or ``None``; raises instead under
    ``HICACHE_REQUIRE_MOONCAKE=1`` (CI). Loads it the way hicache-io does."""
    try:
        from hicache_io.l3.mooncake_client import store_module

        store_module()
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        if os.environ.get("HICACHE_REQUIRE_MOONCAKE") == "1":
            raise
        return f"Mooncake Store not installed ({e})"
    return None


def executors(addressable=False):
    out = ["cpu"]
    if not addressable:
        try:
            hicache_io.Device("wgpu")
            out.append("wgpu")
        except Exception:  # noqa: BLE001 - no adapter here
            if os.environ.get("CI"):
                raise  # CI has lavapipe: the wgpu paths must run there
    try:
        hicache_io.Device("cuda")  # a GPU, or the simulated driver (scripts/cuda-sim.sh)
        out.append("cuda")
    except Exception:  # noqa: BLE001 - no CUDA here
        pass
    return out


def child_env(**extra):
    """The environment of a child process of the suites: this directory on its ``PYTHONPATH``."""
    here = os.path.dirname(os.path.abspath(__file__))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]), **extra)


def io_for(layout):
    return "direct" if layout == "page_first_direct" else "kernel"


def build(executor, kind, layout, heads, bpt, layers, shard, drafts, pages=12, seed=0, host_pages=16, device=None):
    """``(device, device pool, host pool)``: a device pool of ``pages`` pages of random bytes and
    a host pool of ``host_pages`` pages in ``layout``."""
    device = device or hicache_io.Device(executor)
    slots = pages if kind == "dsa" else pages * P
    dev = hicache_io.DevicePool(device, kind, bpt, slots, P, layers, layer_shard=shard, drafts=drafts)
    rng = np.random.default_rng(seed)
    for c in range(2 if kind == "mha" else 1):
        for b in range(dev.buffer_count):
            dev.write_buffer(c, b, rng.integers(0, 256, dev.slots * dev.item_bytes, dtype=np.uint8))
    host = hicache_io.HostPool(dev, layout, host_pages * P, head_num=heads, profile="extended")
    return device, dev, host


def page_meta(host, page, page_size=P):
    """(component, offset, bytes) of each object of host page ``page`` (of ``page_size`` tokens)."""
    return host.get_page_buffer_meta(list(range(page * page_size, (page + 1) * page_size)))


def page_bytes(host, page, buffers=None, page_size=P):
    """Host page ``page``'s bytes, its objects one after another (``buffers``: the pool's
    component buffers, read once by the caller; ``page_size``: the pool's tokens a page)."""
    bufs = buffers if buffers is not None else [host.read_buffer(c) for c in range(host.components)]
    return b"".join(bytes(bufs[c][off : off + n]) for c, off, n in page_meta(host, page, page_size))


def pages(n, page, total, seed=0):
    """The rows (int64, page after page) of ``n // page`` whole pages of ``page`` rows, drawn at
    random (``seed``) among the ``total // page`` pages of ``total`` rows."""
    p = np.random.default_rng(seed).permutation(total // page)[: n // page]
    return (p[:, None] * page + np.arange(page)).reshape(-1).astype(np.int64)


def tokens(pages):
    return np.concatenate([np.arange(p * P, (p + 1) * P) for p in pages]).astype(np.int64)


def make_store(master, segment=64 << 20, extra=None, lender=None, **kw):
    """A ``MooncakeStore`` on ``master`` under a model name of its own (its client lent by
    ``lender``, a :class:`Lender`, where one is given)."""
    from hicache_io.storage import HiCacheStorageConfig, MooncakeStore

    cfg = HiCacheStorageConfig(model_name=f"test/{uuid.uuid4().hex[:8]}", extra_config={"master_server_address": master.address, "global_segment_size": segment, "local_buffer_size": 4 << 20, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1", **(extra or {})})
    return lender.store(cfg, **kw) if lender is not None else MooncakeStore(cfg, {}, **kw)


class Lender:
    """Mooncake clients of one master, lent to the stores of a module's tests one after another
    (the ``clients`` fixture). Closing a client takes 1-2 s: Mooncake's client joins threads that
    sleep a second at a time, and holds the GIL while it waits (so closes cannot overlap other
    work either). A store given back is unregistered and its client lent to the next store;
    each client closes once, when the module ends. What the client once had registered is kept
    until then, as a store keeps it until its own client closes.

    Lent clients are clients as a store opens them (``open_client``), all of one configuration
    whatever the store's (64 MiB segments, TCP on loopback), so that no test's configuration
    depends on which test borrowed a client first. Tests of a store's own opening and closing,
    or of its segment's size, keep stores of their own."""

    def __init__(self, master):
        self.master, self.free, self.kept, self.lent = master, [], [], {}

    def store(self, storage_config, kwargs=None, **kw):
        """A ``MooncakeStore`` of ``storage_config`` on a lent client."""
        from hicache_io.l3.config import MooncakeStoreConfig
        from hicache_io.l3.mooncake_client import open_client
        from hicache_io.storage import MooncakeStore

        if not self.free:
            cfg = {"master_server_address": self.master.address, "global_segment_size": 64 << 20, "local_buffer_size": 4 << 20, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1"}
            self.free.append(open_client(MooncakeStoreConfig.load(cfg), None))
        client = self.free.pop()
        try:
            s = MooncakeStore(storage_config, kwargs or {}, store=client, **kw)
        except BaseException:
            self.free.append(client)  # a configuration refused: the client was never used
            raise
        self.lent[id(s)] = client
        return s

    def give_back(self, s):
        """Takes back the client lent to ``s`` (whatever wraps it now in ``s.store``); ``s`` is
        then closed: its calls fail as a closed store's do."""
        client = self.lent.pop(id(s))
        with s._lock:
            if s.store is None:
                return  # closed by the test, its client with it: nothing to lend again
            s.unregister_mem_pool_host()
            self.kept.append(s._retired)
            s.store = None
        self.free.append(client)

    def close(self):
        for c in self.free:
            c.close()
        self.free, self.kept = [], []


def pack_records(path):
    """The records of local-store pack ``path``: key → where its object's bytes start. (The
    record format, as ``python/src/local_pack.rs`` documents it: a 32-byte header whose bytes
    16..20 hold the object's length and 20..22 the key's, then the key, then the object.)"""
    data, at, out = open(path, "rb").read(), 0, {}
    while at + 32 <= len(data):
        n, k = int.from_bytes(data[at + 16 : at + 20], "little"), int.from_bytes(data[at + 20 : at + 22], "little")
        out[data[at + 32 : at + 32 + k].decode()] = at + 32 + k
        at += 32 + k + n
    return out


def held_at(client, key):
    """The file holding local-store object ``key``'s bytes (of ``client``, a ``LocalDiskClient``)
    and where they start in it: its own file, or the pack that holds it."""
    if os.path.exists(client.path(key)):
        return client.path(key), 0
    folder = os.path.join(client.directory, "packs")
    for name in sorted(os.listdir(folder)):
        at = pack_records(os.path.join(folder, name)).get(key)
        if at is not None:
            return os.path.join(folder, name), at
    raise KeyError(key)
