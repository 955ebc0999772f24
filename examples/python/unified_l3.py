"""One L3 cache for every tensor-parallel shape: pages written by ranks of one TP size are read,
byte-exact, by ranks of another, through Mooncake Store and hicache-io's topology-free keys
(``hicache_io_key_scheme = "unified"``).

The model: 8 kv heads of 64 bytes (MHA, K and V) or 96-byte latent rows (MLA), 4 layers, pages
of 4 tokens. Each process is one rank: it fills its device pool with its share of the model's KV
(its heads; MLA: everything), backs it up into its host pool and puts the pages (``write``), or
gets the pages into its host pool, loads every layer into a fresh device pool and compares each
byte with its share (``read``). It prints one JSON line.

    python examples/python/unified_l3.py                      # the whole story, master on loopback
    python examples/python/unified_l3.py --master H:P --tp 2 --rank 0 write 0 1 2
    python examples/python/unified_l3.py --master H:P --tp 4 --rank 1 read 0 1 2
    python examples/python/unified_l3.py --master local:DIR --tp 2 --rank 0 write 0 1 2   # no server

Needs ``pip install mooncake-transfer-engine-non-cuda`` (plus libibverbs1 libnl-3-200 libnl-route-3-200).
"""

import argparse
import json
import subprocess
import sys

import numpy as np

import hicache_io

KV_HEADS, HEAD_BYTES, MLA_ROW, LAYERS, P = 8, 64, 96, 4, 4


def model_page(kind: str, page: int) -> np.ndarray:
    """The model's KV of page ``page``: ``(components, layers, tokens, row bytes)``, all heads."""
    row = KV_HEADS * HEAD_BYTES if kind == "mha" else MLA_ROW
    comps = 2 if kind == "mha" else 1
    return np.random.default_rng(1000 + page).integers(0, 256, (comps, LAYERS, P, row), dtype=np.uint8)


def rank_share(kind: str, page: int, tp: int, rank: int) -> np.ndarray:
    """This rank's share of a page: its kv heads (MHA; MLA ranks hold every byte)."""
    data = model_page(kind, page)
    if kind == "mla":
        return data
    heads = KV_HEADS // tp
    return data[..., rank * heads * HEAD_BYTES : (rank + 1) * heads * HEAD_BYTES]


