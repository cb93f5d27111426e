"""A torchrun job for tests/test_objects_stream.py (not a test module itself): each rank loads
a checkpoint from object storage, streamed within the window, while a thread samples the rank's
own memory, then loads the same checkpoint from its local folder and compares.

    torchrun --standalone --nproc-per-node 2 -m helpers.object_rank_job URL FOLDER OUT_DIR

Each rank writes OUT_DIR/rank{r}.json: the bytes it kept, how far its memory
(``Pss_Anon + Pss_Shmem`` of ``/proc/self/smaps_rollup``) grew at its peak during the object
load, and whether every piece equals the local load's.
"""

import json
import os
import sys
import threading

import torch

from shardload import TorchDistributedSession, load_sharded


def _pss() -> int:
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss_Anon", "Pss_Shmem"):
                total += int(rest.split()[0]) * 1024
    return total


def main(url: str, folder: str, out: str) -> None:
    with TorchDistributedSession() as sess:
        base = peak = _pss()
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.wait(0.005):
                peak = max(peak, _pss())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            remote = load_sharded(url, None, sess, progress=False)
        finally:
            stop.set()
            sampler.join()
        peak = max(peak, _pss())
        mine = remote.worker(sess.rank)
        local = load_sharded(folder, None, sess, progress=False).worker(sess.rank)
        equal = mine.keys() == local.keys() and all(torch.equal(mine[k], local[k]) for k in mine)
        with open(os.path.join(out, f"rank{sess.rank}.json"), "w") as f:
            json.dump(
                {
                    "kept": sum(t.numel() * t.element_size() for t in mine.values()),
                    "grew": peak - base,
                    "equal": equal,
                },
                f,
            )


if __name__ == "__main__":
    main(*sys.argv[1:4])
