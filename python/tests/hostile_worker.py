"""Runs hostile calls for ``test_hostile_arrays.py``, one JSON case a line on stdin, one JSON
verdict a line on stdout, in a process of its own: a call that crashes the interpreter kills this
process, not the test, which then reports the case.

A case names an op, a seed, and per argument how it is handed over (a *form*). Every array lives in
the middle of a guard buffer of sentinel bytes. The verdict compares what happened with an oracle
that knows only the arguments' logical values (``numpy.asarray`` of what was passed):

- the oracle refuses (an index out of range, lengths that differ, a destination twice, a form
  that cannot be honoured: a read-only or stale destination, a view of freed memory) → the call
  must raise one of ``TYPED``, and no byte of any buffer may change;
- the oracle accepts → the call raises one of ``TYPED`` with no byte changed (refusing a form is
  allowed), or returns having written exactly the oracle's values through the destination's view
  and nothing else: every byte of every buffer, gaps between strided elements and guards included,
  is compared with a prediction.
"""

import json
import sys

import numpy as np

import hicache_io
from hicache_io import hicache
from hicache_io import kvcacheio as kv

TYPED = (ValueError, TypeError, RuntimeError, IndexError, OverflowError, KeyError)
GUARD = 64
SENTINEL = 0xA5

try:
    import torch
except ImportError:  # the forms that need torch are not drawn then
    torch = None


class Refused(Exception):
    """The oracle's refusal."""


class Buf:
    """One argument: a guarded byte buffer, the view handed over, and how to rebuild that view on
    a copy of the buffer (to predict the bytes after an accepted call)."""

    def __init__(self, logical, form, writable_expected):
        self.form = form
        self.stale = False
        self.readonly = False
        a = np.ascontiguousarray(logical)
        n = a.nbytes
        if form == "strided":
            size = 2 * n
        elif form in ("broadcast", "zero"):
            size = a.itemsize * max(1, a.shape[-1] if a.ndim else 1)
        else:
            size = n
        self.raw = np.full(size + 2 * GUARD, SENTINEL, np.uint8)
        self.make = lambda raw: self._view(raw, a.dtype, a.shape, form)
        v = self.make(self.raw)
        if form not in ("broadcast", "zero"):
            v[...] = a.reshape(-1).view(v.dtype).reshape(v.shape)
        elif form == "broadcast":
            self.raw[GUARD : GUARD + a.itemsize * a.shape[-1]].view(a.dtype)[...] = a.reshape(-1, a.shape[-1])[0] if a.size else 0
        self.view = self.make(self.raw)
        if form == "readonly":
            self.view.flags.writeable = False
            self.readonly = True
        if form == "broadcast":
            self.readonly = True
        self.before = self.raw.copy()
        self.passed = self.view
        if form == "torch" and torch is not None:
            self.passed = torch.from_numpy(self.view)
        elif form == "stale":
            # A view of an array resized since: its export names memory the array gave back.
            owner = np.zeros(max(a.size, 1), a.dtype)
            self.passed = owner[: a.size].reshape(a.shape)
            self.passed[...] = a
            owner.resize(1, refcheck=False)
            self.stale = True
        elif form == "torch_stale" and torch is not None:
            t = torch.zeros(max(a.size, 1), dtype=torch.from_numpy(a[:0].reshape(-1)).dtype)
            self.passed = t[: a.size].view(a.shape)
            t.untyped_storage().resize_(a.itemsize)
            self.stale = True
        elif form == "meta" and torch is not None:
            self.passed = torch.empty(a.shape, dtype=torch.from_numpy(a[:0].reshape(-1)).dtype, device="meta")
            self.stale = True
        elif form == "list":
            self.passed = a.tolist()

    @staticmethod
    def _view(raw, dtype, shape, form):
        body = raw[GUARD : len(raw) - GUARD]
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if form == "strided":
            return body[: 2 * n].view(dtype)[::2].reshape(shape) if n else body[:0].view(dtype).reshape(shape)
        if form == "reversed":
            return body[:n].view(dtype).reshape(shape)[::-1] if n and len(shape) else body[:n].view(dtype).reshape(shape)
        if form == "fortran":
            flat = body[:n].view(dtype)
            return flat.reshape(shape[::-1]).T if len(shape) > 1 else flat.reshape(shape)
        if form == "broadcast":
            row = body[: np.dtype(dtype).itemsize * shape[-1]].view(dtype) if len(shape) else body[: np.dtype(dtype).itemsize].view(dtype)
            return np.broadcast_to(row, shape)
        if form == "zero":
            return body[:0].view(dtype).reshape((0,) + tuple(shape[1:]))
        if form.startswith("dtype:"):  # the same bytes as another dtype, rows kept
            return body[:n].view(form[6:]).reshape((shape[0], -1) if len(shape) > 1 else (-1,))
        return body[:n].view(dtype).reshape(shape)

    def logical(self):
        """The argument's logical value as rows of bytes (``(rows, bytes)``; 1-D: ``(bytes,)``)."""
        if self.stale:
            raise Refused("stale or foreign memory")
        v = np.ascontiguousarray(np.array(self.view))
        b = v.view(np.uint8) if v.ndim else v.reshape(1).view(np.uint8)
        if v.ndim > 1:
            return b.reshape(v.shape[0], int(np.prod(v.shape[1:])) * v.itemsize)
        return b.reshape(-1)

    def predict(self, raw, rows):
        """``raw`` with the view's logical value replaced by ``rows`` (bytes, as ``logical``)."""
        v = self.make(raw)
        v[...] = np.ascontiguousarray(rows).reshape(-1).view(v.dtype).reshape(v.shape)


