"""``shardload run``: generate text with a checkpoint split over N workers (the hf extra)."""

from __future__ import annotations

import json
import time

import click

from . import interrupts
from .app import BadInput, Command, json_option, note, out, reading
from .options import ckpt_argument, experts_option, open_session, session_option, shards_option

_HF_MISSING = 'shardload run needs transformers: pip install "shardload[hf]"'


class _StartBar:
    """One progress bar on stderr for the whole start, each stage a span of it
    (``hf.run_setup.START_STAGES``); each new stage is a phase boundary (``interrupts.check``)."""

    NAMES = {"load": "loading", "build": "building"}

    def __init__(self, disable: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=100,
            leave=False,
            disable=True if disable else None,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}",
        )
        self.stage = ""

    def show(self, stage: str, done: int = 0, total: int = 1) -> None:
        from ..hf.run_setup import start_percent

        if self.stage != stage:
            if self.stage:
                interrupts.check()
            self.stage = stage
            self.bar.set_description_str(self.NAMES.get(stage, stage))
        # update() draws at most every tenth of a second: the workers report every piece
        self.bar.update(max(0, start_percent(stage, done, total) - self.bar.n))

    def close(self, *_) -> None:
        self.bar.close()


@click.command(cls=Command)
@shards_option
@ckpt_argument
@click.option(
    "--prompt",
    "-p",
    required=True,
    help="The text to continue (or, with --chat, the user's message).",
)
@click.option(
    "--max-new-tokens", type=click.IntRange(min=1, max=1 << 16), default=32, show_default=True
)
@click.option(
    "--chat/--no-chat",
    default=True,
    show_default=True,
    help="Wrap the prompt in the checkpoint's chat template (where it has one), or "
    "continue the raw text.",
)
@session_option
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="The dtype weights are dequantized to and the model runs in.",
)
@click.option("--sample", is_flag=True, help="Sample instead of greedy decoding.")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=1.0)
@click.option("--top-k", type=click.IntRange(min=0), default=0)
@click.option("--seed", type=int, default=0)
@click.option(
    "--check",
    is_flag=True,
    help="Also run transformers' own unsharded model on the prompt and the "
    "generated text, and print the largest logit difference.",
)
@experts_option
@json_option("Print one JSON object.")
def run(
    num_shards: int,
    ckpt: str,
    prompt: str,
    max_new_tokens: int,
    chat: bool,
    session_kind: str,
    dtype: str,
    sample: bool,
    temperature: float,
    top_k: int,
    seed: int,
    check: bool,
    experts: str,
    as_json: bool,
) -> None:
    """Generate text with CKPT split over N workers: transformers' own model on every worker,
    built from its shards (needs the hf extra: pip install "shardload[hf]").

    Prints the text and tokens per second; --check compares the logits with the unsharded
    model's. One progress bar on stderr (where it is a terminal, and not with --json) covers
    the start: imports, tokenizer, loading, building, the first token.
    """
    bar = _StartBar(disable=as_json)
    try:
        bar.show("importing")
        # imported first, while Ctrl-C still ends the process at once (see interrupts)
        import torch

        try:
            from ..hf import load_tp_model, run_setup, text
        except ImportError:
            raise BadInput(_HF_MISSING) from None
        problem = run_setup.unsharded_check_problem(ckpt) if check else None
        if problem:
            raise BadInput(problem)
        session = open_session(session_kind, num_shards, None, ())
        if not session.reports:
            bar.close()  # under torchrun, rank 0 shows the bar
        bar.show("tokenizer")
        try:
            ready = run_setup.open_for_text(ckpt)
        except ValueError as exc:
            session.close()
            raise BadInput(str(exc)) from None
        except BaseException:
            session.close()
            raise
        with ready, session:
            ids = text.prompt_ids(ready.tokenizer, prompt, chat)
            torch_dtype = getattr(torch, dtype)
            bar.show("load")
            with reading():
                model = load_tp_model(
                    ready.checkpoint, session, dtype=torch_dtype, experts=experts, progress=bar.show
                )
            with model:
                bar.show("first token")
                start = time.perf_counter()
                generated = model.generate(
                    [ids],
                    max_new_tokens,
                    do_sample=sample,
                    temperature=temperature,
                    top_k=top_k,
                    seed=seed,
                    eos_token_id=ready.tokenizer.eos_token_id,
                    on_token=bar.close,
                )
                seconds = time.perf_counter() - start
                new = generated[0, len(ids) :].tolist()
                diff = (
                    text.unsharded_difference(ckpt, model, generated, torch_dtype)
                    if check
                    else None
                )
            interrupts.check()
    finally:
        bar.close()
    if not session.reports:
        return  # under torchrun, rank 0 reports
    said = ready.tokenizer.decode(new, skip_special_tokens=True)
    rate = len(new) / seconds if seconds > 0 else float("inf")
    if as_json:
        out(
            json.dumps(
                {
                    "text": said,
                    "tokens": new,
                    "seconds": seconds,
                    "tokens_per_s": rate,
                    "num_shards": num_shards,
                    **({"max_abs_logit_diff": diff} if check else {}),
                }
            )
        )
        return
    out(said)
    note(f"{len(new)} tokens in {seconds:.2f} s ({rate:.1f} tokens/s) on {num_shards} worker(s)")
    if check:
        out(f"max_abs_logit_diff={diff:.3g}")
