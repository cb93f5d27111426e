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
  ``torchrun -m helpers.dist_job``; ``multinode_job``: the one of
  ``test_sessions_multinode.py``, run by two launchers (``subprocesses.torchrun_nodes``).
* ``environments``: an optional environment's program, or the test skips naming the script
  that makes it (``devtools/environments.py``).
* ``gguf_blocks``, ``gptq_reference``, ``mlc_reference``, ``quant_refs``, ``tp_reference``:
  independent reference codecs and layouts.
* ``hostile_corpus``: the hostile-input corpus; ``real_models``: the real model, downloaded
  once.

What several test modules share, so that no test module imports another (or conftest:
``test_suite_layout.py`` checks it):

* ``paths`` (REPO, EXAMPLES, EXAMPLE), ``subprocesses`` (a subprocess's environment,
  torchrun, one job from several launchers, Ctrl-C), ``cli_runs`` (the CLI in-process),
  ``loads`` (a load on threads, the planner's plan loaded);
* checkpoints and configs: ``quantized_models`` (tiny Llama/Mixtral in every quantized
  format), ``gguf_mlc_models``, ``gpt_oss_gguf``, ``architecture_configs``, ``moe_configs``,
  ``deepseek_configs``, ``modelopt_configs``; ``plan_corpus`` (plans the schema and the parser
  agree on);
* checks: ``reader_checks``, ``process_sessions`` (worker processes through /proc),
  ``fault_plans``, ``hf_parity`` (transformers' answers for the TP-model tests),
  ``vllm_checks`` (one vLLM engine, compared with its default loader).
"""