def forms_ok_for_dst(b):
    if b.readonly or b.stale:
        raise Refused("destination not writable")


def index_values(x, any_int=False, ints=False):
    """An index argument's logical values, or the oracle's refusal: int64 arrays and lists of
    ints (``any_int``: int32 arrays too, as the JIT names take them; ``ints``: any sequence of
    integers, as the ops' plain integer lists take them)."""
    if isinstance(x, list):
        return np.array(x, dtype=np.int64)
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise Refused("index on another device")
        x = x.numpy()
    v = np.asarray(x)
    if v.dtype != np.int64 and not (any_int and v.dtype == np.int32) and not (ints and v.dtype.kind in "iu"):
        raise Refused(f"index dtype {v.dtype}")
    if v.dtype.kind == "u" and len(v) and int(v.max()) > np.iinfo(np.int64).max:
        raise Refused("range")
    return v.astype(np.int64)


def pairs(si, di, n_src, n_dst):
    """sglang's index semantics: equal lengths, negative entries skipped, every other entry in
    range, destinations unique."""
    if si.ndim != 1 or di.ndim != 1 or len(si) != len(di):
        raise Refused("lengths")
    keep = (si >= 0) & (di >= 0)
    s, d = si[keep], di[keep]
    if (s >= n_src).any() or (d >= n_dst).any():
        raise Refused("range")
    if len(np.unique(d)) != len(d):
        raise Refused("duplicate destination")
    return s, d


INDEX_FORMS = ["int64", "int32", "uint64", "float64", "bool", "nan", "huge", "list", "short", "dup", "strided", "reversed", "zero", "torch"]


def index_arg(values, form):
    """An index array of ``values`` in ``form`` (its logical values may differ: that is the point)."""
    v = np.asarray(values, np.int64)
    if form == "int32":
        return v.astype(np.int32)
    if form == "uint64":
        return v.astype(np.uint64)
    if form == "float64":
        return v.astype(np.float64)
    if form == "bool":
        return v.astype(bool)
    if form == "nan":
        with np.errstate(invalid="ignore"):
            return np.full(len(v), np.nan).astype(np.int64)  # what NaN converts to: the smallest int64
    if form == "huge":
        return v + (1 << 62)
    if form == "list":
        return v.tolist()
    if form == "short":
        return v[:-1]
    if form == "dup":
        return np.concatenate([v[:1], v[:1], v[2:]]) if len(v) > 1 else v
    if form == "strided":
        w = np.repeat(v, 2)
        return w[::2]
    if form == "reversed":
        return v[::-1].copy()[::-1]
    if form == "zero":
        return v[:0]
    if form == "torch" and torch is not None:
        return torch.from_numpy(v.copy())
    return v


DATA_FORMS = ["contig", "strided", "reversed", "fortran", "readonly", "broadcast", "zero", "stale", "dtype:uint8", "torch", "torch_stale", "meta", "list"]


def copied(dsts, s_logs, d_logs, s, d):
    """Each destination's expected rows: ``d_log[d] = s_log[s]``."""
    out = {}
    for b, sl, dl in zip(dsts, s_logs, d_logs):
        o = dl.copy()
        o[d] = sl[s]
        out[b] = o
    return out


