"""What a planner must know of a model: its geometry, from HF, GGUF or MLC metadata.

Every field is read through ``config_fields.Fields``: typed, range-checked, and refused with a
``FormatError`` naming the file and the key. The sizes read here are later checked against the
tensors they are applied to (``checks.check_shapes``); ``ModelSpec.keys`` remembers which key each
size came from, so that a disagreement names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config_fields import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_WIDTH, Fields
from ..errors import PlanError
from .architectures import (
    ARCHITECTURES,
    GGUF_ARCHITECTURES,
    LLAMA_RULES,
    MLC_ARCHITECTURES,
    Architecture,
)


@dataclass(frozen=True)
class ModelSpec:
    """The sizes that decide how a Llama-family model may be split.

    ``file`` is the metadata file they were read from and ``keys`` the key each size came from
    (``{"num_heads": "'num_attention_heads'"}``), for messages. ``rules``: what the planner
    knows of the architecture (``ARCHITECTURES``; ``GGUF_ARCHITECTURES`` for GGUF;
    Llama's for MLC).
    """

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    value_head_dim: int = 0  # GGUF's value_length, MLA's v_head_dim: 0 = head_dim
    mla: MLA | None = None
    rules: Architecture = field(default=LLAMA_RULES, compare=False)
    file: str = field(default="", compare=False)
    keys: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def v_head_dim(self) -> int:
        """The width of a value head (the planner supports only ``head_dim``)."""
        return self.value_head_dim or self.head_dim

    def explain(self, attr: str) -> str:
        """``'hidden_size' = 256``: a size with the key it came from."""
        return f"{self.keys.get(attr, attr)} = {getattr(self, attr)}"


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3): queries from a rank
    ``q_lora_rank`` latent (0: straight from the hidden state, ``q_proj``), keys and values from
    a rank ``kv_lora_rank`` latent through ``kv_b_proj``; a query head is ``qk_nope_head_dim +
    qk_rope_head_dim`` wide (``ModelSpec.head_dim``), a value head ``v_head_dim``."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int


def _mla(cfg: Fields, spec: ModelSpec) -> ModelSpec:
    """``spec`` with MLA's sizes: heads of ``qk_nope + qk_rope`` (transformers' ``head_dim``
    for DeepSeek is the rope part alone), value heads of ``v_head_dim``, as many KV heads as
    query heads after ``kv_b_proj``, and the shared experts ``n_shared_experts`` experts wide."""
    nope = cfg.int("qk_nope_head_dim", min=1, max=MAX_HEAD_DIM)
    rope = cfg.int("qk_rope_head_dim", min=1, max=MAX_HEAD_DIM)
    v = cfg.int("v_head_dim", min=1, max=MAX_HEAD_DIM)
    mla = MLA(
        cfg.int("q_lora_rank", min=1, max=MAX_WIDTH, default=0, nullable=True),
        cfg.int("kv_lora_rank", min=1, max=MAX_WIDTH),
        nope,
        rope,
    )
    shared = cfg.int("n_shared_experts", min=1, max=MAX_HEADS, default=0, nullable=True)
    keys = dict(spec.keys)
    keys["head_dim"] = f"{cfg.name('qk_nope_head_dim')!r} + {cfg.name('qk_rope_head_dim')!r}"
    keys["value_head_dim"] = repr(cfg.name("v_head_dim"))
    keys["num_kv_heads"] = f"{keys['num_heads']} (MLA: one key and value head per query head)"
    keys["shared_expert_intermediate_size"] = (
        f"{keys['moe_intermediate_size']} x {cfg.name('n_shared_experts')!r}"
    )
    return dataclasses.replace(
        spec,
        head_dim=nope + rope,
        value_head_dim=v,
        num_kv_heads=spec.num_heads,
        shared_expert_intermediate_size=spec.moe_intermediate_size * shared,
        mla=mla,
        keys=keys,
    )


def _as_fields(config: Fields | Mapping[str, Any], source: str | None) -> Fields:
    return config if isinstance(config, Fields) else Fields(config, file=source or "<config>")


def _kv_heads(cfg: Fields, key: str, heads_key: str, heads: int, default: int | None = None) -> int:
    """The KV head count: an integer dividing the query heads (so at most as many)."""
    kv = cfg.int(
        key, min=1, max=MAX_HEADS, default=heads if default is None else default, nullable=True
    )
    if heads % kv:
        raise cfg.error(
            key,
            f"is {kv}, which does not divide {cfg.name(heads_key)!r} = "
            f"{heads}: each KV head serves a whole group of query heads, so it "
            f"must be a divisor of {heads}",
        )
    return kv


def _head_dim(
    cfg: Fields,
    key: str,
    hidden_key: str,
    hidden: int,
    heads_key: str,
    heads: int,
    nullable: bool,
    default: int | None = None,
) -> tuple[int, str]:
    """``(head_dim, how it was found)``: the key, or hidden / heads when it is absent (or the
    architecture's ``default``)."""
    if cfg.has(key, nullable=nullable):
        return cfg.int(key, min=1, max=MAX_HEAD_DIM), repr(cfg.name(key))
    if default is not None:
        return default, f"{cfg.name(key)!r} (absent, so its default {default})"
    if hidden % heads:
        raise cfg.error(
            hidden_key,
            f"is {hidden}, which {cfg.name(heads_key)!r} = {heads} does "
            f"not divide; with no {cfg.name(key)!r} the head size is "
            f"{cfg.name(hidden_key)} / {cfg.name(heads_key)}, so give "
            f"{cfg.name(key)!r}",
        )
    return hidden // heads, (
        f"{cfg.name(key)!r} (absent, so {cfg.name(hidden_key)!r} / {cfg.name(heads_key)!r})"
    )


