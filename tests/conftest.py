"""Shared fixtures and pytest hooks only: a clean registry per test, and the checkpoints several
modules use. Plain helpers the tests import by name live in ``tests/helpers`` (``helpers.paths``,
``helpers.subprocesses``, ...): no test module imports this one or another test module
(``test_suite_layout.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from shardload import registry
from shardload.sessions import functions as session_functions


def _shard_funcs() -> dict:
    return {f.name: f for f in registry.list_shard_funcs()}


def _session_funcs() -> dict:
    return {f.name: f for f in session_functions.list_session_funcs()}


def _shardloads_own(f) -> bool:
    """Registered by shardload's own modules, once, when they are first imported (which may be
    during a test): kept, as importing the module again would not register it again."""
    return f.module == "shardload" or f.module.startswith("shardload.")


@pytest.fixture(autouse=True)
def _restore_registry():
    """Functions a test registers (or unregisters) do not leak into the next test: both tables
    are put back as they were, through the registries' public API."""
    shard_before = _shard_funcs()  # listing loads the built-ins and entry points first
    session_before = _session_funcs()
    yield
    shard_after = _shard_funcs()
    for name in shard_after.keys() - shard_before.keys():
        if not _shardloads_own(shard_after[name]):
            registry.unregister_shard_func(name)
    for name, f in shard_before.items():
        if shard_after.get(name) != f:  # removed or replaced: register it again as it was
            registry.register_shard_func(
                name,
                f.func,
                override=True,
                array=f.array,
                shape_rule=f.shape_rule,
                ranges=f.ranges,
                fixup=f.fixup,
            )
            assert registry.get_shard_func(name) == f, f"{name!r} was not restored as it was"
    session_after = _session_funcs()
    for name in session_after.keys() - session_before.keys():
        if not _shardloads_own(session_after[name]):
            session_functions.unregister_session_func(name)
    for name, f in session_before.items():
        if session_after.get(name) != f:
            session_functions.register_session_func(name, f.func, override=True)


@pytest.fixture(scope="module")
def smollm2() -> str:
    """The path of the published SmolLM2-135M-Instruct GGUF (Q4_1: 9 query heads, 3 KV heads),
    fetched once (``helpers.real_models``); the tests that use it are marked ``real_model``."""
    from helpers.real_models import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture
def small_ckpt(tmp_path):
    """A folder holding one safetensors file of one float32 tensor ``a`` [8, 4], no config."""
    from safetensors.numpy import save_file

    folder = tmp_path / "small"
    folder.mkdir()
    save_file(
        {"a": np.arange(32, dtype=np.float32).reshape(8, 4)}, str(folder / "model.safetensors")
    )
    return folder


# fixtures that hand a test the real model (tests/helpers/real_models.py downloads it once, 98 MB)
REAL_MODEL_FIXTURES = {"smollm2"}


#: markers naming an optional environment (``devtools/environments.py``): a test carrying one
#: skips before it starts where that environment is not made, saying which script makes it
#: (fails instead under CI's ``SHARDLOAD_REQUIRE_*=1``); nothing is installed from here
ENVIRONMENT_MARKERS = {
    "vllm": "vllm",
    "quant_tools": "quant",
    "azurite": "azurite",
    "gpu_sim": "gpu_sim",
}


def pytest_runtest_setup(item):
    from helpers.environments import require

    for marker, environment in ENVIRONMENT_MARKERS.items():
        if item.get_closest_marker(marker) is not None:
            require(environment)
    if item.get_closest_marker("int4_kernel") is not None:
        from helpers.vllm_engine import int4_kernel_missing

        why = int4_kernel_missing()
        if why is not None:  # the machine's, as a missing GPU is: skipped under CI too
            pytest.skip(why)


def pytest_collection_modifyitems(config, items):
    """Mark the tests that need the real model ``real_model``, so the fast subset can leave
    them out: ``pytest -m "not slow and not real_model"``."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
