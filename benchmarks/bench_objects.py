#!/usr/bin/env python
"""Benchmark: a checkpoint loaded from object storage (s3://, gs://, az://) onto N workers,
shardload against the Run:ai Model Streamer, all reading from the same local emulator: bytes
the server sent, wall time, and the peak host memory of the loader's whole process tree.

    python benchmarks/bench_objects.py [--schemes s3,gs] [--size-gb 1.0] [--shards 1,2,4,8]
                                       [--runs 2] [--window-mb M] [--overlap] [--link-mbps R]
                                       [--json F]

1. Writes (once, cached under ``--dir``, outside the repository) the synthetic GPTQ Llama
   checkpoint of ``bench_load.py`` at ``--size-gb``. For each scheme, starts that scheme's
   emulator behind the counting proxy the tests use too (``devtools/objectservers.py``: moto
   for S3, fake-gcs-server for GCS, Azurite for Azure) in a process of its own, whose memory is
   not counted, and uploads the checkpoint to it (straight to the emulator: not counted).
2. For each N, alternating the methods ``--runs`` times, runs every measured load in a fresh
   process (the *loader*), started and made ready before the clock:
   ``shardload-thread``   ``load_sharded(URL, None, ThreadedSession(N))``;
   ``shardload-process``  the same on ``ProcessSession(N)`` (a fork server and N workers);
   ``runai-streamer``     N rank processes, each streaming the whole file with
                          ``SafetensorsStreamer`` (``runai-model-streamer-s3`` / ``-gcs``) and
                          keeping its slice of every tensor: what each rank of vLLM's
                          ``--load-format runai_streamer`` does (s3 and gs only).
   With ``--overlap``, also the two halves a streamed load overlaps:
   ``fetch-only``         shardload's client fetching the whole file into memory (the GETs of
                          a load, nothing copied);
   ``local-thread``, ``local-process``  the same loads from the checkpoint's local folder
                          (page cache warm),
   and reads each shardload load's time against them: ``max(fetch, local)`` is what a load that
   overlaps fetching and copying completely takes, ``fetch + local`` one that does them in turn.
   ``--link-mbps`` sends the server's answers through one link of that bandwidth (the proxy
   paces them), as from a cloud: the fetch waits on the link, not on the cores.
   Every measured load runs, from the go to the loader's answer: the wall time; the bytes the
   server sent for the safetensors file (counted at the proxy, per key) and its GETs; the memory
   of the loader's process tree (the loader and all its descendants), sampled here every
   ``--sample-ms`` (``TreeSampler``): the peak of the summed ``RssAnon + RssShmem`` of
   ``/proc/<pid>/status``, and the peak of the summed ``Pss_Anon + Pss_Shmem`` of
   ``/proc/<pid>/smaps_rollup``; and the bytes the workers keep (their tensors, summed).
3. Prints the medians per scheme, method and N, and writes everything to ``--json``.

``--open-files F`` measures opening instead (issue 40, goal 4): a sharded checkpoint of ``F``
small safetensors files and its index (written once under ``--dir``), every request the proxy
answers delayed ``--latency-ms`` (default 20) as a distant service's is, opened
(``open_checkpoint`` and its metadata, nothing loaded) in a fresh process by ``open`` (the
headers fetched together, ``sources.store.each``) and ``open-one-at-a-time`` (the same requests
in turn: ``OPEN_CONCURRENCY = 1``, what opening did before). Prints the median seconds and the
requests per scheme and method::

    python benchmarks/bench_objects.py --open-files 200 --schemes s3,gs,az --runs 3

A local server measures request overhead, bytes and memory, not a cloud's bandwidth.
``benchmarks/README.md`` says how to install what each method needs and what each column means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# shardbench, and the checkout (this shardload before any installed one; devtools, the
# emulators); the loader processes get the checkout on PYTHONPATH too (``loader_env``)
sys.path[:0] = [HERE, REPO]

from shardbench import harness  # noqa: E402 - the common flags, medians, the JSON

from devtools.environments import environment  # noqa: E402 - where vLLM's environment is

SCRIPT = os.path.abspath(__file__)
BUCKET = "bench"
PREFIX = "ckpt/"
METHODS = ("shardload-thread", "shardload-process", "runai-streamer")
#: the methods of ``--open-files``: opening, headers fetched together and one at a time
OPEN_METHODS = ("open", "open-one-at-a-time")
#: where ``--open-files`` puts its checkpoint in the bucket
OPEN_PREFIX = "many/"
#: the two halves an object load overlaps, measured with ``--overlap``: fetching alone, and the
#: same load from the local folder
HALVES = ("fetch-only", "local-thread", "local-process")
SCHEMES = ("s3", "gs", "az")
#: the Run:ai backend module each scheme needs (Azure: not measured here, see the README)
RUNAI_BACKENDS = {"s3": "runai_model_streamer_s3", "gs": "runai_model_streamer_gcs"}
#: shardload's bound on the memory an object load keeps in flight (MiB), when it exists
WINDOW_ENV = "SHARDLOAD_OBJECT_WINDOW_MB"
MB = 1e6
#: the tree's memory is sampled this often
SAMPLE_MS = 20.0
#: the share of one CPU the PSS reads (``smaps_rollup`` walks every page table: about 3 ms per
#: GB resident) may take: after a read that took t, the next waits 1 / share - 1 times t
PSS_CPU_SHARE = 0.1
#: the tree's process list is read again every this many samples (processes start before the
#: go, so the list changes little during a load)
TREE_EVERY = 5
SETPRIV = shutil.which("setpriv")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ==== child processes: started, read, ended, none left behind ===================================


def spawn(argv: list[str], env: dict | None = None, group: bool = True) -> subprocess.Popen:
    """A child, killed by the kernel if this process dies first (``setpriv --pdeathsig``, from
    the main thread: the signal comes when the *thread* that started it ends); with ``group``,
    in a process group of its own (its descendants with it, so that ``end`` can stop them all,
    and a terminal's Ctrl-C reaches only this process, which decides), else in this one's."""
    if SETPRIV and threading.current_thread() is threading.main_thread():
        argv = [SETPRIV, "--pdeathsig", "KILL", "--", *argv]  # it execs argv: the same pid
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
        bufsize=1,
        start_new_session=group,
    )


class Lines:
    """A child's standard output, line by line, with a timeout on each line."""

    def __init__(self, proc: subprocess.Popen, what: str):
        self.proc, self.what = proc, what
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name=f"{what}-lines", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                self.queue.put(line)
        except (OSError, ValueError):
            pass
        self.queue.put(None)

    def get(self, timeout: float) -> str:
        try:
            line = self.queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.what}: no answer within {timeout:.0f} s") from None
        if line is None:
            self.queue.put(None)  # and at every later call
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            raise RuntimeError(
                f"{self.what} closed its output (exit status "
                f"{self.proc.returncode}) before answering"
            )
        return line.strip()

    def json(self, timeout: float) -> dict:
        while True:
            line = self.get(timeout)
            try:
                msg = json.loads(line)
            except ValueError:
                log(f"  {self.what}: {line}")  # a stray line on stdout: shown, skipped
                continue
            if isinstance(msg, dict) and "error" in msg:
                raise RuntimeError(f"{self.what}: {msg['error']}")
            return msg


