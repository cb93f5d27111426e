"""vLLM's load format ``shardload``: each rank reads only its own bytes of the original checkpoint.

vLLM builds the model (its fused ``qkv_proj`` and ``gate_up_proj``, its per-rank shapes), calls
the loader's ``load_weights``, then runs ``process_weights_after_loading`` (Marlin repacks, FP8
requantization) itself. ``load_weights`` here, on every tensor-parallel rank:

1. **options**: ``model_loader_extra_config`` checked strictly (``options.py``);
2. **checkpoint**: the ``checkpoint`` option (a path, or an ``s3://``, ``gs://`` or ``az://``
   URL of which each rank fetches only its read plan's byte ranges), else the model folder, or
   vLLM's own download of a hub model;
3. **plan** for (N, rank) through the front door (``resolve_plan``: the ``plan`` option, else
   ``shard_info.json`` beside the checkpoint, else one made from its config; expert-parallel
   when vLLM places whole experts per rank; without the option, made on rank 0 alone and
   received by the other ranks over vLLM's group, ``frontdoor.plan_once``, each validating it
   against its own checkpoint), the embeddings and ``lm_head`` split by vocabulary rows where
   vLLM splits them as the planner does (``holding.py``), and checked against the sizes vLLM
   built the model with (a padded plan needs the padded model: ``padding.py``);
4. **stand-ins**, full-shape tensors of which vLLM narrows this rank's bytes (``standins.py``):
   a tensor stored as vLLM takes it is a view of the mapped file, not read at all (vLLM's
   narrowing copies this rank's bytes out of it, one copy); a zero-padded tensor or a
   computed one is read into memory, through a session of vLLM's own tensor-parallel group,
   so a rank that fails fails every rank, named; with ``verify`` every stand-in is read.
   Under pipeline parallelism, only of the tensors this stage's model holds (``stages.py``:
   its decoder layers, the embeddings on the first stage, the final norm and ``lm_head`` on
   the last), so nothing else is read, kept or counted;
5. **hand** them to the model's own ``load_weights``, which narrows them as it narrows a full
   tensor (with ``verify``: twice, poisoned, ``verify.py``); vLLM's check that every weight was
   loaded runs as for its default loader;
6. **log** what this rank read and kept (under pipeline parallelism, with its stage and the
   layers it holds), and vLLM's "Loading weights took" line.

``get_all_weights`` gives the stand-ins of steps 2 to 4 to vLLM's in-place reload
(``LLM.collective_rpc("reload_weights")``: new weights in a running engine), and ``read_rank``,
the same steps, to the weight-transfer backend's refits (``refit.py``), which read every
stand-in into memory and add checks of their own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ..errors import ShardloadError
from ..frontdoor import open_session, plan_beside, plan_once
from ..loader import load_validated
from ..readers import Checkpoint, open_checkpoint
from .holding import Holding
from .options import LoaderOptions
from .padding import check_built
from .stages import Stage, stage_of
from .standins import StandIns, stand_in_reads
from .verify import poison, verified_load

__all__ = ["STATS_PREFIX", "RankRead", "ReadChecks", "ShardloadModelLoader"]

# under "vllm", so the lines go where and as vLLM's own do
logger = init_logger("vllm.shardload")

#: the start of the per-rank statistics line in vLLM's log (then JSON)
STATS_PREFIX = "shardload load: "

#: what a checkpoint folder vLLM downloads for shardload must hold
_ALLOW = ["*.safetensors", "*.json", "*.gguf", "*.model", "*.txt"]


class _LoadsWeights(Protocol):
    """A vLLM model: its ``load_weights`` takes ``(name, tensor)`` pairs and says which
    parameters it loaded (or None)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None: ...


