"""The rank program of tests/test_sessions_multinode.py (not a test module itself): one job of
two torchrun launchers, as two machines would run it (``helpers.subprocesses.torchrun_nodes``)::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        --rdzv-id ID -m helpers.multinode_job MODE OUT_DIR ARG

MODE ``load``, ARG a folder or an object storage URL (with its ``shard_info.json``): load it
and save this rank's pieces to OUT_DIR/rank{r}.safetensors.
MODE ``die``, ARG a launcher (0: the one serving the rendezvous, 1: the other): load three small
parameters (``helpers.fault_plans``), the second split by ``tests.multinode.split_or_fail``,
which makes that launcher's second rank wait a moment (the others finish their pieces and wait
for its outcome), write OUT_DIR/failing.json (its rank) and end its process: ``os._exit(1)``.
MODE ``freeze``: the same, but that rank stops its process (SIGSTOP), as a machine that is lost
without closing its connections; every rank waits at most ``PEER_TIMEOUT_S`` for it, and the
stopped one is killed ``LOST_FOR_S`` later.

Every rank that gets there (not the failing one; torchrun may stop others first) writes
OUT_DIR/rank{r}.json: where it ran (launcher, node, local rank, device), the load's
statistics, or what it raised; a rank whose load raised then exits 1, as a program does.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from safetensors.torch import save_file

from helpers.fault_plans import params, split_entry
from helpers.fault_plugins import SPLIT_RULE  # and registers tests.faults.split
from shardload import TorchDistributedSession, load_sharded, register_shard_func

#: how long the failing rank lets the others go on before it fails: they finish their pieces
#: and wait for its outcome
HEAD_START_S = 1.0
#: how long the ranks wait on a silent peer in ``freeze`` (the default, a minute, is for
#: real machines)
PEER_TIMEOUT_S = 5.0
#: how long the stopped rank stays stopped: past the others' peer timeout and their next check
LOST_FOR_S = 3 * PEER_TIMEOUT_S


@register_shard_func("tests.multinode.split_or_fail", array="numpy", shape_rule=SPLIT_RULE)
def split_or_fail(input, dim, output):
    """On the failing launcher's second rank: say so in OUT_DIR/failing.json, and end the
    process (``die``) or stop it (``freeze``). Elsewhere: split evenly along ``dim``."""
    mode, out, launcher = os.environ["SHARDLOAD_TEST_RUN"].split(",")
    if (os.environ["SHARDLOAD_TEST_NODE"], os.environ["LOCAL_RANK"]) == (launcher, "1"):
        time.sleep(HEAD_START_S)
        with open(os.path.join(out, "failing.json"), "w") as f:
            json.dump({"rank": int(os.environ["RANK"]), "pid": os.getpid()}, f)
        if mode == "freeze":
            # the lost machine never comes back: a process ends it once the others have
            # given up on it, so that its launcher exits at once, not after torchrun's 30 s
            # between its SIGTERM (pending while stopped) and SIGKILL
            subprocess.Popen(
                ["sh", "-c", f"sleep {LOST_FOR_S}; kill -KILL {os.getpid()}"],
                start_new_session=True,
            )  # out of reach of its launcher
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(1)
    output[...] = np.stack(np.split(input, output.shape[0], axis=dim))


def main(mode: str, out: str, arg: str) -> int:
    os.environ["SHARDLOAD_TEST_RUN"] = f"{mode},{out},{arg}"
    if mode == "freeze":
        TorchDistributedSession.PEER_TIMEOUT = PEER_TIMEOUT_S
    with TorchDistributedSession() as sess:
        report = {
            "launcher": os.environ["SHARDLOAD_TEST_NODE"],
            "group_rank": os.environ["GROUP_RANK"],
            "local_rank": os.environ["LOCAL_RANK"],
            "rank": sess.rank,
            "world_size": sess.num_workers,
            "device": str(sess.device),
        }
        try:
            if mode == "load":
                result = load_sharded(arg, None, sess, progress=False)
                save_file(
                    result.worker(sess.rank), os.path.join(out, f"rank{sess.rank}.safetensors")
                )
                report["stats"] = result.stats.as_dict()
            else:
                plan = {
                    f"p{k}": split_entry(
                        "tests.multinode.split_or_fail" if k == 1 else "tests.faults.split"
                    )
                    for k in range(3)
                }
                load_sharded(params(3), plan, sess, progress=False)
        except Exception as exc:  # noqa: BLE001 - any error is the outcome the test checks
            report.update(
                raised=type(exc).__name__, message=str(exc), worker=getattr(exc, "worker", None)
            )
        with open(os.path.join(out, f"rank{sess.rank}.json"), "w") as f:
            json.dump(report, f)
    return 1 if "raised" in report else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
