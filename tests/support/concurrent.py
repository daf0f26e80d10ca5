"""Running the same work in several threads at once (several reapers, migrators, ...)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def at_once(count: int, work: Callable[[int], T], *, timeout: float = 120) -> list[T]:
    """``work(n)`` for n in range(count), each in a thread of its own, all released together;
    their results (in the order they finished). The first error any of them raised is raised
    here once every thread has ended."""
    barrier = threading.Barrier(count)
    results: list[T] = []
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            barrier.wait(timeout=timeout)
            results.append(work(n))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    if errors:
        raise errors[0]
    assert len(results) == count, f"{count - len(results)} threads never finished"
    return results
