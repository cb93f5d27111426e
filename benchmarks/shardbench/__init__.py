"""The benchmarks' code, one module per concern; ``bench_load.py`` and ``bench_padded.py`` are
its entry points and put ``benchmarks/`` on ``sys.path`` (worker processes inherit it, so the
plugin modules here import there under the same names).

``checkpoints``   the synthetic GPTQ checkpoint: its geometry, writing it once, where it is cached
``peers``         the real libraries compared with (safetensors, fastsafetensors, Run:ai, ...)
``methods``       every method ``bench_load.py`` compares, as a table, and the check that each
                  ends with shardload's pieces
``measure``       time, CPU seconds, peak RSS, the page cache (warming, dropping, ``mincore``)
``runner``        one run of ``bench_load.py``: every N, pass, repetition and method
``cuda``          the CUDA section
``report``        rows, tables, targets (PASS/MISS), JSON
``worker``        the session function that frees a worker's shards between two loads (a plugin)
``padded_funcs``  ``bench_padded.py``'s shard function without its read rule (a plugin)
``models``        ``bench_padded.py``'s default checkpoint, fetched once

Nothing here imports at package level, so a worker process importing a plugin pays for that
plugin only.
"""

#: the units every module reports in: GB for sizes and rates (10^9 bytes), MiB for buffers
GB = 1e9
MiB = 1 << 20
