"""Development-only code shared by the tests and the benchmarks; not part of the installed
package (``shardload``), and never imported by it.

``objectservers``  object-storage emulators on loopback (moto for ``s3://``, fake-gcs-server for
                   ``gs://``, Azurite for ``az://``) behind a counting, fault-injecting proxy:
                   the tests use it through ``tests/helpers/objectservers.py`` (pytest glue),
                   ``benchmarks/bench_objects.py`` directly
``vllm_engine``    one vLLM engine on one checkpoint, run by vLLM's own python, its answer as
                   JSON (the vLLM tests through ``tests/helpers/vllm_engine.py``, and
                   ``benchmarks/bench_vllm_load.py``)
``vllm_ext``       the worker extension those engines load: parameter digests, reloads by
                   vLLM's default loader, every loader's ``load_weights`` timed alike

Importable from the repository root (pytest's ``pythonpath`` has it; the benchmarks put the
root on ``sys.path``). Nothing here imports pytest.
"""
