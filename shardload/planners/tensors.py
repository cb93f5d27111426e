"""A checkpoint's tensors as the planner sees them: each with its module, role and axes.

The one place a tensor's name is turned into what planning needs of it: its role (the
architecture's row, in its naming scheme: ``architectures.Architecture.role_of``), which MLP it
belongs to (``naming.NamingScheme.mlp_kind``), and where the layer's N and K lie in it (the
architecture's own rule, a role's vector, or the format's ``axes``).

A large checkpoint is mostly repetition: DeepSeek-V3's 91,991 tensors are 61 layers alike and
256 experts alike, about 60 kinds of tensor. ``walk`` classifies each kind once: tensors whose
names differ only in their index components (``layers.7``, ``experts.12``) and that share shape,
dtype and stored format are classified alike, because nothing that classifies a tensor reads an
index (roles come from the names' words, axes from the format and the shape). The planner's
passes then work out each kind's answer once and stamp it on every tensor of the kind, in
storage order, so that what they note and refuse first is what a pass over every tensor would.
``tests/test_planner_walk.py`` checks every tensor's kind against ``tensors``, the classifier
of one tensor at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..formats import Axis, Scheme, TensorAxes
from .roles import Role

if TYPE_CHECKING:  # pragma: no cover
    from ..readers.base import Checkpoint, TensorMeta
    from .spec import ModelSpec

__all__ = ["Tensor", "Walk", "role_axes", "tensors", "walk"]

#: an index component of a name (``.7.``): at most 9 digits, as naming.py reads expert indices
_INDEX = re.compile(r"\.[0-9]{1,9}(?=\.)")


@dataclass(frozen=True)
class Tensor:
    """One stored tensor: ``role`` None (replicated) or the role of its module, ``mlp`` the MLP
    kind of its module (``dense``, ``experts``, ``shared``), ``axes`` where N and K lie in it
    (None: it holds neither, so it is replicated)."""

    name: str
    meta: TensorMeta
    module: str
    suffix: str
    role: Role | None
    mlp: str
    axes: TensorAxes | None
    fmt: Mapping[str, Any] | None

    def split(self) -> tuple[Role, TensorAxes]:
        """The role and axes of a tensor the planner splits (neither is None); ``ValueError``
        for a replicated one, which the planner's passes over split tensors never see."""
        if self.role is None or self.axes is None:
            raise ValueError(f"{self.name} is replicated: it has no role and axes to split by")
        return self.role, self.axes


def role_axes(
    scheme: Scheme,
    role: Role,
    name: str,
    meta: TensorMeta,
    fmt: Mapping[str, Any] | None,
    spec: ModelSpec,
) -> TensorAxes | None:
    """Where N and K lie in a tensor of a layer with ``role``: as the architecture's own rule
    says; a vector role's ``weight`` is one vector along N (never quantized); anything else as
    its format stores it."""
    rule = spec.rules.tensor_rule(name)
    if rule is not None:
        return rule.axes
    suffix = name.rpartition(".")[2]
    if role.vector:  # one vector over the heads' rows
        return TensorAxes(Axis(0), None) if suffix == "weight" else None
    return scheme.format.axes(scheme, suffix, meta, fmt)


def tensors(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme) -> Iterator[Tensor]:
    """Every tensor of ``ckpt``, in storage order, each classified on its own (``walk``
    classifies each kind once)."""
    for name, meta in ckpt.metadata().items():
        yield _classify(name, meta, ckpt.tensor_format(name), spec, scheme)


class Walk:
    """Every tensor of a checkpoint in storage order, each with its kind: the ``Tensor`` of the
    first tensor of its kind (``walk``). ``rows()`` gives ``(meta, kind)`` pairs, the planner's
    fast path; iterating gives every tensor's own ``Tensor``."""

    def __init__(self, metas: list[TensorMeta], kinds: list[Tensor]):
        self.metas, self.kinds = metas, kinds

    def __len__(self) -> int:
        return len(self.metas)

    def rows(self) -> Iterator[tuple[TensorMeta, Tensor]]:
        return zip(self.metas, self.kinds)

    @staticmethod
    def tensor(meta: TensorMeta, kind: Tensor) -> Tensor:
        """The tensor ``meta`` classified as its ``kind``."""
        if meta is kind.meta:
            return kind
        return Tensor(
            meta.name,
            meta,
            meta.name.rpartition(".")[0],
            kind.suffix,
            kind.role,
            kind.mlp,
            kind.axes,
            kind.fmt,
        )

    def __iter__(self) -> Iterator[Tensor]:
        return (self.tensor(meta, kind) for meta, kind in self.rows())


def walk(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme) -> Walk:
    """Every tensor of ``ckpt`` with its kind (see the module docstring): ``tensors``'s
    classification, worked out once per kind."""
    by_key: dict[tuple, Tensor] = {}
    metas = list(ckpt.metadata().values())
    kinds = []
    fmt_of = ckpt.tensor_format
    for meta, pattern in zip(metas, _patterns([meta.name for meta in metas])):
        fmt = fmt_of(meta.name)
        key = (pattern, meta.shape, meta.dtype, None if fmt is None else repr(sorted(fmt.items())))
        kind = by_key.get(key)
        if kind is None:
            kind = by_key[key] = _classify(meta.name, meta, fmt, spec, scheme)
        kinds.append(kind)
    return Walk(metas, kinds)


def _patterns(names: list[str]) -> list[str]:
    """Each name with its index components replaced by ``#``: in one pass of the regular
    expression over all the names joined, unless a name holds the line break that joins them."""
    joined = "\n".join(names)
    out = _INDEX.sub(".#", joined).split("\n")
    if len(out) != len(names):
        out = [_INDEX.sub(".#", name) for name in names]
    return out


def _classify(
    name: str, meta: TensorMeta, fmt: Mapping[str, Any] | None, spec: ModelSpec, scheme: Scheme
) -> Tensor:
    module, _, suffix = name.rpartition(".")
    role = spec.rules.role_of(name)
    if role is None:
        return Tensor(name, meta, module, suffix, None, "dense", None, None)
    return Tensor(
        name,
        meta,
        module,
        suffix,
        role,
        spec.rules.naming.mlp_kind(module),
        role_axes(scheme, role, name, meta, fmt, spec),
        fmt,
    )
