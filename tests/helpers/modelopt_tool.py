"""NVFP4 checkpoints made by NVIDIA ModelOpt itself, and ModelOpt's own NVFP4 dequantizer: the
tool-side reference for ModelOpt-format (``quant_method: modelopt``, ``quant_algo: NVFP4``) tests.

Needs ``nvidia-modelopt`` (checked with 0.47.0 on torch 2.13 CPU, transformers 5.24; install it
with plain ``pip install nvidia-modelopt``, no extras: the ``[hf]`` extra pins
transformers<5.15). Runs on CPU, no GPU or env vars needed. ModelOpt is imported inside the
functions, so this module imports without it (importing it takes ~6 s: its quantization package
comes whole, even for the dequantizer).

Format written (per quantized linear; lm_head, embeddings, norms and MoE routers stay float):
``weight`` uint8 [N, K/2] (element k=2j in the low nibble of byte j, k=2j+1 in the high one),
``weight_scale`` float8_e4m3fn [N, K/16], ``weight_scale_2`` and ``input_scale`` float32 scalars;
value = E2M1(code) * float(weight_scale[n, k // 16]) * weight_scale_2.

``cached_modelopt_nvfp4`` keeps each export outside the repository, in
``real_models.cache_dir() / "modelopt-<version>" / "<name>-<hash>"`` (the hash is of the
config, transformers version included, and of ``RECIPE``), so a machine quantizes a given model
once: made in a temporary folder beside it and renamed into place, under a file lock.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path

import torch
import transformers

from .real_models import cache_dir

#: what ``write_modelopt_nvfp4`` does, in words; part of the cache key: change it whenever the
#: function changes what it writes, so that cached exports are made again
RECIPE = (
    "NVFP4_DEFAULT_CFG; torch.manual_seed(0) model; calibrated on 4x32 token ids "
    "(seed 1); export_hf_checkpoint"
)
#: NVFP4's group along K (one E4M3 scale per 16 weights): the only one it has
NVFP4_GROUP = 16


def modelopt_version() -> str:
    """The installed ModelOpt's version, read without importing it."""
    return version("nvidia-modelopt")


def _import_quiet():
    """ModelOpt's quantization and export packages, without the warnings importing them gives:
    this transformers is newer than those ModelOpt was tested with (known: see the module
    docstring), and its modules use ``torch.jit.script``, which torch deprecates."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"transformers .* is not tested with", category=UserWarning
        )
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.script", category=DeprecationWarning
        )
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
        from modelopt.torch.quantization.qtensor import NVFP4QTensor
    return mtq, export_hf_checkpoint, NVFP4QTensor


def write_modelopt_nvfp4(folder: Path, config) -> None:
    """A random model of ``config`` (seed 0) quantized by ModelOpt with ``NVFP4_DEFAULT_CFG``
    (calibrated on fixed random token ids) and exported with ``export_hf_checkpoint`` to
    ``folder`` (model.safetensors, config.json with ``quantization_config``,
    hf_quant_config.json). The caller's random state is left as it was."""
    mtq, export_hf_checkpoint, _ = _import_quiet()

    config = copy.deepcopy(config)
    if not config.architectures:  # the export's model-type checks iterate over it
        config.architectures = [
            transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__
        ]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))

    def forward_loop(m):
        with torch.no_grad():
            m(ids)

    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    export_hf_checkpoint(model, export_dir=str(folder))


def cache_key(config) -> str:
    """A hash of ``config`` (all its fields, and the transformers version it records) and of
    ``RECIPE``: a changed config or recipe is another export."""
    data = {"config": config.to_dict(), "recipe": RECIPE}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _complete(folder: Path) -> bool:
    return all(
        (folder / f).is_file() for f in ("config.json", "hf_quant_config.json", "model.safetensors")
    )


def cached_modelopt_nvfp4(name: str, config) -> Path:
    """The folder of ``write_modelopt_nvfp4(config)``, made the first time it is asked for on
    this machine and kept in ``cache_dir() / "modelopt-<version>" / "<name>-<cache_key>"``
    (``name`` only makes it readable). Concurrent test processes wait on a lock and make it
    once; the folder appears complete or not at all (made beside it, then renamed)."""
    parent = cache_dir() / f"modelopt-{modelopt_version()}"
    target = parent / f"{name}-{cache_key(config)}"
    if _complete(target):
        return target
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be making it: wait for it
        if _complete(target):
            return target
        if target.exists():  # incomplete (made by hand, or damaged): make it again
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{target.name}.", suffix=".part"))
        try:
            write_modelopt_nvfp4(tmp, config)
            if not _complete(tmp):
                raise RuntimeError(
                    f"ModelOpt's export to {tmp} lacks config.json, "
                    "hf_quant_config.json or model.safetensors"
                )
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700: other users of the cache may read it
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def dequantize(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """ModelOpt's own ``NVFP4QTensor.dequantize`` of one exported (possibly sharded) linear:
    packed uint8 ``weight`` [..., K/2], fp8 ``weight_scale`` [..., K/16], scalar
    ``weight_scale_2``; returns float32 [..., K]. Shapes that do not agree (a scale per other
    than 16 weights) are an error, not a block size to infer."""
    _, _, NVFP4QTensor = _import_quiet()

    shape = torch.Size([*weight.shape[:-1], weight.shape[-1] * 2])
    if (
        weight.dtype != torch.uint8
        or weight_scale.dtype != torch.float8_e4m3fn
        or weight_scale.shape != torch.Size([*shape[:-1], shape[-1] // NVFP4_GROUP])
        or shape[-1] % NVFP4_GROUP
        or weight_scale_2.numel() != 1
    ):
        raise ValueError(
            f"not one NVFP4 linear: weight {weight.dtype} {list(weight.shape)}, "
            f"weight_scale {weight_scale.dtype} {list(weight_scale.shape)}, "
            f"weight_scale_2 {list(weight_scale_2.shape)}"
        )
    return NVFP4QTensor(shape, torch.float32, weight).dequantize(
        dtype=torch.float32,
        scale=weight_scale,
        double_scale=weight_scale_2,
        block_sizes={-1: NVFP4_GROUP},
    )


def dequantize_module(tensors, module: str) -> torch.Tensor:
    """``dequantize`` of the module ``module`` (``model.layers.0.mlp.down_proj``) in
    ``tensors`` (a mapping of name -> tensor: a checkpoint's, or one worker's)."""
    return dequantize(
        tensors[f"{module}.weight"],
        tensors[f"{module}.weight_scale"],
        tensors[f"{module}.weight_scale_2"],
    )
