"""The ProcessSession example of docs/python.md, runnable from the repository root:
``python examples/process_session.py``. Loads the embedded example onto 4 worker processes and
asks each how many elements it holds."""

from shardload import ProcessSession, load_sharded

with ProcessSession(4, plugins=["session_funcs"]) as sess:  # the workers import it too
    sharded = load_sharded("examples/tiny_llama_q4", "examples/tiny_llama_q4/shard_info.json", sess)
    print(sess.call("examples.param_count"))  # one result per worker
