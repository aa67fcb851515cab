"""MXFP4, the 4-bit format of GPT-OSS's published expert weights, read back into floats (models/gpt_oss_hf.py).

An MXFP4 tensor is stored as two: `<name>_blocks` [..., rows, groups, 16] uint8, two 4-bit FP4 (e2m1) codes per byte,
the low nibble first, and `<name>_scales` [..., rows, groups] uint8, one power of two per group of 32 values, biased
by 127. Read as transformers' `integrations/mxfp4.py` reads them: value = FP4[code] * 2**(scale - 127), the rows of
each group in order, then the last two axes swapped (the checkpoint stores [out, in]; the weights are [in, out]).
numpy only: conversion runs on the host, one expert at a time, so no copy of all experts' codes is ever made.
"""

from __future__ import annotations

import numpy as np

# The 16 values of an e2m1 code: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = np.array(
  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """blocks [..., rows, groups, 16] uint8, scales [..., rows, groups] uint8 -> float32 [..., groups * 32, rows]."""
  if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
    raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not fit together")
  *lead, rows, groups, _ = blocks.shape
  lead_size = int(np.prod(lead, dtype=np.int64))
  out = np.empty((lead_size, groups * 32, rows), np.float32)
  flat_blocks = blocks.reshape(lead_size, rows, groups, 16)
  flat_scales = scales.reshape(lead_size, rows, groups)
  for i in range(lead_size):  # one expert at a time: the float copies are one expert's
    codes = flat_blocks[i]
    values = np.empty((rows, groups, 32), np.float32)
    values[..., 0::2] = FP4_VALUES[codes & 0x0F]
    values[..., 1::2] = FP4_VALUES[codes >> 4]
    exponents = flat_scales[i].astype(np.int32)[..., None] - 127
    out[i] = np.ldexp(values, exponents).reshape(rows, groups * 32).T
  return out.reshape(*lead, groups * 32, rows)
