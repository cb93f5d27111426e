"""Tiny DeepSeek checkpoints in block FP8 as DeepSeek stores it, written by transformers' own
FP8 quantizer (``FineGrainedFP8Config``), and transformers' own block-FP8 dequantizer.

Each quantized linear layer is saved as ``weight`` float8_e4m3fn [N, K] plus
``weight_scale_inv`` float32 [N/128, K/128] (weight * scale per 128x128 block), routed experts
as per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` with their own scales; embeddings,
``lm_head`` and norms stay bfloat16, the router ``mlp.gate.weight`` (and V3's
``e_score_correction_bias``) float32, as transformers keeps them.

Needs transformers >= 5 and torch with float8 (CPU is enough; accelerate is not needed). Two
transformers limitations are worked around with its own API, nothing is written by hand:
- on-the-fly FP8 quantization refuses to start without a GPU (``validate_environment``), although
  the quantization itself (``Fp8Quantize``) is plain torch: the GPU guard is skipped on CPU;
- ``save_pretrained`` after on-the-fly quantization keeps the MoE expert scales fused
  (``experts.gate_up_proj_scale_inv``) because the scale converters were unused while loading the
  float checkpoint: the model's conversion mapping is rebuilt with the quantizer before saving.
transformers' quantizer only tiles dimensions that are multiples of 128 (it silently leaves
other layers unquantized), so ``write_deepseek_fp8`` refuses such configs; ``tiny_v3_config``
uses ``qk_rope_head_dim=128`` so that ``kv_a_proj_with_mqa`` (kv_lora_rank + rope rows) is one.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

import torch

BLOCK = (128, 128)

# What DeepSeek-V3's own config.json says; transformers writes its own fields instead (see
# ``deepseek_quant_config``).
DEEPSEEK_QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def tiny_v3_config():
    """The tiny DeepSeek-V3 (MLA with q_lora, 1 dense layer then 1 MoE layer)."""
    import transformers

    return transformers.DeepseekV3Config(
        hidden_size=256,
        intermediate_size=384,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=256,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=128,
        v_head_dim=128,
        n_group=2,
        topk_group=1,
    )


def tiny_v2_config():
    """The tiny DeepSeek-V2 variant without q_lora (``q_proj`` instead of ``q_a/q_b_proj``)."""
    import transformers

    return transformers.DeepseekV2Config(
        hidden_size=256,
        intermediate_size=384,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=256,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=128,
        v_head_dim=128,
        n_group=2,
        topk_group=1,
    )


@contextlib.contextmanager
def _cpu_quantization_allowed():
    """Skip only the "no GPU" refusal of transformers' FP8 quantizer (and its accelerate
    check); with a GPU its own checks run unchanged."""
    from transformers.quantizers import quantizer_finegrained_fp8 as qf

    original = qf.FineGrainedFP8HfQuantizer.validate_environment

    def validate_environment(self, *args, **kwargs):
        if torch.cuda.is_available():
            return original(self, *args, **kwargs)

    qf.FineGrainedFP8HfQuantizer.validate_environment = validate_environment
    try:
        yield
    finally:
        qf.FineGrainedFP8HfQuantizer.validate_environment = original


def write_deepseek_fp8(folder, config, deepseek_quant_config: bool = False) -> None:
    """Save a random model of ``config`` (bfloat16, ``torch.manual_seed(0)``) quantized to block
    FP8 by transformers' ``FineGrainedFP8Config(weight_block_size=[128, 128])`` to ``folder``.

    ``config.json`` gets transformers' ``quantization_config`` (quant_method fp8,
    activation_scheme dynamic, weight_block_size, scale_fmt "float", dequantize false, ...; no
    ``fmt``); ``deepseek_quant_config=True`` replaces it by DeepSeek's own four fields."""
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
    from transformers.quantizers.base import HfQuantizer

    folder = Path(folder)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(tmp)
        del model
        with _cpu_quantization_allowed():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tmp,
                dtype=torch.bfloat16,
                quantization_config=transformers.FineGrainedFP8Config(
                    weight_block_size=list(BLOCK)
                ),
            )
    # Fp8Quantize leaves a layer whose shape is not a multiple of the block unquantized (and
    # its weight_scale_inv uninitialized): refuse rather than write such a checkpoint
    for name, module in model.named_modules():
        if isinstance(module, (FP8Linear, FP8Experts)):
            for pname, param in module.named_parameters(recurse=False):
                if not pname.endswith(("scale_inv", "bias")) and param.dtype != torch.float8_e4m3fn:
                    raise ValueError(
                        f"{name}.{pname} {tuple(param.shape)} was not quantized by "
                        f"transformers: its dims must be multiples of {BLOCK}"
                    )
    # Save the expert scales per expert (DeepSeek's layout), not fused: the model's mapping plus
    # the scale converters of the base quantizer class (the FP8 subclass would also prepend its
    # load-time renamings `.scale`/`.qscale_weight` -> `.weight_scale_inv`, which saving reverses)
    model._weight_conversions = HfQuantizer.update_weight_conversions(
        model.hf_quantizer, get_model_conversion_mapping(model, add_legacy=False), model
    )
    model.save_pretrained(folder)
    if deepseek_quant_config:
        path = folder / "config.json"
        written = json.loads(path.read_text())
        written["quantization_config"] = dict(DEEPSEEK_QUANT_CONFIG)
        path.write_text(json.dumps(written, indent=2) + "\n")


def dequantize(weight: torch.Tensor, weight_scale_inv: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """float32 ``weight * weight_scale_inv`` per ``block``, by transformers' own
    ``transformers.integrations.finegrained_fp8._dequantize_fp8_weight(weight, weight_scale_inv,
    block_size, dtype)`` (pure torch, runs on CPU; what ``FP8Linear`` uses for its backward).
    Unlike ``Fp8Dequantize`` (the load-time op, which infers the block from the scale grid and
    needs exact division) it takes the block explicitly and handles partial edge blocks
    (scale grid ceil(N/128) x ceil(K/128)). ``weight`` may have leading (expert) dims."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    if weight.dtype == torch.float32:  # the function multiplies a float copy in place
        weight = weight.clone()
    return _dequantize_fp8_weight(weight, weight_scale_inv, list(block), torch.float32)
