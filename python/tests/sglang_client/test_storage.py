"""sglang 0.5.23's L3 storage path with hicache-io's Mooncake store, against a real
``mooncake_master`` on loopback:

- sglang's StorageBackendFactory, ``dynamic`` backend -> ``hicache_io.storage.MooncakeStore``,
  registered with sglang's own host pools; zero-copy batch_set_v1 / batch_get_v1 /
  batch_exists, bytes checked. MooncakeStore asks sglang's pool for the page addresses with
  ``get_page_buffer_meta(host_indices)``, which calls ``.tolist()`` on them: it must pass a
  CPU int64 torch tensor (it once passed a list); every call is recorded and checked.
- the whole controller attach: HybridCacheController.attach_storage_backend("dynamic"),
  write -> write_storage -> backup thread -> L3, wipe, page_get_func -> bytes restored.
- sglang's own Mooncake backend and hicache-io's store reading each other's pages.

Skips without Mooncake unless HICACHE_REQUIRE_MOONCAKE=1."""

from ._env import require_mooncake, require_sglang

require_sglang()
require_mooncake()

import json  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402
import uuid  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from . import cpu_shims  # noqa: E402
from . import sgl_pools as sp  # noqa: E402
from .harness import check_equal, fill_random, snapshot  # noqa: E402


class Stores:
    """One hicache-io store (built by sglang's factory) and one sglang store per pool kind for
    the module: a Mooncake client takes ~2 s to close, so they are shared, pools are registered
    per test, and all are closed together at the end."""

    def __init__(self, master):
        self.master = master
        self.models = {kind: f"sglang-client/{kind}-{uuid.uuid4().hex[:8]}" for kind in ("mha", "mla")}
        self.ours: dict = {}
        self.theirs: dict = {}
        self.keep: list = []  # pools registered with sglang's store stay alive until it closes

    def dynamic(self, kind, host):
        """hicache_io.storage.MooncakeStore through StorageBackendFactory's dynamic backend."""
        if kind not in self.ours:
            from sglang.srt.mem_cache.storage import StorageBackendFactory

            cfg = storage_config(host, is_mla=(kind == "mla"), extra=dynamic_extra_config(self.master), model=self.models[kind])
            self.ours[kind] = StorageBackendFactory.create_backend("dynamic", cfg, host)  # the pool goes to register_*, not the ctor
        return self.ours[kind]

    def sglang(self, kind, host):
        """sglang 0.5.23's own MooncakeStore through the factory ("mooncake"), registered with
        ``host``."""
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore as SglangMooncakeStore

        if kind not in self.theirs:
            from sglang.srt.mem_cache.storage import StorageBackendFactory

            cfg = storage_config(host, is_mla=(kind == "mla"), extra=connection(self.master), model=self.models[kind])
            self.theirs[kind] = StorageBackendFactory.create_backend("mooncake", cfg, host)
        store = self.theirs[kind]
        assert type(store) is SglangMooncakeStore
        store.register_mem_pool_host(host)
        self.keep.append(host)
        return store

    def close(self):
        closers = [s.close for s in self.ours.values()] + [s.store.close for s in self.theirs.values()]  # sglang's close() leaves it to the destructor
        threads = [threading.Thread(target=c) for c in closers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)


#: Leases of this module's master: its gets run on the controller's threads, and on a busy CI
#: machine a 200 ms lease once ran out inside one (LEASE_EXPIRED, a miss). No test here waits for
#: a lease to end.
MASTER_LEASE_MS = 2000


@pytest.fixture(scope="module")
def stores(master):
    s = Stores(master)
    yield s
    s.close()


def connection(master) -> dict:
    return {
        "master_server_address": master.address, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE",
        "local_hostname": "127.0.0.1", "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
    }


