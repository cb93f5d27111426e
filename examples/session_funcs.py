"""A session function for ``examples/process_session.py``.

Worker processes import this module by name (``plugins=["session_funcs"]``), so it must be a
module of its own on the controller's ``sys.path``: a function defined in the script that starts
the session (``__main__``) cannot be found by a worker.
"""

from shardload import register_session_func


@register_session_func("examples.param_count")
def param_count(ctx):  # ctx: rank, world_size, device, shards, values
    return sum(t.numel() for t in ctx.shards.values())