def row_copies(case, rng, comps, jit, call):
    """One layer's rows copied, ``dst[d] = src[s]``, for ``comps`` source and destination caches
    (MLA: 1; K and V: 2); the case's forms name the sources, the destinations, then the two index
    lists. ``call(srcs, dsts, src_indices, dst_indices)`` makes the call. kvcacheio's ops take rows
    of exactly the item size and int64 indices; the JIT names (``jit``) any 2-D caches of one
    dtype, and int32 indices too."""
    rows, elems, n, f = case["rows"], case["elems"], case["n"], case["forms"]
    srcs = [Buf(rng.standard_normal((rows, elems)).astype(np.float16), f[i], False) for i in range(comps)]
    dsts = [Buf(np.zeros((rows, elems), np.float16), f[comps + i], True) for i in range(comps)]
    si, di = rng.permutation(rows)[:n], rng.permutation(rows)[:n]
    sa, da = index_arg(si, f[2 * comps]), index_arg(di, f[2 * comps + 1])

    def oracle():
        for b in dsts:
            forms_ok_for_dst(b)
        s_logs, d_logs = [b.logical() for b in srcs], [b.logical() for b in dsts]
        logs = s_logs + d_logs
        if jit:
            dtypes = {str(np.asarray(b.passed).dtype) for b in srcs + dsts}
            bad = any(x.shape != logs[0].shape or x.ndim != 2 for x in logs) or len(dtypes) != 1
        else:
            bad = any(x.shape != (rows, 2 * elems) for x in logs)
        if bad:
            raise Refused("shape")
        s, d = pairs(index_values(sa, any_int=jit), index_values(da, any_int=jit), len(s_logs[0]), len(d_logs[0]))
        return copied(dsts, s_logs, d_logs, s, d)

    return srcs + dsts, lambda: call([b.passed for b in srcs], [b.passed for b in dsts], sa, da), oracle


def per_layer_mla(case, rng):
    return row_copies(case, rng, 1, False, lambda s, d, sa, da: kv.transfer_kv_per_layer_mla(s[0], d[0], sa, da, case["elems"] * 2))


def per_layer_mha(case, rng):
    return row_copies(case, rng, 2, False, lambda s, d, sa, da: kv.transfer_kv_per_layer(s[0], d[0], s[1], d[1], sa, da, case["elems"] * 2))


def jit_one_layer_mla(case, rng):
    return row_copies(case, rng, 1, True, lambda s, d, sa, da: hicache.transfer_hicache_one_layer_mla(d[0], da, s[0], sa))


def jit_one_layer(case, rng):
    """The JIT name for K and V caches (sglang's MHA per-layer transfer, destination first)."""
    return row_copies(case, rng, 2, True, lambda s, d, sa, da: hicache.transfer_hicache_one_layer(d[0], d[1], da, s[0], s[1], sa))


def all_layer_mla(case, rng):
    rows, elems, n, layers = case["rows"], case["elems"], case["n"], 2
    f = case["forms"]
    src = [Buf(rng.standard_normal((rows, elems)).astype(np.float16), f[0] if i == 0 else "contig", False) for i in range(layers)]
    dst = [Buf(np.zeros((rows, elems), np.float16), f[1] if i == 0 else "contig", True) for i in range(layers)]
    si, di = rng.permutation(rows)[:n], rng.permutation(rows)[:n]
    sa, da = index_arg(si, f[2]), index_arg(di, f[3])

    def call():
        kv.transfer_kv_all_layer_mla([b.passed for b in src], [b.passed for b in dst], sa, da, elems * 2, layers)

    def oracle():
        for b in dst:
            forms_ok_for_dst(b)
        s_logs, d_logs = [b.logical() for b in src], [b.logical() for b in dst]
        if any(x.shape != (rows, 2 * elems) for x in s_logs + d_logs):
            raise Refused("shape")
        s, d = pairs(index_values(sa), index_values(da), rows, rows)
        return copied(dst, s_logs, d_logs, s, d)

    return src + dst, call, oracle


