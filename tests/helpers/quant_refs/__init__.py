"""Independent reference codecs for already-quantized checkpoint formats.

Written from the formats' definitions (see /work/shared/QUANT_FORMATS.md), in numpy, with no
shardload imports, so tests can check shardload's sharding against something that does not
share its code.  Each format module has

* ``quantize_*(w, ...)``: float32 weight in HF layout ``W [N_out, K_in]`` -> dict of the checkpoint
  tensors under their real suffixes, laid out and typed as the producing library stores them;
* ``dequantize_*(tensors, ...)``: those tensors -> float32 ``W [N_out, K_in]``.

Tensors are numpy arrays, except dtypes numpy lacks (bfloat16, float8_e4m3fn), which are torch
tensors.  The dequantizers accept numpy arrays or torch tensors.

Modules: ``gptq`` (AutoGPTQ / GPTQModel, 2/3/4/8 bit, v1 and v2 zero points, act-order),
``awq`` (AutoAWQ GEMM 4 bit), ``compressed_tensors`` (pack-quantized int4/int8 and
float-quantized FP8).  ``_bits`` holds the shared LSB-first bit-stream packer and
``_dtypes`` the scale-dtype helpers.

The quantizers are plain round-to-nearest with a range that always includes 0 and a scale
rounded *up* to the stored dtype, so that ``|W - deq(quant(W))| <= scale / 2`` holds exactly;
which grid a real GPTQ/AWQ run picks differs, but the stored layout is the same.
"""
