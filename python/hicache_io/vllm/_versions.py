"""Where vLLM 0.33.0 and 0.34.0 differ for hicache_io.vllm, in one place.

- The worker's device side: 0.33 hands ``submit_store``/``submit_load`` a ``GPULoadStoreSpec``
  (block ids per KV group); 0.34 hands them ``DevicePointers`` (a pointer and a size per block and
  data ref, resolved from the block ids without a bounds check), which the worker maps back to
  blocks of its registered tensors (:meth:`HicacheOffloadingWorker._plan`).
- Failed transfers: 0.33's connector asserts every transfer succeeded; 0.34's reports a failed
  load as a failed receive (the request recomputed whole under ``kv_load_failure_policy:
  "recompute"``) and fails on a failed synchronous one. ``HicacheOffloadingConnector`` reports a
  failed load's block ids on both (with one KV group; a failed receive with several), which keeps
  the valid prefix.
- A secondary tier's lookups: 0.34's ``AsyncLookupManager`` has ``mark_present``, which
  ``HicacheTier`` calls for the keys it stored (a lookup begun before the store then cannot
  answer "absent" for them).

What else changed between them does not reach this module's use: the spec factory and
``OffloadingSpec``, the CPU manager's and the tiering manager's constructors and the internals
``HicacheOffloadingManager.discard`` touches, the shared region's constructor, the tier factory
and ``SecondaryTierManager``'s abstract methods. (0.34 also dropped ``touch`` from the managers,
counts ``store_threshold`` per request, maps the region in segments and adds
``deferred_release`` to tiers; none of which these classes override or call.)
"""

from __future__ import annotations

import vllm

VERSION: str = vllm.__version__

try:  # 0.34: the worker's device side as pointers
    from vllm.v1.kv_offload.base import DevicePointers
except ImportError:  # 0.33
    DevicePointers = None  # type: ignore[assignment,misc]

