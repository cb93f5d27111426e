"""The per-worker load: carry out one worker's ``ReadPlan``, keeping its pieces on its device.

This runs on the worker (a thread, a worker process, a torchrun rank) as the session function
``shardload.load_pieces``; the loader sends each worker its read plan and nothing else. For each
piece, in storage order:

1. **read**: copy the plan's byte runs out of the source (a mapped file) into a new tensor
   (zeros where the piece is padding), apply the fixup if any;
2. **compute**: read the whole stored tensor, run the chain of shard functions on it, keep
   ``output[index]``. Workers that share this process (threads) compute each chain once and
   share it: the first to need it computes it, at most ``MAX_SHARED`` such outputs are alive at
   once (the staging bound: about two of the largest parameters), each dropped once all its
   workers took their piece;
3. place the piece on the worker's device, owning its memory, and report progress.

With ``staging`` (the default for CUDA workers) reads go through the worker's ``Pipeline``
(``staging.py``): byte runs land in a ring of host buffers and are copied from there to the
device asynchronously; a replicated tensor is staged once per process and copied
device-to-device to the others, and a chain's input is staged once and its steps run on the
device. Without it, a piece is read into host memory and moved (the CPU's path: one copy).
Mapped pages go back to the kernel in batches once every local worker is done with them
(``PageReleases``), and are asked for a little ahead of the copies (``Readahead``).

A worker in the loader's own process uses the checkpoint the loader opened (``LocalLoad``);
a worker process maps the files the read plan names, checking each is still the file the
loader opened. Either way nothing is parsed or validated here beyond the bounds of each copy.

The modules, one concern each:

* ``chains``: running a chain of shard functions (``run_steps``);
* ``reads``: copying byte runs out of the sources (``read_runs``, ``source_bytes_for``) and the
  page policy around them (``PageReleases``, ``Readahead``);
* ``sharing``: what the workers of one process share (``LocalLoad``, the table of loads under
  way here, ``local_load``; chains computed once through ``shardload.shared_outputs``);
* ``load``: the session functions (``load_pieces``, ``fetch_piece``, ``release_loads``) and
  the per-piece work (``read_piece``);
* ``request``: what the loader asks of each worker (``LoadRequest``, sent as JSON);
* ``wire``: a read plan as the loader sends it to a worker process (compact JSON: its kinds
  of piece, then names and offsets in flat lists).

The sizes a module reads when it runs (``reads.RELEASE_BATCH_BYTES``, ``reads.READAHEAD_*``,
``sharing.MAX_SHARED``) are also importable from here, as values.
"""

from __future__ import annotations

from .chains import run_steps
from .load import (
    FETCH_PIECE,
    LOAD_PIECES,
    RELEASE_LOADS,
    fetch_piece,
    load_pieces,
    read_piece,
    release_loads,
)
from .reads import (
    READAHEAD_BYTES,
    READAHEAD_WINDOW,
    RELEASE_BATCH_BYTES,
    PageReleases,
    Readahead,
    read_runs,
    source_bytes_for,
)
from .request import LoadRequest
from .sharing import MAX_SHARED, LocalLoad, local_load

__all__ = [
    "FETCH_PIECE",
    "LOAD_PIECES",
    "MAX_SHARED",
    "RELEASE_LOADS",
    "LoadRequest",
    "LocalLoad",
    "PageReleases",
    "load_pieces",
    "read_piece",
    "read_runs",
    "run_steps",
    "source_bytes_for",
]
