"""How ``HicacheLinker`` (:mod:`hicache_io.sglang_linker`) sees sglang's device pools as store
objects: :class:`LinkerPages` (a pool's pages as objects of rows, and the copies between the pool
and a staging buffer through hicache-io's ops), :class:`PoolObjects` (a pool's keys, whether this
rank writes them, which layers of the layer counter it holds), :class:`StagingBuffers` (registered
host memory for pages in flight), and the keys: what a page's bytes mean, in a digest."""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName

from . import kvcacheio
from .l3.trailer import TRAILER_BYTES

#: Version of what a linker page object holds, part of every key's digest.
LINKER_FORMAT = 1
#: The KV pools whose pages are their token rows and nothing else (with the ``nhd`` layout): FP4,
#: MXFP8 and DSA pools hold scales or indexer buffers besides, which these objects do not carry.
PLAIN_POOLS = ("MHATokenToKVPool", "MLATokenToKVPool")


class LinkerPages:
    """A device KV pool's pages as objects: ``rows`` are the pool's layer buffers as rows of
    ``item`` bytes (``[slots × groups][item]``, uint8 views: K layers then V layers, or MLA's one
    buffer a layer), slot ``s``'s head group ``h`` at row ``s × groups + h``. A page is ``groups``
    objects (one, unless ``head_group`` cuts an MHA rank's heads into groups of that many heads).
    Object ``j`` of a staging buffer starts at byte ``j × stride``: buffer ``b``'s rows of the
    object at ``(b × P + t) × item``, the trailer after them."""

    def __init__(self, kv: Any, page: int, head_group: Optional[int] = None):
        plain = type(kv).__name__ in PLAIN_POOLS and getattr(kv, "kv_cache_layout", "nhd") == "nhd"
        extra = [a for a in ("k_scale_buffer", "v_scale_buffer", "kv_scale_buffer", "index_k_with_scale_buffer") if getattr(kv, a, None) is not None]
        if not plain or extra:
            what = f"layout {getattr(kv, 'kv_cache_layout', None)}" if type(kv).__name__ in PLAIN_POOLS and not extra else f"buffers {extra}" if extra else "pool"
            raise ValueError(f"hicache-io's linker stores plain MHA and MLA KV pools (token rows, no scales); got {type(kv).__name__} ({what})")
        if getattr(kv, "k_buffer", None) is not None and getattr(kv, "v_buffer", None) is not None:
            self.kind, layers = "mha", list(kv.k_buffer) + list(kv.v_buffer)
        elif getattr(kv, "kv_buffer", None) is not None:
            self.kind, layers = "mla", list(kv.kv_buffer)
        else:
            raise ValueError(f"hicache-io's linker takes MHA (k_buffer, v_buffer) or MLA (kv_buffer) KV pools, got {type(kv).__name__}")
        rows = [_rows(t, i) for i, t in enumerate(layers)]
        items = {r.shape[1] for r in rows}
        if len(items) != 1:
            raise ValueError(f"the pool's layers have rows of different sizes: {sorted(items)}")
        self.heads = int(getattr(kv, "head_num", 1)) if self.kind == "mha" else 1
        self.groups = _groups_of(self.heads, head_group) if self.kind == "mha" else 1
        self.item, self.page = items.pop() // self.groups, int(page)
        self.rows = [r.reshape(-1, self.item) for r in rows]
        self.layers = len(self.rows) // (2 if self.kind == "mha" else 1)
        self.start = int(getattr(kv, "start_layer", 0) or 0)
        self.slots = min(r.shape[0] for r in rows)
        self.dtype = str(getattr(kv, "dtype", rows[0].dtype)).replace("torch.", "")
        self.device = rows[0].device
        self.obj_bytes = len(self.rows) * self.page * self.item
        # The trailer in whole rows after the object: the staging buffer is rows of `item` bytes.
        self.stride = self.obj_bytes + -(-TRAILER_BYTES // self.item) * self.item
        #: Staging bytes of one page (its objects).
        self.page_bytes = self.groups * self.stride

    def check(self, device_indices: Any, n_pages: int) -> torch.Tensor:
        """``device_indices`` as an int64 tensor on the pool's device; raises unless there are
        ``P`` of them a page and each names a slot of the pool."""
        idx = torch.as_tensor(device_indices).reshape(-1).to(torch.int64)
        if idx.numel() != n_pages * self.page:
            raise ValueError(f"{n_pages} pages need {n_pages * self.page} device indices, got {idx.numel()}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.slots):
            raise IndexError(f"device indices outside the pool's {self.slots} slots")
        return idx.to(self.device)

    def object_rows(self, idx: torch.Tensor, objects: Optional[np.ndarray] = None) -> torch.Tensor:
        """The pool rows of objects ``objects`` (default: every object of ``idx``'s pages; object
        ``j`` is page ``j // groups``'s head group ``j % groups``), ``P`` a object, in order. On
        the host: :meth:`move` takes them to the device on the stream of its copies."""
        idx = idx.cpu()
        if objects is None:
            objects = np.arange(idx.numel() // self.page * self.groups)
        j = torch.as_tensor(objects, dtype=torch.int64)
        t = torch.arange(self.page, dtype=torch.int64)
        slots = idx[((j // self.groups)[:, None] * self.page + t[None, :]).reshape(-1)]
        return (slots.view(len(j), self.page) * self.groups + (j % self.groups)[:, None]).reshape(-1)

    def staged_rows(self, n_objects: int) -> torch.Tensor:
        """Per token of ``n_objects`` staged objects, its row of buffer 0 in the staging buffer
        seen as rows of ``item`` bytes (buffer ``b``: plus ``b × P``)."""
        per = self.stride // self.item
        t = torch.arange(self.page, dtype=torch.int64)
        return (torch.arange(n_objects, dtype=torch.int64)[:, None] * per + t[None, :]).reshape(-1)

    def staging(self, nbytes: int) -> torch.Tensor:
        """A staging buffer of ``nbytes`` (pinned when the pool is on a GPU). Not zeroed: only
        the bytes of objects read whole, or written from the pool, are ever used."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def move(self, staged: torch.Tensor, rows: torch.Tensor, buffers: Sequence[int], out: bool) -> None:
        """Copies buffers ``buffers`` of the objects whose pool rows are ``rows`` (see
        :meth:`object_rows`) to the staging buffer (``out``) or from it, through hicache-io's ops."""
        n = rows.numel() // self.page
        rows = rows.to(self.device)  # on the caller's stream: the copies' own
        base = self.staged_rows(n).to(self.device)
        view = staged[: n * self.stride].view(-1, self.item)
        for b in buffers:
            at = base + b * self.page
            if out:
                kvcacheio.transfer_kv_per_layer_mla(self.rows[b], view, rows, at, self.item)
            else:
                kvcacheio.transfer_kv_per_layer_mla(view, self.rows[b], at, rows, self.item)

    def layer_buffers(self, layer: int) -> List[int]:
        return [layer, self.layers + layer] if self.kind == "mha" else [layer]


class StatePages:
    """A Mamba pool's slots as objects (``pool``: sglang's ``HybridReqToTokenPool``): a slot's
    state of every mamba layer, packed as sglang's own direct linkers pack it: the temporal
    (SSM) rows of layers ``0..L-1``, then each conv buffer's rows of layers ``0..L-1``.
    ``rows[b × L + l]`` is buffer ``b``'s layer ``l`` as ``[slots][items[b]]`` (uint8 views);
    its bytes start at ``offsets[b × L + l]`` of an object, the trailer after them. A "page" is
    one slot, slot 0 the padding slot no state is ever loaded into. The ring buffers of
    speculative decoding and ReplaySSM are a step's scratch, not a node's state: not stored."""

    kind, groups, page, heads = "mamba", 1, 1, 1

    def __init__(self, pool: Any):
        _check_state_pool(pool)
        state = pool.mamba_pool.mamba_cache
        # A conv-only model's temporal state is empty: no rows to store.
        bufs = [b for b in [state.temporal, *state.conv] if b.numel()]
        self.layers = int(bufs[0].shape[0])
        self.rows = [_rows(b[l], i * self.layers + l) for i, b in enumerate(bufs) for l in range(self.layers)]
        self.items = [int(r.shape[1]) for r in self.rows]
        self.offsets = np.cumsum([0] + self.items[:-1]).tolist()
        # A copy op moves an item per warp on a GPU: a state row of megabytes moves as pieces.
        self.pieces = [_pieces(n) for n in self.items]
        self.shapes = [[list(b.shape[2:]), str(b.dtype).replace("torch.", "")] for b in bufs]
        self.start = int(getattr(pool, "start_layer", 0) or 0)
        self.slots = min(r.shape[0] for r in self.rows)
        self.device = self.rows[0].device
        self.obj_bytes = sum(self.items)
        self.stride = self.page_bytes = -(-(self.obj_bytes + TRAILER_BYTES) // 64) * 64

    def check(self, device_indices: Any, n_pages: int) -> torch.Tensor:
        """``device_indices`` as an int64 tensor on the pool's device; raises unless there is
        one a state and each names a slot of the pool other than the padding slot 0."""
        idx = torch.as_tensor(device_indices).reshape(-1).to(torch.int64)
        if idx.numel() != n_pages:
            raise ValueError(f"{n_pages} state(s) need {n_pages} slot(s), got {idx.numel()}")
        if idx.numel() and (int(idx.min()) < 1 or int(idx.max()) >= self.slots):
            raise IndexError(f"state slots outside 1..{self.slots - 1} (slot 0 is the padding slot)")
        return idx.to(self.device)

    def object_rows(self, idx: torch.Tensor, objects: Optional[np.ndarray] = None) -> torch.Tensor:
        """The slots of objects ``objects`` (default: all of ``idx``), on the host."""
        idx = idx.cpu()
        return idx if objects is None else idx[torch.as_tensor(objects, dtype=torch.int64)]

    def move(self, staged: torch.Tensor, rows: torch.Tensor, buffers: Sequence[int], out: bool) -> None:
        """Copies buffers ``buffers`` of the states in slots ``rows`` (object ``j``: slot
        ``rows[j]``) to the staging buffer (``out``) or from it, through hicache-io's ops."""
        rows = rows.to(self.device)  # on the caller's stream: the copies' own
        for j in range(rows.numel()):
            for b in buffers:
                k, at = self.pieces[b], j * self.stride + self.offsets[b]
                piece = self.items[b] // k
                view, pool = staged[at : at + self.items[b]].view(k, piece), self.rows[b].view(-1, piece)
                mine = torch.arange(k, dtype=torch.int64, device=self.device)
                theirs = rows[j] * k + mine
                if out:
                    kvcacheio.transfer_kv_per_layer_mla(pool, view, theirs, mine, piece)
                else:
                    kvcacheio.transfer_kv_per_layer_mla(view, pool, mine, theirs, piece)

    def layer_buffers(self, layer: int) -> List[int]:
        return list(range(layer, len(self.rows), self.layers))


def _pieces(item: int, most: int = 64 << 10) -> int:
    """Into how many equal pieces of at most ``most`` bytes (whole 16-byte words) a row of
    ``item`` bytes is cut: the fewest, or 1 where no such cut exists among the first few."""
    for k in range(-(-item // most), min(item // 16, -(-item // most) + 4096) + 1):
        if item % k == 0 and (item // k) % 16 == 0:
            return k
    return 1


def _check_state_pool(pool: Any) -> None:
    """Raises where a slot's state is more than its temporal and conv rows, or a slot id is
    not the row it names: sglang's int8 checkpoint pool (offloads name its slots, loads the
    active pool's), side states riding on a slot, virtual slot ids (unified memory)."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    if getattr(pool, "mamba_pool", None) is None:
        raise ValueError(f"a Mamba model's state lives in a HybridReqToTokenPool; got {type(pool).__name__}")
    refused = [
        ("the int8 Mamba checkpoint pool", getattr(pool, "mamba_ckpt_pool", None) is not None),
        ("short-conv side states", bool(getattr(getattr(pool, "short_conv_pool", None), "enabled", False))),
        ("n-gram side states", bool(getattr(getattr(pool, "ngram_pool", None), "enabled", False))),
        ("virtual Mamba slot ids (unified memory)", getattr(pool, "mamba_v2p_table", None) is not None or type(pool).translate_mamba_indices is not HybridReqToTokenPool.translate_mamba_indices),
    ]
    what = [name for name, on in refused if on]
    if what:
        raise ValueError(f"hicache-io's linker stores a Mamba slot's temporal and conv state only; refused: {', '.join(what)}")


def _groups_of(heads: int, head_group: Optional[int]) -> int:
    """How many objects an MHA page of ``heads`` heads is cut into: one, or one a group of
    ``head_group`` heads (which must divide them)."""
    if head_group is None:
        return 1
    if head_group < 1 or heads % head_group:
        raise ValueError(f"head_group {head_group} does not divide this rank's {heads} kv heads")
    return heads // head_group


def _rows(t: torch.Tensor, i: int) -> torch.Tensor:
    if t.dim() < 1 or not t.is_contiguous():
        raise ValueError(f"layer buffer {i} is not a contiguous tensor of rows")
    return t.view(t.shape[0], -1).view(torch.uint8)


class StagingBuffers:
    """Host buffers for pages in flight, registered with the store once and reused: a new
    registration (and, for a GPU's pool, new pinned memory) costs more than reading a few pages.
    Sizes are powers of two from 1 MiB; at most ``keep`` bytes of them stay while unused."""

    def __init__(self, pages: LinkerPages, io: Any, keep: int):
        self.pages, self.io, self.keep = pages, io, keep
        self._free: Dict[int, List[Tuple[torch.Tensor, List[int]]]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Tuple[torch.Tensor, List[int]]:
        """A registered buffer of at least ``nbytes`` and its registration (raises where memory
        or the registration fails)."""
        size = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
        buf = self.pages.staging(size)
        mem = buf.numpy()
        return buf, self.io.register([(mem.ctypes.data, mem.nbytes)])

    def give(self, held: Tuple[torch.Tensor, List[int]]) -> None:
        size = held[0].numel()
        with self._lock:
            if self._kept + size <= self.keep:
                self._free.setdefault(size, []).append(held)
                self._kept += size
                return
        self.io.unregister(held[1])

    def close(self) -> None:
        with self._lock:
            held = [h for free in self._free.values() for h in free]
            self._free, self._kept = {}, 0
        for h in held:
            self.io.unregister(h[1])


class PoolObjects:
    """One device pool of the linker as store objects: its pages (:class:`LinkerPages`), the
    keys of its objects, whether this rank writes them, and which of the layer counter's layers
    it holds (``local``: counter layer -> the pool's own layer)."""

    def __init__(self, pages: LinkerPages, prefix: str, tail: str, group_names: List[str], writes: bool, layer_ids: Sequence[int]):
        self.pages, self.prefix, self.tail, self.group_names, self.writes = pages, prefix, tail, group_names, writes
        self.local = {int(g): i for i, g in enumerate(layer_ids)}

    def keys(self, page_keys: Sequence[str]) -> List[str]:
        """The objects of pages ``page_keys``, page by page (``groups`` a page)."""
        return [f"{self.prefix}{k}{self.tail}{g}" for k in page_keys for g in self.group_names]


def device_pools(kv: Any) -> List[Tuple[Any, Any]]:
    """The pools whose pages the linker stores: the KV pool, or a sliding-window model's two
    (its full-attention layers' pool as KV, its window layers' as SWA)."""
    if getattr(kv, "full_kv_pool", None) is not None and getattr(kv, "swa_kv_pool", None) is not None:
        return [(PoolName.KV, kv.full_kv_pool), (PoolName.SWA, kv.swa_kv_pool)]
    if type(kv).__name__ == "HybridLinearKVPool":  # a Mamba hybrid's attention layers
        return [(PoolName.KV, kv.full_kv_pool)]
    return [(PoolName.KV, kv)]


def _layer_ids(kv: Any, name: Any, pool: Any, n: int) -> List[int]:
    """The layer counter's layers of ``pool``'s layers, in order: the pool's own for a plain
    pool; the model's for a sliding-window model's pools (the forward waits on the model's)."""
    mapping = getattr(kv, "layers_mapping", None)
    if pool is kv:
        return list(range(n))
    hybrid = getattr(kv, "full_attention_layer_id_mapping", None)
    if hybrid is not None:  # the forward waits on the model's layer less the pool's first
        return [g - int(getattr(kv, "start_layer", 0) or 0) for g, _ in sorted(hybrid.items(), key=lambda e: e[1])]
    if not mapping:
        raise ValueError(f"{type(kv).__name__} has two pools but no layers_mapping: which model layer each holds is unknown")
    ids = sorted((local, g) for g, (local, is_swa) in mapping.items() if bool(is_swa) == (name == PoolName.SWA))
    return [g for _, g in ids]


def pool_objects(pools: Dict[Any, Any], kv: Any, server_args: Any, params: Any, cfg: Dict[str, Any], states: bool = False) -> Dict[Any, "PoolObjects"]:
    """Each pool's :class:`PoolObjects`, from the configuration's ``key_scheme``,
    ``head_group``, ``kv_heads`` and ``namespace`` (taken out of ``cfg``); with ``states``, the
    Mamba states of ``params.req_to_token_pool`` too (as ``MAMBA``)."""
    tp, tp_size, others = _rank(params)
    scheme = cfg.pop("key_scheme", "rank")
    if scheme not in ("rank", "unified"):
        raise ValueError(f"key_scheme must be 'rank' or 'unified', got {scheme!r}")
    head_group, kv_heads = int(cfg.pop("head_group", 1)), cfg.pop("kv_heads", None)
    prefix = f"{cfg.pop('namespace', 'hicache-io')}/"
    out = {}
    for name, pool in pools.items():
        unified = scheme == "unified" and getattr(pool, "k_buffer", None) is not None
        pages = LinkerPages(pool, params.page_size, head_group if unified else None)
        if unified:
            _check_heads(pages, kv_heads, tp_size)
        layer_ids = _layer_ids(kv, name, pool, pages.layers)
        if len(layer_ids) != pages.layers:
            raise ValueError(f"the {name} pool has {pages.layers} layers, the model maps {len(layer_ids)} to it")
        role = None if pool is kv else ("swa" if name == PoolName.SWA else "full", layer_ids)
        rank = f"tp{tp}_{others}" if pages.kind == "mha" and not unified else others
        tail = _key_tail(pages, server_args, rank, tp_size, pages.heads * tp_size if unified else None, role)
        # Unified keys name the model's head groups this rank holds, never the rank.
        groups = [f"_H{tp * pages.groups + h}" for h in range(pages.groups)] if unified else [""]
        # MLA pages are the same on every tp rank: rank 0 writes them, every rank reads them.
        out[name] = PoolObjects(pages, prefix, tail, groups, pages.kind == "mha" or tp == 0, layer_ids)
    if states:
        out[PoolName.MAMBA] = _state_objects(params.req_to_token_pool, server_args, prefix, f"tp{tp}_{others}", tp_size)
    return out


def _state_objects(pool: Any, server_args: Any, prefix: str, rank: str, tp_size: int) -> "PoolObjects":
    """The Mamba states' objects: keyed by the KV page they end at, the tp rank always (a
    state is split over the ranks whatever the KV's keys), every rank writing its own."""
    mamba = sorted(getattr(pool, "mamba_map", {}).items(), key=lambda e: e[1])
    if not mamba:
        raise ValueError("this pipeline stage holds no Mamba layer: hicache-io's linker stores a hybrid's state with the stage's Mamba layers")
    pages = StatePages(pool)
    if len(mamba) != pages.layers:
        raise ValueError(f"the Mamba pool has {pages.layers} layers, the model maps {len(mamba)} to it")
    record = {
        "format": LINKER_FORMAT,
        "model": _model(server_args),
        "state": pages.shapes,
        "layers": [g for g, _ in mamba],
        "tp_size": tp_size,
    }
    digest = _digest(record)
    tail = f"_{rank}_hio-link-mamba-b{pages.obj_bytes}-L{mamba[0][0]}-{mamba[-1][0] + 1}-n{digest}"
    return PoolObjects(pages, prefix, tail, [""], True, [g - pages.start for g, _ in mamba])


def _digest(record: Dict[str, Any]) -> str:
    """What a key's ``n`` part holds: 12 hex digits of the record's hash."""
    return hashlib.blake2b(json.dumps(record, sort_keys=True).encode(), digest_size=6).hexdigest()


def _model(server_args: Any) -> List[Any]:
    """What names the model in a key's digest: two models served under one name must not share
    pages, so the path, revision, weight quantization and overrides too."""
    return [getattr(server_args, a, None) for a in ("model_path", "served_model_name", "revision", "quantization", "json_model_override_args", "kv_cache_dtype")]


def _check_heads(pages: LinkerPages, kv_heads: Any, tp_size: int) -> None:
    """Unified keys name the model's heads: this rank's ``heads`` must be its share of
    ``kv_heads`` (sglang replicates heads where there are more ranks than heads)."""
    if kv_heads is None:
        raise ValueError("unified keys need kv_heads, the model's kv head count")
    if int(kv_heads) != pages.heads * tp_size:
        raise ValueError(f"unified keys need the model's kv_heads={kv_heads} split over the {tp_size} tp rank(s); this rank holds {pages.heads} (heads replicated over ranks cannot be named)")


def _group_rank(group: Any) -> Tuple[int, int]:
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _rank(params: Any) -> Tuple[int, int, str]:
    """This worker's tp rank, the tp size and its name among the other ranks (cp and pp)."""
    tp, tp_size = _group_rank(getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None))
    return tp, tp_size, f"cp{getattr(params, 'attn_cp_rank', 0)}_pp{getattr(params, 'pp_rank', 0)}"


def _key_tail(pages: LinkerPages, server_args: Any, rank: str, tp_size: int, kv_heads: Optional[int] = None, role: Optional[Tuple[str, List[int]]] = None) -> str:
    """The key's part after the page hash: the rank (MHA only) and what the page's bytes mean.
    Unified keys (``kv_heads``, the model's kv heads, given) leave the tp rank and size out: an
    object is a group of the model's heads, whichever ranks held them. A sliding-window model's
    pools (``role``: ``"full"`` or ``"swa"`` and the model's layers the pool holds) are named
    apart."""
    record = {
        "format": LINKER_FORMAT,
        "model": _model(server_args),
        "kv_dtype": pages.dtype,
        "kind": pages.kind,
        "item": pages.item,
        "layers": [pages.start, pages.start + pages.layers],
        "page_size": pages.page,
        "tp_size": tp_size if pages.kind == "mha" and kv_heads is None else None,
    }
    if kv_heads is not None:
        record["unified"] = [kv_heads, pages.heads // pages.groups]
    if role is not None:
        record["pool"] = [role[0], list(role[1])]
    digest = _digest(record)
    kind = pages.kind + ("-u" if kv_heads is not None else "") + (f"-{role[0]}" if role is not None else "")
    return f"_{rank}_hio-link-{kind}-i{pages.item}-L{pages.start}-{pages.start + pages.layers}-P{pages.page}-n{digest}"
