"""What a plan's error messages show of hostile or mistaken input: short renderings and "did you
mean" hints, each bounded in time and length however large the plan or the checkpoint.

>>> brief(list(range(100)))
'[0, 1, 2, 3, 4, 5, 6, 7, ... (100 items)]'
>>> close_match("model.layers.0.mlp.up_prj.weight", {"model.layers.0.mlp.up_proj.weight": None})
" (did you mean 'model.layers.0.mlp.up_proj.weight'?)"
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import quote

__all__ = ["REASON_LIMIT", "brief", "close_match", "cut", "known_names"]

#: longest shape-rule message repeated in a PlanError
REASON_LIMIT = 400
#: names longer than this get no "did you mean" (difflib is quadratic in the name's length)
_MATCH_LIMIT = 256
#: difflib compares the name with at most this many checkpoint names (it takes a few ms each
#: for names alike: a 47k-tensor MoE checkpoint would take 12 s); the rest are ranked first by
#: how many dotted components they share with the name
_MATCH_CANDIDATES = 500


def brief(value: Any, items: int = 8, depth: int = 0) -> str:
    """A short rendering of a (possibly huge, possibly nested) JSON value for messages: at most
    ``items`` entries of a list, each string cut by ``quote``."""
    if isinstance(value, (list, tuple)):
        if depth >= 2:
            return f"[... ({len(value)} items)]"
        shown = ", ".join(brief(v, items, depth + 1) for v in value[:items])
        more = f", ... ({len(value)} items)" if len(value) > items else ""
        return f"[{shown}{more}]"
    if isinstance(value, Mapping):
        return f"{{...}} (an object of {len(value)} keys)"
    if isinstance(value, str):
        return quote(value)
    return quote(value, 40)


def cut(text: str, limit: int = REASON_LIMIT) -> str:
    """``text``, or its first ``limit`` characters and how many there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def close_match(name: str, metadata: Mapping[str, Any]) -> str:
    """`` (did you mean 'x'?)`` for the checkpoint name closest to ``name``, or ``""``."""
    if len(name) > _MATCH_LIMIT:
        return ""
    import difflib
    import heapq

    # difflib's ratio is at most 2 * min(a, b) / (a + b): names of a length that cannot reach
    # its 0.6 cutoff are left out here, in one cheap pass
    lo, hi = 3 * len(name) / 7, 7 * len(name) / 3
    candidates = [k for k in metadata if isinstance(k, str) and lo <= len(k) <= hi]
    if len(candidates) > _MATCH_CANDIDATES:
        parts = set(name.split("."))
        candidates = heapq.nlargest(
            _MATCH_CANDIDATES, candidates, key=lambda k: len(parts.intersection(k.split(".")))
        )
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {quote(close[0])}?)" if close else ""


def known_names() -> list[str]:
    """The registered shard functions' names (for ``UnknownShardFunctionError``'s suggestions)."""
    from ..registry import list_shard_funcs

    return [f.name for f in list_shard_funcs()]
