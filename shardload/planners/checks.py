"""The metadata must agree with the tensors it is applied to.

The planner splits each tensor by sizes read from the metadata (heads x head_dim, the MLP size,
the vocabulary, the hidden size, the quantization's bits and groups). Where they disagree with a
tensor's own shape, a plan would cut it in the wrong places and the load would still succeed:
silent corruption. So, as llama.cpp does when it loads a model, every such size is checked
against every tensor it is applied to, and a disagreement is refused, naming the tensor, its
shape and the keys. The one size that is only a hint is a GGUF's absent ``<arch>.vocab_size``:
the vocabulary is then the embeddings' rows (``vocab_from_tensors``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import FormatError, PlanError
from ..formats import Axis, Scheme

if TYPE_CHECKING:  # pragma: no cover
    from ..readers.base import Checkpoint
    from .spec import ModelSpec
    from .tensors import Tensor, Walk

__all__ = ["check_shapes", "held", "vocab_from_tensors"]

_DISAGREE = (
    "; the metadata and the tensors must agree, or the plan would cut the tensors in "
    "the wrong places"
)


def _packing(axis: Axis, scheme: Scheme, fmt: Mapping[str, Any] | None, spec: ModelSpec) -> str:
    """How the tensor stores the axis, when not one element per unit, and the keys saying so."""
    if axis.elems == 1 and axis.width == 1:
        return ""
    stored = (
        f"{axis.elems} per stored unit"
        if axis.width == 1
        else f"{axis.elems} per {axis.width} stored units"
    )
    blocks = scheme.format.stored_as(fmt)
    if blocks is not None:
        return f", {stored} ({blocks})"
    how = scheme.explain("bits", "group_size", "block")
    if not how:
        return f", {stored}"
    source = scheme.source
    return f", {stored} ({how}{f' in {source}' if source and source != spec.file else ''})"


def held(scheme: Scheme, fmt: Mapping[str, Any] | None) -> str:
    """How a tensor's quantization stores its elements in blocks, for messages:
    `` ('quantization_config.bits' = 4, ...)``, `` (Q4_K blocks)``, or ``""``."""
    blocks = scheme.format.stored_as(fmt)
    if blocks is not None:
        return f" ({blocks})"
    how = scheme.explain("bits", "group_size", "block")
    return f" ({how})" if how else ""


def check_shapes(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme, walked: Walk) -> None:
    """``FormatError`` unless every size the planner will use agrees with the shape of every
    tensor it is applied to (``walked``: ``tensors.walk``; see above). Reads no tensor data,
    but for compressed-tensors' two-element ``weight_shape`` tensors. A kind of tensor is
    checked once, at its first tensor, as the shapes it checks are the kind's."""
    planned = False
    checked: set[int] = set()
    for meta, kind in walked.rows():
        if kind.role is None:
            continue
        planned = True
        if kind.axes is None:
            continue
        if kind.axes.special == "shape":  # the stored values: every tensor's own
            _check_tensor(ckpt, spec, scheme, walked.tensor(meta, kind))
        elif id(kind) not in checked:
            checked.add(id(kind))
            _check_tensor(ckpt, spec, scheme, kind)
    if spec.rules.prefixes and not planned:
        raise PlanError(
            f"model_type {spec.architecture!r} keeps its language model's tensors "
            f"under {', '.join(map(repr, spec.rules.prefixes))}, and the checkpoint "
            "has no projection or embedding there: nothing to split",
            source=spec.file or None,
        )
    if spec.v_head_dim != spec.head_dim and spec.mla is None:
        raise PlanError(
            f"value heads of {spec.explain('value_head_dim')} differ from the key "
            f"heads of {spec.explain('head_dim')}: attention with value heads of "
            "another width is not supported by the planner",
            source=spec.file or None,
        )


def _check_tensor(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme, t: Tensor) -> None:
    """One tensor's shape (and stored ``weight_shape``) against the metadata's sizes."""
    role, axes = t.split()
    (n_out, n_why), (k_in, k_why) = role.extents(spec, t.mlp)

    def refuse(message: str) -> FormatError:
        return FormatError(message, file=spec.file or None, tensor=t.name)

    if role.vector and t.suffix == "weight" and len(t.meta.shape) != 1:
        raise refuse(
            f"has shape {list(t.meta.shape)}: a {spec.architecture} "
            f"{t.module.rpartition('.')[2]} weight is one vector over "
            f"{role.vector} {n_out} rows ({n_why}), so it must be [{n_out}]"
        )
    if axes.special == "shape":
        values = [int(v) for v in ckpt.read_array(t.name).reshape(-1).tolist()]
        if values != [n_out, k_in] and n_out and k_in:
            raise refuse(
                f"holds the weight shape {values}, but the metadata gives "
                f"[{n_out}, {k_in}]: {n_out} output features ({n_why}) and "
                f"{k_in} input features ({k_why}){_DISAGREE}"
            )
        return
    for axis, size, why, what in (
        (axes.n, n_out, n_why, "output features"),
        (axes.k, k_in, k_why, "input features"),
    ):
        if axis is None or not size:
            continue  # not held by this tensor, or a size the metadata lacks
        want = -(-size // axis.elems) * axis.width
        got = t.meta.shape[axis.dim] if axis.dim < len(t.meta.shape) else None
        if got != want:
            found = "none" if got is None else got
            raise refuse(
                f"has shape {list(t.meta.shape)}, which disagrees with the "
                f"metadata: its dim {axis.dim} holds the layer's {what}, {size} by "
                f"{why}{_packing(axis, scheme, t.fmt, spec)}, so it must be "
                f"{want}, not {found}{_DISAGREE}"
            )
    group = scheme.group_size
    if axes.grouped and axes.k is not None and group > 0 and k_in and k_in % group:
        raise refuse(
            f"is quantized in groups of {scheme.explain('group_size')}, which do "
            f"not tile the layer's {k_in} input features ({k_why}); the group size "
            "must divide them"
        )


def vocab_from_tensors(ckpt: Checkpoint, spec: ModelSpec) -> ModelSpec:
    """``spec`` with the vocabulary taken from the embeddings' rows where the metadata gives
    none (a GGUF without ``<arch>.vocab_size``); unchanged otherwise."""
    if spec.vocab_size:
        return spec
    for name, meta in ckpt.metadata().items():
        role = spec.rules.role_of(name)
        if role is not None and role.kind == "vocab" and meta.shape:
            keys = dict(spec.keys)
            keys["vocab_size"] = (
                f"{keys.get('vocab_size', 'vocab_size')} (absent, so the rows of {name})"
            )
            return dataclasses.replace(spec, vocab_size=meta.shape[0], keys=keys)
    return spec
