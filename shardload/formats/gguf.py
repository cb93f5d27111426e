"""GGUF (llama.cpp): raw ggml blocks, mixed types per tensor (Q4_K_M mixes Q4_K, Q5_0, Q6_K,
Q8_0).

A row (``ne1``, HF's output row N) is ``K / block`` blocks of ``type_size`` bytes: rows split
anywhere, K only at block boundaries (32 elements for Q4_0/Q4_1/Q5_x/Q8_0, 256 for the
K-quants). 3-D expert tensors (``ffn_*_exps``) carry the experts first. Dequantization is
gguf-py's own (``gguf.quants.dequantize``).
"""

from __future__ import annotations

from .base import Axis, QuantFormat, TensorAxes, need


class GGUF(QuantFormat):
    name = "gguf"
    description = "GGUF (all block types, mixed per tensor as in Q4_K_M)"
    recognised_by = "a .gguf file"
    parts = ("weight",)
    hf_style = False

    def describe(self, scheme) -> str:
        return "gguf"

    def tensor_axes(self, scheme, suffix, meta, fmt):
        lead = len(meta.shape) - 2  # 3-D expert tensors carry the experts first
        if lead < 0:
            return None
        block, size = (fmt or {}).get("block_size", 1), (fmt or {}).get("type_size", 1)
        quantized = block > 1
        return TensorAxes(Axis(lead), Axis(lead + 1, block, size) if quantized else Axis(lead + 1))

    def stored_as(self, fmt):
        return f"{(fmt or {}).get('ggml_type', 'quantized')} blocks"

    def is_quantized(self, parts) -> bool:
        return True

    def dense(self, parts, scheme, ggml_types):
        import numpy as np
        import torch
        from gguf import GGMLQuantizationType  # only GGUF checkpoints need gguf-py
        from gguf.quants import dequantize

        weight, ggml_type = need(parts, "weight"), ggml_types.get("weight")
        if ggml_type is None:
            raise ValueError(
                "a GGUF weight of raw blocks needs its ggml type: ggml_types={'weight': 'Q4_K'}"
            )
        qtype = (
            GGMLQuantizationType[ggml_type]
            if isinstance(ggml_type, str)
            else GGMLQuantizationType(ggml_type)
        )
        values = dequantize(weight.cpu().numpy(), qtype)  # ggml rows are HF rows: [.., N, K]
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(weight.device)


FORMAT = GGUF()
