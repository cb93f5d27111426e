"""A torchrun job for tests/test_hf_torchrun.py (not a test module itself).

    PYTHONPATH=.:tests torchrun --standalone --nproc-per-node 2 -m helpers.hf_dist_job CKPT OUT

Every rank builds ``load_tp_model(CKPT)`` over the job's ranks (``TorchDistributedSession``:
the row-parallel sums are torch.distributed all-reduces), runs the forward of a fixed prompt
and generates greedily and sampled; each rank writes what it got to OUT/rank{r}.json.
"""

import json
import os
import sys

import torch

from shardload import TorchDistributedSession
from shardload.hf import load_tp_model

PROMPT = [[3, 14, 15, 9, 26, 5, 35, 8]]


def main(ckpt: str, out: str) -> None:
    with TorchDistributedSession() as session:
        with load_tp_model(ckpt, session) as model:
            logits = model(PROMPT)
            greedy = model.generate(PROMPT, max_new_tokens=16)
            sampled = model.generate(
                PROMPT, max_new_tokens=16, do_sample=True, seed=7, temperature=0.8, top_k=20
            )
        record = {
            "rank": session.rank,
            "logits": logits.tolist(),
            "greedy": greedy.tolist(),
            "sampled": sampled.tolist(),
        }
    with open(os.path.join(out, f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    torch.manual_seed(1234 + int(os.environ.get("RANK", "0")))  # ranks' own RNGs differ
    main(sys.argv[1], sys.argv[2])
