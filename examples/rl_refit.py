"""An RL loop's two halves, in one script: a trainer writes each step's weights as a checkpoint,
and a running vLLM engine takes them through vLLM's own weight-transfer API, with shardload's
backend, between two rounds of generation. No restart; each rank reads only its bytes.

    python examples/rl_refit.py [--tp 2] [--steps 3] [--dir /tmp/rl-run]

Run it with vLLM's python (``pip install -e .[vllm]``; on a CPU machine vLLM's CPU build). The
model is a tiny random Llama (made once into ``--dir``, no download); the "trainer" is a step
of noise on every weight, written the way a checkpoint should be for a refit: into a temporary
folder, renamed into place when complete, so the engine never sees one half-written (a refit
of one would be refused, and the engine would keep its weights).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

PROMPTS = [[1, 5, 9, 13, 200, 7], [3, 100, 42]]


def make_model(folder: Path) -> None:
    """Step 0: a tiny random Llama (transformers' own initialisation), saved as a checkpoint."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=512,
        num_hidden_layers=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def train_step(previous: Path, step_dir: Path, step: int) -> None:
    """The trainer: the previous step's weights plus a little noise, written to a temporary
    folder beside ``step_dir`` and renamed into place once complete."""
    import torch
    from safetensors.torch import load_file, save_file

    tmp = step_dir.with_name(step_dir.name + ".writing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in previous.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, tmp / f.name)
    generator = torch.Generator().manual_seed(step)
    weights = load_file(str(previous / "model.safetensors"))
    for name, w in weights.items():
        noise = torch.randn(w.shape, generator=generator, dtype=torch.float32)
        weights[name] = (w.float() + 0.05 * w.float().std() * noise).to(w.dtype)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.replace(tmp, step_dir)  # the refit sees the whole checkpoint, or none


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    ap.add_argument("--steps", type=int, default=3, help="training steps (refits)")
    ap.add_argument("--dir", default="/tmp/shardload-rl-run", help="where the run writes")
    ap.add_argument("--json", default=None, help="write what each round generated here")
    args = ap.parse_args()
    # a CPU machine: a small KV cache, one core per rank
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND",
        "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp)),
    )
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.inputs import TokensPrompt

    run = Path(args.dir)
    if not (run / "step-0" / "config.json").exists():
        shutil.rmtree(run, ignore_errors=True)
        make_model(run / "step-0")

    llm = LLM(
        model=str(run / "step-0"),
        tensor_parallel_size=args.tp,
        weight_transfer_config=WeightTransferConfig(backend="shardload"),
        enforce_eager=True,
        max_model_len=128,
        skip_tokenizer_init=True,  # the tiny model has no tokenizer: prompts are token ids
    )
    # each refit names its step; the template says where the trainer writes it
    llm.init_weight_transfer_engine({"init_info": {"checkpoint": str(run / "step-{step}")}})
    params = SamplingParams(temperature=0, max_tokens=8, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]

    rounds = []
    for step in range(args.steps + 1):
        outs = llm.generate(prompts, params, use_tqdm=False)  # the rollouts of this policy
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        print(f"step {step}: generated {tokens}", flush=True)
        rounds.append({"step": step, "tokens": tokens, "version": llm.get_weight_version()})
        if step == args.steps:
            break
        train_step(run / f"step-{step}", run / f"step-{step + 1}", step + 1)
        llm.start_weight_update()
        llm.update_weights({"update_info": {"step": step + 1}})
        llm.finish_weight_update(weight_version=str(step + 1))
        llm.reset_prefix_cache()  # prefixes cached before were computed with the old weights
        print(f"step {step + 1}: refit from {run / f'step-{step + 1}'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rounds))


if __name__ == "__main__":
    main()
