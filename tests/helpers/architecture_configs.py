"""The tiny transformers configs of the architectures beyond Llama the planner knows (Gemma 2,
Gemma 3 text and multimodal, Phi-3, OLMo-2, Granite): ``CONFIGS`` (name -> config maker) and
``SMALL``, the sizes they share (4 query heads, 2 KV heads, hidden 64, MLP 128, 2 layers).
Saved by the planner's architecture tests, and reused by the TP-model parity tests."""

from __future__ import annotations

import transformers

HEADS, KV_HEADS, HIDDEN, INTER, VOCAB = 4, 2, 64, 128, 96
SMALL = dict(
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    vocab_size=VOCAB,
)
GEMMA_HEAD_DIM = 24  # explicit, and not hidden / heads (16)


def _gemma3_multimodal(**text):
    return transformers.Gemma3Config(
        text_config=dict(SMALL, head_dim=GEMMA_HEAD_DIM, **text),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        image_token_index=90,
        boi_token_index=91,
        eoi_token_index=92,
    )


CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(head_dim=GEMMA_HEAD_DIM, **SMALL),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(head_dim=GEMMA_HEAD_DIM, **SMALL),
    "gemma3": _gemma3_multimodal,
    "phi3": lambda: transformers.Phi3Config(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **SMALL
    ),
    "olmo2": lambda: transformers.Olmo2Config(pad_token_id=0, eos_token_id=1, **SMALL),
    "granite": lambda: transformers.GraniteConfig(
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=8.0,
        **SMALL,
    ),
}
