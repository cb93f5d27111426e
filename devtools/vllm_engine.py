"""Run one vLLM engine on one checkpoint and print what it generated, as JSON (run in vLLM's env).

    python devtools/vllm_engine.py CKPT --tp 2 --load-format shardload --verify
    python devtools/vllm_engine.py CKPT --pp 2 --load-format shardload --compare-default

Greedy tokens and the top-5 logprobs of each generated token, for a fixed prompt of token ids
(the tiny test models have no tokenizer) or of text (``--text``, for real models), and, for
``--load-format shardload``, each rank's statistics line from vLLM's log. One engine start per
call: the tests call it once per (checkpoint, N, loader). ``--pp P``: P pipeline stages, each
of ``--tp`` ranks. ``--refits JSON``: then refits through vLLM's weight-transfer API with
shardload's backend, each followed by a generation (and ``--digests``).

On the caller's side (its Python, no vLLM imported): ``launch`` runs this script with vLLM's
python (the tests find it with ``tests/helpers/vllm_engine.vllm_python``, the benchmark with
its ``--python``) and gives its report, the statistics lines and its whole output. The repository
root must be on the engine's ``PYTHONPATH``: its workers import ``devtools.vllm_ext``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [[1, 5, 9, 13, 200, 7], [3, 100, 42]]

#: the start of shardload's statistics line in vLLM's log
#: (``shardload.vllm.model_loader.STATS_PREFIX``, which imports vLLM)
STATS_PREFIX = "shardload load: "


def launch(
    python: str,
    model: str,
    *args: str,
    env: dict,
    cwd: str,
    timeout: float = 600,
    out_dir: str | None = None,
) -> tuple[dict, list, str]:
    """This script on ``model`` with ``args``, run by vLLM's ``python`` (``env``: the whole
    environment it runs with): its report (``{"returncode": rc}`` where it failed), the
    statistics lines of every rank as dicts, in the order logged, and its whole output."""
    folder = Path(out_dir or os.environ.get("PYTEST_TMP", "/tmp"))
    out = folder / f"vllm-{os.getpid()}-{abs(hash((model, args)))}.json"
    cmd = [python, os.path.abspath(__file__), model, "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    log = proc.stdout + proc.stderr
    stats = [
        json.loads(line.split(STATS_PREFIX, 1)[1])
        for line in log.splitlines()
        if STATS_PREFIX in line
    ]
    if proc.returncode != 0:
        return {"returncode": proc.returncode}, stats, log
    report = json.loads(out.read_text())
    out.unlink()
    return report, stats, log


def _pipeline_buffers(worker) -> None:
    """Give a later pipeline stage the buffers its received activations go into.

    vLLM 0.32's CPU runner makes them only in its warm-up run, which it skips in eager mode
    (``enforce_eager``, as these engines run), so a later stage's first step fails
    (``gpu_model_runner.py``: ``assert self.intermediate_tensors is not None``), with vLLM's
    own loader too. Made here as that warm-up makes them (``_dummy_run``), run in every
    worker through ``collective_rpc``; nothing of the weights is touched."""
    from vllm.distributed import get_pp_group

    runner = worker.model_runner
    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )


def _failed_reload(llm, folder: str) -> dict:
    """Reload in place with a plan beside the checkpoint that is not JSON, so the loader
    fails while planning, then count each worker's mappings of the checkpoint's files and its
    descriptors to them (``devtools.vllm_ext``), the error still held, as a caller that
    reports it later holds it: ``{"error": ..., "before": ..., "after": ...}``, the counts
    one per worker. What the loader opened must not wait for the error to be dropped."""
    before = llm.collective_rpc("handles_under", args=(folder,))
    plan = Path(folder) / "shard_info.json"
    plan.write_text("{not json")
    held = None
    try:
        llm.collective_rpc("reload_with_engines_loader")
    # whatever vLLM's executor wraps the loader's error in: the failure asked for, kept
    except Exception as exc:  # noqa: BLE001
        held = exc
    finally:
        plan.unlink()
    after = llm.collective_rpc("handles_under", args=(folder,))
    error = None if held is None else f"{type(held).__name__}: {held}"
    return {"error": error, "before": before, "after": after}


def _refits(llm, steps: list, generate, digests: bool) -> list:
    """Each step of ``--refits`` through vLLM's weight-transfer API (the ``shardload``
    backend): ``{"update_info": {...}}`` (and ``"init_info"`` to initialise the backend first,
    ``"fail_after": n`` to make vLLM's loader fail after n weights, ``"poison": true`` to
    fill every parameter with a byte no load writes first; both with ``--digests``),
    then what the engine generates, with the refit's error (None: it took the weights) and,
    with ``--digests``, every parameter's digest. A refused refit must leave the engine as it
    was, so each step generates whatever the refit did."""
    out = []
    for step in steps:
        error = None
        start = time.perf_counter()
        try:
            if step.get("poison"):  # a parameter the refit leaves shows (devtools.vllm_ext)
                llm.collective_rpc("poison_params")
            if "fail_after" in step:  # vLLM's loader fails midway (devtools.vllm_ext)
                llm.collective_rpc("fail_next_load_after", args=(step["fail_after"],))
            if "init_info" in step:
                llm.init_weight_transfer_engine({"init_info": step["init_info"]})
            llm.start_weight_update()
            llm.update_weights({"update_info": step["update_info"]})
            llm.finish_weight_update(weight_version=step.get("version"))
        # whatever vLLM's executor wraps the backend's refusal in: the step's outcome
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - start
        llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        done = {"error": error, "seconds": seconds, "outputs": generate()}
        if digests:
            done["digests"] = llm.collective_rpc("param_digests")
        out.append(done)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--extra", default=None, help="model_loader_extra_config as JSON")
    ap.add_argument("--hf-overrides", default=None)
    ap.add_argument("--text", default=None)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ep", action="store_true", help="enable_expert_parallel")
    ap.add_argument(
        "--compare-default",
        action="store_true",
        help="then reload the weights with vLLM's default loader in the same engine "
        "and generate again (and, for shardload, reload with shardload again)",
    )
    ap.add_argument(
        "--reload",
        action="store_true",
        help="then reload the weights in place with the engine's own loader and "
        "generate again (with --digests: digests again)",
    )
    ap.add_argument(
        "--fail-reload",
        action="store_true",
        help="then reload in place with a broken shard_info.json beside the checkpoint (MODEL "
        "must be a folder of one's own), which the loader refuses, and count what each worker "
        "still holds of the checkpoint's files",
    )
    ap.add_argument(
        "--digests",
        action="store_true",
        help="a digest of every parameter after loading (and the bytes they hold)",
    )
    ap.add_argument(
        "--time-loads",
        action="store_true",
        help="each worker prints how long its loader's load_weights took "
        "(devtools.vllm_ext.TIMING_PREFIX), whatever the load format",
    )
    ap.add_argument(
        "--refits",
        default=None,
        help="JSON list of refits through vLLM's weight-transfer API with the shardload "
        'backend, each {"update_info": {...}} (optionally "init_info"), after the first '
        "generation; each reports its error, outputs (and --digests)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND",
        "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp * args.pp)),
    )

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = json.loads(args.extra) if args.extra else {}
    if args.verify and args.load_format == "shardload":
        extra["verify"] = True
    # the engine core in this process, and with one rank its worker too (vLLM's "uni"
    # executor): each process start saved is ~10 s on 2 cores; the loader runs the same, in
    # the workers, over their tensor-parallel group
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kwargs = dict(
        model=args.model,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        load_format=args.load_format,
        distributed_executor_backend="uni" if args.tp * args.pp == 1 else "mp",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=2,
        dtype=args.dtype,
        seed=0,
        skip_tokenizer_init=args.text is None,
        enable_expert_parallel=args.ep,
    )
    if extra:
        kwargs["model_loader_extra_config"] = extra
    if args.refits is not None:
        from vllm.config import WeightTransferConfig

        kwargs["weight_transfer_config"] = WeightTransferConfig(backend="shardload")
    if args.compare_default or args.digests or args.reload or args.time_loads or args.fail_reload:
        kwargs["worker_extension_cls"] = "devtools.vllm_ext.LoaderComparison"
    if args.hf_overrides:
        kwargs["hf_overrides"] = json.loads(args.hf_overrides)
    llm = LLM(**kwargs)
    if args.pp > 1:
        llm.collective_rpc(_pipeline_buffers)
    params = SamplingParams(
        temperature=0, max_tokens=max(1, args.tokens), logprobs=5, detokenize=args.text is not None
    )
    prompts = (
        [args.text]
        if args.text is not None
        else [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    )

    def generate() -> list:
        if args.tokens == 0:  # load only (vLLM's CPU MoE kernels under expert parallelism crash)
            return []
        result = []
        for out in llm.generate(prompts, params, use_tqdm=False):
            gen = out.outputs[0]
            result.append(
                {
                    "tokens": list(gen.token_ids),
                    "text": gen.text if args.text is not None else None,
                    "logprobs": [
                        {str(t): lp.logprob for t, lp in step.items()}
                        for step in (gen.logprobs or [])
                    ],
                }
            )
        return result

    report = {"outputs": generate()}
    if args.compare_default or args.digests or args.reload:
        report["digests"] = llm.collective_rpc("param_digests")
        report["param_bytes"] = llm.collective_rpc("param_bytes")
    if args.compare_default:
        llm.collective_rpc("reload_with_default_loader")
        report["default_outputs"] = generate()
        report["default_digests"] = llm.collective_rpc("param_digests")
    if args.reload or (args.compare_default and args.load_format == "shardload"):
        # and the engine's own loader again, in place (shardload's reload: views of the file
        # where vLLM narrows the stored tensor, reads for the rest)
        llm.collective_rpc("reload_with_engines_loader")
        report["reload_outputs"] = generate()
        report["reload_digests"] = llm.collective_rpc("param_digests")
    if args.fail_reload:
        report["failed_reload"] = _failed_reload(llm, args.model)
    if args.refits is not None:
        report["refits"] = _refits(llm, json.loads(args.refits), generate, args.digests)
    with open(args.out, "w") as f:
        json.dump(report, f)
    llm = None  # the engine shut down before the exit
    sys.exit(0)


if __name__ == "__main__":
    main()
