"""Every rank of a torch.distributed job (torchrun) is one worker: the path to many machines.

Each rank runs the caller's program (SPMD), constructs a ``TorchDistributedSession`` and calls
``load_sharded``; each ends with exactly its own shards on its own device. Ranks agree on the
outcome: after every ``run`` and ``collective`` they exchange a status, so a failure on one rank
is reported on every rank, naming it, instead of leaving the others to hang in a later
collective. A rank that is gone (its process ended, its machine lost) cannot send a status: the
ranks' heartbeats (``peers.py``) name it instead.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import strict_json
from ..errors import ShardloadError, WorkerCrashedError, WorkerError, WorkerFailure, describe
from .base import (
    DEFAULT,
    Heartbeats,
    ProgressCallback,
    Session,
    WorkerArgs,
    WorkerContext,
    args_for,
    check_timeout,
    session_timeout,
)
from .functions import get_session_func
from .groups import DistGroup
from .peers import Peers, name_ranks, watch_peers

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def missing_env() -> list[str]:
    """The torchrun variables this process lacks (empty under torchrun, or when a process group
    is already initialised): a session cannot be made without them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return []
    return [k for k in _ENV if k not in os.environ]


def _watch(
    beats: Heartbeats, timeout: float, rank: int, stop: threading.Event, context: str
) -> None:
    """The watchdog of one rank: its main thread runs the work, so nothing can interrupt a
    stuck one; the rank says why on stderr and ends, and torchrun stops the job."""
    while not stop.wait(min(timeout / 4, 0.5)):
        if beats.stalled(timeout):
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(
                    f"shardload: rank {rank} failed {context}: TimeoutError: "
                    f"{beats.describe(0, timeout)}; ending this rank (exit 1)\n"
                )
                sys.stderr.flush()
            os._exit(1)


