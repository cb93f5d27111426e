"""Where the tests find the checkout: the repository, its tests and its examples (strings)."""

from __future__ import annotations

import os

#: tests/
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the checkout
REPO = os.path.dirname(TESTS)
#: examples/ (``tp_llama``, ``generate.py``, the tiny example checkpoint)
EXAMPLES = os.path.join(REPO, "examples")
#: the tiny Llama checkpoint (Q4, with its ``shard_info.json``) most CLI tests load
EXAMPLE = os.path.join(EXAMPLES, "tiny_llama_q4")
