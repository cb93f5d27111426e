"""The real libraries a user would otherwise load a checkpoint with, as benchmark methods.

Every method here ends with each of N workers owning exactly the pieces ``load_sharded`` gives
it (``methods.check_pieces`` checks that with ``torch.equal``, piece by piece): each takes the
plan's own ranges per worker (``ParamPlan`` -> ``direct_ranges``), runs the plan's fixup on its
piece (``shardload.split_rebase`` rebases a row-parallel ``g_idx``), and clones what the library
hands it, so nothing it keeps is a view of the file mapping or of the library's buffer.

``safetensors-load_file``  ``safetensors.torch.load_file``, then a narrow + clone per worker,
                           in one thread, as a simple user would
``safetensors-get_slice``  one thread per worker, each with its own ``safe_open``, reading its
                           ranges with ``get_slice(name)[...]`` (HF transformers' TP, a vLLM
                           rank), cloned
``fastsafetensors``        ``SafeTensorsFileLoader(SingleGroup(), device, nogds=True)``: the
                           whole file into its buffer, ``get_tensor`` (zero copy), each worker
                           thread clones its pieces
``runai-streamer``         ``SafetensorsStreamer().stream_file(file, owned=False)``: each tensor
                           as it streams in, narrowed and cloned by the worker threads before
                           the stream moves on
``instanttensor``          ``instanttensor.safe_open(file, "pt", device, copy=False)``, each
                           tensor narrowed and cloned per worker (CUDA only: on the CPU it
                           refuses, and is reported as skipped with its reason)

``PEERS`` is the table of them. A peer that does not import (or refuses the device) is reported
by ``unavailable`` with the reason, and the benchmark runs without it. Nothing here is part of
shardload's test extra.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from shardload.pieces import run_steps as _run_steps
from shardload.plan import ParamPlan, ValidatedPlan

Workers = list[dict[str, torch.Tensor]]


# ==== the plan's pieces, from whatever tensor a library hands over ==============================


def direct_ranges(p: ParamPlan, n: int):
    """(axis, ranges per worker) when ``p``'s function declares what each worker reads (its
    ``ranges`` rule) as plain ranges along one axis, else None: the methods take the same
    ranges shardload's read plans do."""
    if len(p.steps) != 1 or p.funcs[0].ranges is None:
        return None
    step = p.steps[0]
    sels = [
        p.funcs[0].ranges(p.meta.shape, p.meta.dtype, *step.extra, num_shards=n, index=i)
        for i in range(n)
    ]
    if any(sel.axis is None or sel.has_zeros for sel in sels):
        return None
    return sels[0].axis, [list(sel.ranges) for sel in sels]


def direct_map(plan: ValidatedPlan, n: int) -> dict[str, Any]:
    """Name -> ``direct_ranges`` of every sharded tensor of ``plan``; None for replicated ones."""
    return {p.name: (None if p.replicated else direct_ranges(p, n)) for p in plan}