def send(proc: subprocess.Popen, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def end(proc: subprocess.Popen, grace: float = 30.0, what: str = "child") -> None:
    """Let ``proc`` exit (its standard input closed) for ``grace`` seconds (0: not at all),
    then SIGKILL its process group: it and whatever it left behind. Its pgid stays reserved
    while any member lives, so this reaches no other process."""
    try:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    except OSError:
        pass
    if grace > 0:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            log(f"  {what} (pid {proc.pid}) did not exit within {grace:.0f} s: killed")
    try:
        os.killpg(proc.pid, 0)
        if grace > 0 and proc.returncode is not None:
            log(f"  {what} (pid {proc.pid}) left processes behind: killed")
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def protocol_out():
    """This process's answers to its parent: a copy of the standard output, the real one then
    pointed at the standard error, so that whatever a library prints cannot garble them."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def say(out, **msg: Any) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def exit_on_sigterm() -> None:
    """SIGTERM (and SIGHUP) end this process as Ctrl-C does: through its cleanup."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


# ==== the emulator, in a process of its own ====================================================


class ServerProcess:
    """``objectservers.make_server(scheme)`` (the emulator behind the counting proxy) in a
    process of its own, so that neither its memory nor its threads count with the loaders'.
    JSON lines on its standard input and output (``server_main``)."""

    def __init__(self, scheme: str, timeout: float = 180.0):
        self.scheme = scheme
        self.proc = spawn([sys.executable, SCRIPT, "--_server", scheme])
        self.lines = Lines(self.proc, f"{scheme} server")
        try:
            hello = self.lines.json(timeout)
        except BaseException:
            self.close()
            raise
        self.env: dict = hello["env"]
        self.endpoint: str = hello["endpoint"]

    def ask(self, *words: Any, timeout: float = 60.0) -> Any:
        send(self.proc, json.dumps(words))
        return self.lines.json(timeout).get("ok")

    def put(self, key: str, path: str) -> None:
        # a large object takes a while: moto and fake-gcs-server take it in one request
        self.ask("put", BUCKET, key, path, timeout=120 + os.path.getsize(path) / 5e6)

    def reset(self) -> None:
        self.ask("reset")

    def counts(self, key: str) -> dict:
        return self.ask("counts", key)

    def url(self, key: str = "") -> str:
        return f"{self.scheme}://{BUCKET}/{key}"

    def close(self) -> None:
        try:
            send(self.proc, json.dumps(["quit"]))
        except (OSError, ValueError):
            pass
        end(self.proc, 30, f"{self.scheme} server")

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def server_main(scheme: str) -> int:
    exit_on_sigterm()
    out = protocol_out()
    from devtools import objectservers

    try:
        srv = objectservers.make_server(scheme).start()
    except BaseException as exc:  # noqa: BLE001 - EmulatorMissing (not installed) too: said
        say(out, error=f"{type(exc).__name__}: {exc}")
        return 1
    try:
        say(out, env=srv.env(), endpoint=srv.endpoint)
        for line in sys.stdin:
            cmd, *args = json.loads(line)
            try:
                if cmd == "quit":
                    break
                if cmd == "put":
                    bucket, key, path = args
                    srv.make_bucket(bucket)
                    with open(path, "rb") as f:
                        data = f.read()
                    srv.put(bucket, key, data)
                    del data
                    say(out, ok=True)
                elif cmd == "link":
                    srv.set_link(float(args[0]))
                    say(out, ok=True)
                elif cmd == "reset":
                    srv.reset_counts()
                    say(out, ok=True)
                elif cmd == "latency":
                    # every request, of an object (key) or not (a listing: key ""), waits
                    for rule_key in (None, ""):
                        srv.inject(
                            "delay", seconds=float(args[0]), times=None, method=None, key=rule_key
                        )
                    say(out, ok=True)
                elif cmd == "requests":
                    say(
                        out,
                        ok={
                            "requests": len(srv.requests()),
                            "gets": len(srv.requests(method="GET")),
                        },
                    )
                elif cmd == "counts":
                    (key,) = args
                    gets = [r for r in srv.requests(key, "GET") if r.data]
                    say(
                        out,
                        ok={
                            "sent": srv.bytes_sent(key),
                            "total": srv.bytes_sent(),
                            "gets": len(gets),
                        },
                    )
                else:
                    say(out, error=f"unknown command {cmd!r}")
            except Exception as exc:  # noqa: BLE001 - answered, the server goes on
                say(out, error=f"{cmd}: {type(exc).__name__}: {exc}")
    finally:
        srv.close()
    return 0


# ==== memory of a process tree ==================================================================


def tree(root: int) -> list[int]:
    """``root`` and all its descendants now (``/proc/PID/task/TID/children``: every thread's
    children, whichever thread started them)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(x) for x in f.read().split())
            except OSError:
                pass
    return pids


def status_bytes(pid: int) -> tuple[int, int] | None:
    """(RssAnon, RssShmem) of ``pid`` in bytes; None for a process that is gone."""
    anon = shmem = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith(b"RssShmem:"):
                    shmem = int(line.split()[1]) * 1024
                    break  # after RssAnon and RssFile
    except OSError:
        return None
    return anon, shmem


def pss_bytes(pid: int) -> int:
    """Pss_Anon + Pss_Shmem of ``pid`` in bytes (0 for a process that is gone)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith((b"Pss_Anon:", b"Pss_Shmem:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


def cpu_seconds(pids: list[int]) -> float:
    """The CPU time (user + system, all threads) the processes ``pids`` have used so far."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds every core of the machine has been busy, since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class TreeSampler:
    """The memory of a process tree (``root`` and its descendants), sampled from a thread of
    this process (not in the tree) every ``interval`` seconds between ``begin`` and ``end``:

    * ``peak``: the largest sum over the tree of ``RssAnon + RssShmem`` (``/proc/PID/status``:
      counters, cheap to read). A page mapped by several processes of the tree counts once in
      each: the workers a fork server forked share its pages copy-on-write, and a memory file
      mapped by the loader and its workers is in both: an upper bound;
    * ``pss_peak``: the largest sum of ``Pss_Anon + Pss_Shmem`` (``/proc/PID/smaps_rollup``),
      where a page mapped by k processes counts 1/k in each, so the sum over a tree that holds
      all its sharers counts it once: the memory the tree takes. Reading it walks the page
      tables, so it is read only when the cheap sum exceeds the PSS peak so far (PSS <= RSS: no
      other sample can raise it) and at most ``PSS_CPU_SHARE`` of a CPU's time; and always at
      ``begin`` and ``end``.
    """

    def __init__(self, root: int, interval: float):
        self.root, self.interval = root, interval
        self.pids = tree(root)
        self.peak = self.pss_peak = 0
        self.peak_processes: list = []
        self.samples = self.pss_samples = 0
        self._next_pss = 0.0
        self._count = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self, force_pss: bool = False) -> tuple[int, int]:
        """One sample: (sum of RssAnon + RssShmem, sum of PSS or -1 when not read)."""
        self._count += 1
        if self._count % TREE_EVERY == 0:
            self.pids = tree(self.root)
        per = [(pid, status_bytes(pid)) for pid in self.pids]
        per = [(pid, s) for pid, s in per if s is not None]
        total = sum(a + s for _, (a, s) in per)
        pss = -1
        now = time.monotonic()
        if force_pss or (total > self.pss_peak and now >= self._next_pss):
            pss = sum(pss_bytes(pid) for pid, _ in per)
            took = time.monotonic() - now
            self._next_pss = now + took / PSS_CPU_SHARE
            self.pss_samples += 1
        with self._lock:
            self.samples += 1
            if total > self.peak:
                self.peak = total
                self.peak_processes = [
                    {"pid": pid, "comm": comm(pid), "anon": a, "shmem": s} for pid, (a, s) in per
                ]
            self.pss_peak = max(self.pss_peak, pss)
        return total, pss

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def begin(self) -> tuple[int, int]:
        """The tree's memory now (RSS sum, PSS sum), and sampling from now on."""
        self.pids = tree(self.root)
        base = self._sample(force_pss=True)
        self._thread = threading.Thread(target=self._loop, name="tree-sampler", daemon=True)
        self._thread.start()
        return base

    def end(self) -> tuple[int, int]:
        """Sampling stopped, after a last sample (of the end state: every kept tensor alive)."""
        self.stop()
        return self._sample(force_pss=True)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


# ==== the loader: one measured load, in a fresh process ========================================

#: a Run:ai rank: streams the whole file (``SafetensorsStreamer``, as vLLM's ``runai_streamer``
#: load format does), keeps its slice of every tensor (``chunk(n)[rank]`` of the first axis,
#: cloned: the narrowing vLLM's weight loaders do), answers, and keeps them until told to end
RANK = """\
import sys, torch
from runai_model_streamer import SafetensorsStreamer
rank, n = int(sys.argv[1]), int(sys.argv[2])
print('ready', flush=True)
url = sys.stdin.readline().strip()
kept = {}
with SafetensorsStreamer() as streamer:
    streamer.stream_file(url, device='cpu')
    for name, t in streamer.get_tensors():
        parts = t.chunk(n) if t.dim() else (t,)
        kept[name] = parts[min(rank, len(parts) - 1)].clone()
print('done', sum(v.numel() * v.element_size() for v in kept.values()), flush=True)
sys.stdin.read()
"""


def load_main(method: str, n: int, url: str, runai_python: str) -> int:
    """The loader's side: start (the session, or Run:ai's ranks), say ``ready``, wait for
    ``go``, load, say what was kept, wait for ``exit``, end."""
    exit_on_sigterm()
    out = protocol_out()
    try:
        if method == "runai-streamer":
            return runai_load(n, url, runai_python, out)
        if method == "fetch-only":
            return fetch_only(url, out)
        if method in OPEN_METHODS:
            return open_only(method, url, out)
        return shardload_load(method, n, url, out)
    except BaseException as exc:
        say(out, error=f"{type(exc).__name__}: {exc}")
        raise


def shardload_load(method: str, n: int, url: str, out) -> int:
    from shardload import ProcessSession, ThreadedSession, load_sharded

    threads = method in ("shardload-thread", "local-thread")
    session = (ThreadedSession if threads else ProcessSession)(n)
    with session:
        say(out, ready=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        start = time.perf_counter()
        sharded = load_sharded(url, None, session, progress=False)
        seconds = time.perf_counter() - start
        per_worker = list(sharded.stats.bytes_per_worker)
        say(out, seconds=seconds, kept=sum(per_worker), kept_per_worker=per_worker)
        sys.stdin.readline()  # "exit", or the harness gone
        del sharded
    return 0


def fetch_only(url: str, out) -> int:
    """The object's bytes fetched into memory by shardload's client (its GETs, in place, on
    its threads), nothing else done with them."""
    import mmap

    from shardload.sources.store import default_client

    client = default_client()
    say(out, ready=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    start = time.perf_counter()
    info = client.head(url)
    held = mmap.mmap(-1, max(1, info.size))
    with memoryview(held) as into:
        client.fetch(info, [(0, info.size)], into=into)
    seconds = time.perf_counter() - start
    say(out, seconds=seconds, kept=0, kept_per_worker=[])
    sys.stdin.readline()
    held.close()
    return 0


def open_only(method: str, url: str, out) -> int:
    """``open_checkpoint(url)`` and its metadata, nothing loaded: ``open`` fetches the headers
    together, ``open-one-at-a-time`` one after another (what opening did before)."""
    from shardload import open_checkpoint
    from shardload.sources import store

    if method == "open-one-at-a-time":
        store.OPEN_CONCURRENCY = 1
    say(out, ready=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    start, cpu = time.perf_counter(), time.process_time()
    with open_checkpoint(url) as ckpt:
        tensors = len(ckpt.metadata())
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    say(out, seconds=seconds, cpu_seconds=cpu, kept=0, kept_per_worker=[], tensors=tensors)
    sys.stdin.readline()
    return 0


def write_many_files(folder: str, files: int) -> str:
    """A sharded checkpoint of ``files`` small safetensors files (six tensors each, as a
    layer's) and its index, under ``folder`` (once); its path."""
    import numpy as np
    from safetensors.numpy import save_file

    path = os.path.join(folder, f"open-{files}-files")
    done = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(done):
        return path
    os.makedirs(path, exist_ok=True)
    weight_map = {}
    for k in range(files):
        name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        tensors = {
            f"model.layers.{k}.{part}": np.full(shape, k % 7, dtype=np.float16)
            for part, shape in (
                ("self_attn.q_proj.weight", (64, 64)),
                ("self_attn.k_proj.weight", (16, 64)),
                ("self_attn.v_proj.weight", (16, 64)),
                ("self_attn.o_proj.weight", (64, 64)),
                ("mlp.down_proj.weight", (64, 128)),
                ("input_layernorm.weight", (64,)),
            )
        }
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": files}, f)
    with open(done + ".tmp", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    os.replace(done + ".tmp", done)
    return path


def run_open(args: argparse.Namespace) -> int:
    """``--open-files``: the open of a checkpoint of many small files, per scheme and method
    (see the module docstring)."""
    bench = harness.Bench("bench_objects", args)
    schemes = [s for s in args.schemes.split(",") if s]
    latency = 20.0 if args.latency_ms is None else args.latency_ms
    folder = write_many_files(os.path.abspath(args.dir or harness.default_dir()), args.open_files)
    names = sorted(os.listdir(folder))
    log(f"checkpoint: {args.open_files} files, {folder}; latency {latency:g} ms a request")
    records: list[dict] = []
    for scheme in schemes:
        try:
            server = ServerProcess(scheme)
        except (RuntimeError, TimeoutError) as exc:
            log(f"{scheme}: skipped: {exc}")
            continue
        with server:
            for name in names:
                server.put(OPEN_PREFIX + name, os.path.join(folder, name))
            server.ask("latency", latency / 1000)
            env = loader_env(server, args)
            for r, method in harness.rounds(OPEN_METHODS, args.runs):
                proc = spawn(
                    [sys.executable, SCRIPT, "--_load", method, "1", server.url(OPEN_PREFIX)],
                    env=env,
                )
                lines = Lines(proc, f"{scheme} {method}")
                try:
                    lines.json(600)
                    server.reset()
                    send(proc, "go")
                    result = lines.json(args.timeout)
                    counts = server.ask("requests")
                    send(proc, "exit")
                    rec = {
                        "scheme": scheme,
                        "method": method,
                        "run": r + 1,
                        "seconds": result["seconds"],
                        "cpu_seconds": result["cpu_seconds"],
                        "tensors": result["tensors"],
                        **counts,
                    }
                except (RuntimeError, TimeoutError, OSError) as exc:
                    rec = {"scheme": scheme, "method": method, "run": r + 1, "failed": str(exc)}
                finally:
                    end(proc, 10, f"{scheme} {method}")
                records.append(rec)
                log(
                    f"  {scheme} run {r + 1} {method:20s} "
                    + (
                        f"FAILED: {rec['failed']}"
                        if "failed" in rec
                        else f"{rec['seconds']:6.3f} s  (opener's CPU {rec['cpu_seconds']:.3f} s)  "
                        f"{rec['requests']} requests"
                    )
                )
    print(
        f"open of {args.open_files} files, {latency:g} ms a request; medians of {args.runs} run(s)"
    )
    print(
        f"{'scheme':6s} {'method':20s} {'open s':>7s} {'CPU s':>6s} {'requests':>8s} "
        f"{'tensors':>7s}"
    )
    rows = []
    for scheme in schemes:
        for method in OPEN_METHODS:
            ok = [
                r
                for r in records
                if r["scheme"] == scheme and r["method"] == method and "failed" not in r
            ]
            if not ok:
                continue
            row = {
                "scheme": scheme,
                "method": method,
                "runs": ok,
                "seconds": harness.median(r["seconds"] for r in ok),
                "cpu_seconds": harness.median(r["cpu_seconds"] for r in ok),
                "requests": harness.median(r["requests"] for r in ok),
                "tensors": ok[0]["tensors"],
            }
            rows.append(row)
            print(
                f"{scheme:6s} {method:20s} {row['seconds']:7.3f} {row['cpu_seconds']:6.3f} "
                f"{row['requests']:8.0f} {row['tensors']:7d}"
            )
    print(
        "(open s: open_checkpoint and its metadata, in a fresh process; CPU s: that "
        "process's; requests: all the proxy answered)"
    )
    bench.write(
        {
            "open_files": args.open_files,
            "latency_ms": latency,
            "schemes": schemes,
            "runs": args.runs,
            "results": rows,
        }
    )
    return 0


def runai_load(n: int, url: str, python: str, out) -> int:
    # in the loader's process group: ended with it
    ranks = [spawn([python, "-c", RANK, str(r), str(n)], group=False) for r in range(n)]
    done = False
    try:
        lines = [Lines(p, f"Run:ai rank {r}") for r, p in enumerate(ranks)]
        for line in lines:
            if line.get(600) != "ready":
                raise RuntimeError(f"{line.what} did not start")
        say(out, ready=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        start = time.perf_counter()
        for p in ranks:
            send(p, url)
        per_rank = []
        for line in lines:
            answer = line.get(24 * 3600).split()
            if not answer or answer[0] != "done":
                raise RuntimeError(f"{line.what} failed: {' '.join(answer)}")
            per_rank.append(int(answer[1]))
        seconds = time.perf_counter() - start
        say(out, seconds=seconds, kept=sum(per_rank), kept_per_worker=per_rank)
        sys.stdin.readline()
        done = True
    finally:
        for p in ranks:  # after a failure, at once: the others may still be streaming
            end_rank(p, 30 if done else 0)
    return 0


def end_rank(proc: subprocess.Popen, grace: float) -> None:
    """A Run:ai rank: its standard input closed, it exits; killed if it has not in ``grace``
    seconds."""
    try:
        proc.stdin.close()
    except OSError:
        pass
    if grace > 0:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


# ==== the benchmark ===============================================================================


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument(
        "--schemes", default="s3,gs", help="of s3, gs, az (az: shardload only) (default s3,gs)"
    )
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--shards", default="1,2,4,8")
    harness.add_common(
        ap,
        runs=2,
        json_help="write everything as JSON here",
        dir=True,
        dir_help="where the checkpoint is cached (default ~/.cache/shardload-bench)",
        figures=True,
    )
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--window-mb",
        type=float,
        default=None,
        help=f"shardload's object window, passed as ${WINDOW_ENV}",
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="also measure fetch-only and the local load, and read each load's time against them",
    )
    ap.add_argument(
        "--link-mbps",
        type=float,
        default=0.0,
        help="the server's answers share one link of this many MB/s (default: "
        "as fast as the machine)",
    )
    ap.add_argument(
        "--runai-python",
        default=None,
        help="the interpreter of Run:ai's ranks (default: the vLLM venv's, "
        "scripts/vllm-env.sh, where it exists; else this one)",
    )
    ap.add_argument(
        "--open-files",
        type=int,
        default=0,
        metavar="F",
        help="measure opening a checkpoint of F small files instead (see above)",
    )
    ap.add_argument(
        "--latency-ms",
        type=float,
        default=None,
        help="with --open-files: every request the proxy answers waits this long (default 20)",
    )
    ap.add_argument("--sample-ms", type=float, default=SAMPLE_MS)
    ap.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds one load may take before it is killed and counted failed",
    )
    # the child processes' entries
    ap.add_argument("--_server", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_load", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    harness.check_runs(ap, args)
    return args


def default_runai_python() -> str:
    return environment("vllm").find() or sys.executable


def runai_check(python: str, scheme: str) -> tuple[str | None, str | None]:
    """(Run:ai's version, None) when ``python`` has it and its ``scheme`` backend, else (None,
    why not)."""
    backend = RUNAI_BACKENDS.get(scheme)
    if backend is None:
        return None, f"not measured for {scheme}:// here (s3 and gs only)"
    code = (
        "import importlib.metadata as m, runai_model_streamer, "
        + backend
        + "; print(m.version('runai-model-streamer'))"
    )
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python}: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{python} does not import runai_model_streamer and {backend}: {last}"
    return done.stdout.strip(), None


def loader_env(server: ServerProcess, args: argparse.Namespace) -> dict:
    """The loader's environment: this one without any cloud setting of its own, plus the
    emulator's (obstore's, botocore's), Run:ai's for the scheme, and the window."""
    from devtools.objectservers import is_cloud_setting

    env = {k: v for k, v in os.environ.items() if not is_cloud_setting(k)}
    env.update(server.env)
    if server.scheme == "s3":
        # the Run:ai streamer's S3 client: path-style addressing on a local endpoint
        env.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
    elif server.scheme == "gs":
        # google-cloud-cpp (Run:ai's GCS backend) reads its emulator's endpoint from here, and
        # then signs nothing (anonymous credentials)
        env["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = server.endpoint
    if args.window_mb is not None:
        env[WINDOW_ENV] = f"{args.window_mb:g}"
    # the checkout first, for the loader
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    return env


def measure(
    server: ServerProcess,
    env: dict,
    method: str,
    n: int,
    args: argparse.Namespace,
    runai_python: str,
    key: str,
    local: str,
) -> dict:
    """One load in a fresh loader process: its record (``failed`` with the reason if it
    failed)."""
    url = (
        server.url(key)
        if method in ("runai-streamer", "fetch-only")
        else local
        if method.startswith("local-")
        else server.url(PREFIX)
    )
    proc = spawn(
        [sys.executable, SCRIPT, "--_load", method, str(n), url, "--runai-python", runai_python],
        env=env,
    )
    lines = Lines(proc, f"{method} N={n}")
    sampler: TreeSampler | None = None
    grace = 60.0
    try:
        lines.json(600)  # ready: the session's workers, or the ranks, started
        server.reset()
        sampler = TreeSampler(proc.pid, args.sample_ms / 1000)
        base, base_pss = sampler.begin()
        servers = tree(server.proc.pid)
        cpu0 = cpu_seconds(sampler.pids) + cpu_seconds(servers)
        busy0, wall0 = machine_busy(), time.monotonic()
        send(proc, "go")
        result = lines.json(args.timeout)
        busy, wall = machine_busy() - busy0, time.monotonic() - wall0
        cpu = cpu_seconds(tree(proc.pid)) + cpu_seconds(servers) - cpu0
        end_rss, end_pss = sampler.end()
        counts = server.counts(key)
        send(proc, "exit")
        return {
            "seconds": result["seconds"],
            "sent_bytes": counts["sent"],
            "sent_total_bytes": counts["total"],
            "gets": counts["gets"],
            "kept_bytes": result["kept"],
            "kept_per_worker": result["kept_per_worker"],
            "base_bytes": base,
            "peak_bytes": sampler.peak,
            "end_bytes": end_rss,
            "base_pss_bytes": base_pss,
            "peak_pss_bytes": sampler.pss_peak,
            "end_pss_bytes": end_pss,
            "processes": len(sampler.pids),
            "peak_processes": sampler.peak_processes,
            "samples": sampler.samples,
            "pss_samples": sampler.pss_samples,
            "cpu_seconds": cpu,
            "machine_busy": busy / (wall * (os.cpu_count() or 1)),
        }
    except (RuntimeError, TimeoutError, OSError) as exc:
        grace = 0.0  # a failed load's processes may still be busy: killed at once
        return {"failed": str(exc)}
    except BaseException:
        grace = 0.0  # Ctrl-C, SIGTERM: at once
        raise
    finally:
        if sampler is not None:
            sampler.stop()
        end(proc, grace, f"{method} N={n} loader")


def summarize(records: list[dict]) -> list[dict]:
    """One row per (scheme, method, N): the medians of its runs that did not fail."""
    rows: dict[tuple, dict] = {}
    for rec in records:
        row = rows.setdefault(
            (rec["scheme"], rec["method"], rec["n"]),
            {"scheme": rec["scheme"], "method": rec["method"], "n": rec["n"], "runs": []},
        )
        row["runs"].append(rec)
    out = []
    for row in rows.values():
        ok = [r for r in row["runs"] if "failed" not in r]
        row["failed_runs"] = len(row["runs"]) - len(ok)
        for field in (
            "seconds",
            "sent_bytes",
            "sent_total_bytes",
            "gets",
            "kept_bytes",
            "base_bytes",
            "peak_bytes",
            "end_bytes",
            "base_pss_bytes",
            "peak_pss_bytes",
            "end_pss_bytes",
            "cpu_seconds",
            "machine_busy",
        ):
            row[field] = harness.median(r.get(field) for r in ok)
        out.append(row)
    return out


def print_table(rows: list[dict], file_bytes: int) -> None:
    print(
        f"{'scheme':6s} {'method':17s} {'N':>2s} {'time s':>7s} {'sent MB':>8s} "
        f"{'x file':>6s} {'GETs':>5s} {'kept MB':>8s} {'base MB':>8s} {'peak MB':>8s} "
        f"{'PSS MB':>8s} {'load MB':>8s} {'load/kept':>9s}"
    )
    for r in rows:
        lead = f"{r['scheme']:6s} {r['method']:17s} {r['n']:2d}"
        if r["seconds"] is None:
            why = r["runs"][-1].get("failed", "?")
            print(f"{lead}   failed every run: {why[:100]}")
            continue
        load = r["peak_pss_bytes"] - r["base_pss_bytes"]
        print(
            f"{lead} {r['seconds']:7.2f} {r['sent_bytes'] / MB:8.1f} "
            f"{r['sent_bytes'] / file_bytes:5.2f}x {r['gets']:5.0f} "
            f"{r['kept_bytes'] / MB:8.1f} {r['base_pss_bytes'] / MB:8.1f} "
            f"{r['peak_bytes'] / MB:8.1f} {r['peak_pss_bytes'] / MB:8.1f} {load / MB:8.1f} "
            f"{load / max(r['kept_bytes'], 1):8.2f}x"
            + (f"  ({r['failed_runs']} failed)" if r["failed_runs"] else "")
        )


def print_overlap(rows: list[dict]) -> None:
    """Each shardload load's time against its halves: ``/max`` near 1 is a load that fetches
    and copies at once; ``/sum`` near 1 one that does them in turn."""
    by = {(r["scheme"], r["method"], r["n"]): r for r in rows if r["seconds"] is not None}
    cores = os.cpu_count() or 1
    print(
        f"{'scheme':6s} {'method':17s} {'N':>2s} {'time s':>7s} {'fetch s':>7s} "
        f"{'local s':>7s} {'/max':>6s} {'/sum':>6s} {'cpu s':>6s} {'fetch+local cpu s':>17s} "
        f"{'busy':>5s}"
    )
    for (scheme, method, n), row in by.items():
        if not method.startswith("shardload-"):
            continue
        fetch = by.get((scheme, "fetch-only", n))
        local = by.get((scheme, method.replace("shardload-", "local-"), n))
        if fetch is None or local is None:
            continue
        t, f, lo = row["seconds"], fetch["seconds"], local["seconds"]
        print(
            f"{scheme:6s} {method:17s} {n:2d} {t:7.2f} {f:7.2f} {lo:7.2f} "
            f"{t / max(f, lo):6.2f} {t / (f + lo):6.2f} {row['cpu_seconds']:6.2f} "
            f"{fetch['cpu_seconds'] + local['cpu_seconds']:17.2f} "
            f"{row['machine_busy']:5.0%}"
        )
    print(
        f"(cpu s: the loader's and the server's processes, user + system; busy: the share "
        f"of the machine's {cores} cores busy during the load, whoever used them)"
    )


def run(args: argparse.Namespace) -> int:
    """The benchmark for the parsed flags (this process: the harness of the children)."""
    from shardbench.checkpoints import (
        MODEL_FILE,
        PLAN_FILE,
        choose_geometry,
        default_dir,
        ensure_checkpoint,
    )
    from shardbench.figures import draw_objects

    bench = harness.Bench("bench_objects", args)

    schemes = [s for s in args.schemes.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    for bad in [s for s in schemes if s not in SCHEMES] + [
        m for m in methods if m not in METHODS + HALVES
    ]:
        raise SystemExit(f"unknown scheme or method {bad!r}")
    if args.overlap:
        methods += [m for m in HALVES if m not in methods]
    shards = [int(x) for x in args.shards.split(",") if x.strip()]
    runai_python = args.runai_python or default_runai_python()
    geom = choose_geometry(args.size_gb)
    folder, made, made_s = ensure_checkpoint(os.path.abspath(args.dir or default_dir()), geom)
    file_bytes = os.path.getsize(os.path.join(folder, MODEL_FILE))
    if made:
        log(f"wrote the checkpoint in {made_s:.1f} s: {folder}")
    log(f"checkpoint: {file_bytes / MB:.1f} MB, {geom.tensors} tensors ({folder})")
    key = PREFIX + MODEL_FILE
    records: list[dict] = []
    skipped: dict[str, str] = {}
    runai_version = None
    for scheme in schemes:
        here = list(methods)
        if "runai-streamer" in here:
            version, why = runai_check(runai_python, scheme)
            runai_version = version or runai_version
            if why:
                skipped[f"{scheme}:runai-streamer"] = why
                log(f"{scheme}: runai-streamer skipped: {why}")
                here.remove("runai-streamer")
        if not here:
            continue
        log(f"{scheme}: starting the emulator and uploading")
        try:
            server = ServerProcess(scheme)
        except (RuntimeError, TimeoutError) as exc:
            skipped[scheme] = str(exc)
            log(f"{scheme}: skipped: {exc}")
            continue
        with server:
            try:
                for name in ("config.json", MODEL_FILE, PLAN_FILE):
                    server.put(PREFIX + name, os.path.join(folder, name))
            except (RuntimeError, TimeoutError, OSError) as exc:
                skipped[scheme] = f"the upload failed: {exc}"
                log(f"{scheme}: skipped: the upload failed: {exc}")
                continue
            env = loader_env(server, args)
            if args.link_mbps:
                server.ask("link", args.link_mbps * MB)
            log(
                f"{scheme}: server {server.endpoint}"
                + (f", link {args.link_mbps:g} MB/s" if args.link_mbps else "")
            )
            for n in shards:
                for r, method in harness.rounds(here, args.runs):
                    rec = {
                        "scheme": scheme,
                        "method": method,
                        "n": n,
                        "run": r + 1,
                        **measure(server, env, method, n, args, runai_python, key, folder),
                    }
                    records.append(rec)
                    if "failed" in rec:
                        log(f"  {scheme} N={n} run {r + 1} {method:17s} FAILED: {rec['failed']}")
                    else:
                        log(
                            f"  {scheme} N={n} run {r + 1} {method:17s} "
                            f"{rec['seconds']:7.2f} s  sent {rec['sent_bytes'] / MB:8.1f} MB"
                            f"  peak {rec['peak_bytes'] / MB:8.1f} MB  PSS "
                            f"{rec['peak_pss_bytes'] / MB:8.1f} MB  kept "
                            f"{rec['kept_bytes'] / MB:8.1f} MB"
                        )
    rows = summarize(records)
    print(
        f"file {file_bytes / MB:.1f} MB; medians of {args.runs} run(s); window "
        f"{'unset' if args.window_mb is None else f'{args.window_mb:g} MiB'}; link "
        f"{f'{args.link_mbps:g} MB/s' if args.link_mbps else 'unlimited'}"
    )
    print_table(rows, file_bytes)
    if args.overlap:
        print_overlap(rows)
    for what, why in skipped.items():
        print(f"skipped {what}: {why}")
    if args.json or args.figures:
        report = {
            "size_gb": args.size_gb,
            "file_bytes": file_bytes,
            "tensors": geom.tensors,
            "checkpoint": folder,
            "schemes": schemes,
            "methods": methods,
            "shards": shards,
            "runs": args.runs,
            "window_mb": args.window_mb,
            "link_mbps": args.link_mbps,
            "object_settings": {
                k: v for k, v in os.environ.items() if k.startswith("SHARDLOAD_OBJECT_")
            }
            | ({WINDOW_ENV: f"{args.window_mb:g}"} if args.window_mb is not None else {}),
            "runai_settings": {
                k: v for k, v in os.environ.items() if k.startswith("RUNAI_STREAMER_")
            },
            "runai_python": runai_python,
            "runai_version": runai_version,
            "memory": {
                "sample_ms": args.sample_ms,
                "pss_cpu_share": PSS_CPU_SHARE,
                "peak": "max over samples of the sum over the tree of RssAnon + "
                "RssShmem (/proc/PID/status)",
                "pss": "max of the sum of Pss_Anon + Pss_Shmem (/proc/PID/smaps_rollup)",
            },
            "machine": {
                "cpus": os.cpu_count(),
                "kernel": platform.release(),
                "python": platform.python_version(),
            },
            "skipped": skipped,
            "results": rows,
        }
        bench.finish(report, draw_objects)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._server:
        return server_main(args._server)
    if args._load:
        method, n, url = args._load
        return load_main(method, int(n), url, args.runai_python or sys.executable)
    exit_on_sigterm()
    try:
        return run_open(args) if args.open_files else run(args)
    except KeyboardInterrupt:  # every child already ended by the cleanup on the way here
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
