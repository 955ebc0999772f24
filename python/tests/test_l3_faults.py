"""The L3 tier under faults, each ending in a miss or a clear error, never a wrong byte or a hang:

- Mooncake's master killed while puts and gets are in flight, then restarted on its port: every
  call returns within ``CALL_BOUND_S`` (a miss or a failed put, code -900), ``integrity_stats()``
  counts the outage and the objects it failed, a warning is logged when it starts and when it
  ends, and the same store works again after the restart;
- leases that run out before a get's transfer completes (-707), objects removed while gets race
  them, a page of which one object is gone: misses, every hit exact;
- a writer process killed with SIGKILL at random points: every hit afterwards is exact;
- the local store on a full disk (``ENOSPC``, part way through a batch) and a failing disk
  (``EIO``, before and part way through a read), injected by ``fsfault.c`` (``LD_PRELOAD``): puts
  report the failure and leave no visible object and no temporary file, the directory's byte
  count stays true, gets are misses that leave the pool's other pages untouched (and the page
  itself, where no byte was read), and everything works once the disk does.

sglang's own controller through an outage: ``sglang_client/test_outage.py``."""

import contextlib
import itertools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest

from common import build, child_env, make_store, mooncake_problem, page_bytes, tokens

HERE = os.path.dirname(os.path.abspath(__file__))

#: The longest a store call may take while the master is down (Mooncake's RPC timeout is about
#: 4.3 s here; a call makes at most two rounds of RPCs).
CALL_BOUND_S = 15.0
#: The longest the client may take to reach a restarted master (measured: 1–5 s).
RECONNECT_BOUND_S = 60.0


def _mooncake():
    problem = mooncake_problem()
    if problem is not None:
        pytest.skip(problem)
    from hicache_io.storage import LocalMaster

    return LocalMaster


def _pages(store, kind="mha", bpt=4096, layers=3):
    """Eight pages of random bytes (pages 0..7 of a pool of 16) registered with ``store``: the
    pool, each page's bytes, and eight fresh keys."""
    _, dev, host = build("cpu", kind, "page_first", 1, bpt, layers, None, 0, pages=8, host_pages=16)
    host.backup_from_device_all_layer(dev, tokens(range(8)), tokens(range(8)), "kernel")
    store.register_mem_pool_host(host)
    bufs = [host.read_buffer(c) for c in range(host.components)]
    return host, [page_bytes(host, p, bufs) for p in range(8)], [uuid.uuid4().hex for _ in range(8)]


@contextlib.contextmanager
def _stores(lease_ms):
    """A master of its own with leases of ``lease_ms``, a store with a segment and a second
    client without one (to remove objects); closed before the master goes."""
    m = _mooncake()(lease_ms=lease_ms)
    s, other = make_store(m, segment=64 << 20), make_store(m, segment=0)
    try:
        yield s, other
    finally:
        other.close()
        s.close()
        m.stop()


def _wrong(host, got, images):
    """The pages read into pages 8..15 as hits whose bytes are not ``images``'."""
    now = [host.read_buffer(c) for c in range(host.components)]
    return [j for j, ok in enumerate(got) if ok and page_bytes(host, 8 + j, now) != images[j]]


# ------------------------------------------------------------------------------ Mooncake's master


