"""Golden losses: the per-step losses of a reference run, recorded once in end_to_end/golden/NAME.json, where a test
would otherwise start an uninterrupted run beside its own only to have losses to compare with.

A golden file holds one reference run: its overrides (all but base_output_directory, run_name and the paths named in
its note), processes x devices per process, its losses per step (per member for an ensemble) and the machine it was
recorded on (the CPU's model, the instruction-set flags XLA's CPU code is chosen by, jaxlib's version). On that machine
a run must match it bit for bit (the project's rule: same config + same seed = same losses, and resumed =
uninterrupted); on another, to RTOL, because XLA's CPU code differs in the last float32 bits between processor models.
A test that needs steps past the recorded ones runs the reference run itself (bit for bit again).

After a change meant to alter the numbers, run the tests that use a golden with UPDATE_GOLDEN=1: each runs the
reference run, writes the file and fails, so that this is never mistaken for a pass; review the diff, then run them
again without it:

  UPDATE_GOLDEN=1 python3 -m pytest -q end_to_end/test_kill_resume.py end_to_end/test_multiprocess.py \
    end_to_end/test_gcs.py end_to_end/test_fine_tuning.py
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re

import procs
import pytest

RTOL = 1e-5  # against a file recorded on another CPU: last-bit rounding, not a changed model
FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
UPDATING = bool(os.environ.get("UPDATE_GOLDEN"))
# The instruction-set extensions that pick XLA's CPU code (vector width, FMA): equal losses need equal ones.
_ISA = re.compile(r"(sse\d|ssse3|avx|fma|f16c|amx|neon|asimd|sve)")


def machine() -> dict:
  """What the bits of a CPU run depend on besides the program: the processor and jaxlib."""
  info: dict[str, str] = {}
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if not key and info:
          break  # the first processor's block is enough
        if key in ("vendor_id", "model name", "cpu family", "model", "flags", "Features") and key not in info:
          info[key] = value.strip()
  except OSError:
    pass
  flags = sorted(f for f in (info.pop("flags", "") + " " + info.pop("Features", "")).split() if _ISA.match(f))
  return {**info, "isa": " ".join(flags), "jaxlib": importlib.metadata.version("jaxlib")}


def _key(value) -> tuple:
  return tuple(value) if isinstance(value, list) else (value,)


@dataclasses.dataclass(frozen=True)
class Reference:
  """A golden run's losses ({step: loss}, {step: [member losses]} for an ensemble) and whether a run on this machine
  must equal them bit for bit."""

  golden: Golden
  losses: dict
  exact: bool

  def check(self, actual: dict, steps=None) -> None:
    """`actual`'s losses (all its steps, or exactly `steps`) equal the reference's: bit for bit on the recording
    machine, to RTOL elsewhere."""
    if steps is not None:
      assert sorted(actual) == sorted(steps), f"logged steps {sorted(actual)}, expected {sorted(steps)}"
    missing = sorted(set(actual) - set(self.losses))
    assert not missing, f"steps {missing} are not in {self.golden.file}"
    if self.exact:
      print(f"{self.golden.file}: recorded on this machine (or run here); comparing bit for bit")
      differ = {s: (actual[s], self.losses[s]) for s in sorted(actual) if _key(actual[s]) != _key(self.losses[s])}
      assert not differ, (
        f"not bit for bit with {self.golden.file} ({{step: (run, golden)}}): {differ}; if a change to the numbers is "
        f"intended, regenerate it: {self.golden.regenerate}"
      )
      return
    worst = max(
      (abs(a - e) / abs(e) for s in actual for a, e in zip(_key(actual[s]), _key(self.losses[s]), strict=True)),
      default=0.0,
    )
    print(f"{self.golden.file}: recorded on another machine; largest relative difference {worst:.2e}")
    assert worst <= RTOL, (
      f"losses differ from {self.golden.file} by up to {worst:.2e} (allowed {RTOL:.0e} on another machine); if the "
      f"change is intended, regenerate it: {self.golden.regenerate}"
    )


@dataclasses.dataclass(frozen=True)
class Golden:
  """One reference run: train.py on `devices` devices, or launch_local.py with `processes` x `devices`."""

  name: str
  args: tuple[str, ...]  # the overrides, as the tests pass them
  devices: int = 1  # per process
  processes: int = 1
  members: int = 0  # an ensemble's size: its losses are recorded member by member
  note: str = ""  # what the reference run's other arguments (paths: `extra` below) are

  @property
  def file(self) -> str:
    return os.path.relpath(os.path.join(FOLDER, f"{self.name}.json"), procs.REPO)

  @property
  def regenerate(self) -> str:
    test_file = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0] or "<the test files that use it>"
    return f"UPDATE_GOLDEN=1 python3 -m pytest -q {test_file}"

  def run(self, out, run_name: str, *extra: str, steps: int | None = None) -> tuple[dict, str]:
    """Runs the reference run (to `steps` if given) under `out`: its losses and its run directory."""
    overrides = (*self.args, *extra, *((f"steps={steps}",) if steps else ()))
    overrides += (f"base_output_directory={out}", f"run_name={run_name}")
    log = os.path.join(str(out), f"{run_name}.log")
    if self.processes == 1:
      code = procs.run(procs.train_command(*overrides), log, devices=self.devices)
    else:
      code = procs.run(procs.launch_command(self.processes, self.devices, *overrides), log)
    assert code == 0, procs.tail(log)
    run_dir = os.path.join(str(out), run_name)
    rows = [r for r in procs.metric_rows(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
    if self.members:
      return {r["step"]: [r[f"loss/member_{i}"] for i in range(self.members)] for r in rows}, run_dir
    return procs.losses(rows), run_dir

  def load(self, out, *extra: str, steps=None) -> Reference:
    """The recorded losses (with UPDATE_GOLDEN: records them, then fails). `out`: a folder for a reference run;
    `extra`: its arguments the file does not record (see `note`); `steps`: those the test compares, run here if the
    file stops short of them."""
    path = os.path.join(FOLDER, f"{self.name}.json")
    if UPDATING:
      losses, _ = self.run(out, f"golden_{self.name}", *extra)
      with open(path, "w", encoding="utf-8") as f:
        record = {"args": list(self.args), "processes": self.processes, "devices_per_process": self.devices}
        record.update({"note": self.note} if self.note else {})
        record.update(recorded_on=machine(), losses={str(s): losses[s] for s in sorted(losses)})
        json.dump(record, f, indent=2)
        f.write("\n")
      pytest.fail(f"wrote {self.file}; review its diff, then run again without UPDATE_GOLDEN")
    if not os.path.exists(path):
      pytest.fail(f"no {self.file}: record it with {self.regenerate}")
    with open(path, encoding="utf-8") as f:
      golden = json.load(f)
    recorded = (golden["args"], golden["processes"], golden["devices_per_process"])
    if recorded != (list(self.args), self.processes, self.devices):
      pytest.fail(f"{self.file} was recorded with other arguments or processes x devices: {self.regenerate}")
    losses = {int(s): v for s, v in golden["losses"].items()}
    if steps is not None and max(steps) > max(losses):
      print(f"{self.file} stops at step {max(losses)}: running the reference run to step {max(steps)}")
      losses, _ = self.run(out, f"reference_{self.name}", *extra, steps=max(steps))
      return Reference(self, losses, exact=True)
    return Reference(self, losses, exact=golden["recorded_on"] == machine())


# The goldens more than one file compares with (a file's own are defined beside its tests).

# The tiny model on 1 device, real grain data, 4 rows a step: test_kill_resume.py's SIGTERM test and test_gcs.py's
# resume on a bucket (end_to_end/fault_trial.py's 1-process local trial runs the same configuration for 12 steps).
ONE_DEVICE = Golden(
  "tiny_grain_1dev",
  (*procs.TINY, "enable_tensorboard=false", "dataset_type=grain", "per_device_batch_size=4", "steps=16"),
)
