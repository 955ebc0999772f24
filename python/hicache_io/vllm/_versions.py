"""Where vLLM 0.33.0 and 0.34.0 differ for hicache_io.vllm, in one place.

- The worker's device side: 0.33 hands ``submit_store``/``submit_load`` a ``GPULoadStoreSpec``
  (block ids per KV group); 0.34 hands them ``DevicePointers`` (a pointer and a size per block and
  data ref, resolved from the block ids without a bounds check), which the worker maps back to
  blocks of its registered tensors (:meth:`HicacheOffloadingWorker._plan`).
- Failed transfers: 0.33's connector asserts every transfer succeeded; 0.34's reports a failed
  load as a failed receive (the request recomputed whole under ``kv_load_failure_policy:
  "recompute"``) and fails on a failed synchronous one. ``HicacheOffloadingConnector`` reports
  block ids with load errors on both, which keeps the valid prefix.

Everything else hicache_io.vllm uses (the spec factory and ``OffloadingSpec``, the CPU and
tiering managers, the shared region, the tier factory and ``SecondaryTierManager``) is the same
in both.
"""

from __future__ import annotations

import vllm

VERSION: str = vllm.__version__

try:  # 0.34: the worker's device side as pointers
    from vllm.v1.kv_offload.base import DevicePointers
except ImportError:  # 0.33
    DevicePointers = None  # type: ignore[assignment,misc]

