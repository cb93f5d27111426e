"""Test helpers, not tests: reference codecs, checkpoint writers, the real-model download, and
plugin modules that register shard and session functions.

Imported as the package ``helpers``: ``tests/`` is on ``sys.path`` through pytest's
``pythonpath`` option (pyproject.toml), worker processes inherit the controller's ``sys.path``,
and tests that start a subprocess (the CLI, torchrun) put ``tests/`` on its ``PYTHONPATH``. A
plugin module is named by that path everywhere (``plugins=["helpers.process_plugins"]``,
``--plugin helpers.fault_plugins``); import it under that name only, or its functions would be
registered twice with different function objects.

* ``cli_plugin_for_tests``, ``fault_plugins``, ``process_plugins``, ``session_plugins``:
  shard and session functions the tests register (here and in worker processes).
* ``dist_job``: the torchrun job of ``test_sessions_torchrun.py``, run as
  ``torchrun -m helpers.dist_job``.
* ``gguf_blocks``, ``gptq_reference``, ``mlc_reference``, ``quant_refs``, ``tp_reference``:
  independent reference codecs and layouts.
* ``hostile_corpus``: the hostile-input corpus; ``real_models``: the real model, downloaded
  once.
"""
