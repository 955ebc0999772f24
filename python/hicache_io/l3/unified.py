"""Topology-free L3 keys: one cache for every tensor-parallel shape.

With ``extra_config["hicache_io_key_scheme"] = "unified"``, the L3 stores (:class:`hicache_io.l3.store.PageStore`)
store each page as objects per (layer range, kv-head group, component) under keys that name no
rank, no tp size and no host layout::

    {prefix}_{page_hash}_u{digest}_L{a}-{b}[_H{g}]_{k|v}

* ``L{a}-{b}``: model layers ``a`` to ``b - 1`` (global numbers; ``hicache_io_layer_ranges``, a
  list of ``[a, b]`` tiling the pool's own layers in order, one range by default).
* ``H{g}``: kv heads ``g·G`` to ``(g + 1)·G - 1`` of the model (``G`` =
  ``hicache_io_head_group``, 1 by default). MHA only: an MLA page is the same on every rank, so
  there is one copy, with no ``H``, only ``_k``.
* The object holds that share of the page in the order (layer, token, head, head dim), whatever
  the host layout, so a ``page_first_direct_hg`` or ``page_unified`` writer and a ``page_first``
  reader share objects too. Where the pool's head groups are the grid's, a head group of a
  ``page_first_direct_hg`` pool is one span of host memory, of a ``page_unified`` pool one span
  per layer (other layouts: one per layer and token, or finer). Checksummed objects of one size,
  up to 64 KiB, whose page fits the 4 MiB staging buffer (:func:`hicache_io.l3.placements.sealing`), are gathered
  with their trailer into one span of it, summed in the same pass, and moved with Mooncake's
  single-buffer calls (its multi-buffer calls cost a quarter
  of the throughput and more); other objects move in place with its scatter/gather calls
  (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``). Either way an object is
  the same bytes.
* ``u{digest}``: a 48-bit hash of what the bytes mean: format version, model, kv dtype
  (``hicache_io_kv_dtype``, or the pool's ``dtype`` where it has one), pool kind,
  bytes per kv head row (MHA) or per token row (MLA), the model's kv heads and layers, the group
  size, the page size and ``hicache_io_namespace``. A reader that differs in any of them asks
  for other keys and gets misses.

A rank's heads are ``tp_rank·H`` to ``(tp_rank + 1)·H - 1`` with ``H = hicache_io_kv_heads /
tp_size`` (the storage config's ``tp_rank`` and ``tp_size``). A writer at tp size ``a`` and a
reader at ``b`` address the same objects when both hold whole groups: ``G`` divides both ``H``.
A rank whose heads cannot be cut into whole groups (``H % G != 0``) reads and writes nothing: every
page is a miss (``integrity_stats()["incompatible"]`` counts them), never wrong bytes. A page is a
hit only when every object of this rank's share exists (``batch_exists``) or was read whole and
verified (``batch_get_v1``).

With checksums on (the default), every object ends in the 16-byte checksum trailer of hicache-io's
other objects, the checksum of the share's bytes in the object's order folded with a hash of the
key: a get verifies it against the bytes that landed; an object that fails fails its page. Objects
written without one read as unverified, never as corrupt.

Needs a hicache-io ``HostPool`` (MHA or MLA, no MTP draft or skipped layers: they lie outside the
grid) whose memory lives in this process (the cpu executor, cuda's pinned pools); wgpu pools are
refused. sglang 0.5.23's own pools have no head-group layout and keep its rank-suffixed keys.
"""

import hashlib
import json
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np


logger = logging.getLogger(__name__)

#: The unified objects' format version (bound into the digest).
UNIFIED_FORMAT = "hio-unified-v1"
#: The key scheme option's values.
KEY_SCHEMES = ("rank-suffix", "unified")


def _layer_ranges(spec: Any, start: int, end: int) -> List[Tuple[int, int]]:
    if spec is None:
        return [(start, end)]
    ranges = [(int(a), int(b)) for a, b in spec]
    at = start
    for a, b in ranges:
        if a != at or b <= a:
            raise ValueError(f"hicache_io_layer_ranges {ranges} must tile this pool's layers [{start}, {end}) in order, without gaps")
        at = b
    if at != end:
        raise ValueError(f"hicache_io_layer_ranges {ranges} must tile this pool's layers [{start}, {end}) in order, without gaps")
    return ranges


