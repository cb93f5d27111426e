"""What generating text with a checkpoint needs before its model is loaded: the checkpoint
where transformers can read it (one in object storage opened once, the bytes its readers
fetched written into its scratch folder), its tokenizer, and the stages of the start, each
weighted by the time it takes.

>>> with open_for_text("s3://models/smollm2.gguf") as ready:                # doctest: +SKIP
...     ids = text.prompt_ids(ready.tokenizer, "Hello", chat=True)
...     model = load_tp_model(ready.checkpoint, session)
"""

from __future__ import annotations

from typing import Any

from ..readers import open_checkpoint
from ..readers.objects import write_fetched_bytes
from ..sources import is_object_url
from . import text

#: the start of a run, stage -> its span of 0..100, sized by where SmolLM2's start at N=3
#: spends its time (importing transformers is most of "tokenizer" and "load")
START_STAGES = {
    "importing": (0, 15),
    "tokenizer": (15, 40),
    "load": (40, 55),
    "build": (55, 92),
    "first token": (92, 100),
}


def start_percent(stage: str, done: int = 0, total: int = 1) -> int:
    """How far the start is, 0..100, ``done`` of ``total`` into ``stage``.

    >>> start_percent("tokenizer"), start_percent("build", 1, 2), start_percent("first token", 9)
    (15, 73, 100)
    """
    low, high = START_STAGES[stage]
    return low + (high - low) * min(done, total) // max(total, 1)


def unsharded_check_problem(ckpt: str) -> str | None:
    """Why transformers' own (unsharded) model cannot run on ``ckpt``, or None."""
    if is_object_url(ckpt):
        return (
            "--check runs transformers' own model, which reads the whole checkpoint from "
            f"a local file: copy {ckpt} to a folder first (aws s3 sync {ckpt} DIR), or "
            "leave out --check"
        )
    return None


class TextCheckpoint:
    """A checkpoint ready for generation: ``checkpoint`` is what ``load_tp_model`` takes (the
    path, or the object checkpoint opened once), ``tokenizer`` its tokenizer. Close it (or use
    ``with``) to close an object checkpoint and remove its scratch folder."""

    def __init__(self, checkpoint: Any, tokenizer: Any, opened: Any = None):
        self.checkpoint, self.tokenizer, self._opened = checkpoint, tokenizer, opened

    def close(self) -> None:
        opened, self._opened = self._opened, None
        if opened is not None:
            opened.close()

    def __enter__(self) -> TextCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_for_text(ckpt: str) -> TextCheckpoint:
    """``ckpt`` (a path or an object storage URL) and its tokenizer. ``ValueError`` (no
    tokenizer transformers can read) names ``ckpt`` as given, not a scratch folder."""
    opened, source = None, ckpt
    try:
        if is_object_url(ckpt):
            # opened once: headers by ranged GETs, the configs and tokenizer files into its
            # scratch folder, a GGUF's header (its vocabulary) into a sparse file there
            opened = open_checkpoint(ckpt)
            write_fetched_bytes(opened)
            source = opened.path or ckpt  # its scratch folder (a local reader's path)
        tokenizer = text.tokenizer(source)
    except ValueError as exc:
        if opened is not None:
            opened.close()
        raise ValueError(str(exc).replace(str(source), ckpt)) from None
    except BaseException:
        if opened is not None:
            opened.close()
        raise
    return TextCheckpoint(opened or ckpt, tokenizer, opened)
