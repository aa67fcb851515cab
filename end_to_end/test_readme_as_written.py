"""The README, run as a new user runs it: every command of its bash blocks and every python block, exactly as printed,
top to bottom (its order is the dependency order: convert before train before decode), in a clean copy of the
checkout, each one required to exit 0.

The one addition is the README's documented cap (`CAP` below: a few steps, a short planner budget), appended to every
command that reads configs/base.yml. What a command downloads or the user brings is a small stand-in at the path the
README names (standins.py: tiny random Hugging Face folders, the user's text and Parquet files made from the shipped
corpus). Commands that need a TPU, a bucket, a GPU cluster, or that are this suite's own set-up, are reported as
skipped, each by name with its reason (`pytest -ra` lists them); a command that neither runs nor has a reason fails.
The checks after the run read what the commands wrote: the exports load in transformers and continue as decode.py
printed, DPO starts at log 2, the sweep's closing line names its best member.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import procs
import pytest
import standins

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

README = os.path.join(procs.REPO, "README.md")
# The README's documented cap for a laptop (its "Tests" section says so): appended to every config-reading command.
CAP = ("steps=2", "plan_time_budget_s=0", "plan_workers=1")
# Lines that do not run here, and why: (pattern on the command line, reason). Each must match some README line.
SKIPPED = (
  (r"^DEVICE=gpu ", "needs a GPU cluster"),
  (r"^bash setup\.sh", "sets up an environment: .ci/run runs setup.sh in a new venv before this suite"),
  (r"^python3 -m pytest", "runs this suite itself"),
  (r"multihost_(runner|job)\.py", "needs TPU VMs and gcloud"),
  (r"gs://", "needs a Cloud Storage bucket"),
  (r"^srun ", "needs a SLURM cluster with GPUs"),
  (r"^tokenizer_(type|path)=", "a fragment of the command lines above, not a command"),
)


def readme_steps(text: str) -> list[tuple[str, str, str]]:
  """(name, kind, body) for each bash command line (continuations joined, comments dropped) and python block, in order;
  kind is "bash" or "python"."""
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
      steps.append((f"L{start} python block", "python", "\n".join(body)))
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
          steps.append((f"L{first} {_short(command)}", "bash", command))
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


def skip_reason(command: str) -> str | None:
  return next((reason for pattern, reason in SKIPPED if re.search(pattern, command)), None)


STEPS = readme_steps(open(README).read())


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


def _downloads_and_own_data(checkout: str) -> None:
  """Everything the README's commands expect to find that the README does not make itself."""
  documents = [doc for shard in range(4) for doc in standins.corpus_documents(shard)]
  standins.text_files(os.path.join(checkout, "my_text"), documents)
  standins.parquet_shards(os.path.join(checkout, "data", "fineweb"), documents[:600])
  standins.llama2_folder(os.path.join(checkout, "llama-dir"))
  standins.llama3_folder(os.path.join(checkout, "Llama-3.2-1B"))
  standins.qwen3_folder(os.path.join(checkout, "Qwen3-0.6B"))


