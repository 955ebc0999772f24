"""Which object names a page, and what a page's bytes mean (its namespace).

Keys. sglang's Mooncake backend names a page's objects ``{prefix}_{page_hash}_{tp_rank}[_{pp_rank}]_k``
and ``_v`` (MHA) or ``{prefix}_{page_hash}_[{pp_rank}]_k`` (MLA, one object; rank-replicated). Those
names carry no layout, and page_first, page_first_direct and page_head order a page's bytes
differently; so a pool whose page holds what sglang's page_first page holds (MHA or MLA,
page_first, every layer, no drafts) uses sglang's names, and sglang and hicache-io processes share
its objects. Every other pool (another layout, a layer shard, MTP draft layers, DSA skip-topk
layers, the DSA indexer) names what its page holds::

    {prefix}_{page_hash}_{rank}_hio-{kind}-{layout}-i{item bytes}-L{start}-{end}[-x{skipped}][+d{drafts}]-n{namespace}_{k|v}

``rank`` is the tp rank (and pp rank) for MHA, whose ranks hold different heads, and empty for
the rank-replicated MLA and DSA pools. It cannot collide with sglang's keys: no segment sglang puts
between the hash and the component starts with ``hio-``. Ranks that hold other layers differ in
``L`` (or skips, or drafts), MHA ranks that hold other heads in ``rank``, pools of another layout or
item size in those segments; the prefix names the model. Reading a page back needs only this
rank's shard.

Namespaces. A page's bytes mean something only to a pool of the same model, KV dtype (the pool's
``dtype``, or ``extra_config["hicache_io_kv_dtype"]``), kind, layout, object size, page size and
head split. These, the format version and an optional
``extra_config["hicache_io_namespace"]`` make the store's namespace (:attr:`PageStore.namespace`,
a JSON record) and its 48-bit digest. hicache-io's own names end in ``-n{digest}``, so a page
written under another namespace is another key: it reads as a miss, never as data. sglang's names
cannot change without losing sglang's own readers, so for them the namespace is a sidecar object
``{prefix}_hio-namespace_{rank}`` holding the record: the first store to register a pool under a
prefix writes it; a store whose namespace differs reads every sglang-named page as a miss and
writes none (counted as ``foreign``), and says so once. The sidecar is checked when the pool is
registered. A deployment that changes what its pages mean under the same prefix therefore gets
misses until it takes another prefix (``extra_backend_tag``, the model name) or the store is
cleared. It cannot protect against writers that do not write the record (sglang's own Mooncake
backend), nor survive its eviction from the store; ``extra_config["hicache_io_namespace_record"] =
False`` turns it off. ``extra_config["hicache_io_sglang_keys_any_layout"] = True`` gives
page_first_direct and page_head pools sglang's names too, for deployments where every rank uses
one layout.
"""

import logging
from typing import Any, Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

#: Version of what hicache-io's page objects mean, part of every namespace.
NAMESPACE_FORMAT = 1


def namespace_of(pool: Any, lay: Any, storage_config: Any, extra: Dict[str, Any]) -> Dict[str, Any]:
    """What a pool's page bytes mean (``lay``: its page objects), as a JSON-able record."""
    sc = storage_config
    dtype = extra.get("hicache_io_kv_dtype") or getattr(pool, "dtype", None)
    return {
        "format": NAMESPACE_FORMAT,
        "model": getattr(sc, "model_name", None),
        "kv_dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "kind": lay.kind,
        "layout": pool.layout,
        "object_bytes": lay.obj_bytes,
        "page_size": lay.page,
        # MHA ranks hold a share of the heads: the split is part of what a page means.
        "heads": {"tp_size": getattr(sc, "tp_size", 1), "tp_lcm_size": getattr(sc, "tp_lcm_size", None)} if lay.kind == "mha" else None,
        "namespace": extra.get("hicache_io_namespace"),
    }


