"""The op catalogue is the one source of the ops: the Python wrappers made from it, their stubs
(``hicache_io/kvcacheio.pyi``, rewritten from the catalogue with ``HICACHE_IO_UPDATE_STUBS=1``),
the ``torch.ops`` schemas and the names sglang imports all agree with it."""

import inspect
import os
import pathlib

from hicache_io import kvcacheio as kv
from hicache_io import sglang as hsg
from hicache_io import torch_ops

STUB = pathlib.Path(kv.__file__).with_suffix(".pyi")

#: What sglang 0.5.23 imports from ``sgl_kernel.kvcacheio`` (its thirteen classic ops, the
#: embedding ranges and the device-pointer helper).
SGLANG_0_5_23 = {
    "transfer_kv_per_layer", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf", "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph", "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf", "transfer_embedding_ranges_direct", "get_device_accessible_ptr",
}

_TYPES = {"Int": "int", "Ints": "List[int]"}


def render_stub() -> str:
    out = [
        '"""Type stubs of :mod:`hicache_io.kvcacheio`, generated from the op catalogue (do not edit:',
        'python/tests/test_catalogue.py rewrites it with HICACHE_IO_UPDATE_STUBS=1)."""',
        "",
        "from typing import Any, Dict, List, Optional",
        "",
        "CATALOGUE: List[Dict[str, Any]]",
        "",
        "def synchronize(device: Optional[int] = None) -> None: ...",
        "def forget_layer_tables() -> None: ...",
    ]
    for spec in kv.CATALOGUE:
        params = [f"{a}: {_TYPES.get(k, 'Any')}" for a, k in spec["args"]]
        if spec["tuning"] == "PerItem":
            params += ["num_warps_per_item: int = 32"]
        elif spec["tuning"] != "None":
            params += ["block_quota: Optional[int] = None", "num_warps_per_block: Optional[int] = None"]
        ret = "int" if spec["schema"].endswith("-> int") else "None"
        out.append(f"def {spec['name']}({', '.join(params)}) -> {ret}: ...")
    out.append('def register_torch_ops(namespace: str = "sgl_kernel", *, overwrite: bool = False) -> List[str]: ...')
    return "\n".join(out) + "\n"


def test_stubs_are_the_catalogue():
    want = render_stub()
    if os.environ.get("HICACHE_IO_UPDATE_STUBS") == "1":
        STUB.write_text(want)
    assert STUB.read_text() == want, "kvcacheio.pyi is stale: rerun with HICACHE_IO_UPDATE_STUBS=1"


def test_every_op_is_a_function_with_the_catalogues_signature():
    assert kv.__all__ == ["CATALOGUE", "synchronize", "forget_layer_tables", *(s["name"] for s in kv.CATALOGUE), "register_torch_ops"]
    for spec in kv.CATALOGUE:
        fn = getattr(kv, spec["name"])
        params = list(inspect.signature(fn).parameters)
        t = spec["tuning"]
        named = {"None": [], "PerItem": ["num_warps_per_item"], "BlockSize": ["block_size"]}
        tuning = named[t] if isinstance(t, str) and t in named else ["block_quota", "num_warps_per_block"]
        want = [a for a, _ in spec["args"]] + tuning
        assert params == want, spec["name"]
        assert inspect.getdoc(fn), spec["name"]


def test_torch_schemas_and_sglangs_names_come_from_the_catalogue():
    torch_named = [s for s in kv.CATALOGUE if s["schema"]]
    assert list(torch_ops.SCHEMAS) == [s["name"] for s in torch_named]
    assert all(torch_ops.SCHEMAS[s["name"]] == s["schema"] for s in torch_named)
    # sglang's JIT ops are no torch ops; everything else is.
    assert all(isinstance(s["sglang"], dict) and "Jit" in s["sglang"] for s in kv.CATALOGUE if not s["schema"])
    assert set(hsg.KVCACHEIO_OPS) == SGLANG_0_5_23
    jit = {name for names in hsg.JIT_OPS.values() for name in names}
    assert jit == {s["name"] for s in kv.CATALOGUE if isinstance(s["sglang"], dict)}


def test_generic_ops_refuse_other_argument_counts_and_kinds():
    import numpy as np
    import pytest

    a = np.zeros((8, 16), np.uint8)
    with pytest.raises(TypeError):
        kv.transfer_kv_per_layer_mla(a, a.copy(), [0], [1])  # item_size missing
    with pytest.raises(TypeError, match="item_size must be an int"):
        kv.transfer_kv_per_layer_mla(a, a.copy(), [0], [1], "16")
    from hicache_io import _native

    with pytest.raises(ValueError, match="not a generic op"):
        _native.call_op("copy_all_layer_kv_cache_cpu", ())
    with pytest.raises(TypeError, match="takes 5 arguments"):
        _native.call_op("transfer_kv_per_layer_mla", (a,))
