"""The benchmarks' code, one module per concern; the ``bench_*.py`` scripts are its entry
points (``bench_load.py`` the main one) and put ``benchmarks/`` on ``sys.path`` (worker
processes inherit it, so the plugin modules here import there under the same names).

``checkpoints``   the synthetic GPTQ checkpoint: its geometry, writing it once, where it is cached
``peers``         the real libraries compared with (safetensors, fastsafetensors, Run:ai, ...)
``methods``       every method ``bench_load.py`` compares, as a table, and the check that each
                  ends with shardload's pieces
``measure``       time, CPU seconds, peak RSS, the page cache (warming, dropping, ``mincore``)
``runner``        one run of ``bench_load.py``: every N, pass, repetition and method
``cuda``          the CUDA section
``report``        rows, tables, targets (PASS/MISS)
``harness``       what every entry script shares: common flags, repetitions, medians, the
                  environment line, the JSON (with its header)
``figures``       load time and peak memory against N as PNGs (``python -m shardbench.figures``)
``worker``        the session function that frees a worker's shards between two loads (a plugin)
``padded_funcs``  ``bench_padded.py``'s shard function without its read rule (a plugin)
``models``        ``bench_padded.py``'s default checkpoint, fetched once
``scale``         ``bench_scale.py``'s header-only checkpoints and its one measurement
``gpu_summary``   the GPU check's reports (``gpu_check.sh``): the machine, the tables

Nothing here imports at package level, so a worker process importing a plugin pays for that
plugin only.
"""

#: the units every module reports in: GB for sizes and rates (10^9 bytes), MiB for buffers
GB = 1e9
MiB = 1 << 20
