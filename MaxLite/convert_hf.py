"""Convert Hugging Face checkpoints to MaxLite checkpoints and back: Llama, Mistral, Mixtral, Qwen2, Qwen3,
Qwen3-MoE, Gemma 3, DeepSeek-V3 and GPT-OSS, its MXFP4 experts too (every architecture a family in MaxLite/models/
reads).

Usage:
  python MaxLite/convert_hf.py to_maxlite --hf_path=DIR --output_path=CKPT [CONFIG.yml] [key=value ...]
  python MaxLite/convert_hf.py to_hf --checkpoint_path=CKPT[/STEP] --output_path=DIR [CONFIG.yml] [key=value ...]
  (or: maxlite-convert-hf ...)
Example:
  python MaxLite/convert_hf.py to_maxlite --hf_path=llama-dir --output_path=ckpt/llama weight_dtype=bfloat16
  python MaxLite/convert_hf.py to_hf --checkpoint_path=outputs/run/checkpoints --output_path=hf-out

to_maxlite writes CKPT/0 (params and the model settings from config.json): train or decode from it with
load_parameters_path=CKPT/0. to_hf writes config.json and safetensors that transformers loads, from the step
--checkpoint_path names, or from the newest complete step of a checkpoints (or run) folder, and the tokenizer the run
was trained with (saved with its checkpoint, as the model keys are; tokenizer_type=... tokenizer_path=... override it).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from MaxLite import cli
from MaxLite.cli.errors import UsageError

_NEEDS = {"to_maxlite": ("hf_path", "output_path"), "to_hf": ("checkpoint_path", "output_path")}


def run(argv: Sequence[str]) -> None:
  parser = cli.FlagParser(__doc__)
  parser.add_argument("direction", choices=tuple(_NEEDS))
  parser.add_argument("--hf_path", default="", help="to_maxlite: Hugging Face model directory")
  parser.add_argument(
    "--checkpoint_path", default="", help="to_hf: a MaxLite checkpoint step, or a checkpoints folder (its newest)"
  )
  parser.add_argument("--output_path", default="", help="new directory to write")
  parser.add_argument("config_args", nargs="*", help="[CONFIG.yml] [key=value ...], as for train.py")
  args = parser.parse_intermixed_args(argv)
  for name in _NEEDS[args.direction]:
    if not getattr(args, name):
      raise UsageError(f"{args.direction}: --{name}=... is required (see --help)")
  from MaxLite.checkpoint import hf

  if args.direction == "to_maxlite":
    step_dir = hf.to_maxlite(args.hf_path, args.output_path, args.config_args)
    print(f"wrote {step_dir}; train or decode with load_parameters_path={step_dir}")
  else:
    files = hf.to_hf(args.checkpoint_path, args.output_path, args.config_args)
    print(f"wrote {', '.join(files)} to {args.output_path}")


def main(argv: Sequence[str] | None = None) -> int:
  return cli.run(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())
