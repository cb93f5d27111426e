"""What a tensor's role in a decoder layer means for splitting it: one table of role objects.

A role (``q``, ``k``, ``o``, ``gate_up``, ``embed``, ...) says, for a layer ``y = x Wᵀ`` with
``W [N_out, K_in]``:

* its **parallel style**: column-parallel roles split N (their output rows), row-parallel ones
  (``o``, ``down``) split K and the workers' outputs are summed;
* its **units**: the whole things a split may not cut: query heads, KV heads (which may instead
  be replicated to the workers whose query heads use them: negative unit counts), MLP rows,
  vocabulary rows; a fused tensor is a list of **segments**, each split on its own;
* its **extents**: the logical N and K of the layer, with the config keys they come from, which
  every stored tensor is checked against (``checks.py``);
* for zero-padded plans, the **units each worker takes** (``-1``: a zero unit).

Adding a structurally new tensor is one more role here; an architecture names its tensors'
roles in its table row (``architectures.py``), never in code.

>>> ROLES["k"].segments(spec, "")                                    # doctest: +SKIP
[(256, -2)]                                       # 2 KV heads of 128: replicable
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import PlanError

if TYPE_CHECKING:  # pragma: no cover
    from .padding import Padding
    from .spec import ModelSpec

Segments = list[tuple[int, int]]  # (logical size, units); units < 0: replicable (KV heads)
Extent = tuple[int, str]  # a logical size along one axis, and where it came from

__all__ = [
    "ROLES",
    "Extent",
    "FusedHeads",
    "HeadRole",
    "MlpRole",
    "Role",
    "Segments",
    "VocabRole",
    "mlp_attr",
    "mlp_size",
]


# ---- the sizes roles are made of ---------------------------------------------------------------


def mlp_attr(spec: ModelSpec, kind: str) -> str:
    """Which of the spec's MLP sizes an MLP of ``kind`` (``naming.mlp_kind``: dense, experts,
    shared) has."""
    if kind == "shared":
        return "shared_expert_intermediate_size"
    if kind == "experts" and spec.moe_intermediate_size:
        return "moe_intermediate_size"
    return "intermediate_size"


def mlp_size(spec: ModelSpec, kind: str, module: str) -> int:
    attr = mlp_attr(spec, kind)
    size = getattr(spec, attr)
    if not size:
        raise PlanError(
            f"{module}: the model config gives no intermediate size for it "
            f"({spec.keys.get(attr, attr)} is absent)",
            source=spec.file or None,
        )
    return size


@dataclass(frozen=True)
class Width:
    """How many elements one head takes along the split axis, and how to say so."""

    value: Callable[[ModelSpec], int]
    text: Callable[[ModelSpec], str]
    #: the extent reads "<heads> heads of <width>" (False: the head count alone, width 1)
    per_head: bool = True


def _value_attr(spec: ModelSpec) -> str:
    return "value_head_dim" if spec.value_head_dim else "head_dim"


def _kv_b(spec: ModelSpec) -> int:
    """MLA: one head of ``kv_b_proj``'s output, its key part and its value."""
    assert spec.mla is not None, "kv_b is an MLA role"
    return spec.mla.qk_nope_head_dim + spec.v_head_dim


HEAD = Width(lambda s: s.head_dim, lambda s: s.explain("head_dim"))
VALUE_HEAD = Width(lambda s: s.v_head_dim, lambda s: s.explain(_value_attr(s)))
KV_B_HEAD = Width(_kv_b, lambda s: f"'qk_nope_head_dim' + 'v_head_dim' = {_kv_b(s)}")
ONE = Width(lambda s: 1, lambda s: "1", per_head=False)

#: the axis a role does not split: the hidden state, an MLA latent, or none (a vector)
Other = Callable[["ModelSpec"], Extent]


def _hidden(spec: ModelSpec) -> Extent:
    return spec.hidden_size, spec.explain("hidden_size")


def _q_latent(spec: ModelSpec) -> Extent:
    assert spec.mla is not None, "q_b is an MLA role"
    return spec.mla.q_lora_rank, repr("q_lora_rank")