def embedding_ranges(case, rng):
    rows, elems = case["rows"], case["elems"]
    f = case["forms"]
    src = Buf(rng.standard_normal((rows, elems)).astype(np.float16), f[0], False)
    dst = Buf(np.zeros((rows, elems), np.float16), f[1], True)
    ss, ds, ln = [0, rows // 2], [rows // 2, 0], [rows // 2, rows // 4]
    args = [index_arg(x, f[2 + i]) for i, x in enumerate((ss, ds, ln))]

    def call():
        kv.transfer_embedding_ranges_direct(src.passed, dst.passed, *args)

    def oracle():
        forms_ok_for_dst(dst)
        s_log, d_log = src.logical(), dst.logical()
        if s_log.shape != d_log.shape or s_log.ndim != 2:
            raise Refused("shape")
        v = [index_values(a, ints=True) for a in args]
        if len({len(x) for x in v}) != 1:
            raise Refused("lengths")
        o = d_log.copy()
        cover = np.zeros(len(d_log), bool)
        for a, b, m in zip(*(x.tolist() for x in v)):
            if a < 0 or b < 0 or m < 0 or a + m > len(s_log) or b + m > len(d_log) or cover[b : b + m].any():
                raise Refused("range")
            cover[b : b + m] = True
            o[b : b + m] = s_log[a : a + m]
        return {dst: o}

    return [src, dst], call, oracle


def page_helpers(case, rng):
    """A host pool's page helpers: ``set_from_flat_data_page(index, data)`` then ``get_data_page``."""
    dev = hicache_io.DevicePool(hicache_io.Device("cpu"), "mla", 64, 64, 8, 2)
    host = hicache_io.HostPool(dev, "page_first", 64)
    n = len(host.get_dummy_flat_data_page())
    data = Buf(rng.integers(0, 256, n, dtype=np.uint8), case["forms"][0], False)
    index = (int(case["n"]) - 1) % 8 * 8 + (1 if case["forms"][1] == "unaligned" else 0) + (1 << 40 if case["forms"][1] == "huge" else 0)
    before = [host.read_buffer(c) for c in range(host.components)]

    def call():
        host.set_from_flat_data_page(index, data.passed)

    def oracle():
        v = data.logical()
        if v.shape != (n,) or v.dtype != np.uint8 or index % 8 or not 0 <= index < 64:
            raise Refused("page")
        return {"page": v}

    def check(accepted, expected):
        now = [host.read_buffer(c) for c in range(host.components)]
        if not accepted:
            return all(np.array_equal(a, b) for a, b in zip(before, now))
        return np.array_equal(host.get_data_page(index), expected["page"])

    return [data], call, oracle, check


OPS = {"per_layer_mla": per_layer_mla, "per_layer_mha": per_layer_mha, "all_layer_mla": all_layer_mla, "jit_one_layer_mla": jit_one_layer_mla, "jit_one_layer": jit_one_layer, "embedding_ranges": embedding_ranges, "page_helpers": page_helpers}


def run(case):
    rng = np.random.default_rng(case["seed"])
    built = OPS[case["op"]](case, rng)
    bufs, call, oracle = built[:3]
    check = built[3] if len(built) > 3 else None
    try:
        expected = oracle()
    except Refused as r:
        expected, why = None, str(r)
    try:
        call()
        raised = None
    except TYPED as e:
        raised = f"{type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001 - an untyped error is a finding
        return {"verdict": f"untyped {type(e).__name__}: {e}"}
    changed = [i for i, b in enumerate(bufs) if not np.array_equal(b.raw, b.before)]
    if raised is not None or expected is None:
        if raised is None:
            return {"verdict": f"accepted a call the oracle refuses ({why})"}
        if changed or (check is not None and not check(False, None)):
            return {"verdict": f"raised ({raised}) but bytes changed in arguments {changed}"}
        return {"verdict": "ok", "raised": raised}
    if check is not None:
        return {"verdict": "ok" if check(True, expected) else "wrong bytes", "raised": None}
    for i, b in enumerate(bufs):
        pred = b.before.copy()
        if b in expected:
            b.predict(pred, expected[b])
        if not np.array_equal(b.raw, pred):
            bad = np.flatnonzero(b.raw != pred)
            where = "a guard" if bad[0] < GUARD or bad[-1] >= len(pred) - GUARD else "the array"
            return {"verdict": f"argument {i}: {len(bad)} wrong bytes, first in {where}"}
    return {"verdict": "ok", "raised": None}


def smoke(case):
    """Any catalogue op with hostile arrays in every array position: no crash, an error or a
    return, no guard byte changed."""
    spec = next(c for c in kv.CATALOGUE if c["name"] == case["op"])
    rng = np.random.default_rng(case["seed"])
    bufs, args = [], []
    for (name, kind), form in zip(spec["args"], case["forms"]):
        if kind == "Int":
            args.append(int(form) if not isinstance(form, str) else 8)
        elif kind in ("Idx", "HostIdx", "Ints"):
            args.append(index_arg(rng.integers(-2, 40, 4), form))
        elif kind in ("InLayers", "OutLayers", "InList", "OutList"):
            b = Buf(rng.standard_normal((16, 8)).astype(np.float16), form if form in DATA_FORMS else "contig", False)
            bufs.append(b)
            args.append([b.passed, b.passed] if form != "zero" else [])
        else:
            b = Buf(rng.standard_normal((16, 8)).astype(np.float16), form if form in DATA_FORMS else "contig", False)
            bufs.append(b)
            args.append(b.passed)
    try:
        getattr(kv, spec["name"])(*args)
    except TYPED:
        pass
    except BaseException as e:  # noqa: BLE001 - an untyped error is a finding
        return {"verdict": f"untyped {type(e).__name__}: {e}"}
    for i, b in enumerate(bufs):
        bad = np.flatnonzero(b.raw != b.before)
        if len(bad) and (bad[0] < GUARD or bad[-1] >= len(b.raw) - GUARD):
            return {"verdict": f"argument {i}: a guard byte changed"}
    return {"verdict": "ok"}


def main():
    for line in sys.stdin:
        case = json.loads(line)
        try:
            out = smoke(case) if case.get("smoke") else run(case)
        except Exception as e:  # noqa: BLE001 - a broken case is reported, not a crash
            out = {"verdict": f"worker error {type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
