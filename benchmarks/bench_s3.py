#!/usr/bin/env python
"""Benchmark: a checkpoint loaded from S3 onto N workers, shardload against the Run:ai
Model Streamer, both reading from the same local S3 server.

    python benchmarks/bench_s3.py [--size-gb 0.25] [--shards 1,2,4,8] [--runs 2] [--json F]

1. Writes (once, cached) the GPTQ Llama checkpoint of ``bench_load.py`` at ``--size-gb``,
   starts moto's S3 server on 127.0.0.1 behind the tests' counting proxy
   (``tests/helpers/s3server.py``), in a process of its own, and uploads the checkpoint.
2. For each N, alternating the methods ``--runs`` times, measures the wall time and the bytes
   the server sent (counted at the server, not by the loaders):
   ``shardload-thread``   ``load_sharded("s3://...")`` on a started ``ThreadedSession(N)``;
   ``shardload-process``  the same on a started ``ProcessSession(N)``;
   ``runai-streamer``     N started processes, each streaming the whole file with
                          ``SafetensorsStreamer`` from ``s3://`` (``runai-model-streamer-s3``)
                          and keeping its slice of every tensor: what each rank of vLLM's
                          ``--load-format runai_streamer`` does (``RunaiRanks``).
3. Prints medians, bytes per worker, and the ratios to ``runai-streamer``.

A local server measures request overhead and bytes, not a cloud's bandwidth: the bytes are the
primary figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

from shardbench.checkpoints import (MODEL_FILE, PLAN_FILE, choose_geometry,  # noqa: E402
                                    default_dir, ensure_checkpoint)

BUCKET = "bench"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.25)
    ap.add_argument("--shards", default="1,2,4,8")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--methods", default="shardload-thread,shardload-process,runai-streamer")
    return ap.parse_args(argv)


class ServerProcess:
    """``S3Server`` (moto behind the counting proxy) in a process of its own, so that its
    Python threads do not share a GIL with the loaders measured. A line protocol on its
    standard input and output: ``reset``; ``sent KEY`` answers the body bytes sent for KEY."""

    CHILD = ("import sys, json; sys.path[:0] = [sys.argv[1]]\n"
             "from helpers import s3server\n"
             "with s3server.S3Server() as srv:\n"
             "    print(json.dumps(srv.aws_env()), flush=True)\n"
             "    for line in sys.stdin:\n"
             "        cmd, _, arg = line.strip().partition(' ')\n"
             "        if cmd == 'reset': srv.reset_counts(); print('ok', flush=True)\n"
             "        elif cmd == 'sent': print(srv.bytes_sent(arg), flush=True)\n"
             "        else: break\n")

    def __init__(self) -> None:
        import subprocess

        tests = os.path.join(os.path.dirname(HERE), "tests")
        self.proc = subprocess.Popen([sys.executable, "-c", self.CHILD, tests],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.env = json.loads(self.proc.stdout.readline())
        self.endpoint = self.env["AWS_ENDPOINT_URL"]

    def _ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def reset_counts(self) -> None:
        self._ask("reset")

    def bytes_sent(self, key: str) -> int:
        return int(self._ask(f"sent {key}"))

    def client(self):
        import botocore.session

        return botocore.session.Session().create_client("s3")

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


class RunaiRanks:
    """N processes, one per rank as vLLM runs its tensor-parallel ranks, each streaming the
    file with the Run:ai streamer (``SafetensorsStreamer``, as vLLM's ``runai_streamer`` load
    format does) and keeping its rank's slice of every tensor (``chunk(n)[rank]`` of the first
    axis, cloned: the narrowing vLLM's weight loaders do). Started before the clock: ``load``
    times a load from the word go to every rank's answer. (Several streamers in the threads of
    one process crash the streamer's native library at N = 4 here.)"""

    CHILD = ("import sys, torch\n"
             "from runai_model_streamer import SafetensorsStreamer\n"
             "rank, n = int(sys.argv[1]), int(sys.argv[2])\n"
             "print('ready', flush=True)\n"
             "for line in sys.stdin:\n"
             "    kept = {}\n"
             "    with SafetensorsStreamer() as streamer:\n"
             "        streamer.stream_file(line.strip(), device='cpu')\n"
             "        for name, t in streamer.get_tensors():\n"
             "            kept[name] = (t.chunk(n)[min(rank, len(t.chunk(n)) - 1)].clone()\n"
             "                          if t.dim() else t.clone())\n"
             "    print('done', sum(v.numel() * v.element_size() for v in kept.values()),\n"
             "          flush=True)\n")

    def __init__(self, n: int) -> None:
        import subprocess

        self.procs = [subprocess.Popen([sys.executable, "-c", self.CHILD, str(r), str(n)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, text=True)
                      for r in range(n)]
        for p in self.procs:
            if p.stdout.readline().strip() != "ready":
                self.close()
                raise RuntimeError("a Run:ai rank did not start")

    def load(self, url: str) -> int:
        """The bytes the ranks keep."""
        for p in self.procs:
            p.stdin.write(url + "\n")
            p.stdin.flush()
        kept = 0
        for rank, p in enumerate(self.procs):
            answer = p.stdout.readline().split()
            if not answer or answer[0] != "done":
                raise RuntimeError(f"Run:ai rank {rank} failed (exit {p.poll()})")
            kept += int(answer[1])
        return kept

    def close(self, kill: bool = False) -> None:
        """End the ranks: at once with ``kill`` (after a failed load, whose other ranks may
        still be streaming and would weigh on the next measurement)."""
        for p in self.procs:
            if kill:
                p.kill()
            elif p.stdin:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(30)
            except Exception:  # noqa: BLE001 - a rank that does not end is killed
                p.kill()
                p.wait()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from shardload import ProcessSession, ThreadedSession, load_sharded

    geom = choose_geometry(args.size_gb)
    folder, _, _ = ensure_checkpoint(os.path.abspath(default_dir()), geom)
    file_bytes = os.path.getsize(os.path.join(folder, MODEL_FILE))
    results = []
    with ServerProcess() as server:
        os.environ.update(server.env)
        # the Run:ai streamer's S3 client: path-style addressing on a local endpoint
        os.environ.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        for name in ("config.json", MODEL_FILE, PLAN_FILE):
            with open(os.path.join(folder, name), "rb") as f:
                client.put_object(Bucket=BUCKET, Key=f"ckpt/{name}", Body=f.read())
        url = f"s3://{BUCKET}/ckpt/"
        methods = args.methods.split(",")
        print(f"checkpoint: {file_bytes / 1e9:.2f} GB, {geom.tensors} tensors; server "
              f"{server.endpoint}", file=sys.stderr)
        for n in [int(x) for x in args.shards.split(",")]:
            sessions = {}
            if "shardload-thread" in methods:
                sessions["shardload-thread"] = ThreadedSession(n)
            if "shardload-process" in methods:
                sessions["shardload-process"] = ProcessSession(n)
            if "runai-streamer" in methods:
                sessions["runai-streamer"] = RunaiRanks(n)
            try:
                times: dict[str, list[float]] = {m: [] for m in methods}
                sent: dict[str, list[int]] = {m: [] for m in methods}
                kept: dict[str, int] = {}
                for r in range(args.runs):
                    order = methods[r % len(methods):] + methods[:r % len(methods)]
                    for method in order:
                        server.reset_counts()
                        start = time.perf_counter()
                        if method == "runai-streamer":
                            try:
                                kept[method] = sessions[method].load(url + MODEL_FILE)
                            except RuntimeError as exc:  # recorded, and the others go on
                                print(f"  N={n} run {r + 1} {method}: {exc}", file=sys.stderr)
                                sessions[method].close(kill=True)
                                sessions[method] = RunaiRanks(n)
                                continue
                        else:
                            sharded = load_sharded(url, None, sessions[method], progress=False)
                            kept[method] = sum(sharded.stats.bytes_per_worker)
                            del sharded
                        times[method].append(time.perf_counter() - start)
                        sent[method].append(server.bytes_sent(f"ckpt/{MODEL_FILE}"))
                        print(f"  N={n} run {r + 1} {method:18s} {times[method][-1]:7.2f} s "
                              f"sent {sent[method][-1] / 1e6:8.1f} MB", file=sys.stderr)
            finally:
                for sess in sessions.values():
                    sess.close()
            for method in methods:
                if not times[method]:
                    results.append({"n": n, "method": method, "failed": True})
                    continue
                results.append({"n": n, "method": method,
                                "seconds": statistics.median(times[method]),
                                "sent_bytes": statistics.median(sent[method]),
                                "kept_bytes": kept.get(method)})
    base = {r["n"]: r for r in results if r["method"] == "runai-streamer" and "failed" not in r}
    print(f"{'method':18s} {'N':>2s} {'median s':>9s} {'sent MB':>9s} {'per worker':>11s} "
          f"{'vs file':>8s} {'time vs runai':>14s}")
    for r in results:
        if "failed" in r:
            print(f"{r['method']:18s} {r['n']:2d}   failed every run")
            continue
        ref = base.get(r["n"])
        ratio = f"{r['seconds'] / ref['seconds']:.2f}x" if ref else ""
        print(f"{r['method']:18s} {r['n']:2d} {r['seconds']:9.2f} {r['sent_bytes'] / 1e6:9.1f} "
              f"{r['sent_bytes'] / r['n'] / 1e6:11.1f} {r['sent_bytes'] / file_bytes:7.2f}x "
              f"{ratio:>14s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"file_bytes": file_bytes, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
