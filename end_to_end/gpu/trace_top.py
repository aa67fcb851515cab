"""Where a traced step's GPU time goes: kernels grouped by kind and the longest ones, from an xplane.pb.

  python end_to_end/gpu/trace_top.py TRACE.xplane.pb [--top N]

Reads the trace with jax.profiler.ProfileData (the GPU machine's or this one's jax). For each GPU plane: every line
with its event count and busy time, then the kernels of its busiest stream line summed by name and by kind (cuBLAS
GEMMs, XLA's Triton GEMM fusions, cuDNN attention, other fusions, collectives, copies) and the same for its
"XLA Ops" line (HLO op names, which say which fusion a kernel came from). Prints only; stdlib and jax.
"""

from __future__ import annotations

import collections
import re
import sys

# In the order they are tried: XLA names its Triton GEMM fusions after dots, so they go before cuBLAS's "gemm_".
KINDS = (
  ("Triton GEMM fusion", re.compile(r"gemm_fusion|triton_gemm|fusion_dot|__triton_gemm", re.I)),
  ("cuBLAS GEMM", re.compile(r"nvjet|cublas|gemm_|sm90_xmma|cutlass", re.I)),
  ("cuDNN attention", re.compile(r"cudnn|sdpa|fmha|flash", re.I)),
  ("collective", re.compile(r"nccl|all-reduce|all-gather|reduce-scatter|all_reduce|all_gather", re.I)),
  ("copy / memset", re.compile(r"memcpy|memset|copy", re.I)),
  ("scatter / gather", re.compile(r"scatter|gather", re.I)),
  ("other fusion", re.compile(r"fusion|loop_|input_|reduce|convert|transpose", re.I)),
)


def kind(name: str) -> str:
  return next((label for label, pattern in KINDS if pattern.search(name)), "other")


def summarize(path: str, top: int = 25) -> str:
  from jax.profiler import ProfileData

  data = ProfileData.from_file(path)
  out = [f"trace {path}"]
  for plane in data.planes:
    if "GPU" not in plane.name and "gpu" not in plane.name:
      continue
    lines = []
    for line in plane.lines:
      events = [(e.name, e.duration_ns) for e in line.events]
      lines.append((line.name, events))
      out.append(f"  {plane.name} | {line.name}: {len(events)} events, {sum(d for _, d in events) / 1e6:.1f} ms")
    streams = [ln for ln in lines if ln[0].lower().startswith("stream")] or lines
    for title, chosen in (
      ("busiest stream", max(streams, key=lambda ln: sum(d for _, d in ln[1]), default=None)),
      ("XLA Ops", next((ln for ln in lines if ln[0] == "XLA Ops"), None)),
    ):
      if not chosen or not chosen[1]:
        continue
      by_name, by_kind, calls = collections.Counter(), collections.Counter(), collections.Counter()
      for name, dur in chosen[1]:
        by_name[name] += dur
        calls[name] += 1
        by_kind[kind(name)] += dur
      total = sum(by_name.values())
      out.append(f"  == {title} ({chosen[0]}): {total / 1e6:.1f} ms busy")
      for label, dur in by_kind.most_common():
        out.append(f"     {dur / 1e6:9.1f} ms  {100 * dur / total:5.1f}%  {label}")
      out.append(f"     top {top} by time:")
      for name, dur in by_name.most_common(top):
        out.append(f"     {dur / 1e6:9.2f} ms  x{calls[name]:<5} {kind(name):<20} {name[:110]}")
  if len(out) == 1:
    out.append("  no GPU plane in this trace")
  return "\n".join(out)


def main(argv: list[str]) -> None:
  if not argv:
    raise SystemExit(__doc__)
  top = int(argv[argv.index("--top") + 1]) if "--top" in argv else 25
  for path in [a for a in argv if a.endswith(".pb")]:
    print(summarize(path, top), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