def _hf_spec(
    cfg: Fields, model_type: str, layers_key: str, rules: Architecture = LLAMA_RULES
) -> ModelSpec:
    """The sizes of an HF-style config (``config.json``, or MLC's ``model_config``)."""
    given = rules.defaults

    def size(key: str, limit: int, **kw) -> int:
        if key in given:
            kw = dict(kw, default=given[key], nullable=True)
        return cfg.int(key, min=1, max=limit, **kw)

    heads = size("num_attention_heads", MAX_HEADS)
    hidden = size("hidden_size", MAX_WIDTH)
    kv = _kv_heads(
        cfg, "num_key_value_heads", "num_attention_heads", heads, given.get("num_key_value_heads")
    )
    head_dim, head_dim_key = _head_dim(
        cfg,
        "head_dim",
        "hidden_size",
        hidden,
        "num_attention_heads",
        heads,
        nullable=True,
        default=given.get("head_dim"),
    )
    layers = size(layers_key, MAX_LAYERS)
    vocab = size("vocab_size", MAX_WIDTH)
    inter = size(
        "intermediate_size",
        MAX_WIDTH,
        **({} if "intermediate_size" in given else dict(default=0, nullable=True)),
    )
    keys = {
        "hidden_size": "hidden_size",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "num_layers": layers_key,
        "intermediate_size": "intermediate_size",
        "vocab_size": "vocab_size",
        "moe_intermediate_size": "moe_intermediate_size",
        "shared_expert_intermediate_size": "shared_expert_intermediate_size",
    }
    absent = {
        attr: given[key]
        for attr, key in keys.items()
        if key in given and not cfg.has(key, nullable=True)
    }
    keys = {attr: repr(cfg.name(key)) for attr, key in keys.items()}
    for attr, value in absent.items():
        keys[attr] += f" (absent, so its default {value})"
    keys["head_dim"] = head_dim_key
    if not cfg.has("num_key_value_heads", nullable=True) and "num_kv_heads" not in absent:
        keys["num_kv_heads"] = f"{keys['num_kv_heads']} (absent, so {keys['num_heads']})"
    moe = cfg.int("moe_intermediate_size", min=1, max=MAX_WIDTH, default=0, nullable=True)
    if rules.experts_size == "intermediate_size":
        # Mixtral's and gpt-oss's intermediate_size is the experts'
        moe, keys["moe_intermediate_size"] = inter, keys["intermediate_size"]
    shared = cfg.int(
        "shared_expert_intermediate_size", min=1, max=MAX_WIDTH, default=0, nullable=True
    )
    spec = ModelSpec(
        architecture=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        moe_intermediate_size=moe,
        shared_expert_intermediate_size=shared,
        rules=rules,
        file=cfg.file,
        keys=keys,
    )
    return _mla(cfg, spec) if rules.mla else spec


