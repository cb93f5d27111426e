"""vLLM's weight transfer from a checkpoint: the backend ``shardload``, for RL refits.

A trainer writes each step's weights as a checkpoint (a folder, or ``s3://``, ``gs://``,
``az://``); the engine takes them through vLLM's own weight-transfer API, each rank reading
only its bytes of the checkpoint at the engine's TP (padded where the engine's model is),
quantized formats included, without a restart:

>>> from vllm import LLM                                                    # doctest: +SKIP
>>> from vllm.config import WeightTransferConfig
>>> llm = LLM("ckpt/step-0", tensor_parallel_size=2,
...           weight_transfer_config=WeightTransferConfig(backend="shardload"))
>>> llm.init_weight_transfer_engine({"init_info": {"checkpoint": "s3://run/step-{step}/"}})
>>> llm.start_weight_update()
>>> llm.update_weights({"update_info": {"step": 100}})  # or {"checkpoint": "/ckpts/step-100"}
>>> llm.finish_weight_update(weight_version="100")
>>> llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

``init_weight_transfer_engine`` is optional: it takes only what a checkpoint needs
(``refit_info.INIT``).
A refit, on every tensor-parallel rank:

1. ``start_weight_update``: a refit begins; nothing is touched.
2. ``update_weights`` (``refit_info.UPDATE``: the checkpoint, or the step of the init's
   template):

   a. **open and plan** for the engine's N and this rank (``ShardloadModelLoader.read_rank``,
      as ``--load-format shardload`` does), and compare the checkpoint's tensors with those of
      the checkpoint the engine serves (``signature.py``): one missing, added, or of another
      shape is refused;
   b. **read** this rank's bytes into its memory (no views of the files: the trainer may
      write over them once read);
   c. **confirm** that no file changed while it was read (an object's every GET names the
      ETag it listed). Steps a to c are collectives over vLLM's tensor-parallel group: a
      rank that refuses refuses every rank, and the engine keeps serving its weights;
   d. **hand** them to vLLM's layerwise reload (``initialize_layerwise_reload``, the
      model's own ``load_weights``): each layer is processed (Marlin repacks, FP8 scales) as
      its weights complete, as on a first load.
3. ``finish_weight_update``: vLLM finishes the layers it defers (attention), each rank logs
   its statistics line (``STATS_PREFIX``, with ``"refit": true``), and the checkpoint becomes
   the one the engine serves.

A refused refit (2a to 2c) raises ``RefitError`` in one line on every rank, and the engine
answers as before; start the next one with ``start_weight_update``. Past 2c, vLLM's own loaders
run on the tensors the engine first loaded, of the same names, shapes and dtypes; should one
fail anyway, the layers it had not reached get their weights back and the error says that
those it had are new.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from vllm.distributed import get_world_group
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.logger import init_logger

from ..errors import ShardloadError
from ..frontdoor import open_session
from ..readers import Checkpoint, open_checkpoint
from .model_loader import STATS_PREFIX, RankRead, ShardloadModelLoader
from .options import LoaderOptions
from .refit_info import RefitError, RefitInit, RefitUpdate, parse_init, parse_update
from .signature import Signature

__all__ = ["BACKEND", "RefitError", "ShardloadWeightTransferEngine"]

logger = init_logger("vllm.shardload")

#: the backend's name in ``WeightTransferConfig(backend=...)``
BACKEND = "shardload"


class ShardloadWeightTransferEngine(WeightTransferEngine):
    """``WeightTransferConfig(backend="shardload")``: each refit names a checkpoint (the steps
    are in the module docstring)."""

    init_info_cls = RefitInit
    update_info_cls = RefitUpdate
    # a draft model has a checkpoint of its own, which no test here has: refused by vLLM
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.init = RefitInit()
        self._worker = _WorkerOfEngine.find()
        self._refit: _Refit | None = None
        self.serves: Signature | None = None
        try:  # what the engine loaded: the reference of the first refit
            self.serves = _engine_signature(vllm_config)
        except (ShardloadError, OSError) as exc:
            logger.warning(
                "shardload refit: the engine's own checkpoint could not be opened (%s): the "
                "first refit's tensors are not compared with what the engine serves",
                exc,
            )

    # -- vLLM's parsing, with shardload's checks (refit_info.py) --------------------------------

    def parse_init_info(self, init_dict: dict[str, Any]) -> RefitInit:
        try:
            return parse_init(init_dict)
        except RefitError:
            # the same dict on every rank, so the same refusal: raised by the last rank alone,
            # the init left as it was on the others (``_WorkerOfEngine`` says why)
            world = get_world_group()
            if world.rank_in_group == world.world_size - 1:
                raise
            return self.init

    def parse_update_info(self, update_dict: dict[str, Any]) -> RefitUpdate:
        return parse_update(update_dict, self.init)

    # -- the lifecycle ---------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: RefitInit) -> None:
        self.init = init_info

    def start_weight_update(self) -> None:  # 1.
        # a refit refused before (its update_weights raised) left nothing to undo
        self._refit = _Refit(time.perf_counter())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Step 2 on every rank, its outcome agreed: a refit any rank refused (or failed) is
        raised by one rank only, the last, and ended quietly on the others (see
        ``_WorkerOfEngine``)."""
        world = get_world_group()
        try:
            with open_session(
                "torch",
                world.world_size,
                device="cpu",
                timeout=self.init.timeout,
                group=world.cpu_group,
            ) as sess:
                with sess.collective("refitting"):
                    self.receive_weights(self.parse_update_info(update_info))
        except Exception as exc:
            refit, self._refit = self._refit, None
            if refit is not None and refit.applied:
                # this rank took the weights, another failed to: its layers are not left half
                # done (the error says to refit again)
                self._finalize()
            if world.rank_in_group == world.world_size - 1 or not self._worker.end_update(self):
                raise RefitError(_one_line(exc)) from exc
            return
        if torch.accelerator.is_available():  # (the base class's sync, which a CPU has not)
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RefitUpdate) -> None:  # 2.
        refit = self._refit
        if refit is None:
            raise RefitError("update_weights before start_weight_update")
        if refit.read is not None:
            raise RefitError(
                f"this refit already took {refit.checkpoint}: one checkpoint a refit "
                "(finish_weight_update, then start_weight_update for the next)"
            )
        checkpoint = update_info.checkpoint
        refit.checkpoint, refit.step = checkpoint, update_info.step
        opts = LoaderOptions(
            plan=update_info.plan or self.init.plan,
            staging=self.init.staging,
            timeout=self.init.timeout,
            checkpoint=checkpoint,
        )
        loader = ShardloadModelLoader(self.vllm_config.load_config, opts)
        checks = _RefitChecks(self.serves, checkpoint)
        try:  # a to c: nothing of the model is touched yet
            read = loader.read_rank(self.model, self.model_config, in_place=False, checks=checks)
        # whatever failed, nothing was touched: the one line says what (a shardload error
        # names the file and tensor; another is vLLM's or torch's, named by its type)
        except Exception as exc:  # raised again, as the refit's refusal
            self._refit = None
            raise RefitError(
                f"refit to {checkpoint} refused, the engine keeps its weights: {_one_line(exc)}"
            ) from exc
        refit.read, refit.signature = read, checks.signature
        refit.read_done = time.perf_counter()
        try:
            self._hand(read)  # d.
        except Exception as exc:
            self._refit = None
            raise RefitError(
                f"refit to {checkpoint} failed in vLLM's load_weights ({_one_line(exc)}): the "
                "layers it had not reached kept their weights, those it had are new; refit "
                "again"
            ) from exc
        finally:
            read.close()  # the stand-ins are the model's now, or dropped
        refit.applied = time.perf_counter()

    def _hand(self, read: RankRead) -> None:
        """Step 2d: vLLM's layerwise reload of the stand-ins; on a failure, every layer not
        yet processed gets its tensors back."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(iter(read.tensors.items()))
        except BaseException:
            _put_back(self.model, self.model_config)
            raise

    def finish_weight_update(self) -> None:  # 3.
        refit, self._refit = self._refit, None
        if refit is None or refit.read is None:  # started, but nothing taken
            return
        self._finalize()
        if refit.signature is not None:
            self.serves = refit.signature
        refit.log()

    def _finalize(self) -> None:
        """vLLM's end of a layerwise reload: the layers it defers (attention) processed."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self._refit = None


