"""``scripts/vllm_coverage.py`` as a module: its published configs (``MODELS``) and its writer
of header-only checkpoints (``write_checkpoint``), which the tests (``tests/test_vllm_coverage.py``,
the plan digests) and ``benchmarks/bench_scale.py`` share. Standard library only."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "vllm_coverage.py"
)
NAME = "vllm_coverage"


def coverage_script() -> ModuleType:
    """The script, loaded once per process (registered in ``sys.modules``: its dataclasses
    look their module up)."""
    module = sys.modules.get(NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(NAME, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(NAME, None)
            raise
    return module
