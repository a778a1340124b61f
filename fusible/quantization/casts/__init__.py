"""FP8 casts: one entry point per granularity, each a custom op under tracing so that
eager and compiled runs give the same bits.

- :func:`~fusible.quantization.casts.tensorwise.cast_tensorwise`: one scale per tensor
  (``fusible::cast_to_fp8``).
- :func:`~fusible.quantization.casts.rowwise.cast_rowwise`: one scale per row
  (``fusible::cast_to_fp8_rowwise``).
- :func:`~fusible.quantization.casts.blocks.cast_blocks`: one scale per 1xG tile or GxG
  block, float32 or power-of-two (``fusible::cast_to_fp8_blocks``).
- :func:`~fusible.quantization.casts.delayed.cast_delayed`: one scale per tensor from
  an amax history (``fusible::cast_to_fp8`` off CUDA).

:func:`~fusible.quantization.casts.dequantize.dequantize` is the way back for all of
them (``fusible::dequantize``); ``common.py`` holds what they share. The scalings
(:mod:`fusible.quantization.scalings`) call these; so do the ops that cast a tensor of a
known granularity themselves.
"""
