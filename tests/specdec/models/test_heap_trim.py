"""specdec.models.trim_heap: a loaded draft's freed memory goes back to the system, from glibc's
heap and, when the process runs with tcmalloc preloaded (as vLLM's CPU images run), from
tcmalloc's. The C libraries are faked: which release each process can call is the point."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from specdec.models import trim_heap


class _Library:
    """A shared object exporting `exports`; each call is recorded as (its name, its arguments)."""

    def __init__(self, exports: set[str], calls: list[tuple[str, tuple[int, ...]]]) -> None:
        self._exports, self._calls = exports, calls

    def __getattr__(self, name: str) -> object:
        if name not in self._exports:
            raise AttributeError(name)
        return lambda *args: self._calls.append((name, args))


@pytest.mark.parametrize(
    ("process_exports", "released"),
    [
        (set(), [("malloc_trim", (0,))]),  # glibc's heap only
        (
            {"MallocExtension_ReleaseFreeMemory"},  # tcmalloc preloaded: its page heap too
            [("malloc_trim", (0,)), ("MallocExtension_ReleaseFreeMemory", ())],
        ),
    ],
)
def test_the_heap_that_holds_the_freed_pages_releases_them(
    monkeypatch: pytest.MonkeyPatch, process_exports: set[str], released: list[tuple[str, tuple[int, ...]]]
) -> None:
    calls: list[tuple[str, tuple[int, ...]]] = []
    libc = _Library({"malloc_trim"}, calls)
    process = _Library(process_exports, calls)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libc.so.6")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc if name == "libc.so.6" else process)
    trim_heap()
    assert calls == released