def test_the_master_killed_in_flight_and_restarted(caplog):
    LocalMaster = _mooncake()
    caplog.set_level(logging.WARNING, logger="hicache_io.l3.transport")
    m = LocalMaster(lease_ms=200)
    port, restarted = m.port, None
    s = make_store(m, segment=128 << 20)
    stop, th = threading.Event(), None
    try:
        # 1 MiB pages: a batch of 8 is a call that takes a while, so the kill lands inside calls.
        host, images, _ = _pages(s, "mla", 32768, 4)
        calls, wrong = [], []
        # Four sets of keys in turn (the segment holds them all): puts of stored pages ask the
        # master and count as written, gets move the bytes.
        key_sets = [[uuid.uuid4().hex for _ in range(8)] for _ in range(4)]

        def traffic():
            while not stop.is_set():
                keys = key_sets[len(calls) % 4]
                t0 = time.monotonic()
                put = s.batch_set_v1(keys, tokens(range(8)))
                t1 = time.monotonic()
                got = s.batch_get_v1(keys, tokens(range(8, 16)))
                t2 = time.monotonic()
                calls.append((t0, t1 - t0, put, t2 - t1, got))
                wrong.extend(_wrong(host, got, images))

        th = threading.Thread(target=traffic, daemon=True)
        th.start()
        time.sleep(1.0)
        assert calls and all(all(c[2]) and all(c[4]) for c in calls), f"traffic failed before the outage: {s.last_error}"
        m.stop()
        dead = time.monotonic()  # stop() waits for the master to exit
        # Down for about one RPC timeout (calls in flight and new ones fail), and on until a call
        # begun after the kill has returned: a call in flight at the kill can wait out the whole
        # timeout, and under load one did, so that no call was made inside a fixed 5 s.
        time.sleep(5.0)
        while not any(c[0] > dead for c in calls) and time.monotonic() - dead < 5.0 + 2 * CALL_BOUND_S:
            time.sleep(0.2)
        restarting = time.monotonic()
        restarted = LocalMaster(port=port, lease_ms=200)
        back = time.monotonic()
        while time.monotonic() - back < RECONNECT_BOUND_S:
            if any(c[0] > back and all(c[2]) and all(c[4]) for c in calls):
                break
            time.sleep(0.2)
        stop.set()
        th.join(2 * CALL_BOUND_S)
        assert not th.is_alive(), "a store call hung"
        assert wrong == [], f"hits with wrong bytes: {wrong}"
        # The calls made inside the outage: begun once the master had exited, returned before its
        # successor started. (A call that began before the master died, or one still waiting when
        # the successor came up, may succeed: under load both happened.)
        during = [c for c in calls if dead < c[0] and c[0] + c[1] + c[3] < restarting]
        assert during, f"no call was made in the {restarting - dead:.1f} s the master was down"
        assert not any(any(c[2]) or any(c[4]) for c in during), "a call succeeded with the master down"
        assert max(max(c[1], c[3]) for c in calls) <= CALL_BOUND_S, f"a call took {max(max(c[1], c[3]) for c in calls):.1f} s"
        assert any(c[0] > back and all(c[2]) and all(c[4]) for c in calls), f"no round trip within {RECONNECT_BOUND_S} s of the restart"
        st = s.integrity_stats()
        assert st["io_errors"] == 0, st  # Mooncake's codes are not disk errors
        # 2: a call may meet the old connection while the client remounts (a short second outage).
        assert st["outages"] in (1, 2) and st["unreachable"] > 0 and st["corrupt"] == 0, st
        said = [r.getMessage() for r in caplog.records]
        assert any("is unreachable" in t for t in said) and any("answers again" in t for t in said), said
    finally:
        stop.set()
        if th is not None:
            th.join(2 * CALL_BOUND_S)
        s.close()  # before the masters go: no wait on Mooncake's timeouts
        m.stop()
        if restarted is not None:
            restarted.stop()


def test_leases_that_run_out_and_objects_removed_mid_batch():
    # A lease of 1 ms runs out before any get's transfer completes: Mooncake fails the object.
    with _stores(1) as (s, _):
        _, _, keys = _pages(s, "mla", 32768, 4)
        assert s.batch_set_v1(keys, tokens(range(8))) == [True] * 8
        assert s.batch_get_v1(keys, tokens(range(8, 16))) == [False] * 8
        assert s.last_error.code == -707, s.last_error

    # Leases of 50 ms: the gets below finish inside them, and objects can be removed past them.
    with _stores(50) as (s, remover):
        # Two objects a page (K and V): a page with one of them gone is a miss, whatever landed.
        host, images, keys = _pages(s)
        assert s.batch_set_v1(keys, tokens(range(8))) == [True] * 8
        time.sleep(0.1)  # past the put's lease
        for page, part in ((1, 1), (5, 0)):
            assert remover.store.remove(s.object_keys(keys[page])[part]) == 0
        got = s.batch_get_v1(keys, tokens(range(8, 16)))
        assert got == [j not in (1, 5) for j in range(8)]
        assert _wrong(host, got, images) == []

    # Objects removed and written again while gets race them (leases of 3 ms, so that removals
    # land between and inside gets): misses, and exact hits.
    with _stores(3) as (s, remover):
        host, images, keys = _pages(s)
        stop, hits, removed, wrong = threading.Event(), [0], [0], []

        def remove():
            while not stop.is_set():
                for k in keys:
                    for o in s.object_keys(k):
                        removed[0] += remover.store.remove(o) == 0

        th = threading.Thread(target=remove)
        th.start()
        try:
            # 40 rounds at least, and on until the remover got in (a busy machine can starve its
            # thread through 40 rounds: CI saw 320 hits and no removal once), for 30 s at most.
            end = time.monotonic() + 30
            for n in itertools.count():
                if n >= 40 and ((hits[0] and removed[0]) or time.monotonic() > end):
                    break
                s.batch_set_v1(keys, tokens(range(8)))
                got = s.batch_get_v1(keys, tokens(range(8, 16)))
                hits[0] += sum(got)
                wrong.extend(_wrong(host, got, images))
        finally:
            stop.set()
            th.join()
        assert wrong == [], f"hits with wrong bytes: {wrong}"
        assert hits[0] > 0 and removed[0] > 0, f"{hits[0]} hits, {removed[0]} objects removed: the race tried nothing"