def shard_descriptor(pool: Any, sglang_keys_any_layout: bool) -> Optional[str]:
    """``None`` when a hicache-io pool's page holds what sglang's page_first pages hold (sglang's
    keys apply), else the shard's name."""
    layer_num, start, end, drafts, skipped = pool.layer_map
    plain = pool.kind in ("mha", "mla") and (start, end) == (0, layer_num) and drafts == 0 and not any(skipped)
    if plain and (pool.layout == "page_first" or sglang_keys_any_layout):
        return None
    tag = {"page_first": "pf", "page_first_direct": "pfd", "page_head": f"ph{pool.head_num}", "page_first_direct_hg": f"pfdhg{pool.head_num}", "page_unified": f"pu{pool.head_num}"}[pool.layout]
    name = f"hio-{pool.kind}-{tag}-i{pool.item_bytes}-L{start}-{end}"
    gone = [str(i) for i in range(start, end) if skipped[i]]
    if gone:
        name += "-x" + ".".join(gone)
    if drafts:
        name += f"+d{drafts}"
    return name


class KeyScheme:
    """Which store keys name the objects of a page: ``keys(page_keys)`` gives every object key
    of the pages, page by page, ``per_page`` a page, in the order the pages' objects are moved."""

    per_page = 1

    def keys(self, page_keys: Sequence[str]) -> List[str]:
        raise NotImplementedError


class RankKeys(KeyScheme):
    """sglang's names (``descriptor`` ``None``: ``{prefix}{page}_{rank}_{k|v}``, as sglang's
    Mooncake backend writes them) or a shard's (``{prefix}{page}_{rank}_{descriptor}_{k|v}``,
    :func:`shard_descriptor`); an MHA ``page_unified`` page is one object ``_kv``."""

    def __init__(self, prefix: str, rank: str, descriptor: Optional[str], kind: str, comps: int):
        middle = rank if descriptor is None else f"{rank}_{descriptor}"
        names = ("kv",) if kind == "mha" and comps == 1 else ("k", "v")[:comps]
        self.prefix, self.tails, self.per_page = prefix, [f"_{middle}_{c}" for c in names], len(names)

    def keys(self, page_keys: Sequence[str]) -> List[str]:
        return [f"{self.prefix}{key}{tail}" for key in page_keys for tail in self.tails]


class GridKeys(KeyScheme):
    """The unified scheme's keys (:mod:`hicache_io.l3.unified`):
    ``{prefix}{page}_{digest}_{suffix}``, one per share of the grid, no rank."""

    def __init__(self, prefix: str, digest: str, suffixes: Sequence[str]):
        self.prefix, self.tails, self.per_page = prefix, [f"_{digest}_{s}" for s in suffixes], len(suffixes)

    def keys(self, page_keys: Sequence[str]) -> List[str]:
        return [f"{self.prefix}{key}{tail}" for key in page_keys for tail in self.tails]


class SidecarKeys(KeyScheme):
    """Storage v2's keys of a pool's page objects (:mod:`hicache_io.l3.sidecars`):
    ``{prefix}{page}_{rank}_hio2-{pool}-n{digest}_{j}``."""

    def __init__(self, prefix: str, rank: str, pool: str, digest: str, per_page: int):
        self.prefix, self.middle, self.per_page = prefix, f"{rank}_hio2-{pool}-n{digest}", per_page

    def keys(self, page_keys: Sequence[str]) -> List[str]:
        return [f"{self.prefix}{key}_{self.middle}_{j}" for key in page_keys for j in range(self.per_page)]


def namespace_key(prefix: str, rank: str) -> str:
    """The sidecar object holding the namespace record of sglang-named pages under ``prefix``."""
    return f"{prefix}hio-namespace_{rank}"


def claim_namespace(client: Any, key: str, record: bytes) -> bool:
    """Whether the sglang-named objects whose namespace sidecar is ``key`` belong to the
    namespace ``record`` (its JSON): the sidecar says so, or there was none and this call wrote
    it."""
    found = client.get(key)
    if not found:
        if client.put(key, record) == 0:
            return True
        found = client.get(key)  # another store wrote it meanwhile
    if found and bytes(found) == record:
        return True
    logger.warning(
        "hicache-io L3: the sglang-named objects under %r belong to another namespace (%s; this store's: %s): they read as misses and none is written",
        key, bytes(found or b"").decode(errors="replace"), record.decode(),
    )
    return False
