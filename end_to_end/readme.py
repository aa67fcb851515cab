"""The README, run as a new user runs it (helper of the end_to_end/test_readme_*.py files): every command of its bash
blocks and every python block, exactly as printed, in a clean copy of the checkout, each one required to exit 0.

The README is cut into parts at the headings in PARTS; each part runs top to bottom in its own copy (its order is
the dependency order: convert before train before decode) and one file, end_to_end/test_readme_<part>.py, runs it,
so the parts run side by side under pytest-xdist. A part needs nothing another part wrote: a cut goes only where the
commands after it read no file the commands before it made.

The one addition is the README's documented cap (`CAP` below: a few steps, one eval batch, a short planner budget),
appended to every command that reads configs/base.yml. What a command downloads or the user brings is a small stand-in
at the path the README names (standins.py: tiny random Hugging Face folders, the user's text and Parquet files made
from the shipped corpus), made only for the parts whose commands name it. Commands that need a TPU, a bucket, a GPU
cluster, or that are this suite's own set-up, are reported as skipped, each by name with its reason (`pytest -ra`
lists them); a command that neither runs nor has a reason fails.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import procs
import pytest
import standins

README = os.path.join(procs.REPO, "README.md")
# The README's documented cap for a laptop (its "Tests" section says so): appended to every config-reading command.
CAP = ("steps=2", "eval_steps=1", "plan_time_budget_s=0", "plan_workers=1")
# Lines that do not run here, and why: (pattern on the command line, reason). Each must match some README line.
SKIPPED = (
  (r"^DEVICE=gpu ", "needs a GPU cluster"),
  (r"^bash setup\.sh", "sets up an environment: .ci/run runs setup.sh in a new venv before this suite"),
  (r"^python3 -m pytest", "runs this suite itself"),
  (r"multihost_(runner|job)\.py", "needs TPU VMs and gcloud"),
  (r"gs://", "needs a Cloud Storage bucket"),
  (r"^srun ", "needs a SLURM cluster with GPUs"),
  (r"^tokenizer_(type|path)=", "a fragment of the command lines above, not a command"),
  (
    r"(train_compile|plan)\.py .*model_name=llama2-",
    "a pod-scale libtpu compile (80 s on a 2-core VM, twice that beside another test): the memory it prints is a "
    "measurement, whose figures the README's tables give with their date; tests/aot/test_train_compile.py and "
    "tests/planning/test_plan.py run both tools for v5p (plan.py starting from train_compile.py's cache included), and "
    "tests/project/test_readme_commands.py checks the line's tool, keys and values",
  ),
)
# The parts, in README order: (name, the heading it starts at). Each runs up to the next part's heading.
PARTS = (
  ("first_steps", "## Two commands: install and train, then decode"),
  ("checkpoints", "## Checkpoints and resuming"),
  ("fine_tuning", "### Fine-tune on this machine: SFT, then DPO, on the shipped chats"),
  ("ensembles_and_processes", "## Ensembles: many small runs in one program"),
  ("pods", "## Train on a TPU pod"),
)


class Step(NamedTuple):
  name: str  # "L<line> <short command>": the test id
  kind: str  # "bash" or "python"
  body: str
  line: int


def readme_steps(text: str) -> list[Step]:
  """Each bash command line (continuations joined, comments dropped) and python block, in order."""
  steps, lines = [], text.splitlines()
  i = 0
  while i < len(lines):
    opening = lines[i].strip()
    if not opening.startswith("```"):
      i += 1
      continue
    kind, body, start = opening[3:].strip(), [], i + 1
    i += 1
    while not lines[i].strip().startswith("```"):
      body.append(lines[i])
      i += 1
    i += 1
    if kind == "python":
      steps.append(Step(f"L{start} python block", "python", "\n".join(body), start))
    elif kind == "bash":
      pending, first = "", start
      for n, line in enumerate(body, start + 1):
        if not pending:
          first = n
        if line.rstrip().endswith("\\"):
          pending += line.rstrip()[:-1] + " "
          continue
        command = shlex.join(_as_typed(pending + line))
        pending = ""
        if command:
          steps.append(Step(f"L{first} {_short(command)}", "bash", command, first))
  return steps


def _as_typed(line: str) -> list[str]:
  """The words of a README line as a user runs it: comments, `...` and the optional `[...]` parts left out."""
  words, optional = [], False
  for word in shlex.split(line, comments=True):
    if word.startswith("[") and "=[" not in word:
      optional = True
    if not optional and word != "...":
      words.append(word)
    if optional and word.endswith("]"):
      optional = False
  return words


def _short(command: str) -> str:
  words = [w for w in shlex.split(command) if not w.startswith("configs/")]
  return " ".join(os.path.basename(w) if w.endswith(".py") else w for w in words)[:90]


def skip_reason(step: Step) -> str | None:
  if step.kind != "bash":
    return None
  return next((reason for pattern, reason in SKIPPED if re.search(pattern, step.body)), None)


def part_starts(text: str) -> dict[str, int]:
  """{part: the README line its heading is on}; a heading PARTS names that the README lacks stops collection."""
  lines = text.splitlines()
  starts = {}
  for name, heading in PARTS:
    if heading not in lines:
      raise ValueError(f"end_to_end/readme.py PARTS: the README has no heading {heading!r} (part {name!r})")
    starts[name] = lines.index(heading) + 1
  return starts


TEXT = open(README, encoding="utf-8").read()
STEPS = readme_steps(TEXT)
_STARTS = part_starts(TEXT)


def steps_of(part: str) -> list[Step]:
  """The steps from the part's heading to the next part's (the last part: to the end)."""
  begin = _STARTS[part]
  end = min((line for line in _STARTS.values() if line > begin), default=len(TEXT.splitlines()) + 1)
  return [step for step in STEPS if begin <= step.line < end]


def _clean_checkout(root: str) -> str:
  """The files a fresh clone has (tracked, and new files git would add), and the libtpu setup.sh installs."""
  listed = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    cwd=procs.REPO,
    capture_output=True,
    check=True,
  ).stdout.split(b"\0")
  checkout = os.path.join(root, "maxlite")
  for name in filter(None, (n.decode() for n in listed)):
    source = os.path.join(procs.REPO, name)
    if os.path.isfile(source):
      os.makedirs(os.path.dirname(os.path.join(checkout, name)), exist_ok=True)
      shutil.copy2(source, os.path.join(checkout, name))
  if os.path.isdir(os.path.join(procs.REPO, ".deps")):
    os.symlink(os.path.join(procs.REPO, ".deps"), os.path.join(checkout, ".deps"))
  return checkout


@functools.cache
def _documents() -> tuple[str, ...]:
  """The shipped corpus's documents, read once for the stand-ins that are made of them."""
  return tuple(doc for shard in range(4) for doc in standins.corpus_documents(shard))