def _env() -> dict[str, str]:
  # The user's `python` is this interpreter; one CPU device unless the command sets XLA_FLAGS itself, compiled as the
  # tests compile (the suite's other XLA flags kept: tests/support/fast_compile.py's FAST_COMPILE says why).
  env = procs.env_with_devices(1)
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
  env.pop("PYTHONPATH", None)
  return env


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict:
  """Runs the README top to bottom once; {name: (exit code, output, seconds)} of each step that ran, in order, and
  the checkout it ran in."""
  checkout = _clean_checkout(str(tmp_path_factory.mktemp("readme")))
  _downloads_and_own_data(checkout)
  results, env = {}, _env()
  for name, kind, body in STEPS:
    if kind == "bash" and skip_reason(body):
      continue
    if kind == "python":
      command = [sys.executable, "-c", body]
    else:
      capped = body + (" " + " ".join(CAP) if "configs/base.yml" in shlex.split(body) else "")
      command = ["bash", "-c", capped]
    began = time.monotonic()
    done = subprocess.run(
      command, cwd=checkout, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    results[name] = (done.returncode, done.stdout + done.stderr, time.monotonic() - began)
    print(f"{results[name][2]:6.1f} s  exit {done.returncode}  {name}", file=sys.stderr)
  return {"results": results, "checkout": checkout}


@pytest.mark.parametrize("name,kind,body", STEPS, ids=[name for name, _, _ in STEPS])
def test_readme_step(ran, name, kind, body):
  reason = skip_reason(body) if kind == "bash" else None
  if reason:
    pytest.skip(f"README {name}: {reason}")
  code, output, _ = ran["results"][name]
  assert code == 0, f"`{body}` exited {code}:\n{output[-4000:]}"


def test_every_skip_reason_is_used_and_every_tool_runs():
  """A skip rule nothing matches is stale; and each tool the README shows runs at least once."""
  commands = [body for _, kind, body in STEPS if kind == "bash"]
  unused = [pattern for pattern, _ in SKIPPED if not any(re.search(pattern, c) for c in commands)]
  assert not unused, f"skip rules that match no README line: {unused}"
  run = " ".join(c for c in commands if not skip_reason(c))
  for tool in ("train.py", "decode.py", "convert_hf.py", "train_compile.py", "plan.py", "launch_local.py"):
    assert f"MaxLite/{tool}" in run, tool
  assert any(kind == "python" for _, kind, _ in STEPS)


def _output(ran, pattern: str) -> str:
  (found,) = [out for name, (_, out, _) in ran["results"].items() if re.search(pattern, name)]
  return found


def _printed_completion(output: str, prompt: str) -> str:
  """decode.py's completion of its first prompt: it prints `[0] prompt: "..."`, then `[0] completion: "..."` (JSON)."""
  assert f"[0] prompt: {json.dumps(prompt, ensure_ascii=False)}\n" in output, output[-2000:]
  return json.loads(re.search(r"^\[0\] completion: (.*)$", output, re.M)[1])


def _metric_rows(ran, run_name: str) -> list[dict]:
  with open(os.path.join(ran["checkout"], "outputs", run_name, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _greedy_in_transformers(folder: str, prompt: str, new_tokens: int, add_bos: bool) -> str:
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  tok = transformers.AutoTokenizer.from_pretrained(folder)
  eos = model.config.eos_token_id
  ids = ([model.config.bos_token_id] if add_bos else []) + tok(prompt, add_special_tokens=False)["input_ids"]
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos)
  return tok.decode([t for t in out[0, len(ids) :].tolist() if t != eos])


def test_continued_llama3_exports_and_continues_as_decode_printed(ran):
  """Continue pretraining: the export is a Llama 3 folder transformers loads (BOS/EOS from the tokenizer, llama3 RoPE,
  the original context length), training moved it, and its greedy text is decode.py's."""
  import torch
  import transformers

  out, original = (os.path.join(ran["checkout"], d) for d in ("llama32-cpt-hf", "Llama-3.2-1B"))
  prompt = "The capital of France is"
  printed = _printed_completion(_output(ran, r"decode\.py .*llama32-cpt"), prompt)
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert (model.config.bos_token_id, model.config.eos_token_id) == (0, 1)  # from the tokenizer, not Llama 2's 1, 2
  assert model.config.rope_parameters["rope_type"] == "llama3" and model.config.tie_word_embeddings
  assert model.config.max_position_embeddings == 131072
  base = transformers.AutoModelForCausalLM.from_pretrained(original)
  assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
  assert _greedy_in_transformers(out, prompt, 32, add_bos=True) == printed


def test_qwen3_sft_then_dpo_exports_with_its_chat_template(ran):
  """Fine-tune Qwen3: SFT trained and evaluated, DPO's first loss is log 2 (the policy is its reference), the export
  is a Qwen3 with the chat template, and its greedy text is decode.py's."""
  import transformers

  sft, dpo = _metric_rows(ran, "qwen3-sft"), _metric_rows(ran, "qwen3-dpo")
  assert [r["step"] for r in sft if "loss" in r] == [1, 2] and all(r["trained_tokens"] > 0 for r in sft if "loss" in r)
  assert math.isclose(dpo[0]["loss"], math.log(2), rel_tol=1e-3)  # bfloat16, as the README trains
  out = os.path.join(ran["checkout"], "qwen3-dpo-hf")
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")
  prompt = 'The section "Lists" says:'
  printed = _printed_completion(_output(ran, r"decode\.py .*qwen3-dpo"), prompt)
  assert type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__ == "Qwen3ForCausalLM"
  assert _greedy_in_transformers(out, prompt, 32, add_bos=False) == printed


def test_lora_export_has_merged_weights_adapter_and_base(ran):
  folder = os.path.join(ran["checkout"], "qwen3-sft-lora-hf")
  assert {"config.json", "adapter", "base"} <= set(os.listdir(folder))
  assert "adapter_config.json" in os.listdir(os.path.join(folder, "adapter"))


def test_sweep_names_its_best_member(ran):
  """By the last eval's losses, or (no eval within the cap's steps) by the last step's training losses."""
  printed = _output(ran, r"train\.py run_name=lr-sweep")
  best = re.search(r"best member (\d) \((eval loss|loss) ([\d.]+), learning rate ([\d.e-]+)\)", printed)
  assert best, printed[-2000:]
  rows = _metric_rows(ran, "lr-sweep")
  key = "eval_loss" if best[2] == "eval loss" else "loss"
  last = [r for r in rows if f"{key}/member_0" in r][-1]
  losses = [last[f"{key}/member_{i}"] for i in range(4)]
  assert int(best[1]) == losses.index(min(losses)) and float(best[3]) == round(min(losses), 4)
  # The member run starts from the sweep's trained member 2, not a fresh model.
  assert _metric_rows(ran, "lr-best")[0]["loss"] < rows[0]["loss/member_2"]
