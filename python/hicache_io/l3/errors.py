"""What a failed L3 call reports: Mooncake Store's error codes, hicache-io's own, and
:class:`StorageError`."""

import errno
import os
from typing import Sequence

#: Mooncake Store error codes a caller meets here (``mooncake-store/include/types.h``).
MOONCAKE_ERRORS = {
    -10: "BUFFER_OVERFLOW (the object does not fit the target span)",
    -200: "NO_AVAILABLE_HANDLE (the store is full)",
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED (the object's lease ran out before the transfer completed)",
    -900: "RPC_FAIL (the master is unreachable)",
}

#: hicache-io's own code: an object read back with another size than the page's (a short read).
SHORT_READ = -100000
#: hicache-io's own code: a call refused before reaching the store (bad indices or lengths).
REFUSED = -100001
MOONCAKE_ERRORS[SHORT_READ] = "short read (the object has another size than the page)"
#: hicache-io's own code: an object whose checksum trailer does not match the bytes read.
INTEGRITY = -100002
MOONCAKE_ERRORS[INTEGRITY] = "integrity check failed (the bytes read are not the page that was stored under this key)"
MOONCAKE_ERRORS[REFUSED] = "refused before any byte moved"
#: hicache-io's own code: the local store found the object damaged (its footer does not hold, or
#: its bytes fail the footer's CRC) and removed it; a miss, counted as ``corrupt``.
DAMAGED = -100003
MOONCAKE_ERRORS[DAMAGED] = "damaged object (its file's footer or CRC failed: a miss; the file is removed)"


#: How failures name the two stores.
MOONCAKE_STORE = "Mooncake Store"
LOCAL_STORE = "local L3 store"
#: The local store's own codes (Mooncake's numbers for the same answers), which are not errno values.
OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600
#: A multi-span get whose spans add up to another size than the object (Mooncake: TRANSFER_FAIL).
BUFFER_MISMATCH = -800
LOCAL_CODES = (INVALID_PARAMS, OBJECT_NOT_FOUND, BUFFER_MISMATCH)


def is_io_errno(code: int) -> bool:
    """Whether a local store's answer ``code`` is a negated ``errno`` value (an I/O failure of
    its disk) rather than one of its own codes. Meaningless for Mooncake, whose codes share the range."""
    return -4096 < code < 0 and code not in LOCAL_CODES and -code in errno.errorcode


class StorageError(RuntimeError):
    """An L3 store call that failed: ``code`` (Mooncake's codes, which the local store answers
    too), ``what`` (the call), the ``keys`` it failed for, and the ``store`` that answered."""

    def __init__(self, what: str, code: int, keys: Sequence[str] = (), detail: str = "", store: str = MOONCAKE_STORE):
        self.what, self.code, self.keys, self.detail, self.store = what, code, list(keys), detail, store
        name = MOONCAKE_ERRORS.get(code) or (errno_name(code) if store == LOCAL_STORE else "error")
        shown = ", ".join(self.keys[:3]) + (" ..." if len(self.keys) > 3 else "")
        super().__init__(f"{store} {what} failed: {code} {name}" + (f" for {shown}" if shown else "") + (f": {detail}" if detail else ""))

    def of(self, store: str) -> "StorageError":
        """The same failure, reported by ``store`` (itself where ``store`` reported it)."""
        return self if store == self.store else StorageError(self.what, self.code, self.keys, self.detail, store)


def errno_name(code: int) -> str:
    """A local store's negated ``errno`` answer by its name, else ``error``."""
    if is_io_errno(code):
        return f"{errno.errorcode[-code]} ({os.strerror(-code)})"
    return "error"