class ShardloadModelLoader(BaseModelLoader):
    """``--load-format shardload``: the steps are in the module docstring."""

    def __init__(self, load_config: LoadConfig, options: LoaderOptions | None = None):
        super().__init__(load_config)
        # ``options``: given by a caller of ``read_rank`` that is not vLLM (a refit names its
        # checkpoint), else the engine's own
        self.options = options or LoaderOptions.from_extra_config(
            load_config.model_loader_extra_config
        )

    def _default_loader(self) -> DefaultModelLoader:
        """vLLM's default loader, for the checks of its own that a load through shardload runs
        too. Made without shardload's options, which its constructor would refuse as
        unexpected."""
        return DefaultModelLoader(
            dataclasses.replace(self.load_config, model_loader_extra_config={})
        )

    def _folder(self, model_config: ModelConfig) -> str:
        """The checkpoint to open: the ``checkpoint`` option (a local path or an object storage
        URL, each rank fetching only its own byte ranges), else vLLM's model folder, or vLLM's
        download of a hub model. (vLLM itself refuses an ``s3://`` model for every load format
        but its own streamers, so an object's weights come through the option.)"""
        if self.options.checkpoint is not None:
            return self.options.checkpoint
        path = model_config.model
        if os.path.isfile(path) or path.endswith(".gguf"):
            # GGUF in vLLM is an out-of-tree plugin whose loader renames GGUF tensors to
            # vLLM's names and whose kernels are CUDA-only: the stand-ins would have to repeat
            # that renaming, untested on any machine here (docs/vllm.md, "What stays refused")
            raise ShardloadError(
                f"--load-format shardload reads Hugging Face (safetensors) "
                f"checkpoints, and {path} is a file: load a GGUF with vLLM's "
                "GGUF plugin (pip install vllm-gguf-plugin; --load-format "
                "gguf)"
            )
        if os.path.isdir(path):
            return path
        from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

        return download_weights_from_hf(
            path,
            self.load_config.download_dir,
            _ALLOW,
            model_config.revision,
            ignore_patterns=self.load_config.ignore_patterns,
        )

    def download_model(self, model_config: ModelConfig) -> None:
        self._folder(model_config)

    def read_rank(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        *,
        verify: bool = False,
        in_place: bool = True,
        checks: ReadChecks | None = None,
    ) -> RankRead:
        """Steps 2 to 4 on this rank: its stand-ins, in storage order. The checkpoint it opens
        is closed here if they fail, else by the caller (``RankRead.close``).

        ``in_place=False``: every stand-in read into this process's memory, none a view of
        the mapped file, so that the checkpoint may change once this returns; ``checks``:
        the caller's own, run on every rank as one collective (a rank that refuses fails
        them all) before planning and after the reads (``ReadChecks``)."""
        start = time.perf_counter()
        holding = Holding.of(model, model_config)
        stage = stage_of(model)  # under pipeline parallelism: what this stage holds
        ckpt = open_checkpoint(self._folder(model_config))  # 2.
        try:
            return self._read_from(
                ckpt,
                model_config,
                _ReadMode(verify, in_place and not verify, checks),
                holding,
                stage,
                start,
            )
        except BaseException:
            # closed here, not when the error is dropped: an engine that reloads weights
            # keeps running, and a caller may hold the error (and so this frame) for long
            ckpt.close()
            raise

    def _read_from(
        self,
        ckpt: Checkpoint,
        model_config: ModelConfig,
        mode: _ReadMode,
        holding: Holding,
        stage: Stage | None,
        start: float,
    ) -> RankRead:
        """Steps 3 and 4 on this rank, from the checkpoint ``read_rank`` opened."""
        from vllm.distributed import get_tp_group

        opts = self.options
        tp = get_tp_group()
        rank, n = tp.rank_in_group, tp.world_size
        made: dict[int, StandIns] = {}
        # the workers are vLLM's own tensor-parallel ranks: a torch session over its group
        with open_session(
            "torch", n, device="cpu", timeout=opts.timeout, group=tp.cpu_group
        ) as sess:
            with sess.collective("planning the load"):  # 3.
                if mode.checks is not None:
                    mode.checks.opened(ckpt)
                # rank 0 plans; the other ranks receive its plan and validate it
                choices = holding.planner_options(opts.plan is not None, plan_beside(ckpt))
                job = plan_once(sess, ckpt, opts.plan, what="planning the load", **choices)
                resolved = job.resolved
                validated = resolved.validated
                check_built(validated, model_config.hf_text_config)
            planned = time.perf_counter()

            # verify poisons the stand-ins, so it reads them all; else read pieces are
            # views of the mapped checkpoint, which vLLM's narrowing copies from (standins.py)
            view = ckpt.view if mode.in_place else None

            def reads(plan):
                if stage is not None:  # only the tensors of this stage's modules
                    plan = stage.restrict(plan)
                made[plan.rank] = stand_in_reads(plan, validated, ckpt, view)
                return made[plan.rank].plan

            sharded = load_validated(
                ckpt,
                validated,
                sess,
                progress=False,  # 4.
                staging=opts.staging,
                reads=reads,
            )
            if mode.checks is not None:
                with sess.collective("checking what was read"):
                    mode.checks.read(ckpt)
        ins = made[rank]
        tensors = {
            name: ins.views[name] if name in ins.views else sharded.shard(name, rank)
            for name in ins.order
        }
        # bytes read: by shardload into stand-ins, and by vLLM's narrowing out of the views
        line = {
            "rank": rank,
            "num_shards": n,
            "plan": resolved.origin,
            "source": resolved.source,
            "bytes_read": sharded.stats.bytes_read_per_worker[rank] + ins.viewed,
            "bytes_read_in_place": ins.viewed,
            "bytes_kept": ins.kept,
            "bytes_replicated": ins.replicated,
            "tensors": len(tensors),
            "padded_tensors": len(ins.padded),
            "plan_seconds": round(planned - start, 4),
            "plan_from": job.plan_from,
            "read_seconds": round(time.perf_counter() - start, 4),
            "verified": mode.verify,
            "experts": "ep" if holding.whole_experts else "tp",
            "vocab_parallel": choices.get("vocab_parallel", False),
        }
        if stage is not None:
            line.update(stage.describe())
        return RankRead(ckpt, ins, tensors, line, start)

    def get_all_weights(
        self, model_config: ModelConfig, model: nn.Module
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's stand-ins as ``(name, tensor)``, for vLLM's in-place reload
        (``reload_weights``: new weights in a running engine), which hands them to the model's
        ``load_weights`` and processes them again. ``verify`` takes two loads of its own, so
        a reload does not verify."""
        read = self.read_rank(model, model_config)
        try:
            yield from read.tensors.items()
            read.log(reload=True)
        finally:
            read.close()

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        opts = self.options  # 1.
        read = self.read_rank(model, model_config, verify=opts.verify)
        try:
            self._hand(model, model_config, read)
            read.log(reload=False)  # 6.
        finally:
            read.close()

    def _hand(self, model: nn.Module, model_config: ModelConfig, read: RankRead) -> None:
        """Step 5: the stand-ins to the model's own ``load_weights`` (with ``verify``, twice,
        poisoned), then vLLM's check that every parameter was loaded."""
        opts = self.options
        ins, tensors, rank = read.ins, read.tensors, read.line["rank"]

        def hand(bad: int | None = None) -> set[str] | None:  # 5.
            if bad is not None:
                for name, t in tensors.items():
                    poison(t, ins.mine[name], bad)
            return cast(_LoadsWeights, model).load_weights(iter(tensors.items()))

        unwritten: list[str] = []
        loaded: set[str] | None
        if opts.verify:
            seen: set[str] = set()
            unwritten = verified_load(
                dict(model.named_parameters()), lambda bad: seen.update(hand(bad) or ()), rank
            )
            loaded = seen or None
        else:
            loaded = hand()
        if model_config.quantization is None and loaded is not None:
            # vLLM's own check, as its default loader runs it: every parameter was loaded
            self._default_loader().track_weights_loading(model, set(loaded))
        if unwritten:
            read.line["not_in_checkpoint"] = unwritten


