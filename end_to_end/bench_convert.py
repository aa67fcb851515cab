"""Peak memory of convert_hf.py on a ~1B-parameter random Llama checkpoint, next to its size on disk.

  python end_to_end/bench_convert.py [--dtype=float32|bfloat16] [--workdir=DIR]

Writes a random Hugging Face-layout checkpoint (16 layers, hidden 2048, MLP 5632, vocab 32000: 0.95B
parameters) in two shards, converts it to MaxLite and back in child processes, and prints one JSON
line per direction: seconds, peak RSS of the converter, bytes on disk. The converter holds one copy of
the model (the output) and one input tensor at a time; orbax's save adds its staging buffers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import ml_dtypes
import numpy as np

from MaxLite.checkpoint.safetensors_io import write_checkpoint

HIDDEN, LAYERS, HEADS, MLP, VOCAB = 2048, 16, 16, 5632, 32000


def _random_checkpoint(path: str, dtype: str) -> int:
  rng = np.random.default_rng(0)
  np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
  shapes = [
    ("model.embed_tokens.weight", (VOCAB, HIDDEN)),
    ("model.norm.weight", (HIDDEN,)),
    ("lm_head.weight", (VOCAB, HIDDEN)),
  ]
  for i in range(LAYERS):
    for name, shape in (
      ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
      ("self_attn.k_proj.weight", (HIDDEN, HIDDEN)),
      ("self_attn.v_proj.weight", (HIDDEN, HIDDEN)),
      ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
      ("mlp.gate_proj.weight", (MLP, HIDDEN)),
      ("mlp.up_proj.weight", (MLP, HIDDEN)),
      ("mlp.down_proj.weight", (HIDDEN, MLP)),
      ("input_layernorm.weight", (HIDDEN,)),
      ("post_attention_layernorm.weight", (HIDDEN,)),
    ):
      shapes.append((f"model.layers.{i}.{name}", shape))
  tensors = [
    (n, s, np_dtype, lambda s=s: (rng.standard_normal(s, np.float32) * 0.02).astype(np_dtype)) for n, s in shapes
  ]
  files = write_checkpoint(path, tensors, max_shard_bytes=sum(np.prod(s) for _, s in shapes) * np_dtype.itemsize // 2)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(
      {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": MLP,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
      },
      f,
    )
  return sum(os.path.getsize(os.path.join(path, f)) for f in files)


def _du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _run(args: list[str]) -> tuple[float, float]:
  """(seconds, peak RSS GiB) of one converter run, measured by GNU time in its own process tree."""
  start = time.perf_counter()
  proc = subprocess.run(
    ["/usr/bin/time", "-f", "MAXRSS_KB=%M", sys.executable, os.path.join(REPO, "MaxLite", "convert_hf.py"), *args],
    capture_output=True,
    text=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  if proc.returncode:
    raise SystemExit(proc.stderr[-3000:])
  peak_kb = int(proc.stderr.rsplit("MAXRSS_KB=", 1)[1].split()[0])
  return time.perf_counter() - start, peak_kb / 2**20


def main(argv: list[str]) -> None:
  flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--"))
  dtype = flags.get("dtype", "float32")
  work = flags.get("workdir") or tempfile.mkdtemp(prefix="bench_convert_")
  try:
    on_disk = _random_checkpoint(os.path.join(work, "hf"), dtype)
    seconds, rss = _run(
      [
        "to_maxlite",
        f"--hf_path={os.path.join(work, 'hf')}",
        f"--output_path={os.path.join(work, 'ml')}",
        f"weight_dtype={dtype}",
      ]
    )
    print(
      json.dumps(
        {
          "direction": "to_maxlite",
          "params": 0.95e9,
          "dtype": dtype,
          "seconds": round(seconds, 1),
          "peak_rss_gib": round(rss, 2),
          "input_gib": round(on_disk / 2**30, 2),
          "output_gib": round(_du(os.path.join(work, "ml")) / 2**30, 2),
        }
      ),
      flush=True,
    )
    seconds, rss = _run(
      ["to_hf", f"--checkpoint_path={os.path.join(work, 'ml', '0')}", f"--output_path={os.path.join(work, 'hf_back')}"]
    )
    print(
      json.dumps(
        {
          "direction": "to_hf",
          "dtype": dtype,
          "seconds": round(seconds, 1),
          "peak_rss_gib": round(rss, 2),
          "output_gib": round(_du(os.path.join(work, "hf_back")) / 2**30, 2),
        }
      ),
      flush=True,
    )
  finally:
    if "workdir" not in flags:
      shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main(sys.argv[1:])