def _kv_latent(spec: ModelSpec) -> Extent:
    assert spec.mla is not None, "kv_b is an MLA role"
    return spec.mla.kv_lora_rank, repr("kv_lora_rank")


def _no_input(spec: ModelSpec) -> Extent:
    return 0, ""


# ---- the roles ---------------------------------------------------------------------------------


class Role:
    """One role. ``column``: it splits N (else K); ``kind``: what its units are (``heads``,
    ``mlp``, ``vocab``: the vocabulary is never zero-padded); ``vector``: when its ``weight``
    is one vector over the split rows, never quantized (a norm over a whole projection,
    attention sinks), what those rows are, for messages ("the projection's")."""

    name: str
    column: bool = True
    kind: str = "heads"
    vector: str = ""

    @property
    def paddable(self) -> bool:
        return self.kind != "vocab"

    def extents(self, spec: ModelSpec, mlp: str) -> tuple[Extent, Extent]:
        """(output features N, input features K) of the layer, each with its provenance."""
        raise NotImplementedError

    def segments(self, spec: ModelSpec, mlp: str, module: str = "") -> Segments:
        """The logical split along the axis the role splits."""
        raise NotImplementedError

    def labels(self, spec: ModelSpec, mlp: str, module: str = "") -> list[str]:
        """What the units of each segment are, with the keys saying so."""
        raise NotImplementedError

    def head_width(self, spec: ModelSpec) -> int:
        """Elements one unit takes (heads: the head's width)."""
        raise NotImplementedError

    def padded_units(
        self, spec: ModelSpec, padding: Padding, mlp: str, module: str, worker: int
    ) -> tuple[int, list[int]]:
        """(logical elements per unit, the units worker ``worker`` takes) for a padded plan."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<role {self.name}>"


def _shift(units: list[int], by: int) -> list[int]:
    return [u + by if u >= 0 else -1 for u in units]


class HeadRole(Role):
    """A tensor split in attention heads: query heads (``query``: they split, never replicate)
    or KV heads (replicable when the workers outnumber them), each ``width`` wide."""

    def __init__(
        self,
        name: str,
        *,
        query: bool,
        width: Width = HEAD,
        column: bool = True,
        other: Other = _hidden,
        vector: str = "",
    ):
        self.name, self.query, self.width, self.column = name, query, width, column
        self.other, self.vector = other, vector

    def _count(self, spec: ModelSpec) -> tuple[int, str]:
        attr = "num_heads" if self.query else "num_kv_heads"
        return getattr(spec, attr), spec.explain(attr)

    def extents(self, spec, mlp):
        count, count_text = self._count(spec)
        text = (
            f"{count_text} heads of {self.width.text(spec)}" if self.width.per_head else count_text
        )
        split = (count * self.width.value(spec), text)
        other = self.other(spec)
        return (split, other) if self.column else (other, split)

    def segments(self, spec, mlp, module=""):
        count, _ = self._count(spec)
        return [(count * self.width.value(spec), count if self.query else -count)]

    def labels(self, spec, mlp, module=""):
        if self.query:
            return [f"the {spec.num_heads} query heads ({spec.explain('num_heads')})"]
        return [f"the {spec.num_kv_heads} KV heads ({spec.explain('num_kv_heads')})"]

    def head_width(self, spec):
        return self.width.value(spec)

    def padded_units(self, spec, padding, mlp, module, worker):
        heads = padding.heads.q_heads if self.query else padding.heads.kv_heads
        return self.width.value(spec), heads[worker]


class FusedHeads(Role):
    """A fused projection of head roles (``qkv_proj``: [q, k, v]), each part split on its own
    and re-concatenated per worker."""

    def __init__(self, name: str, parts: tuple[HeadRole, ...]):
        self.name, self.parts = name, parts

    def extents(self, spec, mlp):
        splits = [part.extents(spec, mlp)[0] for part in self.parts]
        return (
            (sum(size for size, _ in splits), ", plus ".join(text for _, text in splits)),
            _hidden(spec),
        )

    def segments(self, spec, mlp, module=""):
        return [s for part in self.parts for s in part.segments(spec, mlp, module)]

    def labels(self, spec, mlp, module=""):
        return [label for part in self.parts for label in part.labels(spec, mlp, module)]

    def head_width(self, spec):
        return spec.head_dim

    def padded_units(self, spec, padding, mlp, module, worker):
        units, offset = [], 0
        for part in self.parts:
            _, taken = part.padded_units(spec, padding, mlp, module, worker)
            units += _shift(taken, offset)
            offset += part._count(spec)[0]
        return spec.head_dim, units


class MlpRole(Role):
    """A tensor split in MLP rows (an MLP's, a routed expert's or a shared expert's: ``mlp`` is
    the kind, ``naming.mlp_kind``); ``parts`` 2 for a fused [gate, up]."""

    kind = "mlp"

    def __init__(self, name: str, *, column: bool, parts: int = 1):
        self.name, self.column, self.parts = name, column, parts

    def extents(self, spec, mlp):
        attr = mlp_attr(spec, mlp)
        inter = (getattr(spec, attr), spec.explain(attr))
        if not self.column:
            return _hidden(spec), inter
        if self.parts == 2:
            return (2 * inter[0], f"2 x {inter[1]}"), _hidden(spec)
        return inter, _hidden(spec)

    def segments(self, spec, mlp, module=""):
        size = mlp_size(spec, mlp, module)
        return [(size, size)] * self.parts

    def labels(self, spec, mlp, module=""):
        size = mlp_size(spec, mlp, module)
        return [f"the {size} MLP rows ({spec.explain(mlp_attr(spec, mlp))})"] * self.parts

    def head_width(self, spec):
        raise AssertionError("MLP rows are no heads")

    def padded_units(self, spec, padding, mlp, module, worker):
        size = mlp_size(spec, mlp, module)
        blocks = padding.mlp[size][worker]
        if self.parts == 2:
            return padding.mlp_unit, blocks + _shift(blocks, size // padding.mlp_unit)
        return padding.mlp_unit, blocks


class VocabRole(Role):
    """Embeddings and lm_head: replicated, or split in vocabulary rows (``vocab_parallel``),
    never padded."""

    kind = "vocab"

    def __init__(self, name: str):
        self.name = name

    def extents(self, spec, mlp):
        return (spec.vocab_size, spec.explain("vocab_size")), _hidden(spec)

    def segments(self, spec, mlp, module=""):
        return [(spec.vocab_size, spec.vocab_size)]

    def labels(self, spec, mlp, module=""):
        return [f"the {spec.vocab_size} vocabulary rows ({spec.explain('vocab_size')})"]

    def head_width(self, spec):
        raise AssertionError("vocabulary rows are no heads")

    def padded_units(self, spec, padding, mlp, module, worker):
        raise AssertionError("the vocabulary is never padded")


_Q = HeadRole("q", query=True)
_K = HeadRole("k", query=False)
_V = HeadRole("v", query=False, width=VALUE_HEAD)

#: every role, by name
ROLES: dict[str, Role] = {
    role.name: role
    for role in (
        _Q,
        _K,
        _V,
        FusedHeads("qkv", (_Q, _K, _V)),
        HeadRole("o", query=True, width=VALUE_HEAD, column=False),
        MlpRole("gate", column=True),
        MlpRole("up", column=True),
        MlpRole("gate_up", column=True, parts=2),
        MlpRole("down", column=False),
        VocabRole("embed"),
        VocabRole("lm_head"),
        # norms over a whole projection (OLMo-2's q_norm, k_norm): one weight per projection row,
        # split like the rows of the projection they normalise
        HeadRole("q_norm", query=True, other=_no_input, vector="the projection's"),
        HeadRole("k_norm", query=False, other=_no_input, vector="the projection's"),
        # DeepSeek's MLA: query heads from the q latent, key-and-value heads from the kv latent
        HeadRole("q_b", query=True, other=_q_latent),
        HeadRole("kv_b", query=True, width=KV_B_HEAD, other=_kv_latent),
        # gpt-oss: one attention sink (a learned logit) per query head
        HeadRole("sinks", query=True, width=ONE, other=_no_input, vector="the query heads'"),
    )
}


def role(name: str | None) -> Role | None:
    """The role named ``name`` (``None`` for ``None``: replicated)."""
    return None if name is None else ROLES[name]
