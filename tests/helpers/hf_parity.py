"""What the TP-model parity tests compare with transformers' own answers: the prompt and the
16 greedy tokens (``PROMPT``, ``NEW_TOKENS``), the tolerance on the logits (``TOLERANCE``,
relative: ``relative``), the reference's answers (``answers``, kept by ``Reference``), the sizes
of the tiny quantized checkpoints (``QUANT_SIZES``), and ``randomise``, which draws a random
model's constant-initialised parameters so that a mis-sharded one shows."""

from __future__ import annotations

import torch

PROMPT = [[3, 17, 42, 5, 88, 11, 60, 29]]  # token ids < 96, every tiny vocabulary
NEW_TOKENS = 16
TOLERANCE = 1e-3  # max |TP - reference| / max |reference|, float32

#: the quantized checkpoints: sizes where every N of 1..4 plans (one head = one 32-group of
#: o_proj's inputs; 256 MLP rows), as tests/test_formats_compressed_tensors.py has them, with 2
#: layers
QUANT_SIZES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
)


def randomise(model) -> None:
    """Biases, norms and every other constant-initialised parameter (gpt-oss's sinks, Gemma's
    zero-centred norms) drawn at random, so that any of them taken from the wrong worker, added
    N times or dropped changes the logits; DeepSeek-V3's router bias ~ N(0, 0.01) (small enough
    that the router still picks every expert group, as in test_planner_deepseek)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            first = float(param.flatten()[0])
            if name.endswith("bias"):
                param.normal_(0.0, 0.05)
            elif "norm" in name or (param.numel() > 1 and bool((param == first).all())):
                param.normal_(first, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.01)


def answers(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits float32, greedy tokens) of a transformers model for ``PROMPT``; all 16 tokens,
    as ``TPModel.generate`` without ``eos_token_id`` gives them (the tiny OLMo-2 picks its EOS
    at once)."""
    ids = torch.tensor(PROMPT)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        logits = model(ids).logits.float()
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return logits, tokens


class Reference:
    """A checkpoint folder and its reference model's answers (logits, 16 greedy tokens)."""

    def __init__(self, folder, model):
        self.folder = folder
        self.logits, self.tokens = answers(model)
        # every one of the 16 tokens is compared: the reference does not stop at an EOS
        assert self.tokens.shape == (1, len(PROMPT[0]) + NEW_TOKENS)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the difference ``TOLERANCE`` bounds."""
    return ((got - want).abs().max() / want.abs().max()).item()
