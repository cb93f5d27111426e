"""A checkpoint's tensors as the planner sees them: each with its module, role and axes.

The one place a tensor's name is turned into what planning needs of it: its role (the
architecture's row, in its naming scheme: ``architectures.Architecture.role_of``), which MLP it
belongs to (``naming.NamingScheme.mlp_kind``), and where the layer's N and K lie in it (the
architecture's own rule, a role's vector, or the format's ``axes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

from ..formats import Axis, Scheme, TensorAxes
from .roles import Role

if TYPE_CHECKING:  # pragma: no cover
    from ..readers.base import Checkpoint, TensorMeta
    from .spec import ModelSpec

__all__ = ["Tensor", "tensors", "role_axes"]


@dataclass(frozen=True)
class Tensor:
    """One stored tensor: ``role`` None (replicated) or the role of its module, ``mlp`` the MLP
    kind of its module (``dense``, ``experts``, ``shared``), ``axes`` where N and K lie in it
    (None: it holds neither, so it is replicated)."""

    name: str
    meta: "TensorMeta"
    module: str
    suffix: str
    role: Optional[Role]
    mlp: str
    axes: Optional[TensorAxes]
    fmt: Optional[Mapping[str, Any]]


def role_axes(scheme: Scheme, role: Role, name: str, meta: "TensorMeta",
              fmt: Optional[Mapping[str, Any]], spec: "ModelSpec") -> Optional[TensorAxes]:
    """Where N and K lie in a tensor of a layer with ``role``: as the architecture's own rule
    says; a vector role's ``weight`` is one vector along N (never quantized); anything else as
    its format stores it."""
    rule = spec.rules.tensor_rule(name)
    if rule is not None:
        return rule.axes
    suffix = name.rpartition(".")[2]
    if role.vector:     # one vector over the heads' rows
        return TensorAxes(Axis(0), None) if suffix == "weight" else None
    return scheme.format.axes(scheme, suffix, meta, fmt)


def tensors(ckpt: "Checkpoint", spec: "ModelSpec", scheme: Scheme, *,
            vocab_parallel: bool = True) -> Iterator[Tensor]:
    """Every tensor of ``ckpt``, in storage order. Embeddings and lm_head have no role unless
    ``vocab_parallel`` (they are then replicated)."""
    naming = spec.rules.naming
    for name, meta in ckpt.metadata().items():
        module, _, suffix = name.rpartition(".")
        role = spec.rules.role_of(name)
        if role is None or (role.kind == "vocab" and not vocab_parallel):
            yield Tensor(name, meta, module, suffix, None, "dense", None, None)
            continue
        fmt = ckpt.tensor_format(name)
        yield Tensor(name, meta, module, suffix, role, naming.mlp_kind(module),
                     role_axes(scheme, role, name, meta, fmt, spec), fmt)