WRITER = textwrap.dedent(
    """
    import sys
    sys.modules["sglang"] = None  # no torch import: seconds
    import numpy as np
    import hicache_io
    from hicache_io.storage import HiCacheStorageConfig, MooncakeStore

    address, model, start, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), "mla", 8192, 16 * 8, 8, 4)
    host = hicache_io.HostPool(dev, "page_first", 16 * 8, profile="extended")
    n = len(host.get_dummy_flat_data_page())
    extra = {"master_server_address": address, "global_segment_size": 16 << 20, "local_buffer_size": 4 << 20, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1"}
    store = MooncakeStore(HiCacheStorageConfig(model_name=model, extra_config=extra), {})
    store.register_mem_pool_host(host)
    for first in range(start, start + count, 8):
        for slot, seed in enumerate(range(first, first + 8)):
            host.set_from_flat_data_page(slot * 8, np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))
        store.batch_set_v1([f"key-{s}" for s in range(first, first + 8)], np.arange(64))
        if first == start:
            print("ready", flush=True)
    """
)


def test_writers_killed_at_random_points_leave_exact_hits(tmp_path):
    LocalMaster = _mooncake()
    import hicache_io
    from hicache_io.storage import HiCacheStorageConfig, MooncakeStore

    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = child_env()
    m, model, rng = LocalMaster(lease_ms=200), f"test/{uuid.uuid4().hex[:8]}", np.random.default_rng(56)
    reader = None
    try:
        # The reader's segment is there first and is the larger: most objects land in it, so a
        # writer killed part way leaves objects it began and never finished in living memory.
        dev = hicache_io.DevicePool(hicache_io.Device("cpu"), "mla", 8192, 16 * 8, 8, 4)
        host = hicache_io.HostPool(dev, "page_first", 16 * 8, profile="extended")
        n = len(host.get_dummy_flat_data_page())
        extra = {"master_server_address": m.address, "global_segment_size": 256 << 20, "local_buffer_size": 4 << 20, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1"}
        reader = MooncakeStore(HiCacheStorageConfig(model_name=model, extra_config=extra), {})
        reader.register_mem_pool_host(host)
        for round_ in range(3):
            proc = subprocess.Popen([sys.executable, str(script), m.address, model, str(round_ * 4000), "4000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            try:
                ready, _, _ = select.select([proc.stdout], [], [], 120)
                assert ready and proc.stdout.readline().strip() == b"ready", "a writer did not start"
                time.sleep(float(rng.uniform(0.05, 0.6)))  # into the puts
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                proc.stdout.close()
        # Objects in the dead writers' segments have lost their memory: misses.
        hits, wrong, t0 = 0, [], time.monotonic()
        for round_ in range(3):
            for first in range(round_ * 4000, round_ * 4000 + 400, 16):
                seeds = list(range(first, first + 16))
                got = reader.batch_get_v1([f"key-{s}" for s in seeds], np.arange(16 * 8))
                for slot, ok in enumerate(got):
                    if ok:
                        hits += 1
                        if not np.array_equal(host.get_data_page(slot * 8), np.random.default_rng(seeds[slot]).integers(0, 256, n, dtype=np.uint8)):
                            wrong.append(seeds[slot])
        assert wrong == [], f"hits with wrong bytes: {wrong[:10]}"
        assert time.monotonic() - t0 < 75 * CALL_BOUND_S
        assert hits > 0, "no page was read back: the test tried nothing"
    finally:
        if reader is not None:
            reader.close()
        m.stop()


# ------------------------------------------------------------------------------ the local disk


@pytest.fixture(scope="module")
def fsfault(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        if os.environ.get("CI"):
            raise RuntimeError("CI needs a C compiler for the fault-injecting shim")
        pytest.skip("no C compiler for the fault-injecting shim")
    out = tmp_path_factory.mktemp("fsfault") / "fsfault.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), os.path.join(HERE, "fsfault.c"), "-ldl"], check=True)
    return str(out)


DISK = textwrap.dedent(
    """
    import json, os, sys
    sys.modules["sglang"] = None
    import numpy as np
    import hicache_io
    from hicache_io.l3.local import stats
    from hicache_io.storage import LocalStore

    directory, kind = sys.argv[1], sys.argv[2]
    bpt, layers = {"dsa": (132, 4), "mla": (32768, 4)}[kind]  # trailered 528 B pages; 1 MiB pages, written direct
    # Where their bytes go: small objects to packs (this process's one pack file), others to files
    # written under tmp/ and linked into objects/.
    writes, reads = ("/packs/", "/packs/") if kind == "dsa" else ("/tmp/", "/objects/")
    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), kind, bpt, 16 if kind == "dsa" else 16 * 8, 8, layers)
    host = hicache_io.HostPool(dev, "page_first", 16 * 8, profile="extended")
    n = len(host.get_dummy_flat_data_page())
    store = LocalStore(kwargs={"hicache_io_local_dir": directory})
    store.register_mem_pool_host(host)
    client = store.store
    image = [np.random.default_rng(p).integers(0, 256, n, dtype=np.uint8) for p in range(8)]
    keys = [f"{kind}-{p}" for p in range(8)]
    toks = lambda pages: np.concatenate([np.arange(p * 8, p * 8 + 8) for p in pages])
    out = {}

    def counted():
        with open(os.path.join(directory, "lock"), "rb") as f:
            return int.from_bytes(f.read(8), "little")

    def fault(**kw):
        for k in [k for k in os.environ if k.startswith("HICACHE_FAULT_")]:
            del os.environ[k]
        for k, v in kw.items():
            os.environ["HICACHE_FAULT_" + k.upper()] = str(v)

    def pages_of_pool():
        return [host.get_data_page(p * 8).copy() for p in range(16)]

    for p in range(8):
        host.set_from_flat_data_page(p * 8, image[p])

    # A disk that fills part way through a batch: the puts that did not fit fail, whole.
    fault(path=directory + writes, write_errno=28, write_budget=int(2.5 * n), epoch=1)
    put = store.batch_set_v1(keys, toks(range(8)))
    err = store.last_error
    out["enospc_put"] = put
    assert not all(put) and err is not None and err.code == -28 and "ENOSPC" in str(err), (put, err)
    for k, ok in zip(keys, put):
        assert store.batch_exists([k]) == int(ok), k
        assert client.batch_is_exist(store.object_keys(k)) == [int(ok)] * len(store.object_keys(k)), k
    assert os.listdir(os.path.join(directory, "tmp")) == [], "a failed put left its temporary file"
    c0, c1 = counted(), client.resync()
    assert c0 == c1, ("the byte count kept bytes that were never written", c0, c1, put)
    assert store.integrity_stats()["io_errors"] > 0
    fault()
    assert store.batch_set_v1(keys, toks(range(8))) == [True] * 8, store.last_error

    # A failing disk, at the first byte and part way: misses, the objects stay, other pages untouched.
    for budget, epoch in ((0, 2), (int(1.5 * n), 3)):
        for p in range(8, 16):
            host.set_from_flat_data_page(p * 8, np.full(n, 0x5A, np.uint8))
        before = pages_of_pool()
        fault(path=directory + reads, read_errno=5, read_budget=budget, epoch=epoch)
        got = store.batch_get_v1(keys[:4], toks(range(8, 12)))
        err = store.last_error
        fault()
        out[f"eio_get_{budget}"] = got
        assert not all(got) and err.code == -5 and "EIO" in str(err), (got, err)
        after = pages_of_pool()
        for p in range(16):
            if 8 <= p < 12 and got[p - 8]:
                assert np.array_equal(after[p], image[p - 8]), p
            elif not (8 <= p < 12) or budget == 0:
                assert np.array_equal(after[p], before[p]), f"page {p} was written by a failed get"
        assert store.batch_exists(keys) == 8, "a read error removed an object"
    assert store.batch_get_v1(keys, toks(range(8, 16))) == [True] * 8, store.last_error
    assert all(np.array_equal(host.get_data_page((8 + p) * 8), image[p]) for p in range(8))
    st = store.integrity_stats()
    assert st["corrupt"] == 0 and st["io_errors"] > 0, st
    out["stats"], out["disk"] = st, stats(directory)
    store.close()
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("kind", ["dsa", "mla"])
def test_a_full_disk_and_a_failing_disk(tmp_path, fsfault, kind):
    script = tmp_path / "disk.py"
    script.write_text(DISK)
    env = child_env(LD_PRELOAD=fsfault)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "l3"), kind], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if kind == "dsa":  # one writer thread: the first pages fit (1 MiB pages go on four threads, which may all be cut)
        assert any(got["enospc_put"]), "no put fitted before the disk filled: the budget tried nothing part way"