@dataclass
class _Refit:
    """One refit's state on this rank, from ``start_weight_update`` to its end."""

    start: float
    checkpoint: str = ""
    step: int | str | None = None
    read: RankRead | None = None
    signature: Signature | None = None
    read_done: float = 0.0
    applied: float = 0.0
    line: dict = field(default_factory=dict)

    def log(self) -> None:
        """This rank's statistics line: what it read, and how long each step took."""
        assert self.read is not None
        now = time.perf_counter()
        line = dict(self.read.line)
        line.update(
            refit=True,
            reload=True,
            checkpoint=self.checkpoint,
            step=self.step,
            apply_seconds=round(self.applied - self.read_done, 4),
            seconds=round(now - self.start, 4),
        )
        logger.info("%s%s", STATS_PREFIX, json.dumps(line))


@dataclass
class _RefitChecks:
    """Steps 2a and 2c (``model_loader.ReadChecks``): the new checkpoint's tensors against
    those the engine serves, and its files unchanged once read."""

    serves: Signature | None
    origin: str
    signature: Signature | None = None

    def opened(self, ckpt: Checkpoint) -> None:
        self.signature = Signature.of(ckpt, self.origin)
        if self.serves is not None:
            differ = self.signature.describe_differences(self.serves)
            if differ is not None:
                raise RefitError(differ)

    def read(self, ckpt: Checkpoint) -> None:
        ckpt.confirm_unchanged()


