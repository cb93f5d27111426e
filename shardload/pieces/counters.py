"""A stream's counters: 64-bit words in memory that the loader's process and the worker
processes map, each word written by one side and polled by the others.

The words are ``[state, units fetched, bytes fetched, moves, position of worker 0, 1, ...]``:
the fetch writes the first four, each worker its own position (``NOT_ATTACHED`` until it
says where it is, ``DONE`` once it reads no more).

>>> control = Control(consumers=2, shared=False)
>>> control.set_position(0, 3); control.slowest()  # worker 1 not attached: needs them all
0
>>> control.close()
"""

from __future__ import annotations

import mmap
import os

__all__ = [
    "BYTES",
    "CLOSED",
    "DONE",
    "FAILED",
    "FETCHED",
    "MOVES",
    "NOT_ATTACHED",
    "POLL_MAX_S",
    "POLL_S",
    "RUNNING",
    "STATE",
    "Control",
]

#: seconds between looks at the counters, while waiting (a worker for bytes, the fetch for
#: room in the window)
POLL_S = 0.002
POLL_MAX_S = 0.02
#: a worker position: not yet attached (counted as at the first unit), and done (or gone)
NOT_ATTACHED = -1
DONE = 1 << 62
#: states
RUNNING, FAILED, CLOSED = 0, 1, 2
#: the words before the workers' positions: state, units fetched, bytes fetched, moves
STATE, FETCHED, BYTES, MOVES, _HEADER = 0, 1, 2, 3, 4
#: the most workers a mapped block of counters is taken to have (a bound on what is mapped)
_MAX_CONSUMERS = 1 << 20


class Control:
    """The stream's counters (module docstring), in memory of this process, or, ``shared``,
    in a memory file worker processes map (``path``, ``attach``)."""

    def __init__(self, consumers: int, shared: bool):
        from ..sources.sparse import memory_file

        size = 8 * (_HEADER + consumers)
        self._fd, self._map = (
            memory_file("shardload-stream", size) if shared else (-1, mmap.mmap(-1, size))
        )
        self.consumers = consumers
        self.words: memoryview | None = memoryview(self._map).cast("q")
        for k in range(consumers):
            self.words[_HEADER + k] = NOT_ATTACHED

    @classmethod
    def attach(cls, path: str | None, consumers: int) -> Control | None:
        """The loader's counters, mapped here; None where they cannot be."""
        from ..sources.sparse import map_memory_file

        if path is None or not 0 < consumers < _MAX_CONSUMERS:
            return None
        mapped = map_memory_file(path, 8 * (_HEADER + consumers))
        if mapped is None:
            return None
        self = cls.__new__(cls)
        self._fd, self._map, self.consumers = -1, mapped, consumers
        self.words = memoryview(mapped).cast("q")
        return self

    @property
    def path(self) -> str | None:
        """Where another process maps these counters; None where they are not shared."""
        from ..sources.sparse import memory_file_path

        return None if self._fd < 0 else memory_file_path(self._fd)

    @property
    def live(self) -> memoryview:
        """The words, while the counters are open."""
        if self.words is None:
            raise RuntimeError("the stream's counters are closed")
        return self.words

    def get(self, word: int) -> int:
        return int(self.live[word])

    def set(self, word: int, value: int) -> None:
        self.live[word] = value

    def add(self, word: int, value: int) -> None:
        self.live[word] += value

    def position(self, slot: int) -> int:
        return int(self.live[_HEADER + slot])

    def set_position(self, slot: int, unit: int) -> None:
        self.live[_HEADER + slot] = unit

    def positions(self) -> int:
        """The workers' positions summed: it changes whenever one moves on."""
        words = self.live
        return sum(words[_HEADER + k] for k in range(self.consumers))

    def slowest(self) -> int:
        """The first unit some worker still needs (a worker not yet attached needs all)."""
        words = self.live
        low = DONE
        for k in range(self.consumers):
            at = words[_HEADER + k]
            low = min(low, 0 if at == NOT_ATTACHED else at)
        return low

    def close(self) -> None:
        words, self.words = self.words, None
        if words is not None:
            words.release()
        self._map.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
