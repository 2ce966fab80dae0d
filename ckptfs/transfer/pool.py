"""The engine's worker pool: the parts of one transfer in parallel, failing as one call would."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

import trio

T = TypeVar("T")


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


@contextlib.asynccontextmanager
async def parallel() -> AsyncIterator[trio.Nursery]:
    """A nursery for the parts of one transfer that fails with the first real error of its tasks, as one
    call would: callers handle a BackendError, not a group of them (a cancellation passes unchanged)."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        first = next((exc for exc in _leaves(group) if not isinstance(exc, trio.Cancelled)), None)
        if first is None:
            raise
        raise first from None


async def for_each(items: Iterable[T], work: Callable[[T], Awaitable[object]], width: int) -> None:
    """work(item) for every item, in their order, `width` at a time (the engine's worker pool for the parts
    of one transfer); fails as parallel() does."""
    todo = collections.deque(items)

    async def worker() -> None:
        while todo:
            await work(todo.popleft())

    async with parallel() as nursery:
        for _ in range(min(width, len(todo))):
            nursery.start_soon(worker)