# What the README's commands expect to find that the README does not make itself: {path: how to make it there}.
STAND_INS: dict[str, Callable[[str], None]] = {
  "my_text": lambda path: standins.text_files(path, list(_documents())),
  "data/fineweb": lambda path: standins.parquet_shards(path, list(_documents()[:600])),
  "llama-dir": standins.llama2_folder,
  "Llama-3.2-1B": standins.llama3_folder,
  "Qwen3-0.6B": standins.qwen3_folder,
}


def _env() -> dict[str, str]:
  # The user's `python` is this interpreter; one CPU device unless the command sets XLA_FLAGS itself, compiled as the
  # tests compile (the suite's other XLA flags kept: tests/support/fast_compile.py's FAST_COMPILE says why).
  env = procs.env_with_devices(1)
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
  env.pop("PYTHONPATH", None)
  return env


def run_part(part: str, root: str) -> dict:
  """Runs one part of the README top to bottom in a clean checkout under `root`; {"results": {name: (exit code,
  output, seconds)} of each step that ran, in order, "checkout": the checkout it ran in}."""
  checkout = _clean_checkout(root)
  steps = steps_of(part)
  for path, make in STAND_INS.items():
    if any(path in step.body for step in steps):
      make(os.path.join(checkout, path))
  results, env = {}, _env()
  for step in steps:
    if skip_reason(step):
      continue
    if step.kind == "python":
      command = [sys.executable, "-c", step.body]
    else:
      capped = step.body + (" " + " ".join(CAP) if "configs/base.yml" in shlex.split(step.body) else "")
      command = ["bash", "-c", capped]
    began = time.monotonic()
    done = subprocess.run(
      command, cwd=checkout, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    results[step.name] = (done.returncode, done.stdout + done.stderr, time.monotonic() - began)
    print(f"{results[step.name][2]:6.1f} s  exit {done.returncode}  {step.name}", file=sys.stderr)
  return {"results": results, "checkout": checkout}


def ran_fixture(part: str):
  """The module fixture `ran` of a part's file: run_part's result, the part run once for all its tests."""

  @pytest.fixture(scope="module")
  def ran(tmp_path_factory) -> dict:
    return run_part(part, str(tmp_path_factory.mktemp("readme")))

  return ran


def step_test(part: str):
  """The test of each step of a part, one test id per README line: it exited 0, or is skipped with its reason."""

  @pytest.mark.parametrize("step", steps_of(part), ids=lambda step: step.name)
  def test_readme_step(ran: dict, step: Step) -> None:
    check_step(ran, step)

  return test_readme_step


def check_step(ran: dict, step: Step) -> None:
  """The step exited 0, or is skipped with its reason."""
  reason = skip_reason(step)
  if reason:
    pytest.skip(f"README {step.name}: {reason}")
  code, output, _ = ran["results"][step.name]
  assert code == 0, f"`{step.body}` exited {code}:\n{output[-4000:]}"


def output(ran: dict, pattern: str) -> str:
  """The output of the one step whose name matches `pattern`."""
  (found,) = [out for name, (_, out, _) in ran["results"].items() if re.search(pattern, name)]
  return found


def printed_completion(output: str, prompt: str) -> str:
  """decode.py's completion of its first prompt: it prints `[0] prompt: "..."`, then `[0] completion: "..."` (JSON)."""
  assert f"[0] prompt: {json.dumps(prompt, ensure_ascii=False)}\n" in output, output[-2000:]
  return json.loads(re.search(r"^\[0\] completion: (.*)$", output, re.M)[1])


def metric_rows(ran: dict, run_name: str) -> list[dict]:
  with open(os.path.join(ran["checkout"], "outputs", run_name, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def greedy_in_transformers(folder: str, prompt: str, new_tokens: int, add_bos: bool) -> str:
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  tok = transformers.AutoTokenizer.from_pretrained(folder)
  eos = model.config.eos_token_id
  ids = ([model.config.bos_token_id] if add_bos else []) + tok(prompt, add_special_tokens=False)["input_ids"]
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos)
  return tok.decode([t for t in out[0, len(ids) :].tolist() if t != eos])
