"""Development-only code shared by the tests and the benchmarks; not part of the installed
package (``shardload``), and never imported by it.

``objectservers``  object-storage emulators on loopback (moto for ``s3://``, fake-gcs-server for
                   ``gs://``, Azurite for ``az://``) behind a counting, fault-injecting proxy:
                   the tests use it through ``tests/helpers/objectservers.py`` (pytest glue),
                   ``benchmarks/bench_objects.py`` directly

Importable from the repository root (pytest's ``pythonpath`` has it; the benchmarks put the
root on ``sys.path``). Nothing here imports pytest.
"""