def run_rank(args: argparse.Namespace) -> dict:
    # A rank here needs no sglang: where it is installed, importing it (and torch) would cost
    # seconds per process before hicache_io.storage falls back to its own base class.
    sys.modules.setdefault("sglang", None)  # type: ignore[arg-type]
    from hicache_io.storage import HiCacheStorageConfig, LocalStore, MooncakeStore

    kind, pages = args.kind, [int(p) for p in args.pages]
    item = (KV_HEADS // args.tp) * HEAD_BYTES if kind == "mha" else MLA_ROW
    device = hicache_io.Device(args.executor)
    slots = len(pages) * P
    dev = hicache_io.DevicePool(device, kind, item, slots, P, LAYERS)
    host = hicache_io.HostPool(dev, args.layout, slots, head_num=args.host_groups if kind == "mha" else 1, profile="extended")
    tokens = np.arange(slots, dtype=np.int64)
    extra = {
        "master_server_address": args.master,
        "global_segment_size": 128 << 20,  # split over tp_size ranks; Mooncake wants 16 MiB each
        "local_buffer_size": 4 << 20,
        "protocol": "tcp",
        "metadata_server": "P2PHANDSHAKE",
        "local_hostname": "127.0.0.1",
        "hicache_io_key_scheme": "unified",
        "hicache_io_kv_heads": KV_HEADS,
        "hicache_io_head_group": args.head_group,
        "hicache_io_kv_dtype": "uint8",
    }
    local = args.master.startswith("local:")  # the local-disk store: a directory, no server
    if local:
        extra = {k: v for k, v in extra.items() if k.startswith("hicache_io_")}
        extra["hicache_io_local_dir"] = args.master[len("local:") :]
    config = HiCacheStorageConfig(tp_rank=args.rank, tp_size=args.tp, model_name=args.model, is_mla_model=kind == "mla", extra_config=extra)
    store = LocalStore(config, {}) if local else MooncakeStore(config, {})
    keys = [f"page{p}" for p in pages]
    out: dict = {"tp": args.tp, "rank": args.rank, "layout": args.layout}
    try:
        store.register_mem_pool_host(host)
        out["objects_per_page"] = len(store.object_keys(keys[0]))
        out["keys"] = store.object_keys(keys[0])
        if args.action == "write":
            for c in range(2 if kind == "mha" else 1):
                for layer in range(LAYERS):
                    rows = np.concatenate([rank_share(kind, p, args.tp, args.rank)[c, layer] for p in pages])
                    dev.write_buffer(c, layer, rows.reshape(-1))
            host.backup_from_device_all_layer(dev, tokens, tokens, "kernel")
            out["written"] = store.batch_set_v1(keys, tokens)
            out["objects"] = store.integrity_stats()
            print(json.dumps(out), flush=True)
            sys.stdin.read()  # hold the objects (this client's memory) until told to stop
            return out
        else:
            out["exists"] = store.batch_exists(keys)
            hits = store.batch_get_v1(keys, tokens)
            out["hits"] = hits
            for layer in range(LAYERS):
                host.load_to_device_per_layer(dev, tokens, tokens, layer, "kernel")
            exact = []
            for i, p in enumerate(pages):
                want = rank_share(kind, p, args.tp, args.rank)
                got = [[dev.read_buffer(c, layer)[i * P * item : (i + 1) * P * item] for layer in range(LAYERS)] for c in range(want.shape[0])]
                exact.append(bool(hits[i]) and np.array_equal(np.asarray(got).reshape(want.shape), want))
            out["exact"] = exact
            out["host_items"] = host.integrity_stats()
        out["objects"] = store.integrity_stats()
    finally:
        store.close()
    return out


class Rank:
    """One rank in its own process. Mooncake keeps objects in the memory its clients lend, so a
    writer stays up (holding its segment) until :meth:`stop`; a reader exits when done."""

    def __init__(self, master: str, kind: str, tp: int, r: int, action: str, pages, layout: str, groups: int = 1, head_group: int = 2, model: str = "example/unified"):
        cmd = [sys.executable, __file__, "--master", master, "--kind", kind, "--tp", str(tp), "--rank", str(r), "--layout", layout,
               "--host-groups", str(groups), "--head-group", str(head_group), "--model", model, action, *map(str, pages)]
        self.name = f"TP={tp} rank {r} {action}"
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            raise RuntimeError(f"{self.name} failed:\n{self.proc.stderr.read()[-4000:]}")
        self.result = json.loads(line)

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def rank(*args, **kw) -> dict:
    """A reading rank's JSON line (the process exits)."""
    r = Rank(*args, **kw)
    r.stop()
    return r.result


def story() -> None:
    from hicache_io.storage import LocalMaster

    writers = []
    with LocalMaster() as m:
        try:
            print("MHA, 8 kv heads in groups of 2")
            w = Rank(m.address, "mha", 2, 0, "write", [0, 1, 2], "page_unified", groups=2)
            writers.append(w)
            w = w.result
            print(f"  TP=2 rank 0 (heads 0..3, page_unified) wrote {w['written']}: {w['objects_per_page']} objects a page, e.g. {w['keys'][0]}")
            r = rank(m.address, "mha", 4, 1, "read", [0, 1, 2], "page_first_direct_hg", groups=1)
            print(f"  TP=4 rank 1 (heads 2..3, page_first_direct_hg) read {r['hits']}, byte-exact {r['exact']}, objects {r['objects']}")
            writers += [Rank(m.address, "mha", 4, t, "write", [5], "page_first_direct_hg", groups=2) for t in (0, 1)]
            r = rank(m.address, "mha", 2, 0, "read", [5], "page_first")
            print(f"  TP=4 ranks 0 and 1 wrote page 5; TP=2 rank 0 (page_first) read {r['hits']}, byte-exact {r['exact']}")
            r = rank(m.address, "mha", 8, 1, "read", [0, 1, 2], "page_first")
            print(f"  TP=8 rank 1 (one head; groups of 2 do not fit) read {r['hits']}: misses, {r['objects']['incompatible']} counted incompatible")
            print("MLA, rank-replicated")
            w = Rank(m.address, "mla", 2, 0, "write", [0, 1], "page_unified")
            writers.append(w)
            r = rank(m.address, "mla", 4, 3, "read", [0, 1], "page_first")
            print(f"  TP=2 rank 0 wrote one copy ({w.result['keys']}); TP=4 rank 3 read {r['hits']}, byte-exact {r['exact']}")
        finally:
            for w in writers:
                w.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--master")
    ap.add_argument("--kind", default="mha", choices=["mha", "mla"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--layout", default="page_first_direct_hg")
    ap.add_argument("--host-groups", type=int, default=1, help="the host pool's head groups (page_first_direct_hg, page_unified)")
    ap.add_argument("--head-group", type=int, default=2, help="kv heads per L3 object (hicache_io_head_group)")
    ap.add_argument("--executor", default="cpu")
    ap.add_argument("--model", default="example/unified")
    ap.add_argument("action", nargs="?", choices=["write", "read"])
    ap.add_argument("pages", nargs="*")
    args = ap.parse_args()
    if args.action is None:
        story()
        return
    out = run_rank(args)
    if args.action == "read":  # a writer printed its line before holding its objects
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
