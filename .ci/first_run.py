"""What .ci/run needs to check a new user's first run: the README's commands as written, and that a run trained.

  python3 .ci/first_run.py commands                 # the README's "Two commands", one per line, comments removed
  python3 .ci/first_run.py check RUN_DIR STEPS [eval]  # RUN_DIR reached step STEPS, its loss fell (and it evaluated)

Only the standard library: it runs before anything is installed.
"""

import json
import pathlib
import re
import statistics
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def readme_commands() -> list[str]:
  """The lines of the first bash block under '## Two commands', without their trailing comments."""
  text = README.read_text()
  section = text.split("## Two commands", 1)[1]
  block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
  if block is None:
    raise SystemExit("error: README.md has no ```bash block under '## Two commands'")
  commands = [re.sub(r"\s+#.*$", "", line).strip() for line in block.group(1).splitlines()]
  return [c for c in commands if c]


def check_run(run_dir: pathlib.Path, steps: int, evaluated: bool) -> str:
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  last_step = max(r["step"] for r in rows)
  if last_step != steps or not losses:
    raise SystemExit(f"error: {run_dir}: the last metrics row is step {last_step}, expected {steps}")
  # Steps are noisy (batch 4): compare the first and last fifth of the run, at least one step each.
  n = max(1, len(losses) // 5)
  first, last = statistics.fmean(losses[:n]), statistics.fmean(losses[-n:])
  if not last < first:
    raise SystemExit(
      f"error: {run_dir}: the loss did not fall (mean of the first {n} steps {first:.4f}, last {last:.4f})"
    )
  evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
  if evaluated and not evals:
    raise SystemExit(f"error: {run_dir}: no eval_loss row in metrics.jsonl")
  if not list((run_dir / "tensorboard").glob("events.out.tfevents.*")):
    raise SystemExit(f"error: {run_dir}: no tensorboard event file")
  summary = f"{run_dir.name}: {steps} steps, loss {first:.3f} -> {last:.3f} (mean of {n} steps)"
  return summary + (f", eval loss {evals[-1]:.3f}" if evals else "")


def main(argv: list[str]) -> None:
  if argv[1:2] == ["commands"]:
    print("\n".join(readme_commands()))
  elif argv[1:2] == ["check"] and len(argv) in (4, 5) and argv[4:] in ([], ["eval"]):
    print(check_run(pathlib.Path(argv[2]), int(argv[3]), evaluated=argv[4:] == ["eval"]))
  else:
    raise SystemExit(__doc__)


if __name__ == "__main__":
  main(sys.argv)
