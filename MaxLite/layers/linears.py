"""Dense projections whose kernels carry logical axis names."""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxLite.layers.quantities import DType
from MaxLite.parallel.sharding import logical_axis_is_split


def _normalize(axes: int | Sequence[int], ndim: int) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(a % ndim for a in axes)


def cast_weight(w: jax.Array, dtype: DType) -> jax.Array:
  """w in `dtype`; float32 -> bfloat16 goes through _bfloat16_in_loop."""
  if w.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16:
    return _bfloat16_in_loop(w)
  return jnp.asarray(w, dtype)


@jax.custom_vjp
def _bfloat16_in_loop(w: jax.Array) -> jax.Array:
  """float32 -> bfloat16 with integer ops (round to nearest even, bit for bit XLA's convert).

  XLA rewrites a convert of one layer's slice of the scanned weights into a slice of the whole converted stack
  and hoists that out of the layer loop, which keeps a second, bfloat16 copy of every layer's weights alive for
  the whole step (3 GiB per device for Llama 2 7B on v5p-8). Integer ops on the slice stay in the loop. Their
  derivative is zero, so the custom VJP gives the cast's true one: the cotangent back in float32. XLA's GPU compiler
  hoists neither (a deviceless H100 compile of the Llama 3.2 1B step: one cast fusion per weight per layer in the
  loop either way, none fused into a GEMM), so this costs the GPU nothing a plain convert would not."""
  bits = jax.lax.bitcast_convert_type(w, jnp.uint32)
  rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
  quiet_nan = (bits >> 16) | 0x40  # a NaN stays a NaN (rounding its payload could carry into inf or zero)
  high = jnp.where((bits & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded)
  return jax.lax.bitcast_convert_type(high.astype(jnp.uint16), jnp.bfloat16)


def _cast_fwd(w: jax.Array) -> tuple[jax.Array, None]:
  return _bfloat16_in_loop(w), None


def _cast_bwd(_, g: jax.Array) -> tuple[jax.Array]:
  return (g.astype(jnp.float32),)


_bfloat16_in_loop.defvjp(_cast_fwd, _cast_bwd)


def quantized_base(config: object) -> dict[str, bool]:
  """DenseGeneral's keyword for the projections of a model whose frozen base Qwix stores quantized (QLoRA)."""
  return (
    {"quantized_base": bool(getattr(config, "lora_weight_qtype", ""))} if getattr(config, "enable_lora", False) else {}
  )


class DenseGeneral(nn.Module):
  """y = x . W contracting `axis` of x with the leading dims of W (shape in_dims + features).

  Written here rather than using flax's DenseGeneral because the kernel must be created in its
  final multi-dimensional shape for logical partitioning and fan-in initialisation to line up.
  """

  features: int | Sequence[int]
  logical_axes: Sequence[str]
  axis: int | Sequence[int] = -1
  dtype: DType = jnp.float32
  weight_dtype: DType = jnp.float32
  init_scale: float = 1.0
  output_dtype: DType | None = None  # None = dtype; float32 = accumulate and return float32 (the logits)
  use_bias: bool = False  # a learned bias over the output features (Qwen2.5's q/k/v), initialised to zero
  # QLoRA (layers/lora.py): Qwix stores this kernel quantized in its own shape, so the matmul takes it unreshaped and
  # uncast (Qwix dequantizes it).
  quantized_base: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    axis = _normalize(self.axis, x.ndim)
    in_dims = tuple(x.shape[a] for a in axis)
    kernel_shape = in_dims + features
    n_in = len(in_dims)
    init = nn.initializers.variance_scaling(
      self.init_scale,
      "fan_in",
      "truncated_normal",
      in_axis=tuple(range(n_in)),
      out_axis=tuple(range(n_in, len(kernel_shape))),
    )
    kernel = self.param(
      "kernel", nn.with_logical_partitioning(init, tuple(self.logical_axes)), kernel_shape, self.weight_dtype
    )
    kernel = kernel if self.quantized_base else cast_weight(kernel, self.dtype)
    x = jnp.asarray(x, self.dtype)
    # Only a merged group's leading dim may be split: merging a split dim behind an unsplit one (the heads of a
    # fused [3, heads, head_dim] output) interleaves the shards, which GSPMD can only regather.
    minor_dims = (*self.logical_axes[1:n_in], *self.logical_axes[n_in + 1 :])
    mergeable = not any(logical_axis_is_split(a) for a in minor_dims)
    flat = mergeable and not self.quantized_base and not logical_axis_is_split("activation_length")
    if axis == tuple(range(x.ndim - n_in, x.ndim)) and flat:
      # Contracting the trailing dims: one 2D matmul [rows, in] x [in, out]. XLA's CPU backend runs
      # the backward pass of this form about twice as fast as the same dot with 3D operands. Not when
      # the sequence is split: merging a split batch with a split sequence makes GSPMD regather.
      rows = x.shape[: x.ndim - n_in]
      # lax.dot_general, not jnp.dot: jnp.dot is jitted inside jax, and its trace cache would hide the call from Qwix
      # (layers/quantization.py) or hand a quantized trace to an unquantized model.
      y = jax.lax.dot_general(
        x.reshape(-1, math.prod(in_dims)),
        kernel.reshape(math.prod(in_dims), -1),
        (((1,), (0,)), ((), ())),
        preferred_element_type=self.output_dtype,
      )
      y = y.reshape(*rows, *features)
    else:
      contract = (axis, tuple(range(n_in)))
      y = jax.lax.dot_general(x, kernel, (contract, ((), ())), preferred_element_type=self.output_dtype)
    if self.output_dtype is not None:  # a quantized dot (Qwix) returns the inputs' type whatever it was asked for
      y = y.astype(self.output_dtype)
    elif self.quantized_base:  # the uncast kernel (float32, or Qwix's dequantized one) promotes a bfloat16 x
      y = y.astype(self.dtype)
    if not self.use_bias:
      return y
    bias_init = nn.with_logical_partitioning(nn.initializers.zeros, tuple(self.logical_axes)[n_in:])
    bias = self.param("bias", bias_init, features, self.weight_dtype)
    return y + jnp.asarray(bias, y.dtype)
