"""What the workers of one process share: computed chains, and the load the loader runs here.

Workers that share this process (threads, or the loader's own rank) compute each chain once
(``shared_outputs.SharedOutputs``) and read from the checkpoint the loader opened
(``LocalLoad``), leaving their pieces there for the loader to return. A worker finds its
``LocalLoad`` by the token the loader sent in its request (``local_for``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
from dataclasses import dataclass, field

import torch

from ..readers.base import Checkpoint
from ..readplan import ReadPlan
from ..shared_outputs import SharedOutputs
from .reads import PageReleases, Readahead, tensor_spans

__all__ = ["MAX_SHARED", "LocalLoad", "local_for", "local_load"]

#: chains whose full output may be alive at once in one process (the staging bound)
MAX_SHARED = 2


# ---- loads the loader runs in its own process ----------------------------------------------------


@dataclass
class LocalLoad:
    """A load whose workers (some or all) run in the loader's process: they read from the
    checkpoint the loader opened, share computed chains, and leave their pieces here for the
    loader to return."""

    ckpt: Checkpoint
    num_local: int
    num_shards: int
    shards: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: the read plans of the workers in this process, by rank (handed over as they are)
    plans: dict[int, ReadPlan] = field(default_factory=dict)
    #: the workers' sides of the load's stream of object bytes, by rank
    consumers: dict = field(default_factory=dict)
    stopped: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.shared = SharedOutputs(self.num_local, self.stopped.is_set, most_alive=MAX_SHARED)
        self.releases = PageReleases(self.ckpt, workers=self.num_local, num_shards=self.num_shards)
        # every tensor, for the workers here to read ahead and release; none where there are
        # none (a load on worker processes only: they read ahead for themselves)
        self._spans = tensor_spans(self.ckpt) if self.num_local else []
        self.readahead = Readahead(self.ckpt, self._spans)
        self._order = {span[0]: k for k, span in enumerate(self._spans)}
        self._at: dict[int, int] = {}  # each local worker's last finished tensor, in order
        # Workers of CPU devices take turns to read batches of pieces, as many at once as
        # there are cores: each copy is memory-bound, and more threads than cores running
        # per-piece Python only hand the GIL back and forth (a third of the CPU time of eight
        # workers on two cores went to that).
        # (a queue of tokens, not threading.Semaphore: that is Python code around a Condition,
        # itself a GIL hand-off at every turn)
        self.turns: queue.SimpleQueue[int] = queue.SimpleQueue()
        for token in range(max(1, min(self.num_local, os.cpu_count() or 1))):
            self.turns.put(token)
        self._released = -1  # the tensors up to this one went back

    def start(self, plans: dict[int, ReadPlan], consumers: dict | None = None) -> None:
        """The read plans of the workers in this process, before they run, and their sides of
        the load's stream of object bytes (``stream.Consumer``), where it has one."""
        self.plans.update(plans)
        self.consumers.update(consumers or {})
        self._at.update((rank, -1) for rank in plans)

    def finished(self, rank: int, name: str) -> None:
        """Worker ``rank`` has its pieces up to tensor ``name``'s. Workers take their pieces in
        storage order, so every tensor before the one the slowest worker is on is done with:
        its mapped pages go back (in a batch). No lock in the common case: many workers
        finishing small pieces made one lock the load's bottleneck."""
        last = self._order.get(name)
        if last is None or rank not in self._at:
            return
        self._at[rank] = last  # one store: atomic under the GIL
        low = min(self._at.values())
        if low <= self._released:
            return
        with self._lock:  # whichever worker gets here first releases the span
            begin, self._released = self._released + 1, max(low, self._released)
        run: list | None = None  # tensors lie in storage order: one span per file
        for _, index, first, end in self._spans[begin : low + 1]:
            if run is not None and run[0] == index and first >= run[2]:
                run[2] = end
                continue
            if run is not None:
                self.releases.add(*run)
            run = [index, first, end]
        if run is not None:
            self.releases.add(*run)


#: the loads under way in this process, by token. Module-global because the worker's side has
#: nothing else to find its load through: the loader registers the load here (``local_load``)
#: and sends each worker only JSON (the request carries the token, a string), through the
#: session, which knows nothing of loads; a worker thread (or this torchrun rank) then looks the
#: token up here (``local_for``) to share the loader's open checkpoint, chains and pieces. A
#: worker process has a table of its own, empty: it finds no entry and opens the files its read
#: plan names instead. An entry lives for one load; each load has its own token.
_local: dict[str, LocalLoad] = {}
_counter = itertools.count()


@contextlib.contextmanager
def local_load(ckpt: Checkpoint, num_local: int, num_shards: int):
    """Register a load of ``num_local`` of the ``num_shards`` workers in this process for its
    duration; yields ``(token, LocalLoad)``."""
    token = f"{os.getpid()}-{next(_counter)}"
    load = _local[token] = LocalLoad(ckpt, num_local, num_shards)
    load.readahead.start()
    try:
        yield token, load
    except BaseException:
        load.stopped.set()  # Ctrl-C or a failure: threads still running stop at their next piece
        raise
    finally:
        _local.pop(token, None)
        load.readahead.close()
        load.releases.flush()


def local_for(token: str) -> LocalLoad | None:
    """The load ``token`` names if it runs in this process (``local_load``), else None."""
    return _local.get(token)