def spec_from_hf(config: Fields | Mapping[str, Any], source: str | None = None) -> ModelSpec:
    """From an HF ``config.json`` (as ``Fields``, or a dict and the file it came from)."""
    cfg = _as_fields(config, source)
    model_type = cfg.str("model_type")
    rules = ARCHITECTURES.get(model_type)
    if rules is None:
        raise PlanError(
            f"key 'model_type': model_type {model_type!r} is not supported by the "
            f"planner (it knows "
            f"{', '.join(sorted(ARCHITECTURES))}); write shard_info.json by hand, "
            "or register shard functions for it",
            source=cfg.file,
        )
    if rules.sizes_under:
        sizes = cfg.sub(rules.sizes_under, optional=True)
        cfg = (
            sizes if sizes is not None else Fields({}, file=cfg.file_label, path=rules.sizes_under)
        )
    return _hf_spec(cfg, model_type, "num_hidden_layers", rules)


def spec_from_gguf(kv: Fields | Mapping[str, Any], source: str | None = None) -> ModelSpec:
    """From GGUF key-values (``llama.attention.head_count`` ...).

    ``vocab_size`` is 0 when the file has no ``<arch>.vocab_size``: it is then a hint only, and
    the planner takes the vocabulary from the embeddings' shape.
    """
    top = _as_fields(kv, source)
    arch = top.str("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise PlanError(
            f"GGUF architecture {arch!r} (key 'general.architecture') is not "
            f"supported by the planner (it knows {', '.join(GGUF_ARCHITECTURES)})",
            source=top.file,
        )
    cfg = Fields(top.raw, file=top.file, prefix=f"{arch}.")
    heads = cfg.int("attention.head_count", min=1, max=MAX_HEADS)
    hidden = cfg.int("embedding_length", min=1, max=MAX_WIDTH)
    n_kv = _kv_heads(cfg, "attention.head_count_kv", "attention.head_count", heads)
    head_dim, head_dim_key = _head_dim(
        cfg,
        "attention.key_length",
        "embedding_length",
        hidden,
        "attention.head_count",
        heads,
        nullable=False,
    )
    # judged after the shapes are checked (llama.check_shapes): a wrong key_length is then
    # named as what disagrees with the tensors, not as an unsupported model
    value_dim = cfg.int("attention.value_length", min=1, max=MAX_HEAD_DIM, default=0)
    keys = {
        "hidden_size": "embedding_length",
        "num_heads": "attention.head_count",
        "num_kv_heads": "attention.head_count_kv",
        "num_layers": "block_count",
        "intermediate_size": "feed_forward_length",
        "vocab_size": "vocab_size",
        "moe_intermediate_size": "expert_feed_forward_length",
        "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    }
    keys = {attr: repr(cfg.name(key)) for attr, key in keys.items()}
    keys["head_dim"] = head_dim_key
    keys["value_head_dim"] = repr(cfg.name("attention.value_length"))
    if not cfg.has("attention.head_count_kv"):
        keys["num_kv_heads"] += f" (absent, so {keys['num_heads']})"

    def size(key: str) -> int:  # a width, 0 where the model has none
        return cfg.int(key, min=1, max=MAX_WIDTH, default=0)

    return ModelSpec(
        architecture=arch,
        num_layers=cfg.int("block_count", min=1, max=MAX_LAYERS),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=size("feed_forward_length"),
        vocab_size=size("vocab_size"),
        moe_intermediate_size=size("expert_feed_forward_length"),
        shared_expert_intermediate_size=size("expert_shared_feed_forward_length"),
        value_head_dim=value_dim,
        rules=GGUF_ARCHITECTURES[arch],
        file=cfg.file,
        keys=keys,
    )


def spec_from_mlc(config: Fields | Mapping[str, Any], source: str | None = None) -> ModelSpec:
    """From MLC's ``mlc-chat-config.json`` (its ``model_config`` holds HF-style sizes)."""
    top = _as_fields(config, source)
    model = top.sub("model_config")
    assert model is not None  # sub() gives None only where optional
    model_type = (
        model.str("model_type") if model.has("model_type", nullable=True) else top.str("model_type")
    )
    if model_type not in MLC_ARCHITECTURES:
        raise PlanError(
            f"key 'model_type': MLC model_type {model_type!r} is not supported by "
            f"the planner (it knows {', '.join(sorted(MLC_ARCHITECTURES))})",
            source=top.file,
        )
    layers_key = "num_hidden_layers" if model.has("num_hidden_layers") else "num_layers"
    return _hf_spec(model, model_type, layers_key, MLC_ARCHITECTURES[model_type])
