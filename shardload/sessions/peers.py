"""Whether the other ranks of a torch.distributed job are still there, and which are not.

Every rank of a ``TorchDistributedSession`` beats once a second, from a thread of its own, in
the job's key-value store (the one ``init_process_group`` uses: under torchrun, the launcher
at ``--rdzv-endpoint`` serves it), and notes there each exchange it reaches. Two things go
wrong across machines, and the beats tell them apart from a slow rank:

* a rank's process ends: its connections close, and the exchange the others are in fails at
  once (gloo), saying nothing of which rank it was. ``gone`` finds it: the ranks that stopped
  beating, and of them those that never reached the exchange (a rank that reached it and went
  after was stopped by its launcher, as torchrun stops a node's ranks when one fails);
* a machine is lost, or a process stopped: nothing closes, and the others would wait in the
  exchange for the process group's timeout (ten minutes; NCCL waits so even for a process that
  ended). While this rank waits in an exchange, the thread watches the others' beats; one
  silent for ``peer_timeout`` seconds ends this rank with one line naming it, as the watchdog
  ends a stuck rank (the main thread is inside the backend and cannot be interrupted). The
  line goes to the store too: every waiting rank ends with it within a beat, before torchrun
  stops them for the first one's exit, so that every machine's log says why.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["BEAT_S", "ROLL_CALL_S", "Missing", "Peers", "name_ranks", "watch_peers"]

#: how often a rank beats
BEAT_S = 1.0
#: how long ``gone`` watches for beats: a live rank beats more than once meanwhile, and the
#: ranks are still there to say it (torchrun stops a node's ranks soon after one fails)
ROLL_CALL_S = 3.0


def watch_peers(token: str, rank: int, size: int, peer_timeout: float) -> Peers | None:
    """This rank's ``Peers`` in the job's store; None where there is none to use (then a rank
    gone is the backend's error, unnamed, as before)."""
    try:
        return Peers(_job_store(), token, rank, size, peer_timeout)
    except Exception:  # noqa: BLE001 - a store that cannot be cloned or written
        return None


def _job_store():
    """The default process group's store: private in torch, and the one store every way of
    starting a job shares (torchrun, ``env://``, ``tcp://``, an engine's own)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


@dataclass(frozen=True)
class Missing:
    """The ranks gone when an exchange broke: ``first``, those that stopped beating without
    reaching it (else every silent one), and ``after``, those that reached it and then
    stopped (their launcher stopped them). ``store_lost``: the store stopped answering while
    the beats were watched, and ``first`` is who had not reached the exchange."""

    first: list[int]
    after: list[int]
    store_lost: bool


def name_ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 2, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


class Peers:
    """This rank's beats in ``store`` under ``token`` (the same on every rank of the session),
    and the others' as it sees them. ``stop`` ends the beats."""

    def __init__(self, store, token: str, rank: int, size: int, peer_timeout: float):
        self.rank, self.size, self.peer_timeout = rank, size, peer_timeout
        self._prefix = f"shardload/{token}"
        self._store = store.clone()  # the main thread's connection
        self._beating = store.clone()  # the thread's own: a store is not shared by threads
        # a store that stops answering must not hold either up longer than a peer would
        self._store.set_timeout(datetime.timedelta(seconds=ROLL_CALL_S))
        self._beating.set_timeout(datetime.timedelta(seconds=peer_timeout))
        self._exchanges = 0  # reached by this rank: every rank makes the same (SPMD)
        self._waiting: tuple[int, str, float] | None = None  # (exchange, context, since)
        self._stop = threading.Event()
        self._store.add(self._beat_key(rank), 1)
        self._thread = threading.Thread(target=self._beat, name="shardload-peers", daemon=True)
        self._thread.start()

    def _beat_key(self, rank: int) -> str:
        return f"{self._prefix}/beat/{rank}"

    @property
    def _verdict_key(self) -> str:
        return f"{self._prefix}/verdict"

    def _arrived_key(self, rank: int) -> str:
        return f"{self._prefix}/arrived/{rank}"  # how many exchanges it reached

    def beats(self, store) -> list[int]:
        """Every rank's count of beats (0: none yet)."""
        return [int(store.add(self._beat_key(r), 0)) for r in range(self.size)]

    def arrived(self) -> set[int]:
        """The ranks that reached this rank's latest exchange."""
        return {
            r
            for r in range(self.size)
            if int(self._store.add(self._arrived_key(r), 0)) >= self._exchanges
        }

    @contextlib.contextmanager
    def exchanging(self, context: str) -> Iterator[None]:
        """The body is this rank in its next exchange (``context``: what the ranks are doing):
        noted in the store, and watched by the thread."""
        self._exchanges += 1
        with contextlib.suppress(Exception):  # a store gone: the exchange goes on unwatched
            self._store.add(self._arrived_key(self.rank), 1)
        self._waiting = (self._exchanges, context, time.monotonic())
        try:
            yield
        finally:
            self._waiting = None

    def gone(self) -> Missing | None:
        """After this rank's latest exchange broke: who is missing (``Missing``), found by
        watching the beats for ``ROLL_CALL_S``, less once every rank has beaten. None when the
        store cannot say (it went first)."""
        try:
            arrived = self.arrived()
            first = self.beats(self._store)
        except Exception:  # noqa: BLE001 - the store's machine is gone too
            return None
        alive = {self.rank}
        try:
            deadline = time.monotonic() + ROLL_CALL_S
            while len(alive) < self.size and time.monotonic() < deadline:
                time.sleep(BEAT_S / 4)
                now = self.beats(self._store)
                alive |= {r for r in range(self.size) if now[r] != first[r]}
        except Exception:  # noqa: BLE001 - the store went while watching
            return Missing(
                [r for r in range(self.size) if r not in arrived | {self.rank}], [], True
            )
        silent = [r for r in range(self.size) if r not in alive]
        before = [r for r in silent if r not in arrived]
        return Missing(
            before or silent, [r for r in silent if r in arrived] if before else [], False
        )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * BEAT_S)

    # ---- the thread ------------------------------------------------------------------------------

    def _beat(self) -> None:
        seen: dict[int, tuple[int, float]] = {}  # rank -> (its beats, when they last changed)
        watching, read_at = None, 0.0
        while not self._stop.wait(BEAT_S):
            with contextlib.suppress(Exception):  # a store gone: the watch below says so
                self._beating.add(self._beat_key(self.rank), 1)
            waiting = self._waiting
            if waiting is None:
                continue
            exchange, context, since = waiting
            if watching != exchange:
                watching, seen, read_at = exchange, {}, since
            now = time.monotonic()
            verdict = None
            with contextlib.suppress(Exception):
                for r, count in enumerate(self.beats(self._beating)):
                    if seen.get(r, (None,))[0] != count:
                        seen[r] = (count, now)
                read_at = now
                if self._beating.check([self._verdict_key]):  # another rank has given up
                    verdict = self._beating.get(self._verdict_key).decode()
            if verdict is None:
                verdict = self._verdict(seen, since, read_at, now)
                if verdict is None:
                    continue
                if read_at == now:  # the store answers: the others read it at their next beat
                    with contextlib.suppress(Exception):
                        self._beating.set(self._verdict_key, verdict)
            if self._waiting == waiting:  # the exchange may have ended meanwhile
                self._end(verdict, context)

    def _verdict(self, seen: dict, since: float, read_at: float, now: float) -> str | None:
        """Why this rank gives up waiting: the ranks silent for ``peer_timeout``, or the store;
        None while every rank beats."""
        if now - read_at >= self.peer_timeout:
            return (
                f"the job's store has not answered for {self.peer_timeout:g} s (the "
                "machine serving it, MASTER_ADDR: torchrun's --rdzv-endpoint, is lost or "
                "unreachable)"
            )
        silent = [
            r
            for r in range(self.size)
            if r != self.rank and now - seen.get(r, (None, since))[1] >= self.peer_timeout
        ]
        if not silent:
            return None
        return (
            f"{name_ranks(silent)} stopped answering: no heartbeat for "
            f"{self.peer_timeout:g} s (its machine is lost or unreachable, or its process "
            "stopped)"
        )

    def _end(self, why: str, context: str) -> None:
        """Say why, and end this rank. Not at once: the first rank to exit makes torchrun stop
        the others, and each waiting rank reads the verdict within a beat and says it first."""
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(
                f"shardload: rank {self.rank} failed {context}: {why}; ending this rank (exit 1)\n"
            )
            sys.stderr.flush()
        time.sleep(2 * BEAT_S)
        os._exit(1)
