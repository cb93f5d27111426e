"""Run what was loaded: transformers' own model, tensor-parallel over a session's workers.

Behind the optional ``hf`` extra (``pip install "shardload[hf]"``): transformers is imported
only here (and by the planners' tests). Each worker builds the model class of the checkpoint's
config with its own sizes and fills it from its shards, dequantized to one dtype by
``shardload.formats``; the outputs of row-parallel layers are summed over the workers. Weights
are held dense: keeping them packed for quantized kernels is a later step.

>>> from shardload import ThreadedSession                                     # doctest: +SKIP
>>> from shardload.hf import load_tp_model
>>> with ThreadedSession(2) as sess:
...     model = load_tp_model("ckpt/", sess)
...     tokens = model.generate([[1, 2, 3]], max_new_tokens=8)
"""

from .model import TPModel, load_tp_model

__all__ = ["TPModel", "load_tp_model"]
