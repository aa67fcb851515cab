"""Quantized training (QT) through Qwix, with MaxText's keys: `quantization` int8 | fp8 | fp8_full and
`use_qwix_quantization=true`.

Qwix intercepts the matmuls (lax.dot_general, jnp.einsum) of the modules its rule matches while the model is applied:
their operands are quantized (weights per output channel, activations per row, scales by absmax or the calibration
method), multiplied in the low-precision type, and the gradients flow by the straight-through estimator, quantized too
(bwd_qtype). Parameters, optimizer state and checkpoints stay in full precision: a QT run's checkpoint loads into a
run without quantization and exports to Hugging Face as any other.

What runs quantized, as in MaxText: every projection of every decoder layer (q/k/v/out and MLA's, the MLP's gate, up
and down, DeepSeek's shared experts). What does not: the attention scores and their softmax-weighted sum (the
attention module's own einsums and the splash kernel), the embedding, the output head and the loss, and the routed
experts of a MoE layer (MaxText quantizes them only with fp8_full through its own fork of the megablox kernel;
Qwix cannot reach into jax's Pallas megablox kernel, so here they stay in the compute dtype for every mode).
"""

from __future__ import annotations

import logging
from typing import Any

import jax.numpy as jnp

# The projections: submodules of a layer's attention (its own einsums are the scores), its MLP and shared experts.
# A pipelined run applies each layer as a module of its own (models/transformer.py), so the decoder prefix is optional.
PROJECTIONS = r"(decoder/\w*layers(_\d+)?/)?(self_attention/\w+|mlp|mlp/\w+|shared_experts|shared_experts/\w+)"


def qtypes(quantization: str) -> tuple[Any, Any]:
  """(forward type of weights and activations, type of the gradients)."""
  if quantization == "int8":
    return jnp.int8, jnp.int8
  if quantization == "fp8":
    return jnp.float8_e4m3fn, jnp.float8_e4m3fn  # MaxText's fp8: e4m3 both ways
  return jnp.float8_e4m3fn, jnp.float8_e5m2  # fp8_full: e5m2's range for the gradients


def qt_rule(config: Any) -> Any:
  import qwix  # only a quantized run loads it

  forward, backward = qtypes(config.quantization)
  return qwix.QtRule(
    module_path=PROJECTIONS,
    weight_qtype=forward,
    act_qtype=forward,
    bwd_qtype=backward,
    weight_calibration_method=config.weight_quantization_calibration_method,
    act_calibration_method=config.act_quantization_calibration_method,
    bwd_calibration_method=config.bwd_quantization_calibration_method,
    op_names=("dot_general", "einsum"),
  )


def quantized(model: Any, config: Any) -> Any:
  """`model` with its projections' matmuls quantized by Qwix where config.quantization asks for it, else itself."""
  if not config.quantization:
    return model
  import qwix

  round_the_same_in_every_layout()
  return qwix.quantize_model(model, qwix.QtProvider([qt_rule(config)]))


def round_the_same_in_every_layout() -> None:
  """Qwix quantizes with x / scale, and XLA rewrites that division into x * (1 / scale) in some programs and not in
  others: the one-device program of a projection multiplied, the same projection sharded over 8 devices divided, and
  18% of the int8 outputs differed by a rounding step (a last-bit difference moves a value across a rounding
  boundary), so a sharded run was not the one-device run even on the same inputs. Qwix's own reciprocal mode (AQT's
  way) writes the multiplication itself: every layout then rounds the same values the same way, bit for bit. Every
  Qwix quantization MaxLite traces sets it first (quantized training, QLoRA's base), so what a process computes does
  not depend on which of them ran before."""
  from qwix._src.core import qarray  # qwix's switch for it has no public name (qwix 0.1.8)

  if not hasattr(qarray, "USE_RECIPROCAL_FOR_QUANTIZATION"):
    logging.warning("this qwix has no reciprocal quantization: sharded layouts may round differently from one device")
    return
  qarray.USE_RECIPROCAL_FOR_QUANTIZATION = True


def native_path_note(quantization: str, chip: str, peak_int8: float = 0.0, peak_fp8: float = 0.0) -> str | None:
  """One line when `chip` (a TPU family, or jax's platform name) has no matmul unit for the quantization's type: the
  run is then emulated (correct, not faster). None when it has one, or without quantization."""
  if quantization == "int8" and not peak_int8:
    return (
      f"warning: quantization=int8 on {chip}: no int8 matmul rate above bf16 here, so no speed-up (numerics as on TPU)"
    )
  if quantization.startswith("fp8") and not peak_fp8:
    return (
      f"warning: quantization={quantization} on {chip}: no native fp8 matmuls, so fp8 is emulated (numerics as on a "
      "chip with them, no speed-up)"
    )
  return None
