"""One vLLM engine for ``bench_refit.py``, run by vLLM's python: refits and reloads, or a start.

    python benchmarks/refit_engine.py MODEL --tp 2 --checkpoint C --runs 3 --out F [--reload-path P]
    python benchmarks/refit_engine.py MODEL --tp 2 --fresh --out F

Without ``--fresh``: an engine with the ``shardload`` weight-transfer backend generates once, then
``--runs`` times (in alternating order) refits to ``--checkpoint`` through vLLM's weight-transfer
API and reloads in place with the engine's own loader (``reload_weights``, from
``--reload-path`` where given), each timed, each followed by a generation whose tokens must be
the first ones (the same checkpoint). With ``--fresh``: the wall time from ``LLM(...)`` to the
end of its first generation of one short prompt (vLLM imported before). Writes JSON to
``--out``; the statistics lines and the load time (``devtools.vllm_ext``) are in the log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PROMPT = [1, 5, 9, 13, 200, 7]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="the folder vLLM's model config comes from")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--extra", default=None, help="model_loader_extra_config as JSON")
    ap.add_argument("--checkpoint", default=None, help="what each refit takes")
    ap.add_argument("--reload-path", default=None, help="reload_weights' weights_path")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fresh", action="store_true", help="time a start, nothing else")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    # as devtools/vllm_engine.py runs the tests' engines
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND",
        "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp)),
    )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=args.model,
        tensor_parallel_size=args.tp,
        load_format=args.load_format,
        distributed_executor_backend="uni" if args.tp == 1 else "mp",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=2,
        seed=0,
        skip_tokenizer_init=True,
        # importing it times every loader's load_weights alike (its TIMING_PREFIX line)
        worker_extension_cls="devtools.vllm_ext.LoaderComparison",
    )
    if args.extra:
        kwargs["model_loader_extra_config"] = json.loads(args.extra)
    params = SamplingParams(temperature=0, max_tokens=8, detokenize=False)
    prompt = [TokensPrompt(prompt_token_ids=PROMPT)]

    if args.fresh:
        start = time.perf_counter()
        llm = LLM(**kwargs)
        built = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        done = time.perf_counter()
        report = {"constructor_s": built - start, "fresh_s": done - start}
    else:
        llm = LLM(**kwargs, weight_transfer_config=WeightTransferConfig(backend="shardload"))

        def tokens() -> list:
            return list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)

        def refit() -> None:
            llm.start_weight_update()
            llm.update_weights({"update_info": {"checkpoint": args.checkpoint}})
            llm.finish_weight_update()

        def reload() -> None:
            reload_kwargs = {} if args.reload_path is None else {"weights_path": args.reload_path}
            llm.collective_rpc("reload_weights", kwargs=reload_kwargs)

        first = tokens()
        runs: dict[str, list] = {"refit": [], "reload": []}
        same = True
        for r in range(args.runs):
            # alternating, so that neither always runs first
            for name in ("refit", "reload") if r % 2 == 0 else ("reload", "refit"):
                start = time.perf_counter()
                (refit if name == "refit" else reload)()
                runs[name].append(time.perf_counter() - start)
                llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
                same = same and tokens() == first
        report = {**runs, "same_tokens": same}
    with open(args.out, "w") as f:
        json.dump(report, f)
    llm = None  # the engine shut down before the exit
    sys.exit(0)


if __name__ == "__main__":
    main()