class TorchDistributedSession(Session):
    """This process as rank ``RANK`` of ``WORLD_SIZE``, under torchrun or an existing group.

    Without an initialised process group it creates one from the usual environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): NCCL when this rank's
    device is CUDA, gloo otherwise. The device defaults to ``cuda:LOCAL_RANK`` where CUDA is
    available, else the CPU.

    ``group``: a process group of an existing job to be the session's workers instead of the
    whole job (an engine's tensor-parallel group: ``shardload.vllm`` passes vLLM's); each member
    is the worker of its rank within the group, and the session never destroys it.

    ``timeout`` is the watchdog (left out: ``DEFAULT_TIMEOUT_S`` or ``$SHARDLOAD_TIMEOUT``;
    None: none): a rank without progress for that many seconds
    in a ``run`` (a load) prints one line naming it and what it is on, and ends with exit 1
    (a rank's own thread runs the work, so a stuck one cannot be interrupted);
    torchrun then stops the other ranks. ``timeout_s`` is the process group's timeout.

    A rank whose process ends while the others wait for its outcome fails them with
    ``WorkerCrashedError`` naming it; one that stops answering without closing its connections
    (its machine lost) ends each rank that waits on it for ``PEER_TIMEOUT`` seconds, with one
    line naming it.

    >>> # torchrun --nproc-per-node 2 load.py                                 # doctest: +SKIP
    >>> sess = TorchDistributedSession()
    >>> mine = load_sharded("ckpt/", "ckpt/shard_info.json", sess).worker(sess.rank)
    """

    #: how long a rank waiting in an exchange lets a silent peer (no heartbeat: its machine
    #: lost, its process stopped) go before it ends. A peer's beats come from a thread of their
    #: own, silent only while something holds its GIL; a peer whose process ended is named
    #: within seconds, as its connections close
    PEER_TIMEOUT = 60.0

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        backend: str | None = None,
        timeout_s: float = 600.0,
        timeout: float | None = DEFAULT,
        group=None,
    ):
        import torch.distributed as dist

        self._dist = dist
        self.timeout = session_timeout(timeout)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device is None:
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._owns_group = False
        self._group = group
        if group is not None and not dist.is_initialized():
            raise ShardloadError(
                "TorchDistributedSession(group=...) needs torch.distributed "
                "initialised: the group belongs to a job that is running"
            )
        if not dist.is_initialized():
            missing = [k for k in _ENV if k not in os.environ]
            if missing:
                raise ShardloadError(
                    f"TorchDistributedSession needs a torch.distributed job, and "
                    f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: run "
                    "under torchrun (torchrun --nproc-per-node N ...), or initialise a process "
                    "group first"
                )
            backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
            self._owns_group = True
        self.rank = dist.get_rank(group)
        self.num_workers = dist.get_world_size(group)
        # collectives of small status messages run where the backend can: NCCL needs CUDA
        self._comm_device = (
            self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        )
        self._ctx = WorkerContext(
            self.rank,
            self.num_workers,
            self.device,
            group=DistGroup(self.rank, self.num_workers, group),
        )
        self._closed = False
        self._peers: Peers | None = None
        self._lost = False  # a rank is gone: no rank to meet at close
        opened = self._all_gather(
            {"device": str(self.device), "token": secrets.token_hex(8)}, "opening the session"
        )
        self.devices = [torch.device(o["device"]) for o in opened]
        if self.num_workers > 1:
            self._peers = watch_peers(
                opened[0]["token"], self.rank, self.num_workers, self.PEER_TIMEOUT
            )

    # ---- agreeing on outcomes --------------------------------------------------------------------

    def _all_gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (JSON), in rank order. Where the exchange breaks because a
        rank is gone, ``WorkerCrashedError`` naming it (``what``: what the ranks were doing)."""
        peers = self._peers
        try:
            with peers.exchanging(what) if peers else contextlib.nullcontext():
                return self._gather_bytes(json.dumps(value).encode())
        except Exception as exc:
            named = self._who_went(peers, what, exc) if peers else None
            if named is None:
                raise
            self._lost = True
            raise named from exc

    def _who_went(self, peers: Peers, what: str, exc: Exception) -> ShardloadError | None:
        """The error saying which rank went (``peers`` watched them), after the exchange broke
        with ``exc``; None where every rank is still there (the backend's own error stands)."""
        gone = peers.gone()
        if gone is None or (gone.store_lost and not gone.first):
            return ShardloadError(
                f"{what}: the exchange between the ranks broke ({type(exc).__name__}) and the "
                "job's store does not answer either: the machine serving it (MASTER_ADDR; "
                "under torchrun, the --rdzv-endpoint's) is lost, or its launcher ended"
            )
        if not gone.first:
            return None
        if gone.store_lost:
            how = (
                "it had not reached the exchange when it broke, and the job's store stopped "
                "answering too (the launcher or machine serving it ended; its log says why)"
            )
        else:
            how = (
                "its process ended or its machine was lost (its connections closed and its "
                "heartbeat stopped; its launcher's log says why)"
            )
        too = f"; {name_ranks(gone.first[1:])} too" if gone.first[1:] else ""
        then = f"; {name_ranks(gone.after)} ended after it" if gone.after else ""
        return WorkerCrashedError(gone.first[0], context=f"{what}: {how}{too}{then}")

    def _gather_bytes(self, data: bytes) -> list[Any]:
        """Every rank's JSON ``data``, decoded, in rank order: sizes, then padded bytes."""
        dev = self._comm_device
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros_like(size) for _ in range(self.num_workers)]
        self._dist.all_gather(sizes, size, group=self._group)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8, device=dev)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        bufs = [torch.empty_like(buf) for _ in range(self.num_workers)]
        self._dist.all_gather(bufs, buf, group=self._group)
        return [
            strict_json.loads(bytes(b[: int(s.item())].cpu().numpy())) for b, s in zip(bufs, sizes)
        ]

    def _outcome(self, status: dict, local: BaseException | None, what: str) -> list[dict]:
        """Exchange every rank's status; raise this rank's own error, or ``WorkerError`` naming
        the ranks that failed; else every rank's status."""
        try:
            statuses = self._all_gather(status, what)
        except Exception:
            if local is not None:  # this rank's own failure is its answer, the rest context
                raise local  # noqa: B904 - its own cause kept; the exchange's error its context
            raise
        failures = [
            WorkerFailure(r, s["exc_type"], s["message"], s["traceback"])
            for r, s in enumerate(statuses)
            if not s["ok"]
        ]
        if local is not None:
            raise local
        if failures:
            raise WorkerError(failures, what)
        return statuses

    @staticmethod
    def _failed(exc: BaseException) -> dict:
        return {
            "ok": False,
            "exc_type": type(exc).__name__,
            "message": describe(exc),
            "traceback": traceback.format_exc(),
        }

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Run the body on every rank, then exchange outcomes: if any rank failed, every rank
        raises (the failing ranks their own error, the others ``WorkerError`` naming them)."""
        self._check_open()
        status: dict[str, Any] = {"ok": True}
        local: BaseException | None = None
        try:
            yield
        except BaseException as exc:  # noqa: BLE001 - every rank hears of it, then it is raised
            local, status = exc, self._failed(exc)
        self._outcome(status, local, what)

    # ---- the Session API -------------------------------------------------------------------------

    @property
    def local_workers(self) -> list[int]:
        return [self.rank]

    @property
    def spmd(self) -> bool:
        return True

    def run(
        self,
        func_name: str,
        args: WorkerArgs,
        *,
        workers: Sequence[int] | None = None,
        context: str = "",
        timeout: float | None = DEFAULT,
        on_progress: ProgressCallback | None = None,
    ) -> list[Any]:
        """Run the session function on this rank, the worker it is (every rank makes the same
        call: SPMD); the results of the ranks in ``workers`` in that order. JSON results are
        exchanged; a tensor result stays on its rank (the others see ``None`` in its place), as
        moving tensors between ranks is the engine's business (its collectives). A failure on
        any rank is raised on every rank."""
        self._check_open()
        workers = self._workers(workers)
        context = context or f"in {func_name}"
        timeout = self.timeout if timeout is DEFAULT else check_timeout(timeout)
        status: dict[str, Any] = {"ok": True, "value": None}
        local: BaseException | None = None
        value: Any = None
        if self.rank in workers:
            beats, stop = Heartbeats(1), threading.Event()
            if timeout is not None:
                threading.Thread(
                    target=_watch,
                    args=(beats, timeout, self.rank, stop, context),
                    name="shardload-watchdog",
                    daemon=True,
                ).start()

            def progress(nbytes: int, where: str | None) -> None:
                beats.beat(0, where)
                if nbytes and on_progress is not None:
                    on_progress(nbytes)

            try:
                with self._ctx.hooks(progress, lambda: False):
                    mine = args_for(
                        args if not callable(args) else (lambda w: args(w)),
                        [self.rank] if callable(args) else workers,
                    )[self.rank]
                    value = get_session_func(func_name).func(self._ctx, *mine)
                if not isinstance(value, torch.Tensor):
                    status["value"] = value
            except BaseException as exc:  # noqa: BLE001 - every rank hears of it, then it is raised
                local, status = exc, self._failed(exc)
            finally:
                stop.set()
        statuses = self._outcome(status, local, context)
        results = [s.get("value") for s in statuses]
        if self.rank in workers:
            results[self.rank] = value
        return [results[w] for w in workers]

    def set_value(self, worker: int, name: str, value: Any) -> None:
        self._check_worker(worker)
        if worker == self.rank:
            self._ctx.values[name] = value

    def get_value(self, worker: int, name: str) -> Any:
        self._check_worker(worker)
        if worker != self.rank:
            raise ShardloadError(f"rank {self.rank} holds only its own values")
        return self._ctx.values[name]

    def close(self) -> None:
        """Destroy the process group if this session created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._peers is not None:
            self._peers.stop()
        if self._owns_group and self._dist.is_initialized():
            if not self._lost:
                self._meet_before_teardown()
            self._dist.destroy_process_group()

    #: how long a closing rank waits for the others before tearing the group down anyway
    TEARDOWN_WAIT = datetime.timedelta(seconds=60)

    def _meet_before_teardown(self) -> None:
        """Wait (briefly) for every rank to reach close: a collective can return on one rank
        while its last bytes are still on their way to another, and a rank that tears the group
        down then makes the other abort mid-receive (gloo). A rank that never comes (it failed)
        only delays the teardown by ``TEARDOWN_WAIT``."""
        try:
            if self._dist.get_backend() == "gloo":
                self._dist.monitored_barrier(timeout=self.TEARDOWN_WAIT)
            else:
                self._dist.barrier()
        except Exception:  # noqa: BLE001 - a peer gone is what the teardown is for
            pass

    def __repr__(self) -> str:
        return (
            f"TorchDistributedSession(rank={self.rank}, num_workers={self.num_workers}, "
            f"device={self.device})"
        )
