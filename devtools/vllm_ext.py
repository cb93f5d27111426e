"""A vLLM worker extension for the tests and bench_vllm_load.py: digests of the model's
parameters, and a reload of them by vLLM's own default loader in the same engine (so that only
the loader differs); importing it times every loader's ``load_weights`` alike (for the
benchmark).

``LLM(..., worker_extension_cls="devtools.vllm_ext.LoaderComparison")``, then
``llm.collective_rpc("param_digests")``, ``llm.collective_rpc("reload_with_default_loader")``
and ``llm.collective_rpc("reload_with_engines_loader")`` (the engine's own load format again,
through its ``get_all_weights``: for shardload, the stand-ins as views of the mapped file);
``llm.collective_rpc("handles_under", args=(folder,))`` counts what a worker still holds of a
checkpoint's files; ``llm.collective_rpc("fail_next_load_after", args=(n,))`` makes the model's
next ``load_weights`` fail after ``n`` weights; ``llm.collective_rpc("poison_params")`` fills
every parameter with a byte no load writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

#: the start of the line each worker prints with the time its loader's ``load_weights`` took
TIMING_PREFIX = "vllm_ext load_weights: "


def _time_every_loaders_load_weights() -> None:
    """Time ``load_weights`` the same way for every load format (vLLM's own "Loading weights
    took" line is printed by some loaders only; Run:ai's prints none): vLLM imports a worker
    extension in each worker before the model loads, so wrapping ``BaseModelLoader.load_model``
    here times whichever loader runs. One line per load on stderr: ``TIMING_PREFIX`` + JSON."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if getattr(BaseModelLoader.load_model, "_timed", False):
        return
    load_model = BaseModelLoader.load_model

    def timed_load_model(self, *args, **kwargs):
        load_weights = self.load_weights

        def timed(model, model_config):
            start = time.perf_counter()
            load_weights(model, model_config)
            print(
                TIMING_PREFIX
                + json.dumps(
                    {"loader": type(self).__name__, "seconds": time.perf_counter() - start}
                ),
                file=sys.stderr,
                flush=True,
            )

        self.load_weights = timed
        try:
            return load_model(self, *args, **kwargs)
        finally:
            del self.load_weights

    timed_load_model._timed = True
    BaseModelLoader.load_model = timed_load_model


_time_every_loaders_load_weights()


class LoaderComparison:
    def param_digests(self) -> dict:
        """{name: sha256 of its bytes} of this rank's parameters, after vLLM's processing."""
        model = self.model_runner.get_model()
        out = {}
        for name, p in model.named_parameters():
            data = p.detach().contiguous().reshape(-1).view(__import__("torch").uint8)
            out[name] = hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()
        return out

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters."""
        model = self.model_runner.get_model()
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def reload_with_default_loader(self) -> None:
        """Reload every weight in place with vLLM's default loader (its own reload path, which
        processes the weights again as a first load does)."""
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        model = self.model_runner.get_model()
        config = self.model_runner.vllm_config
        loader = DefaultModelLoader(LoadConfig(load_format="auto"))
        weights = loader.get_all_weights(config.model_config, model)
        self.model_runner.reload_weights(weights_iterator=weights)

    def reload_with_engines_loader(self) -> None:
        """Reload every weight in place with the engine's own load format (vLLM's reload asks
        the loader for ``get_all_weights``)."""
        self.model_runner.reload_weights()

    def poison_params(self) -> None:
        """Every byte of every parameter set to 0xA5, so that one a later load does not write
        shows in ``param_digests``."""
        import torch

        model = self.model_runner.get_model()
        for p in model.parameters():
            poison = torch.empty_like(p.data, memory_format=torch.contiguous_format)
            poison.view(-1).view(torch.uint8).fill_(0xA5)
            p.data.copy_(poison)  # (whatever its strides)

    def fail_next_load_after(self, count: int) -> None:
        """The model's next ``load_weights`` takes ``count`` weights, then fails (a loader of
        vLLM's failing midway), once."""
        model = self.model_runner.get_model()
        real = model.load_weights

        def failing(weights):
            def first():
                for i, item in enumerate(weights):
                    if i == count:
                        raise RuntimeError(f"injected failure after {count} weight(s)")
                    yield item

            del model.load_weights  # once: the class's own again
            return real(first())

        model.load_weights = failing

    def handles_under(self, folder: str) -> dict:
        """What this worker process holds of the files under ``folder``: its mappings of them
        (``/proc/self/maps``) and its open descriptors to them (``/proc/self/fd``)."""
        root = os.path.realpath(folder) + os.sep
        with open("/proc/self/maps") as f:
            # address, perms, offset, device, inode, then the path (of a file mapping)
            paths = [line.split(maxsplit=5)[5:] for line in f]
        maps = sum(1 for path in paths if path and path[0].startswith(root))
        fds = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # the descriptor listdir itself used, closed since
                continue
            fds += target.startswith(root)
        return {"maps": maps, "fds": fds}
