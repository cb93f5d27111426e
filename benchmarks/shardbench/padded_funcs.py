"""``bench.take_units_computed``: ``shardload.take_units`` registered without its ``ranges`` rule,
so the loader computes it whole and slices it (what padded plans cost before read plans). A
plugin module of its own (``shardbench.padded_funcs``), so ``bench_padded.py``'s worker
processes register it too."""

from shardload import get_shard_func, register_shard_func

COMPUTED = "bench.take_units_computed"

_builtin = get_shard_func("shardload.take_units")
register_shard_func(COMPUTED, _builtin.func, shape_rule=_builtin.shape_rule)
