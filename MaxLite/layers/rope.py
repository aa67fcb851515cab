"""Rotary position embedding (RoPE) and the frequency schedules of today's open models.

rope_type (MaxText's key): `default` (Llama 2/3, Qwen: theta**(-2i/d)), `llama3.1` (Llama 3.1+: long wavelengths
divided by rope_factor, a smooth blend between low_freq and high_freq wavelengths) and `yarn` (YaRN: a ramp between
interpolated and original frequencies by rotation count, plus a factor on cos/sin: rope_attention_factor, by default
as transformers derives it from rope_factor and mscale). The schedules are
numbers fixed by the config, computed once in float32 numpy in the order transformers (and Meta's reference code)
computes them: equal to transformers' to within one float32 ulp (libraries round float32 pow differently).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _exponents(head_dim: int) -> np.ndarray:
  return np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)


def default_frequencies(head_dim: int, theta: float) -> np.ndarray:
  """theta ** (-2i / head_dim) for i < head_dim / 2: the angle per position of each rotated pair."""
  return np.float32(1.0) / np.float32(theta) ** _exponents(head_dim)


def llama31_frequencies(
  freq: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float, original_length: int
) -> np.ndarray:
  """Wavelengths shorter than original_length / high_freq_factor stay, longer than original_length /
  low_freq_factor are stretched by `factor`, and the ones between blend the two linearly in 1/wavelength."""
  wavelength = np.float32(2 * math.pi) / freq
  stretched = np.where(wavelength > original_length / low_freq_factor, freq / np.float32(factor), freq)
  smooth = (np.float32(original_length) / wavelength - np.float32(low_freq_factor)) / np.float32(
    high_freq_factor - low_freq_factor
  )
  blended = (1 - smooth) * stretched / np.float32(factor) + smooth * stretched
  middle = (wavelength >= original_length / high_freq_factor) & (wavelength <= original_length / low_freq_factor)
  return np.where(middle, blended, stretched)


def yarn_frequencies(
  head_dim: int, theta: float, factor: float, original_length: int, beta_fast: float, beta_slow: float, truncate: bool
) -> tuple[np.ndarray, float]:
  """YaRN (Peng et al. 2023): pairs that turn more than beta_fast times over the original context keep their
  frequency, fewer than beta_slow times are interpolated by `factor`, linear in between. Returns (frequencies,
  the paper's cos/sin factor 0.1 ln(factor) + 1; a config's own is yarn_attention_factor)."""
  wavelength_scale = np.float32(theta) ** _exponents(head_dim)  # 1 / frequency

  def pair_turning(rotations: float) -> float:  # the (fractional) pair index that turns `rotations` times
    return head_dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = pair_turning(beta_fast), pair_turning(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # a single-pair ramp would divide by zero
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
  keep = 1 - ramp
  interpolated = np.float32(1.0) / (np.float32(factor) * wavelength_scale)
  original = np.float32(1.0) / wavelength_scale
  scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
  return interpolated * (1 - keep) + original * keep, scale


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1): transformers' get_mscale."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def hf_yarn_attention_factor(
  factor: float, attention_factor: float | None, mscale: float | None, mscale_all_dim: float | None
) -> float:
  """The factor transformers multiplies YaRN's cos/sin by (modeling_rope_utils._compute_yarn_parameters): an explicit
  attention_factor, else the mscale / mscale_all_dim ratio when both are set (non-zero), else yarn_mscale(factor).
  So mscale alone changes nothing and mscale_all_dim alone scales only DeepSeek's softmax."""
  if attention_factor is not None:
    return float(attention_factor)
  if mscale and mscale_all_dim:
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
  return yarn_mscale(factor)


def yarn_attention_factor(c: Any) -> float:
  """The config's YaRN cos/sin factor: rope_attention_factor, or -1 read as transformers reads a config.json whose
  mscale and mscale_all_dim are both MaxLite's mscale (DeepSeek's checkpoints): their ratio 1 for MLA with mscale
  set, else yarn_mscale(rope_factor). MLA's mscale is mscale_all_dim; other attention has no softmax mscale."""
  if c.rope_attention_factor != -1:
    return float(c.rope_attention_factor)
  mscale = c.mscale if c.attention_type == "mla" else 0.0
  return hf_yarn_attention_factor(c.rope_factor, None, mscale, mscale)


def rope_frequencies(c: Any, head_dim: int = 0) -> tuple[np.ndarray, float]:
  """(float32 frequencies [head_dim / 2], cos/sin scale) for the config's rope_type; head_dim 0 = the config's (MLA
  rotates qk_rope_head_dim features)."""
  head_dim = head_dim or c.head_dim
  freq, scale = default_frequencies(head_dim, c.rope_max_timescale), 1.0
  if c.rope_type == "llama3.1":
    freq = llama31_frequencies(
      freq, c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor, c.original_max_position_embeddings
    )
  elif c.rope_type == "yarn":
    freq, _ = yarn_frequencies(
      head_dim,
      c.rope_max_timescale,
      c.rope_factor,
      c.original_max_position_embeddings,
      c.beta_fast,
      c.beta_slow,
      c.rope_truncate,
    )
    scale = yarn_attention_factor(c)
  if c.rope_linear_scaling_factor != 1.0:  # positions divided by the factor (transformers' rope_type linear)
    freq = freq / np.float32(c.rope_linear_scaling_factor)
  return np.asarray(freq, np.float32), float(scale)


def apply_rope(x: jax.Array, positions: jax.Array, frequencies: Any, scale: Any = 1.0) -> jax.Array:
  """Rotate x [batch, seq, heads, head_dim] by its positions [batch, seq].

  Uses the "rotate half" layout (first half of head_dim paired with the second half), which is
  the layout of Hugging Face Llama and Qwen checkpoints, so their q/k weights need no permutation.
  """
  half = x.shape[-1] // 2
  angle = positions[..., None].astype(jnp.float32) * jnp.asarray(frequencies, jnp.float32)  # [b, s, half]
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  if not isinstance(scale, float) or scale != 1.0:  # a traced scale (Gemma 3's local layers) is applied as well
    sin, cos = sin * jnp.asarray(scale, jnp.float32), cos * jnp.asarray(scale, jnp.float32)
  # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) as x * cos + flip(x) * (-1, 1) * sin over a [2, half] view: no
  # slices, whose gradients are pads (on an H200, Llama 3.2 1B: 64 pad and 64 add fusions, ~21 ms of a 0.66 s step).
  pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, half)
  sign = jnp.asarray([[-1.0], [1.0]], jnp.float32)
  rotated = pairs * cos[..., None, :] + jnp.flip(pairs, axis=-2) * sign * sin[..., None, :]
  return rotated.reshape(x.shape).astype(x.dtype)
