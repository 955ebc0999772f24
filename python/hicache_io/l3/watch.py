"""Whether an L3 store is ever read back: a store that only takes puts costs the engine every
backup and serves nothing, and from the outside it looks healthy (the engine recomputes, the
tokens are right, only hit counts tell).

The known way into that state: sglang computes page keys with a C++ extension it builds at first
use (torch's cpp_extension: ninja, g++, OpenSSL's headers); where the build fails its lookups
never match what it wrote. Keys that never match for any other reason (another namespace,
a salt that changes per process) look the same from here.

:class:`ReadBack` counts put batches, lookups and hits; after :data:`SILENT_AFTER` put batches
with pages written and not one hit, it warns once (with what it counted) and the store's
``integrity_stats()`` says so (``never_read``: 1, and it stays 1: it records that the warning
was given, while ``hits`` shows what came after). A workload whose prompts share no prefix has no
hits either: the warning names that possibility too; it is a signal to check, not an error.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict

log = logging.getLogger("hicache_io.storage")

#: Put batches with pages written, and no hit, before the warning.
SILENT_AFTER = 64


class ReadBack:
    """Counts of one store: ``put_batches`` (calls that wrote at least one page), ``lookups``
    (existence and page reads asked), ``hits`` (those that found at least one page) and
    ``never_read`` (1 once warned)."""

    def __init__(self, store_name: str, where: str = "", silent_after: int = SILENT_AFTER):
        self.store_name, self.where, self.silent_after = store_name, where, silent_after
        self._lock = threading.Lock()
        self.counts: Dict[str, int] = {"put_batches": 0, "lookups": 0, "hits": 0, "never_read": 0}

    def put(self, written: int) -> None:
        """A put call that wrote ``written`` pages."""
        if written <= 0:
            return
        with self._lock:
            c = self.counts
            c["put_batches"] += 1
            warn = not c["never_read"] and c["hits"] == 0 and c["put_batches"] >= self.silent_after
            if warn:
                c["never_read"] = 1
                lookups = c["lookups"]
        if warn:
            log.warning(
                "hicache-io L3 (%s%s): %d put calls stored pages and %s — the engine never reads back what it "
                "writes. If its prompts share prefixes, its keys never match what it stored: for sglang, check "
                "that its page-hash extension builds (it needs ninja, g++ and OpenSSL's headers at first use), "
                "and that readers and writers share a namespace. (Prompts with no shared prefix also look like this.)",
                self.store_name,
                f" at {self.where}" if self.where else "",
                self.silent_after,
                f"{lookups} lookups found nothing" if lookups else "no lookup came",
            )

    def looked_up(self, found: bool) -> None:
        """A lookup (existence check or page read) that ``found`` at least one page."""
        with self._lock:
            self.counts["lookups"] += 1
            if found:
                self.counts["hits"] += 1