class ReadChecks(Protocol):
    """A caller's own checks of the checkpoint ``read_rank`` reads, on every rank."""

    def opened(self, ckpt: Checkpoint) -> None:
        """Once the checkpoint is open, before it is planned (or read)."""

    def read(self, ckpt: Checkpoint) -> None:
        """Once this rank's reads are done."""


@dataclass(frozen=True)
class _ReadMode:
    """How ``read_rank`` reads: verified (poisoned stand-ins), in place (views of the mapped
    file where it can), with a caller's checks."""

    verify: bool
    in_place: bool
    checks: ReadChecks | None


@dataclass
class RankRead:
    """One rank's stand-ins (by name, in storage order), what they came from, and its
    statistics line so far."""

    ckpt: Checkpoint
    ins: StandIns
    tensors: dict[str, torch.Tensor]
    line: dict
    start: float

    def log(self, reload: bool) -> None:
        """Log the rank's statistics and vLLM's "Loading weights took" line (of a load that
        succeeded)."""
        seconds = time.perf_counter() - self.start
        self.line.update(seconds=round(seconds, 4), reload=reload)
        logger.info("%s%s", STATS_PREFIX, json.dumps(self.line))
        logger.info(
            "%s took %.2f seconds", "Reloading weights" if reload else "Loading weights", seconds
        )

    def close(self) -> None:
        """Let go of the stand-ins and the checkpoint, whether the load succeeded or not
        (views keep their pages mapped until vLLM drops them)."""
        self.tensors.clear()
        self.ckpt.close()
