"""What a refit is asked: the weight-transfer backend's ``init_info`` and ``update_info``,
checked strictly (vLLM passes them as free dicts: a key misspelt would be silently ignored).

``init_weight_transfer_engine({"init_info": {...}})`` is optional and takes only what a
checkpoint needs (``INIT``); each ``update_weights({"update_info": {...}})`` names the
checkpoint, or the step to put in the init's template (``UPDATE``):

>>> init = parse_init({"checkpoint": "s3://run/step-{step:06d}/"})
>>> parse_update({"step": 40}, init).checkpoint
's3://run/step-000040/'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import ShardloadError
from .options import LoaderOptions, OptionsError, unknown_keys

__all__ = ["INIT", "UPDATE", "RefitError", "RefitInit", "RefitUpdate", "parse_init", "parse_update"]

#: what ``init_info`` may hold (all optional)
INIT = {
    "checkpoint": "where each step's checkpoint is: a path or URL with {step} (or {step:06d}) "
    "in it, for update_weights({'step': S})",
    "plan": "path of a shard_info.json for every refit (default: the one beside each "
    "checkpoint, else one planned from its config)",
    "timeout": "seconds without progress before a rank's refit fails (default: none)",
    "staging": 'false, true, or {"buffers": B, "buffer_mib": M}, as for --load-format shardload',
}

#: what ``update_info`` holds: ``checkpoint`` or ``step``, and optionally ``plan``
UPDATE = {
    "checkpoint": "the checkpoint to take: a folder, or an s3://, gs:// or az:// URL",
    "step": "the step to put in the init's checkpoint template (a number, or a name of "
    "letters, digits, '.', '_' and '-')",
    "plan": "path of a shard_info.json for this refit only",
}

_STEP = re.compile(r"\{step(?::0(\d{1,2})d)?\}")
_STEP_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


class RefitError(ShardloadError):
    """A refit the engine refused or could not finish; the message says which, and why."""


@dataclass(frozen=True)
class RefitInit:
    """``init_info``, checked: the checkpoint template, and the options of every refit."""

    template: str | None = None
    plan: str | None = None
    timeout: float | None = None
    staging: Any = None


@dataclass(frozen=True)
class RefitUpdate:
    """``update_info``, checked: the checkpoint to take (the template filled in) and its
    step (None: named as it is)."""

    checkpoint: str
    step: int | str | None = None
    plan: str | None = None


def fill(template: str, step: int | str) -> str:
    """The template's ``{step}`` (or ``{step:0Nd}``, zero-padded to N digits) set to ``step``.

    >>> fill("s3://run/global_step_{step}/", 40)
    's3://run/global_step_40/'
    """

    def put(m: re.Match) -> str:
        if m.group(1) is not None:
            if not isinstance(step, int):
                raise RefitError(f"step {step!r} is not a number, for {m.group(0)} in {template}")
            return str(step).zfill(int(m.group(1)))
        return str(step)

    return _STEP.sub(put, template)


def _known(info: Any, allowed: dict[str, str], what: str) -> dict[str, Any]:
    if not isinstance(info, dict):
        raise RefitError(f"the shardload weight-transfer backend's {what} is a dict, not {info!r}")
    unknown = unknown_keys(info, allowed)
    if unknown is not None:
        raise RefitError(
            f"the shardload weight-transfer backend's {what} has no {unknown[0]}; "
            f"it takes {unknown[1]}"
        )
    return info


def parse_init(info: Any) -> RefitInit:
    """``init_info`` as a ``RefitInit``, or ``RefitError`` naming what is wrong."""
    _known(info, INIT, "init_info")
    try:  # the values as --load-format shardload's options (the same names, the same checks)
        opts = LoaderOptions.from_extra_config(info)
    except OptionsError as exc:
        raise RefitError(f"init_info: {exc}") from None
    template = opts.checkpoint
    if template is not None and not _STEP.search(template):
        raise RefitError(
            f"init_info's checkpoint {template!r} has no {{step}}: name each checkpoint in "
            "update_weights ({'checkpoint': ...}), or give a template such as "
            "'s3://bucket/run/step-{step}/'"
        )
    return RefitInit(template, opts.plan, opts.timeout, opts.staging)


def parse_update(info: Any, init: RefitInit) -> RefitUpdate:
    """``update_info`` as a ``RefitUpdate`` (the step put in ``init``'s template), or
    ``RefitError`` naming what is wrong."""
    _known(info, UPDATE, "update_info")
    checkpoint, step, plan = info.get("checkpoint"), info.get("step"), info.get("plan")
    if (checkpoint is None) == (step is None):
        raise RefitError(
            "update_info names the checkpoint to take: {'checkpoint': PATH_OR_URL}, or "
            "{'step': S} with a template given to init_weight_transfer_engine"
        )
    if plan is not None and (not isinstance(plan, str) or not plan):
        raise RefitError(f"update_info's plan must be a path (a string), not {plan!r}")
    if checkpoint is not None:
        if not isinstance(checkpoint, str) or not checkpoint:
            raise RefitError(f"update_info's checkpoint must be a path or URL, not {checkpoint!r}")
        return RefitUpdate(checkpoint, None, plan)
    if isinstance(step, bool) or not (
        (isinstance(step, int) and step >= 0)
        or (isinstance(step, str) and _STEP_NAME.fullmatch(step))
    ):
        raise RefitError(f"update_info's step must be {UPDATE['step']}, not {step!r}")
    if init.template is None:
        raise RefitError(
            f"update_info names step {step!r}, but init_weight_transfer_engine gave no "
            "checkpoint template with {step}: name the checkpoint instead"
        )
    return RefitUpdate(fill(init.template, step), step, plan)
