"""The load format's options: vLLM's ``model_loader_extra_config``, checked strictly.

``--model-loader-extra-config '{"verify": true}'`` (or ``LLM(...,
model_loader_extra_config={...})``) is a free dict in vLLM: a key misspelt would be silently
ignored, so every key is checked here and an unknown one refused, naming the keys there are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ShardloadError
from ..staging import Staging

__all__ = ["OPTIONS", "LoaderOptions", "OptionsError", "unknown_keys"]

#: key -> what it does (the refusal of an unknown key lists them)
OPTIONS = {
    "plan": "path of a shard_info.json to use (default: the one beside the checkpoint, else "
    "one planned from its config)",
    "verify": "poison what this rank does not read and fail naming any vLLM parameter it "
    "reaches (two loads; for tests and first runs)",
    "staging": 'false, true, or {"buffers": B, "buffer_mib": M}: the staged pipeline to the '
    "device; buffers is how many pieces are in flight at once (default: "
    "shardload's choice for the device)",
    "timeout": "seconds without progress before a rank's load fails (default: none)",
    "checkpoint": "where the weights are, when not in vLLM's model folder: a local path or an "
    "object storage URL (s3://, gs:// or az://bucket/folder/; vLLM's model is "
    "then a local folder with the config and tokenizer)",
}


class OptionsError(ShardloadError, ValueError):
    """A ``model_loader_extra_config`` shardload cannot take."""


@dataclass(frozen=True)
class LoaderOptions:
    """The options of one load (``OPTIONS`` says what each does)."""

    plan: str | None = None
    verify: bool = False
    staging: Any = None
    timeout: float | None = None
    checkpoint: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Any) -> LoaderOptions:
        """``extra`` (vLLM's ``model_loader_extra_config``) as options, or ``OptionsError``.

        >>> LoaderOptions.from_extra_config({"verify": True}).verify
        True
        """
        if extra is None:
            return cls()
        if not isinstance(extra, dict):
            raise OptionsError(
                f"model_loader_extra_config for --load-format shardload must be "
                f"a JSON object, not {type(extra).__name__}"
            )
        unknown = unknown_keys(extra, OPTIONS)
        if unknown is not None:
            raise OptionsError(
                f"--load-format shardload has no option {unknown[0]}; its options are {unknown[1]}"
            )
        plan = extra.get("plan")
        if plan is not None and not isinstance(plan, str):
            raise OptionsError(f"plan must be a path (a string), not {plan!r}")
        checkpoint = extra.get("checkpoint")
        if checkpoint is not None and (not isinstance(checkpoint, str) or not checkpoint):
            raise OptionsError(
                "checkpoint must be a path or an s3://, gs:// or az:// URL "
                f"(a string), not {checkpoint!r}"
            )
        verify = extra.get("verify", False)
        if not isinstance(verify, bool):
            raise OptionsError(f"verify must be true or false, not {verify!r}")
        timeout = extra.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise OptionsError(f"timeout must be a number of seconds above 0, not {timeout!r}")
        return cls(plan, verify, _staging(extra.get("staging")), timeout, checkpoint)


def unknown_keys(given: dict, known: dict[str, str]) -> tuple[str, str] | None:
    """The keys of ``given`` not in ``known``, quoted, and ``known`` described (``key: what
    it does``), for a refusal that names both; None where every key is known.

    >>> unknown_keys({"verfy": 1}, {"verify": "check"})
    ("'verfy'", 'verify: check')
    """
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return None
    return ", ".join(map(repr, unknown)), "; ".join(f"{k}: {v}" for k, v in known.items())


def _staging(value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, dict):
        keys = set(value) - {"buffers", "buffer_mib"}
        if keys:
            raise OptionsError(
                f"staging takes buffers and buffer_mib, not {', '.join(sorted(keys))}"
            )
        try:
            return Staging(**value)
        except (TypeError, ValueError) as exc:
            raise OptionsError(f"staging {value!r}: {exc}") from None
    raise OptionsError(
        f'staging must be true, false or {{"buffers": B, "buffer_mib": M}}, not {value!r}'
    )
