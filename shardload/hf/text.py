"""Text in and out of a ``TPModel`` for ``shardload run``: the checkpoint's own tokenizer and
chat template, and the check against transformers' unsharded model."""

from __future__ import annotations

import os

import torch


def _folder(ckpt: str) -> str:
    return ckpt if os.path.isdir(ckpt) else os.path.dirname(ckpt)


def tokenizer(ckpt: str):
    """The tokenizer that ships with the checkpoint (``tokenizer.json`` and its config, or a
    GGUF file's vocabulary, which transformers reads); ``ValueError`` saying what is missing."""
    import transformers

    folder = _folder(ckpt)
    kwargs = {"gguf_file": os.path.basename(ckpt)} if ckpt.endswith(".gguf") else {}
    try:
        chosen = _gguf_tokenizer_class(ckpt) if kwargs else None
        if chosen is not None:
            return chosen.from_pretrained(folder, **kwargs)
        return transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure means: no usable tokenizer there
        raise ValueError(
            f"{ckpt} has no tokenizer transformers can read ({type(exc).__name__}: "
            f"{_first_line(str(exc))}); shardload run needs the checkpoint's "
            "tokenizer (tokenizer.json and tokenizer_config.json, or a GGUF "
            "file's vocabulary)"
        ) from None


def _gguf_tokenizer_class(path: str):
    """The class ``AutoTokenizer`` picks for a GGUF file with no ``tokenizer_config.json``
    beside it: the one registered for its config's class, else ``TokenizersBackend``; None
    where its choice takes more (a tokenizer config, a class the config names, Mistral's).

    ``AutoTokenizer`` reads the config with transformers' GGUF parser, which decodes the whole
    vocabulary and merges key by key (4 s for SmolLM2's 49k tokens) only to learn the model
    type; ``from_gguf.config_dict`` reads the same config from shardload's reader."""
    import transformers
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING, get_tokenizer_config
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from ..readers import open_checkpoint
    from .from_gguf import config_dict

    if get_tokenizer_config(_folder(path)):
        return None
    with open_checkpoint(path) as ckpt:
        config = transformers.AutoConfig.for_model(**config_dict(ckpt))
    if getattr(config, "tokenizer_class", None):
        return None
    chosen = TOKENIZER_MAPPING.get(type(config), TokenizersBackend) or TokenizersBackend
    # transformers 5 maps a config to one tokenizer class; the type its auto mappings share
    # also allows the (slow, fast) pairs of the model mappings
    name = chosen.__name__  # type: ignore[union-attr]
    return None if name == "MistralCommonBackend" else chosen


def _first_line(text: str, limit: int = 160) -> str:
    """The first line of ``text``, cut at a word (a message must stay one readable line)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0] + " ..."


def prompt_ids(tok, prompt: str, chat: bool) -> list[int]:
    """``prompt`` as token ids, wrapped in the chat template when asked and there is one."""
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tok(prompt)["input_ids"]]


def unsharded_difference(ckpt: str, model, tokens: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest absolute difference between the sharded logits and transformers' own
    unsharded model's over the whole sequence ``tokens`` (teacher-forced)."""
    import transformers

    logging = transformers.utils.logging
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    kwargs = {"gguf_file": os.path.basename(ckpt)} if ckpt.endswith(".gguf") else {}
    try:
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            _folder(ckpt), dtype=dtype, **kwargs
        ).eval()
    finally:
        if bars:
            logging.enable_progress_bar()
    with torch.no_grad():
        want = reference(input_ids=tokens).logits.float()
    return float((model(tokens) - want).abs().max())
