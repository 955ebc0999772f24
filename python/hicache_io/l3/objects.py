"""The plain forms of sglang's storage interface: one object by its raw key (as sglang's Mooncake
backend names them), over any transport's client."""

from typing import Any, Optional, Tuple

import numpy as np

from .errors import SHORT_READ, StorageError


def get_object(client: Any, key: str, target_location: Optional[int], target_sizes: Optional[int]) -> Tuple[Any, Optional[StorageError]]:
    """Object ``key`` into ``target_location`` (``target_sizes`` bytes of registered memory:
    whether it was read whole), or as a ``numpy.uint8`` array (``None`` when missing); and the
    failure, if any."""
    if target_location is None:
        data = client.get(key)
        return (np.frombuffer(data, np.uint8).copy() if data else None), None
    n = client.batch_get_into([key], [target_location], [target_sizes])[0]
    if n != target_sizes:
        return False, StorageError("get", n if n < 0 else SHORT_READ, [key])
    return True, None


def set_object(client: Any, key: str, value: Any, target_location: Optional[int], target_sizes: Optional[int]) -> Optional[StorageError]:
    """Writes object ``key`` from ``value`` (bytes or a host array) or from ``target_sizes`` bytes
    at ``target_location`` unless it exists (an existing object is kept); the failure, if any."""
    if client.is_exist(key) == 1:
        return None
    if value is not None:
        data = bytes(value) if isinstance(value, (bytes, bytearray)) else np.ascontiguousarray(value).view(np.uint8).tobytes()
        rc = client.put(key, data)
    else:
        rc = client.batch_put_from([key], [target_location], [target_sizes])[0]
    return StorageError("put", rc, [key]) if rc != 0 else None
