"""Greedy text generation with SmolLM2-135M-Instruct (GGUF, Q4_1) over N tensor-parallel workers.

    python examples/generate.py --shards 3 --prompt "What is the capital of France?" \\
        --max-new-tokens 32 [--session thread|process] [--model PATH] [--no-chat]

Loads the model onto N workers with shardload (each worker reads and dequantizes only its own
shards), generates greedily through ``tp_llama``, prints the text, then checks the sharded
forward against one worker: the last line is ``max_abs_logit_diff=<v>``, the largest absolute
difference between the N-worker logits (those of the generation, through the KV cache, and of a
teacher-forced pass over the whole sequence) and the 1-worker teacher-forced logits, over all
positions. Progress goes to stderr.

The tokenizer is built from the vocabulary and merges stored in the GGUF file (the
``tokenizers`` package: byte-level BPE); the chat template too comes from the file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from models import ModelUnavailable, smollm2_gguf
from tp_llama import TensorParallelLlama

from shardload import ProcessSession, ThreadedSession, open_checkpoint

DEFAULT_PROMPT = "What is the capital of France?"


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# ---- the model file ----------------------------------------------------------------------------


def find_model(path: str | None = None) -> str:
    """``path`` if given, else the published model (``models.py``: fetched once into a cache)."""
    if path:
        if not os.path.isfile(path):
            sys.exit(f"error: no model file at {path}")
        return path
    try:
        return smollm2_gguf()
    except ModelUnavailable as exc:
        sys.exit(f"error: {exc}; pass --model PATH")


# ---- tokenizer and chat template, from the GGUF key-values ---------------------------------------

CONTROL = 3  # GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
USER_DEFINED = 4


def gguf_tokenizer(ckpt):
    """A ``tokenizers.Tokenizer`` for a GGUF "gpt2" (byte-level BPE) vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    config = ckpt.config
    if config.get("tokenizer.ggml.model") != "gpt2":
        sys.exit(
            f"error: tokenizer model {config.get('tokenizer.ggml.model')!r} is not "
            "supported (byte-level BPE, 'gpt2', is)"
        )
    tokens = ckpt.field("tokenizer.ggml.tokens")
    types = ckpt.field("tokenizer.ggml.token_type")
    # merges are "left right"; byte-level tokens never contain a plain space
    merges = [tuple(m.split(" ", 1)) for m in ckpt.field("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    # SmolLM's pre-tokenizer (llama.cpp's "smollm"): every digit alone, then GPT-2's regex
    # split and the byte-to-unicode mapping
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # control tokens (<|im_start|> ...) are matched whole in the text, before BPE
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == CONTROL
        ]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False) for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    )
    return tokenizer


def chat_prompt(ckpt, text: str) -> str:
    """``text`` as a user turn, in the chat template stored in the GGUF file."""
    template = ckpt.config.get("tokenizer.chat_template")
    messages = [{"role": "user", "content": text}]
    if not template:
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # the template is data: sandbox it

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


# ---- main --------------------------------------------------------------------------------------


def make_session(kind: str, n: int):
    return ProcessSession(n) if kind == "process" else ThreadedSession(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=1, help="tensor-parallel workers (N)")
    parser.add_argument("--session", choices=("thread", "process"), default="thread")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--model", help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template (default: yes)",
    )
    args = parser.parse_args(argv)
    if args.shards < 1 or args.max_new_tokens < 1:
        parser.error("--shards and --max-new-tokens must be at least 1")

    path = find_model(args.model)
    with open_checkpoint(path) as ckpt:
        tokenizer = gguf_tokenizer(ckpt)
        text = chat_prompt(ckpt, args.prompt) if args.chat else args.prompt
        eos = ckpt.config.get("tokenizer.ggml.eos_token_id")
    prompt_ids = tokenizer.encode(text).ids
    log(f"{path}: {len(prompt_ids)} prompt tokens, {args.shards} worker(s), {args.session}")

    start = time.perf_counter()
    with (
        make_session(args.session, args.shards) as session,
        TensorParallelLlama(path, session) as model,
    ):
        log(f"loaded in {time.perf_counter() - start:.2f} s")
        start = time.perf_counter()
        new_ids, step_logits = model.generate(prompt_ids, args.max_new_tokens, eos_id=eos)
        log(f"generated {len(new_ids)} tokens in {time.perf_counter() - start:.2f} s")
        print(tokenizer.decode(new_ids, skip_special_tokens=True), flush=True)
        sequence = prompt_ids + new_ids
        sharded = model.logits(sequence)

    # The check: one worker, teacher-forced over the same tokens.
    with ThreadedSession(1) as session, TensorParallelLlama(path, session) as reference:
        expected = reference.logits(sequence)
    first = len(prompt_ids) - 1  # the position whose logits chose the first new token
    diff_generation = (step_logits - expected[first : first + len(new_ids)]).abs().max().item()
    diff_forced = (sharded - expected).abs().max().item()
    log(
        f"max |logit diff| vs 1 worker: generation {diff_generation:.3g}, "
        f"teacher-forced {diff_forced:.3g}"
    )
    print(f"max_abs_logit_diff={max(diff_generation, diff_forced):.6g}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
