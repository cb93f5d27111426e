"""Checkpoints quantized by GPTQModel itself, the tool most GPTQ checkpoints on the Hub come from.

Two halves, because GPTQModel lives in its own environment (``scripts/quant-tools-env.sh``):

* on the tests' side, ``quantize(source, out, ...)`` runs this file in that environment (or skips
  the calling test, or fails it where ``SHARDLOAD_REQUIRE_QUANT_TOOLS=1``, as CI sets);
* run as a script there, it quantizes the dense checkpoint ``source`` with GPTQModel's own
  ``GPTQModel.load(...).quantize(...)`` and ``save`` on the CPU, calibrated on seeded random
  token ids (the tiny test models have no vocabulary worth sampling), and writes ``out``.

    python tests/helpers/gptqmodel_tool.py SOURCE OUT --bits 4 --group 32 --desc-act

A source without tokenizer files is given the tests' character tokenizer for GPTQModel to load
(it insists on one); it is left out of ``out`` when the source had none, so an engine reads the
checkpoint as it read the source.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

#: files of a tokenizer, as ``save_pretrained`` writes them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tool_python() -> str:
    """The python of the quantization tools' environment (``helpers.environments``: made by
    ``scripts/quant-tools-env.sh``); without it the calling test skips, or fails where
    ``SHARDLOAD_REQUIRE_QUANT_TOOLS=1`` (CI)."""
    from helpers.environments import require

    return require("quant")


def quantize(
    source: Path,
    out: Path,
    *,
    bits: int = 4,
    group: int = 32,
    desc_act: bool = False,
    sym: bool = True,
    samples: int = 16,
) -> None:
    """``source`` quantized by GPTQModel into ``out`` (made by the caller, empty)."""
    cmd = [
        tool_python(),
        os.path.abspath(__file__),
        str(source),
        str(out),
        "--bits",
        str(bits),
        "--group",
        str(group),
        "--samples",
        str(samples),
    ]
    cmd += ["--desc-act"] if desc_act else []
    cmd += [] if sym else ["--asym"]
    # GPTQModel sizes its CPU pool at half the cores, and wants 2 workers in it
    env = {
        **os.environ,
        "GPTQMODEL_CPU_WORKERS": os.environ.get("GPTQMODEL_CPU_WORKERS", "2"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    with tempfile.TemporaryDirectory() as cwd:  # GPTQModel writes logs/ where it runs
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"GPTQModel failed on {source}:\n{(proc.stdout + proc.stderr)[-4000:]}")


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--desc-act", action="store_true")
    parser.add_argument("--asym", action="store_true")
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()

    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    had_tokenizer = (args.source / "tokenizer.json").exists()
    with tempfile.TemporaryDirectory() as tmp:
        source = args.source
        if not had_tokenizer:
            from helpers.tokenizer import char_tokenizer

            source = Path(tmp) / "source"
            shutil.copytree(args.source, source)
            char_tokenizer().save_pretrained(source)
        config = QuantizeConfig(
            bits=args.bits, group_size=args.group, desc_act=args.desc_act, sym=not args.asym
        )
        model = GPTQModel.load(str(source), config, device="cpu")
        vocab = model.model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        calibration = [
            {
                "input_ids": torch.randint(0, vocab, (1, 64), generator=generator),
                "attention_mask": torch.ones(1, 64, dtype=torch.long),
            }
            for _ in range(args.samples)
        ]
        model.quantize(calibration, batch_size=1)
        model.save(str(args.out))
    if not had_tokenizer:
        for name in TOKENIZER_FILES:
            (args.out / name).unlink(missing_ok=True)


if __name__ == "__main__":
    _main()