def narrowed(full: torch.Tensor, axis: int, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of ``full``, one per (start, length) range along ``axis``."""
    return [full.narrow(axis, start, length) for start, length in ranges]


def run_steps(p: ParamPlan, full: torch.Tensor) -> torch.Tensor:
    return _run_steps([(s.func, s.out_shape, s.dtype, s.extra) for s in p.steps], full, p.name)


def owned(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A copy of ``t`` in fresh, contiguous memory on ``device`` (default: where it is)."""
    if device is None or t.device == device:
        return t.clone(memory_format=torch.contiguous_format)
    return t.to(device, non_blocking=False).contiguous()


def _cat(parts: list[torch.Tensor], axis: int, device: torch.device | None) -> torch.Tensor:
    """The parts joined along ``axis`` (a new tensor), on ``device``."""
    t = torch.cat(parts, dim=axis)
    return t if device is None or t.device == device else t.to(device)


def fixup(p: ParamPlan, piece: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """The plan's in-place edit of a piece read by ranges (``split_rebase``: ``g_idx`` minus
    its first element), on worker ``i``'s own copy."""
    fix = p.funcs[0].fixup if p.steps else None
    if fix is not None:
        fix(piece, *p.steps[0].extra, num_shards=n, index=i)
    return piece


def piece_from_full(
    p: ParamPlan, full: torch.Tensor, i: int, n: int, direct, device: torch.device | None = None
) -> torch.Tensor:
    """Worker ``i``'s piece of ``p`` out of the whole tensor, owning its memory on ``device``."""
    if p.replicated:
        return owned(full, device)
    if direct is not None:
        axis, ranges = direct
        parts = narrowed(full, axis, ranges[i])
        t = owned(parts[0], device) if len(parts) == 1 else _cat(parts, axis, device)
        return fixup(p, t, i, n)
    return owned(run_steps(p, full)[i], device)


def piece_from_parts(
    p: ParamPlan,
    parts: list[torch.Tensor],
    axis: int,
    i: int,
    n: int,
    device: torch.device | None,
    parts_are_views: bool,
) -> torch.Tensor:
    """Worker ``i``'s piece from the slices it read itself (one per range)."""
    if len(parts) == 1:
        t = parts[0]
        t = (
            owned(t, device)
            if parts_are_views or (device is not None and t.device != device)
            else t.contiguous()
        )
    else:
        t = _cat(parts, axis, device)
    return fixup(p, t, i, n)


@dataclass
class Job:
    """One load by a peer: the file, the plan at this N, and where each worker's pieces go."""

    file: str
    params: list[ParamPlan]
    n: int
    direct: dict[str, Any]  # name -> (axis, ranges per worker) or None
    pool: ThreadPoolExecutor  # N threads, one per worker
    devices: list[torch.device] | None = None  # None: the CPU
    #: whether safetensors hands out views of its mapping (0.8: yes), so a slice needs a clone
    slices_are_views: bool = True

    def device(self, i: int) -> torch.device | None:
        return None if self.devices is None else self.devices[i]

    @property
    def source_device(self) -> str:
        """Where a library that loads to one device loads to: worker 0's device, or the CPU."""
        return "cpu" if self.devices is None else str(self.devices[0])


def _fan_out(job: Job, fulls: dict[str, torch.Tensor]) -> Workers:
    """Each worker thread takes its pieces of the whole tensors ``fulls``."""

    def worker(i: int) -> dict[str, torch.Tensor]:
        return {
            p.name: piece_from_full(p, fulls[p.name], i, job.n, job.direct[p.name], job.device(i))
            for p in job.params
            if p.name in fulls
        }

    return list(job.pool.map(worker, range(job.n)))


# ==== the peers =================================================================================


def run_load_file(job: Job) -> Workers:
    from safetensors.torch import load_file

    full = load_file(job.file, device=job.source_device)
    workers: Workers = [{} for _ in range(job.n)]
    for p in job.params:  # one thread, as a simple user would
        for i in range(job.n):
            workers[i][p.name] = piece_from_full(
                p, full[p.name], i, job.n, job.direct[p.name], job.device(i)
            )
    del full
    return workers


def run_get_slice(job: Job) -> Workers:
    from safetensors import safe_open

    def worker(i: int) -> dict[str, torch.Tensor]:
        kept: dict[str, torch.Tensor] = {}
        dev = job.device(i)
        with safe_open(job.file, framework="pt") as f:
            for p in job.params:
                d = job.direct[p.name]
                if p.replicated:
                    kept[p.name] = piece_from_parts(
                        p, [f.get_slice(p.name)[:]], 0, i, job.n, dev, job.slices_are_views
                    )
                elif d is not None:
                    axis, ranges = d
                    sl = f.get_slice(p.name)
                    lead = (slice(None),) * axis
                    parts = [
                        sl[lead + (slice(start, start + length),)] for start, length in ranges[i]
                    ]
                    kept[p.name] = piece_from_parts(
                        p, parts, axis, i, job.n, dev, job.slices_are_views
                    )
                else:  # an opaque chain: the whole tensor, then the plan's steps
                    kept[p.name] = piece_from_full(p, f.get_tensor(p.name), i, job.n, None, dev)
        return kept

    return list(job.pool.map(worker, range(job.n)))


def run_fastsafetensors(job: Job) -> Workers:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    loader = SafeTensorsFileLoader(SingleGroup(), job.source_device, nogds=True)
    try:
        loader.add_filenames({0: [job.file]})
        fb = loader.copy_files_to_device()
        try:
            # get_tensor is zero copy in one process (a view of its buffer); with one rank
            # get_sharded hands back the whole tensor too, so each worker narrows and clones
            fulls = {p.name: fb.get_tensor(p.name) for p in job.params}
            workers = _fan_out(job, fulls)
            del fulls
            return workers
        finally:
            fb.close()
    finally:
        loader.close()


def run_runai(job: Job) -> Workers:
    from runai_model_streamer import SafetensorsStreamer

    by_name = {p.name: p for p in job.params}
    workers: Workers = [{} for _ in range(job.n)]
    with SafetensorsStreamer() as streamer:
        try:  # owned=False: views into its reused buffers, consumed before the stream moves on
            streamer.stream_file(job.file, device="cpu", owned=False)
        except TypeError:  # a release without the keyword: tensors it hands over are its own
            streamer.stream_file(job.file, device="cpu")
        for name, tensor in streamer.get_tensors():
            p = by_name.get(name)
            if p is None:
                continue

            def take(i: int, p=p, tensor=tensor) -> torch.Tensor:
                return piece_from_full(p, tensor, i, job.n, job.direct[p.name], job.device(i))

            for i, piece in enumerate(job.pool.map(take, range(job.n))):
                workers[i][name] = piece
    return workers


def run_instanttensor(job: Job) -> Workers:
    import instanttensor

    by_name = {p.name: p for p in job.params}
    workers: Workers = [{} for _ in range(job.n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its copy=False warning: we consume each tensor inline
        f = instanttensor.safe_open(job.file, framework="pt", device=job.source_device, copy=False)
    with f:
        for name, tensor in f.tensors():  # ring-buffer views: consumed before the next yield
            p = by_name.get(name)
            if p is None:
                continue
            for i in range(job.n):
                workers[i][name] = piece_from_full(
                    p, tensor, i, job.n, job.direct[name], job.device(i)
                )
            torch.cuda.current_stream(tensor.device).synchronize()  # copied before it moves on
    return workers


@dataclass(frozen=True)
class Peer:
    """One real library: what it imports, how it runs, and what it reads."""

    module: str  # what it imports
    pip_name: str  # what pip installs it as (for the skip message)
    run: Callable[[Job], Workers]
    #: one reader of the whole file (shown as worker 0's reads), else each worker its ranges
    reads_whole_file: bool = True
    #: whether the CUDA section runs it
    cuda: bool = True


#: the peers, in table order
PEERS: dict[str, Peer] = {
    "safetensors-load_file": Peer("safetensors", "safetensors", run_load_file),
    "safetensors-get_slice": Peer(
        "safetensors", "safetensors", run_get_slice, reads_whole_file=False
    ),
    "fastsafetensors": Peer("fastsafetensors", "fastsafetensors", run_fastsafetensors),
    # on a GPU as vLLM's runai_streamer format uses it: streamed into its host buffers, each
    # worker copying its pieces to its device (its own GPU path is its distributed mode, which
    # needs torch.distributed)
    "runai-streamer": Peer("runai_model_streamer", "runai-model-streamer", run_runai),
    "instanttensor": Peer("instanttensor", "instanttensor", run_instanttensor),
}


def unavailable(peer: str, device: str = "cpu", file: str | None = None) -> str | None:
    """Why ``peer`` cannot run here (not installed, does not import, refuses ``device``), or
    None when it can."""
    module, pip_name = PEERS[peer].module, PEERS[peer].pip_name
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install's anything
        return f"does not import ({type(exc).__name__}: {exc}); pip install {pip_name}"
    if peer == "instanttensor" and file is not None:
        import instanttensor

        try:  # load_now=False: reads the header only; it checks the device first
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                instanttensor.safe_open(file, framework="pt", device=device, load_now=False)
        except Exception as exc:  # noqa: BLE001 - its refusal, of any type (nothing was opened)
            return f"refuses device {device!r}: {type(exc).__name__}: {exc}"
    if peer == "fastsafetensors" and device.startswith("cuda"):
        try:
            from fastsafetensors.common import is_gpu_found

            if not is_gpu_found():
                return "fastsafetensors finds no GPU (is_gpu_found() is False)"
        except ImportError:
            pass
    return None


def zero_copy_get_tensor(file: str, name: str) -> bool:
    """Whether safetensors' get_tensor returns a view of its memory map (no copy)."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        a, b = f.get_tensor(name), f.get_tensor(name)
        return a.data_ptr() == b.data_ptr()
