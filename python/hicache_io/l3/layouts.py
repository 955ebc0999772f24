"""Where a host pool's page objects are: hicache-io's ``HostPool`` (one span per component,
in this process's memory or behind the executor's staging) and sglang's own host pools (their
``get_page_buffer_meta``), and the host index lists that name the pages."""

from typing import Any, List, Optional, Sequence

import numpy as np


def host_list(indices: Any) -> Any:
    """Host index values: numpy as is; torch (CPU or CUDA) and other arrays through ``tolist``."""
    if isinstance(indices, np.ndarray):
        return indices.reshape(-1)
    if hasattr(indices, "tolist"):
        return np.asarray(indices.tolist(), dtype=np.int64).reshape(-1)
    return np.asarray(indices, dtype=np.int64).reshape(-1)


class PoolLayout:
    """A hicache-io ``HostPool``'s page objects: per page, one span per component (K, V)."""

    def __init__(self, pool: Any, shares: Optional[int] = None):
        """``shares``: the page's objects are that many shares of it (the unified key scheme's,
        which say where they lie themselves), not one span per component."""
        self.pool = pool
        self.kind = pool.kind
        self.page = pool.page_size
        self.bases = [pool.host_span(c) for c in range(pool.components)]
        self.zero_copy = all(b is not None for b in self.bases)
        self.regions = [b for b in self.bases if b is not None and b[1] > 0] if self.zero_copy else []
        if shares is not None:
            self.comps, self.obj_bytes = shares, 0
            return
        self.comps = pool.components
        spans = pool.get_page_buffer_meta(list(range(self.page)))
        if len(spans) != self.comps:
            raise ValueError(f"{pool.layout} pages are not one span per component")
        self.obj_bytes = spans[0][2]

    def synchronize(self) -> None:
        self.pool.synchronize()

    def addrs(self, host_indices: Sequence[int]) -> List[int]:
        """The address of each object of the pages (of ``P`` token slots; a page starts at
        ``host_indices[i * P]``), page by page, K before V."""
        return self.pool._object_addrs(host_indices)

    def validate(self, host_indices: Any) -> None:
        """Raises for an index outside the pool or a page that does not start on a page start."""
        self.pool._check_pages(host_indices)

    def read_page(self, index: int) -> Any:
        return self.pool.get_data_page(index)

    def write_page(self, index: int, data: Any, trusted: bool = True) -> None:
        """Writes a page through the pool: a verified page's item checksums are recorded from
        its bytes, an unverified one's forgotten (its loads read as unverified, never corrupt)."""
        if trusted:
            self.pool.set_from_flat_data_page(index, data)
        else:
            self.pool.set_from_flat_data_page_checked(index, data, [])

    def stage_out(self, staging: Any, pages: Sequence[int], idx: Any) -> None:
        """Copies pages ``pages`` of the batch (page ``i`` starts at ``idx[i * P]``) into
        ``staging``, page ``i`` at byte ``i`` × the page's bytes (pools without a host address)."""
        page_bytes = self.comps * self.obj_bytes
        for i in pages:
            staging[i * page_bytes : (i + 1) * page_bytes] = self.read_page(int(idx[i * self.page]))

    def stage_in(self, staging: Any, pages: List[bool], idx: Any, trusted: List[bool]) -> None:
        """Writes back from ``staging`` each page of the batch that arrived (``pages``), its item
        checksums recorded where ``trusted``, else forgotten."""
        page_bytes = self.comps * self.obj_bytes
        for i, arrived in enumerate(pages):
            if arrived:
                self.write_page(int(idx[i * self.page]), staging[i * page_bytes : (i + 1) * page_bytes], trusted[i])

    def landed(self, idx: Any, trusted: List[bool]) -> None:
        """After a zero-copy read into the pool's memory (which may write any page it was asked
        for): the pool's item checksums of each page read whole and verified are recomputed from
        the bytes that landed; those of every other page are forgotten (its loads then read as
        unverified, never as corrupt)."""
        if not self.zero_copy or not getattr(self.pool, "integrity", False):
            return
        first = [int(idx[i * self.page]) for i in range(len(trusted))]
        good = [f for f, t in zip(first, trusted) if t]
        stale = [f for f, t in zip(first, trusted) if not t]
        if good:
            self.pool.recompute_page_checksums(good)
        if stale:
            self.pool.forget_page_checksums(stale)


def check_inside(regions: Sequence[Any], ptrs: Sequence[Any], sizes: Sequence[Any], what: str) -> None:
    """Raises unless every object ``(ptr, size)`` lies inside one ``(address, bytes)`` region."""
    for ptr, size in zip(ptrs, sizes):
        p, n = int(ptr), int(size)
        if not any(a <= p and p + n <= a + length for a, length in regions):
            raise ValueError(f"page object at {p:#x} ({n} bytes) lies outside {what}")


def sglang_indices(values: Any) -> Any:
    """Host indices as sglang's pools take them in ``get_page_buffer_meta``: a 1-D CPU int64
    torch tensor (they call ``.tolist()`` and ``.reshape`` on it)."""
    import torch

    if isinstance(values, torch.Tensor):
        return values.to(device="cpu", dtype=torch.int64).reshape(-1)
    return torch.from_numpy(np.ascontiguousarray(np.asarray(list(values) if isinstance(values, range) else values, dtype=np.int64).reshape(-1)))


class SglangLayout:
    """An sglang host pool (``MHATokenToKVPoolHost`` and kin, torch tensors): its own
    ``get_page_buffer_meta`` gives the objects' addresses and sizes, K and V interleaved per page,
    as sglang's Mooncake backend reads them; its buffers are registered whole."""

    def __init__(self, pool: Any, mla: bool):
        self.pool = pool
        self.kind = "mla" if mla else "mha"
        self.comps = 1 if mla else 2
        self.page = pool.page_size
        ptrs, sizes = pool.get_page_buffer_meta(sglang_indices(range(self.page)))
        if len(ptrs) != self.comps or len(set(sizes)) != 1:
            raise ValueError(f"sglang pool pages of {len(ptrs)} objects ({list(sizes)}); expected {self.comps} of one size (layer_first pages are one span per layer)")
        self.obj_bytes = int(sizes[0])
        self.zero_copy = True
        if getattr(pool, "kv_buffer", None) is None:
            raise ValueError("hicache-io's Mooncake store takes sglang's plain KV host pools (MHA, MLA: one kv_buffer); hybrid pools are not supported")
        b = pool.kv_buffer
        self.regions = [(int(b.data_ptr()), int(b.numel() * b.element_size()))]

    def synchronize(self) -> None:
        return None  # sglang's controller orders its own transfers before storage calls

    def addrs(self, host_indices: Sequence[int]) -> List[int]:
        ptrs, _sizes = self.pool.get_page_buffer_meta(sglang_indices(host_indices))
        return list(map(int, ptrs))

    def validate(self, host_indices: Any) -> None:
        """sglang's pools compute addresses without checks: every object must lie inside the
        registered buffer."""
        ptrs, sizes = self.pool.get_page_buffer_meta(sglang_indices(host_indices))
        check_inside(self.regions, ptrs, sizes, "the host pool")