class _WorkerOfEngine:
    """The vLLM worker that made this engine, so that a refit refused on every rank is
    raised by one.

    vLLM 0.32's multiprocess executor reads the workers' replies to a call in rank order and
    raises at the first failure, leaving the later ranks' replies in their queues: every later
    call then reads a stale reply from those ranks (vLLM pull request 57846, open), so one
    refused refit would leave the engine's calls answered a step late, its next refit included.
    A refusal is raised by the last rank alone, whose reply is read last; the other ranks
    return, and end the update as vLLM's worker does for a rank that raised (its
    ``update_weights``: the update no longer active, the target reset). That state is the
    worker's own (``_weight_update_active``), found here, as the worker made the engine."""

    def __init__(self, worker: Any):
        self.worker = worker

    @classmethod
    def find(cls) -> _WorkerOfEngine:
        """The worker whose ``load_model`` is making this engine (None where vLLM made it
        elsewhere: then every rank raises, as vLLM's API has it)."""
        frame: FrameType | None = sys._getframe(1)
        for _ in range(8):
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            if hasattr(candidate, "_weight_update_active") and hasattr(
                candidate, "weight_transfer_engine"
            ):
                return cls(candidate)
            frame = frame.f_back
        return cls(None)

    def end_update(self, engine: ShardloadWeightTransferEngine) -> bool:
        """End the worker's update as vLLM does for a rank that raised; False where there is
        no worker to end it in."""
        if self.worker is None:
            return False
        self.worker._weight_update_active = False
        engine.reset_weight_update_target()
        return True


def _engine_signature(vllm_config) -> Signature | None:
    """The tensors of the checkpoint the engine loaded: its load format's ``checkpoint``
    option (``--load-format shardload``), else its model folder, else vLLM's download of a hub
    model where it is on this machine (nothing is fetched); None where there is none."""
    model_config, load_config = vllm_config.model_config, vllm_config.load_config
    where: str | None = None
    if load_config.load_format == BACKEND:
        where = LoaderOptions.from_extra_config(load_config.model_loader_extra_config).checkpoint
    if where is None:
        where = model_config.model
        if not os.path.isdir(where):
            where = _cached_hub_folder(model_config, load_config)
    if where is None:
        return None
    ckpt = open_checkpoint(where)
    try:
        return Signature.of(ckpt, where)
    finally:
        ckpt.close()


def _cached_hub_folder(model_config, load_config) -> str | None:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model_config.model,
            revision=model_config.revision,
            cache_dir=load_config.download_dir,
            local_files_only=True,
        )
    except Exception:  # noqa: BLE001 - not on this machine (or not a hub name): no reference
        return None


def _put_back(model: torch.nn.Module, model_config) -> None:
    """Undo ``initialize_layerwise_reload`` for every layer not yet processed: nothing of it
    counts as loaded, so vLLM's finalize puts its previous tensors back (its warning that the
    layer loaded nothing, once per layer, is not logged: that is the point here)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load():
            info.loaded_weights.clear()
            info.load_numel = 0
    with _quiet("vllm.model_executor.model_loader.reload.layerwise"):
        finalize_layerwise_reload(model, model_config)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
