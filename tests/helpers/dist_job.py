"""A torchrun job for tests/test_sessions_torchrun.py (not a test module itself).

    PYTHONPATH=.:tests:examples torchrun --standalone --nproc-per-node 2 -m helpers.dist_job \
        MODE OUT_DIR

from the repository root. The test sets that ``PYTHONPATH``
(``helpers.subprocesses.subprocess_env``): the job imports ``helpers.real_models`` and the
example's ``tp_llama`` from it.

MODE ``example``: load the embedded example, save this rank's shards to OUT_DIR/rank{r}.safetensors.
MODE ``staged``: the same through the staged pipeline (a ring of two 10 KiB buffers).
MODE ``fail``: rank 1 loads with a plan naming a missing tensor; every rank writes what it raised
to OUT_DIR/rank{r}.json.
MODE ``tp``: the tensor-parallel SmolLM2 forward of examples/tp_llama.py over the ranks (a real
torch.distributed all-reduce); rank 0 writes its logits and the 1-worker logits to OUT_DIR.
"""

import json
import os
import sys

from safetensors.torch import save_file

from shardload import TorchDistributedSession, load_sharded

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "tiny_llama_q4")


PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 2, 198, 1, 520, 9531, 198, 504]


def tensor_parallel(sess, out: str) -> None:
    from tp_llama import TensorParallelLlama  # examples/tp_llama.py

    from helpers.real_models import smollm2_gguf
    from shardload import ThreadedSession

    path = smollm2_gguf()
    with TensorParallelLlama(path, sess) as model:
        logits = model.logits(PROMPT)
    if sess.rank == 0:
        with ThreadedSession(1) as one, TensorParallelLlama(path, one) as reference:
            expected = reference.logits(PROMPT)
        save_file(
            {"logits": logits.contiguous(), "reference": expected.contiguous()},
            os.path.join(out, "tp.safetensors"),
        )


def main(mode: str, out: str) -> None:
    with TorchDistributedSession() as sess:
        if mode == "tp":
            tensor_parallel(sess, out)
            return
        if mode in ("example", "staged"):
            from shardload import Staging

            staging = Staging(buffers=2, buffer_mib=0.01) if mode == "staged" else None
            result = load_sharded(
                EXAMPLE,
                os.path.join(EXAMPLE, "shard_info.json"),
                sess,
                progress=False,
                staging=staging,
            )
            save_file(result.worker(sess.rank), os.path.join(out, f"rank{sess.rank}.safetensors"))
            with open(os.path.join(out, f"rank{sess.rank}.json"), "w") as f:
                json.dump({"stats": result.stats.as_dict(), "rank": sess.rank}, f)
            return
        plan = {"no.such.tensor": []} if sess.rank == 1 else None
        outcome = {"raised": None}
        try:
            load_sharded(EXAMPLE, plan, sess, progress=False)
        except Exception as exc:  # noqa: BLE001 - any error is the outcome the test checks
            outcome = {
                "raised": type(exc).__name__,
                "message": str(exc),
                "workers": list(getattr(exc, "workers", ())),
            }
        with open(os.path.join(out, f"rank{sess.rank}.json"), "w") as f:
            json.dump(outcome, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
