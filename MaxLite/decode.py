r"""Generate text from a checkpoint with a KV cache: batched prefill, then one token per step.

Usage:   python MaxLite/decode.py CONFIG.yml load_parameters_path=CKPT/STEP [key=value ...]   (or: maxlite-decode ...)
         python MaxLite/decode.py CONFIG.yml run_name=RUN [base_output_directory=DIR] [key=value ...]
Example: python MaxLite/decode.py configs/base.yml load_parameters_path=outputs/run/checkpoints/200 \
           prompt="The Python" max_prefill_predict_length=64 max_decode_steps=32 decode_sampling_strategy=greedy

decode_sampling_strategy is greedy, weighted (temperature sampling), topk or nucleus, as in MaxText; the sampling
ones need decode_sampling_temperature > 0 (greedy ignores it), topk decode_sampling_top_k >= 1 and nucleus
decode_sampling_nucleus_p in (0, 1]. A prompt longer than max_prefill_predict_length keeps BOS and its last tokens,
with a warning, and is printed as the model saw it, after "…".

Model settings and the tokenizer (tokenizer_type, tokenizer_path, add_bos, add_eos, chat_template_path) come from the
checkpoint; keys given on the command line or in CONFIG.yml win, but a tokenizer with more tokens than the model's
vocab_size is an error. run_name=RUN without load_parameters_path decodes that run's newest checkpoint, as training
would resume it. Several prompts separated by " ||| " decode as one batch (right-padded; padding is segment 0, which
attention never sees). Each row prints as labeled lines, texts as JSON strings (so a leading space or a newline
shows): `[0] prompt: "The Python"` then `[0] completion: " is a language"`; with use_chat_template=true each message
of the prompt (`[0] user: "..."`) and then `[0] assistant: "..."`.

The cache lives in flax's "cache" collection, [batch, kv_heads, max_target_length, head_dim] per layer, sharded by the
logical rules.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from MaxLite import cli
from MaxLite.config import schema

if TYPE_CHECKING:
  from MaxLite.inference.generate import generate, run, sample

__all__ = ["generate", "main", "run", "sample"]


def __getattr__(name: str) -> Any:
  # inference.generate's, imported when first read: --help and a usage error answer without starting jax.
  if name in ("generate", "run", "sample"):
    from MaxLite.inference import generate

    return getattr(generate, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _run(argv: Sequence[str]) -> int | None:
  from MaxLite.inference.generate import run

  return run(argv)


def main() -> None:
  cli.run_config_tool(_run, __doc__, keys=schema)


if __name__ == "__main__":
  main()