class UnifiedGrid:
    """One rank's share of the unified grid: its objects per page, where their bytes lie in the
    host pool, and the namespace they belong to."""

    def __init__(self, pool: Any, storage_config: Any, extra: Dict[str, Any]):
        kind = pool.kind
        if kind not in ("mha", "mla"):
            raise ValueError(f"unified keys hold MHA and MLA pages; a {kind} pool keeps rank-suffixed keys")
        layer_num, start, end, drafts, skipped = pool.layer_map
        if drafts or any(skipped[start:end]):
            raise ValueError("unified keys cover the model's own layers: MTP draft and skipped layers lie outside the grid (use hicache_io_key_scheme 'rank-suffix')")
        bases = [pool.host_span(c) for c in range(pool.components)]
        if any(b is None for b in bases):
            raise ValueError("unified keys move page shares in place: this pool lives in executor buffers (wgpu); use the cpu or cuda executor")
        item = pool.item_bytes
        self.missing: Optional[str] = None
        if kind == "mha":
            if "hicache_io_kv_heads" not in extra:
                raise ValueError('unified keys for an MHA pool need the model\'s kv head count: extra_config["hicache_io_kv_heads"]')
            total = int(extra["hicache_io_kv_heads"])
            tp_size, tp_rank = int(getattr(storage_config, "tp_size", 1)), int(getattr(storage_config, "tp_rank", 0))
            if total <= 0 or total % tp_size or not 0 <= tp_rank < tp_size:
                raise ValueError(f"{total} kv heads cannot be split evenly over tp_size {tp_size} (rank {tp_rank}); replicated kv heads are not supported by unified keys")
            heads = total // tp_size
            if item % heads:
                raise ValueError(f"the pool's {item}-byte token rows are not {heads} whole kv heads")
            head_bytes, first = item // heads, tp_rank * heads
            group = int(extra.get("hicache_io_head_group", 1))
            if group <= 0:
                raise ValueError(f"hicache_io_head_group must be positive, got {group}")
            if heads % group:
                self.missing = f"this rank's kv heads {first}..{first + heads - 1} cannot be cut into groups of {group}"
                groups: List[Tuple[Optional[int], int, int]] = []
            else:
                groups = [(first // group + j, j * group * head_bytes, (j + 1) * group * head_bytes) for j in range(heads // group)]
            comps: Tuple[str, ...] = ("k", "v")
            shape = {"head_bytes": head_bytes, "kv_heads": total, "head_group": group}
        else:
            groups, comps = [(None, 0, item)], ("k",)
            shape = {"row_bytes": item}
        dtype = extra.get("hicache_io_kv_dtype") or getattr(pool, "dtype", None)
        self.namespace: Dict[str, Any] = {
            "format": UNIFIED_FORMAT,
            "model": getattr(storage_config, "model_name", None),
            "kv_dtype": None if dtype is None else str(dtype).replace("torch.", ""),
            "kind": kind,
            **shape,
            "layers": layer_num,
            "page_size": pool.page_size,
            "namespace": extra.get("hicache_io_namespace"),
        }
        record = json.dumps(self.namespace, sort_keys=True).encode()
        self.digest = "u" + hashlib.blake2b(record, digest_size=6).hexdigest()
        #: Per object of a page: key suffix, share ``(comp, layer start, layer end, byte start, byte end)``
        #: (host layers), spans of page 0 as addresses, their sizes and the shift to the next page.
        self.suffixes: List[str] = []
        self.shares: List[Tuple[int, int, int, int, int]] = []
        self._spans: List[Tuple[np.ndarray, List[int], int]] = []
        for a, b in _layer_ranges(extra.get("hicache_io_layer_ranges"), start, end):
            for g, lo, hi in groups:
                for c, name in enumerate(comps):
                    self.suffixes.append(f"L{a}-{b}" + ("" if g is None else f"_H{g}") + f"_{name}")
                    share = (c, a - start, b - start, lo, hi)
                    self.shares.append(share)
                    spans, shift = pool.page_share_spans(c, (share[1], share[2]), (lo, hi))
                    addrs = np.asarray([bases[buf][0] + off for buf, off, _ in spans], dtype=np.uint64)
                    self._spans.append((addrs, [n for _, _, n in spans], shift))
        self.object_bytes = [sum(sizes) for _, sizes, _ in self._spans]
        self.regions = [b for b in bases if b[1] > 0]

    def buffers(self, pages: Sequence[int]) -> Tuple[List[List[int]], List[List[int]]]:
        """Per object of each host page (page numbers), its spans' addresses and sizes."""
        ptrs: List[List[int]] = []
        sizes: List[List[int]] = []
        for page in pages:
            for addrs, lens, shift in self._spans:
                ptrs.append((addrs + np.uint64(page * shift)).tolist())
                sizes.append(lens)
        return ptrs, sizes
