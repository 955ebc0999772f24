#!/usr/bin/env python3
"""sglang's direct L3 through hicache-io's linker, timed through sglang 0.5.23's own tree (the
test suite's ``LinkedTree``: ``UnifiedRadixCache`` built by sglang's factory on a CPU MHA pool):

  * ``offload``: a prefix computed and inserted, the tree writing it through the linker until
    every page is stored (gather from the pool, checksums, the local store's puts);
  * ``restore``: the prefix evicted from the device, a request matching it: ``lookup``, ``load``
    (reads, every object verified) and the layer-wise copy into the request's slots;
  * ``restore (cold)``: the same after the store's files were written back and dropped from the
    page cache (a restarted server).

GB/s of page bytes (K and V of every layer), median of ``--rounds``; each round a new prefix in a
fresh tree over one store directory (``--dir``, default a temporary folder).

    python3 scripts/bench-linker.py [--rounds 5] [--pages 96] [--dir DIR] [--json]

Needs sglang 0.5.23 and ninja importable (as ``python/tests/sglang_client`` does).
"""
import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))
sys.path.insert(0, HERE)

import hicache_io.sglang  # noqa: E402

hicache_io.sglang.install()
from sglang_client import cpu_shims  # noqa: E402

cpu_shims.apply()
from sglang_client.linker_tree import LinkedTree  # noqa: E402

from importlib import import_module  # noqa: E402

drop_cache = import_module("bench-l3-local").drop_cache
#: The pool: 16 layers of 8 kv heads of 128 bf16 values, 4-token pages (256 KiB a page).
SHAPE = dict(layers=16, head_num=8, head_dim=128)


def timed_restore(tree: LinkedTree, rid: str, tokens: list, computed) -> float:
    """Seconds ``tree`` took to restore ``tokens`` (every one, bytes equal to ``computed``)."""
    t = time.perf_counter()
    n, got, aborted = tree.restore(rid, tokens)
    seconds = time.perf_counter() - t
    assert n == len(tokens) and not aborted and (tree.rows(got) == computed).all(), f"{rid} restore fell short or differs"
    return seconds


def one_round(directory: str, pages: int, seed: int) -> dict:
    tokens = [1000 * (seed + 1) + t for t in range(pages * 4)]
    tree = LinkedTree({"store": "local", "path": directory}, size=pages * 4 + 64, **SHAPE)
    page_bytes = tree.linker.pages.obj_bytes
    try:
        slots = tree.compute(tokens, seed=seed)
        offload = tree.insert_seconds
        computed = tree.rows(slots)
        tree.evict(slots)
        restore = timed_restore(tree, "warm", tokens, computed)
    finally:
        tree.close()
    drop_cache(directory)
    cold_tree = LinkedTree({"store": "local", "path": directory}, size=pages * 4 + 64, **SHAPE)
    try:
        cold = timed_restore(cold_tree, "cold", tokens, computed)
    finally:
        cold_tree.close()
    gb = pages * page_bytes / 1e9
    return {"offload": gb / offload, "restore": gb / restore, "restore (cold)": gb / cold}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pages", type=int, default=96)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    directory = tempfile.mkdtemp(prefix="hicache-linker-bench-", dir=a.dir)
    rounds = []
    for r in range(a.rounds):
        rounds.append(one_round(directory, a.pages, r))
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rounds[-1].items()), file=sys.stderr)
    med = {k: sorted(x[k] for x in rounds)[len(rounds) // 2] for k in rounds[0]}
    if a.json:
        print(json.dumps(med))
        return
    print(f"| path | GB/s (median of {a.rounds}; {a.pages} pages of 256 KiB) |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} |")


if __name__ == "__main__":
    main()
