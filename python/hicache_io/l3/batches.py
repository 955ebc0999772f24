"""What a batch of page keys means, whatever the transport: repeated keys, and the error a call
reports.

Repeated keys. A store's batched calls move each object key once (Mooncake answers a key named
twice in one call for one of its buffers only), while a batch of pages may name a key more than
once. So a batch runs in *rounds*: round ``r`` holds each key's ``r + 1``-th occurrence, in batch
order, and no key repeats inside a round. The answers are those of the rounds, each slot's in its
place. Its meaning per call:

- a get fills every slot that names a stored key (each round reads the key into its own slots);
- a set writes a key's first occurrence; a later occurrence finds the object stored and counts
  as written, as an existing object always does (the store keeps the object it has);
- exists asks each distinct object once; a repeated key counts at each of its positions.

A batch without repeats is one round: no cost.

``last_error``. :func:`one_call` gives each public call a scope, per thread: the call's own
failures are collected there, and when the outermost call returns (or raises) the store's
``last_error`` becomes that call's last failure, or ``None``. A call made inside another (a v2 call
moving its KV pages through the v1 call) reports into the outer one."""

import functools
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, TypeVar

import numpy as np

F = TypeVar("F", bound=Callable[..., Any])


def occurrence_rounds(keys: Sequence[str]) -> List[List[int]]:
    """Positions of ``keys`` by occurrence: ``[[first occurrences], [second ones], ...]``, each in
    batch order. One round when no key repeats."""
    if len(set(keys)) == len(keys):  # the usual batch: one round, found without a dict per key
        return [list(range(len(keys)))] if len(keys) else []
    seen: Dict[str, int] = {}
    rounds: List[List[int]] = []
    for i, k in enumerate(keys):
        n = seen.get(k, 0)
        seen[k] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(i)
    return rounds


def pages_of(idx: Any, positions: Sequence[int], page: int) -> Any:
    """The host indices of pages ``positions`` (``page`` indices each) of ``idx``, a numpy array
    or a list, in that order and of the same type."""
    if isinstance(idx, np.ndarray):
        if not len(positions):
            return idx[:0]
        return np.concatenate([idx[i * page : (i + 1) * page] for i in positions])
    return [x for i in positions for x in idx[i * page : (i + 1) * page]]


def distinct_pages(idx: Any, page: int) -> bool:
    """Whether the pages of ``idx`` (host indices, ``page`` a page, each page on its start) are
    all different pages."""
    firsts = np.asarray(idx[::page])
    return len(np.unique(firsts)) == len(firsts)


def in_rounds(keys: Sequence[str], idx: Any, page: int, run: Callable[[List[str], Any], List[bool]]) -> List[bool]:
    """``run(keys, idx)`` over the batch's rounds; one answer per key, in the batch's order."""
    rounds = occurrence_rounds(keys)
    if len(rounds) <= 1:
        return run(list(keys), idx)
    out = [False] * len(keys)
    for positions in rounds:
        for i, ok in zip(positions, run([keys[i] for i in positions], pages_of(idx, positions, page))):
            out[i] = ok
    return out


def exist_once(keys: Sequence[str], ask: Callable[[List[str]], Sequence[int]]) -> List[int]:
    """``ask(distinct keys)`` (one answer per key: 1 stored, 0 not, negative an error) answered for
    every position of ``keys``. An answer of another length says nothing of any key: all ``-1``."""
    distinct = list(dict.fromkeys(keys))
    answers = list(ask(distinct)) if distinct else []
    if len(answers) != len(distinct):
        return [-1] * len(keys)
    found = dict(zip(distinct, answers))
    return [found[k] for k in keys]


class CallScope(threading.local):
    """Per thread: how deep in public calls, and the outermost call's last failure."""

    depth = 0
    error: Optional[BaseException] = None


def one_call(method: F) -> F:
    """A public store call: ``last_error`` describes it once it returns (see the module docstring).
    The store has ``_calls`` (a :class:`CallScope`) and ``last_error``."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        scope: CallScope = self._calls
        depth = scope.depth
        if depth == 0:
            scope.error = None
        scope.depth = depth + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            scope.depth = depth
            if depth == 0:
                self.last_error = scope.error

    return call  # type: ignore[return-value]