def dynamic_extra_config(master, local_dir=None) -> dict:
    """What --hicache-storage-backend-extra-config carries, parsed by sglang itself (it pops the
    prefetch_* keys): hicache-io's Mooncake store on ``master``, or with ``local_dir`` its local
    store in that directory (no server)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    # The module's stores are shared by pools of several layouts under one prefix (sglang's names
    # omit the layout): the namespace record, which would rightly call the second layout's pages
    # foreign, is off here (its own tests are in test_mooncake.py and test_install.py).
    raw = {"backend_name": "hicache_io", "module_path": "hicache_io.storage", "class_name": "MooncakeStore", "interface_v1": 1, "prefetch_threshold": 64, "hicache_io_namespace_record": False}
    raw.update({"class_name": "LocalStore", "hicache_io_local_dir": str(local_dir)} if local_dir is not None else connection(master))
    extra, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(json.dumps(raw))
    assert threshold == 64 and "prefetch_threshold" not in extra
    return extra


def storage_config(host, *, is_mla: bool, extra: dict, model: str):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=is_mla, enable_storage_metrics=False, is_page_first_layout=(host.layout == "page_first"), model_name=model, extra_config=extra)


def build_host(kind, layout):
    with cpu_shims.sglang_paths(cuda=True):
        if kind == "mha":
            return sp.mha_host(sp.mha_device(), layout)
        return sp.mla_host(sp.mla_device(), layout, (sp.mla_device(layer_num=1),))


def page_view(kind, layout, host, t0):
    """The torch view of host page starting at token slot t0 (every component)."""
    b, P = host.kv_buffer, host.page_size
    if kind == "mha":
        return b[:, t0 : t0 + P] if layout == "page_first" else b[:, t0 // P]
    return b[t0 : t0 + P] if layout == "page_first" else b[t0 // P]


def record_meta_calls(host) -> list:
    """Wraps this pool's get_page_buffer_meta: records what the store passes (type, dtype,
    device, length)."""
    seen = []
    inner = host.get_page_buffer_meta

    def recorder(indices):
        seen.append((type(indices).__name__, getattr(indices, "dtype", None), getattr(getattr(indices, "device", None), "type", None), len(indices)))
        return inner(indices)

    host.get_page_buffer_meta = recorder
    return seen


def assert_sglang_index_type(seen):
    assert seen, "the store never asked sglang's pool for page addresses"
    assert all(s[:3] == ("Tensor", torch.int64, "cpu") for s in seen), seen


STORE_CASES = [
    pytest.param("mha", "page_first", id="mha-page_first"),
    pytest.param("mha", "page_first_direct", id="mha-page_first_direct"),
    pytest.param("mla", "page_first", id="mla+draft-page_first"),
    pytest.param("mla", "page_first_direct", id="mla+draft-page_first_direct"),
]


@pytest.mark.parametrize("kind,layout", STORE_CASES)
def test_dynamic_backend_round_trip(stores, kind, layout):
    from hicache_io.storage import MooncakeStore

    g = sp.gen(sp.seed_of(kind, layout))
    host = build_host(kind, layout)
    P = host.page_size
    store = stores.dynamic(kind, host)
    assert type(store) is MooncakeStore and store.storage_config.extra_config["module_path"] == "hicache_io.storage"
    seen = record_meta_calls(host)
    store.register_mem_pool_host(host)
    try:
        fill_random([host.kv_buffer], g)
        before = snapshot([host.kv_buffer])[0]
        idx = host.alloc(3 * P)
        keys = [uuid.uuid4().hex for _ in range(3)]
        assert store.batch_exists(keys) == 0
        assert store.batch_set_v1(keys, idx) == [True] * 3, store.last_error
        assert store.batch_exists(keys) == 3
        assert store.batch_exists([keys[0], keys[1], "absent", keys[2]]) == 2
        check_equal("set left the host pool alone", host.kv_buffer, before)

        # wipe the pages, read them back in place: the whole pool image is the original again
        for t0 in idx[::P].tolist():
            page_view(kind, layout, host, t0).zero_()
        assert store.batch_get_v1(keys, idx) == [True] * 3, store.last_error
        check_equal(f"{kind}/{layout} get in place", host.kv_buffer, before)

        # read into other host pages, in another order: only those pages change
        other = host.alloc(3 * P)
        order = [2, 0, 1]
        assert store.batch_get_v1([keys[i] for i in order], other) == [True] * 3
        exp = before.clone().view(host.kv_buffer.dtype)
        src = before.view(host.kv_buffer.dtype)
        for j, i in enumerate(order):
            page_view(kind, layout, types.SimpleNamespace(kv_buffer=exp, page_size=P), other[j * P].item()).copy_(
                page_view(kind, layout, types.SimpleNamespace(kv_buffer=src, page_size=P), idx[i * P].item()))
        check_equal(f"{kind}/{layout} get elsewhere", host.kv_buffer, exp)
        assert store.last_error is None
        assert_sglang_index_type(seen)
        assert all(s[3] % P == 0 for s in seen)
    finally:
        store.unregister_mem_pool_host()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_layer_first_pool_refused(stores, kind):
    """A layer_first page is one span per layer: the store refuses the pool at registration
    (for MHA with sglang's own Mooncake message)."""
    host = build_host(kind, "layer_first")
    store = stores.dynamic(kind, host)
    with pytest.raises(ValueError, match="layer_first"):
        store.register_mem_pool_host(host)
    assert store.mem_pool_host is None


def storage_at(transport, request, tmp_path):
    """``(master, local_dir)`` for ``dynamic_extra_config``: Mooncake's master, or a directory."""
    if transport == "local":
        return None, tmp_path / "l3"
    return request.getfixturevalue("master"), None


@pytest.mark.parametrize("transport", ["mooncake", "local"])
@pytest.mark.parametrize("kind", ["mha", "mla"], ids=["mha-page_first", "mla+draft-page_first"])
def test_controller_attach_write_storage_and_get(transport, kind, request, tmp_path):
    """The server's path: HybridCacheController.attach_storage_backend("dynamic") builds the
    store through the factory and registers the host pool group; write() -> write_storage() ->
    backup thread -> batch_set_v1; then the host pages are wiped and page_get_func (the
    prefetch's zero-copy get) restores them."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from hicache_io.storage import LocalStore, MooncakeStore

    master, local_dir = storage_at(transport, request, tmp_path)
    g = sp.gen(sp.seed_of("attach", kind))
    layout = "page_first"
    with cpu_shims.sglang_paths(cuda=True), cpu_shims.memory_config(hicache_mem_layout=layout, hicache_io_backend="kernel"):
        dev, drafts, allocator, group, ctrl = sp.build_controller_stack(kind, layout, "kernel")
    host = group.anchor_entry.host_pool
    seen = record_meta_calls(host)
    ctrl.attach_storage_backend(storage_backend="dynamic", prefetch_threshold=64, model_name=f"sglang-client/{uuid.uuid4().hex[:8]}", storage_backend_extra_config=dynamic_extra_config(master, local_dir), host_pools=group.entries)
    try:
        be = ctrl.storage_backend
        assert type(be) is (LocalStore if local_dir else MooncakeStore) and be.mem_pool_host is host
        assert be.registered_pools[PoolName.KV] is host
        assert ctrl.page_set_func == ctrl._page_set_zero_copy and ctrl.page_get_func == ctrl._page_get_zero_copy
        assert be.storage_config.is_mla_model is (kind == "mla") and be.storage_config.is_page_first_layout

        dev_bufs, *_ = sp.controller_views(kind, layout, host)
        fill_random(dev_bufs, g)
        dev_idx = allocator.alloc(2 * sp.P)
        host_idx = ctrl.write(dev_idx, node_id=1)
        ctrl.ack_write_queue.pop()
        image = snapshot([host.kv_buffer])[0]
        keys = [uuid.uuid4().hex, uuid.uuid4().hex]
        ctrl.write_storage(host_idx, token_ids=list(range(2 * sp.P)), hash_value=keys)
        op = ctrl.ack_backup_queue.get(timeout=20)
        assert op.completed_tokens == 2 * sp.P
        assert be.batch_exists(keys) == 2

        if kind == "mha":  # page_first: [K/V, token, layer, head, dim]
            host.kv_buffer[:, host_idx] = 0
        else:  # [token, layer, 1, dim]
            host.kv_buffer[host_idx] = 0
        assert not torch.equal(snapshot([host.kv_buffer])[0], image)
        stub_op = types.SimpleNamespace(request_id="r0", is_terminated=lambda: False)
        assert ctrl.page_get_func(stub_op, keys, host_idx) == 2
        check_equal(f"controller L3 round trip ({kind})", host.kv_buffer, image)
        assert be.last_error is None
        assert_sglang_index_type(seen)
    finally:
        ctrl.detach_storage_backend()  # stops the storage threads, closes the store
    assert ctrl.storage_backend is None


# --------------------------------------------------------------------------------- sglang's own Mooncake backend


INTEROP_CASES = [
    pytest.param("mha", "page_first", id="mha-page_first"),
    pytest.param("mla", "page_first", id="mla+draft-page_first"),
    pytest.param("mla", "page_first_direct", id="mla+draft-page_first_direct"),
]


@pytest.mark.parametrize("kind,layout", INTEROP_CASES)
def test_sglang_mooncake_backend_interop(stores, kind, layout):
    """Same keys, same object shape: pages hicache-io's store wrote are read by sglang's
    MooncakeStore into another sglang host pool, and the reverse."""
    g = sp.gen(sp.seed_of("interop", kind, layout))
    model = stores.models[kind]
    ours_host, theirs_host = build_host(kind, layout), build_host(kind, layout)
    P = ours_host.page_size
    ours = stores.dynamic(kind, ours_host)
    theirs = stores.sglang(kind, theirs_host)
    seen = record_meta_calls(ours_host)
    ours.register_mem_pool_host(ours_host)
    try:
        fill_random([ours_host.kv_buffer, theirs_host.kv_buffer], g)
        a_idx, b_idx = ours_host.alloc(3 * P), theirs_host.alloc(3 * P)
        assert ours.object_keys("k") == ([f"{model.replace('/', '-')}_k_0_k", f"{model.replace('/', '-')}_k_0_v"] if kind == "mha" else [f"{model.replace('/', '-')}_k__k"])

        # hicache-io writes, sglang reads
        keys = [uuid.uuid4().hex for _ in range(3)]
        assert ours.batch_set_v1(keys, a_idx) == [True] * 3
        assert theirs.batch_exists(keys) == 3
        assert theirs.batch_get_v1(keys, b_idx) == [True] * 3
        for j in range(3):
            t_a, t_b = a_idx[j * P].item(), b_idx[j * P].item()
            check_equal(f"sglang read page {j}", page_view(kind, layout, theirs_host, t_b), page_view(kind, layout, ours_host, t_a))

        # sglang writes, hicache-io reads
        fill_random([theirs_host.kv_buffer], g)
        keys2 = [uuid.uuid4().hex for _ in range(3)]
        assert theirs.batch_set_v1(keys2, b_idx) == [True] * 3
        assert ours.batch_exists(keys2) == 3
        before = snapshot([ours_host.kv_buffer])[0]
        c_idx = ours_host.alloc(3 * P)
        assert ours.batch_get_v1(keys2, c_idx) == [True] * 3, ours.last_error
        exp = before.clone().view(ours_host.kv_buffer.dtype)
        for j in range(3):
            page_view(kind, layout, types.SimpleNamespace(kv_buffer=exp, page_size=P), c_idx[j * P].item()).copy_(page_view(kind, layout, theirs_host, b_idx[j * P].item()))
        check_equal("hicache-io read sglang's pages", ours_host.kv_buffer, exp)
        assert_sglang_index_type(seen)
    finally:
        ours.unregister_mem_pool_host()
