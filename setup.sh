#!/usr/bin/env bash
# Install MaxLite and its pinned dependencies into a virtual environment: the active one (a venv or a conda env), the
# interpreter PYTHON names, or else .venv in this checkout, made here (a system Python often refuses pip installs, PEP
# 668); `source .venv/bin/activate` then enters it, in each new shell.
#
#   bash setup.sh [DEVICE=cpu|tpu|gpu] [CUDA=auto|12|13] [MODE=pinned|stable|nightly] [AOT=1|0] [TEST=0|1] [PYTHON=python3]
#
# MaxText's argument form; the same names work as environment variables.
#   DEVICE  cpu (default) | tpu (jax[tpu]) | gpu (jax[cuda13] or jax[cuda12]); checked after installing: DEVICE=tpu on
#           a machine without TPU chips stops with an error instead of leaving a CPU-only install behind
#   CUDA    DEVICE=gpu: which CUDA plugin; auto (default) = what the NVIDIA driver runs (nvidia-smi's "CUDA Version":
#           13 -> jax[cuda13], 12 -> jax[cuda12]; 13 when nvidia-smi is absent)
#   MODE    pinned (default): the versions in requirements*.txt, tested together; stable: the newest releases of
#           the same packages; nightly: jax/jaxlib pre-releases on top of stable
#   AOT     1 (default, not with DEVICE=tpu): also put libtpu into .deps/libtpu for train_compile.py (compile for
#           TPU topologies on this machine; kept off the import path so CPU runs stay quiet)
#   TEST    1: also the test-only packages of requirements/test.txt (pytest, ruff, torch, transformers, a local
#           GCS server); never needed to train, so pod workers leave it at 0 (the default). .ci/run sets 1.
#   PYTHON  the interpreter to install into (PYTHON=python3 outside any venv: the system's); unset: the active
#           environment's python3, else .venv's (made if missing)
# Then: python MaxLite/train.py configs/base.yml   (or maxlite-train configs/base.yml)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

for arg in "$@"; do
  case "$arg" in
    DEVICE=*|CUDA=*|MODE=*|AOT=*|TEST=*|PYTHON=*) export "${arg?}" ;;
    *) echo "error: setup.sh: unknown argument '$arg'; use DEVICE=cpu|tpu|gpu CUDA=auto|12|13 MODE=pinned|stable|nightly AOT=0|1 TEST=0|1 PYTHON=..." >&2
       exit 2 ;;
  esac
done
# Named (an argument or the environment) or not: only an unnamed one may become .venv's below.
PYTHON_NAMED="${PYTHON:+1}"
DEVICE="${DEVICE:-cpu}"
CUDA="${CUDA:-auto}"
MODE="${MODE:-pinned}"
AOT="${AOT:-1}"
TEST="${TEST:-0}"
PYTHON="${PYTHON:-python3}"
case "$DEVICE" in cpu|tpu|gpu) ;; *) echo "error: setup.sh: DEVICE=$DEVICE is not one of cpu, tpu, gpu" >&2; exit 2 ;; esac
case "$CUDA" in auto|12|13) ;; *) echo "error: setup.sh: CUDA=$CUDA is not one of auto, 12, 13" >&2; exit 2 ;; esac
case "$MODE" in pinned|stable|nightly) ;; *) echo "error: setup.sh: MODE=$MODE is not one of pinned, stable, nightly" >&2; exit 2 ;; esac
case "$AOT$TEST" in [01][01]) ;; *) echo "error: setup.sh: AOT and TEST take 0 or 1, got AOT=$AOT TEST=$TEST" >&2; exit 2 ;; esac

if ! command -v "$PYTHON" > /dev/null; then
  echo "error: setup.sh: PYTHON=$PYTHON is not a command; install Python 3.11 or newer and pass PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "error: setup.sh: $("$PYTHON" -V 2>&1) is too old: jax $(sed -n 's/^jax==//p' requirements.txt) needs Python 3.11 or newer;" \
       "make one with e.g. \`python3 -m pip install uv && python3 -m uv venv --python 3.12 ~/venv\` and run" \
       "\`PYTHON=~/venv/bin/python bash setup.sh ...\`" >&2
  exit 2
fi
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check --quiet "$@"; }
# pip is quiet (--quiet), so each step says what it installs before it starts, and the end how long each took.
SECONDS=0
timings=()
step_name="" step_start=0
step() {  # step NAME TEXT: close the previous step's timing, print TEXT as this step's line
  [[ -n "$step_name" ]] && timings+=("$step_name $(( SECONDS - step_start )) s")
  step_name="$1" step_start=$SECONDS
  echo "setup.sh: $2"
}
# "requirements.txt (29 packages: jax 0.10.2, jaxlib 0.10.2, flax 0.12.8, ...)": what a requirement file installs.
describe_requirements() {
  local file names count
  for file in "$@"; do
    names="$(sed -n 's/^\([^#=<> ]*\)==\([^ ;#]*\).*/\1 \2/p' "$file")"
    count="$(grep -c . <<< "$names" || true)"
    printf '%s (%s: %s)\n' "$file" "$count package$([[ "$count" == 1 ]] || echo s)" \
      "$(head -n 3 <<< "$names" | paste -sd, - | sed 's/,/, /g')$([[ "$count" -gt 3 ]] && echo ', ...')"
  done
}
extras=(requirements/gcs.txt)
if [[ "$DEVICE" == gpu && "$CUDA" == auto ]]; then
  # The driver's newest CUDA decides the plugin: jax's CUDA 13 wheels do not load under a CUDA 12 driver.
  driver_cuda="$(nvidia-smi 2> /dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1 || true)"
  if [[ -z "$driver_cuda" ]]; then
    CUDA=13
    echo "note: nvidia-smi did not say which CUDA the driver runs; installing jax's CUDA 13 plugin (CUDA=12 for older drivers)"
  elif (( driver_cuda >= 13 )); then
    CUDA=13
  elif (( driver_cuda == 12 )); then
    CUDA=12
  else
    echo "error: setup.sh: the NVIDIA driver runs CUDA $driver_cuda; jax $(sed -n 's/^jax==//p' requirements.txt) needs a driver for CUDA 12 or 13: update the driver" >&2
    exit 2
  fi
  echo "DEVICE=gpu: jax's CUDA $CUDA plugin${driver_cuda:+ (the driver runs CUDA $driver_cuda)}"
fi
case "$DEVICE" in
  tpu) extras+=(requirements/tpu.txt) ;;
  gpu) if [[ "$CUDA" == 12 ]]; then extras+=(requirements/gpu-cuda12.txt); else extras+=(requirements/gpu.txt); fi ;;
esac
[[ "$TEST" == 1 ]] && extras+=(requirements/test.txt)


in_dot_venv=""
if [[ -z "$PYTHON_NAMED" && -z "${VIRTUAL_ENV:-}" && -z "${CONDA_PREFIX:-}" ]]; then
  # No environment to install into: one of MaxLite's own, kept (and reused by the next run) in the checkout.
  if [[ ! -x .venv/bin/python ]] && ! venv_error="$("$PYTHON" -m venv .venv 2>&1)"; then
    rm -rf .venv
    echo "error: setup.sh: \`$PYTHON -m venv .venv\` failed ($(tail -n 1 <<< "$venv_error")); on Debian/Ubuntu" \
         "\`apt install python3-venv\`, or activate a virtual environment of your own, or pass PYTHON=/path/to/python" >&2
    exit 2
  fi
  PYTHON="$PWD/.venv/bin/python"
  in_dot_venv=1
elif [[ -z "$PYTHON_NAMED" && ! -e .venv ]]; then
  # The README's next words are `source .venv/bin/activate`: for a user whose environment is already active they
  # must enter that same one, not fail.
  if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    ln -s "$VIRTUAL_ENV" .venv
  else
    mkdir -p .venv/bin && printf 'conda activate %q\n' "$CONDA_PREFIX" > .venv/bin/activate
  fi
fi

echo "setup.sh: installing into $PYTHON ($("$PYTHON" -V 2>&1)); DEVICE=$DEVICE MODE=$MODE AOT=$AOT TEST=$TEST"
if [[ "$MODE" == pinned ]]; then
  step dependencies "pip: the pinned dependencies, resolved together (the long step: minutes on a fresh machine):"
  describe_requirements requirements.txt "${extras[@]}" | sed 's/^/  /'
  pip_install -r requirements.txt "${extras[@]/#/-r}"
else
  # The same packages, unpinned.
  mapfile -t packages < <(sed -n 's/==.*//p' requirements.txt "${extras[@]}")
  step dependencies "pip: the newest releases of ${#packages[@]} packages (requirements.txt ${extras[*]}, unpinned)"
  pip_install --upgrade "${packages[@]}"
  if [[ "$MODE" == nightly ]]; then
    step nightly "pip: jax and jaxlib pre-releases (MODE=nightly)"
    pip_install --upgrade --pre jax jaxlib
  fi
fi
# MaxLite itself, editable: `import MaxLite` and the maxlite-* commands run this checkout's code. No
# dependency resolution here: the step above chose the versions.
step maxlite "pip: MaxLite itself, editable (this checkout's code; the maxlite-* commands)"
pip_install --no-deps --editable .

if [[ "$AOT" == 1 && "$DEVICE" != tpu ]]; then
  # The libtpu build this jax release asks for (its `tpu` extra), as a plain directory.
  LIBTPU_SPEC="$("$PYTHON" -c 'import importlib.metadata as m, re; print(next(re.sub(r";.*", "", r).replace(" ", "") for r in m.requires("jax") if r.startswith("libtpu")))')"
  if [[ ! -f .deps/libtpu/libtpu/libtpu.so ]] || ! grep -qx "$LIBTPU_SPEC" .deps/libtpu/.spec 2>/dev/null; then
    rm -rf .deps/libtpu
    step libtpu "pip: $LIBTPU_SPEC into .deps/libtpu (AOT=1: train_compile.py compiles for TPU topologies here)"
    pip_install --no-deps --target .deps/libtpu "$LIBTPU_SPEC"
    echo "$LIBTPU_SPEC" > .deps/libtpu/.spec
  fi
fi

# tcmalloc: train.py re-execs itself under it when present, so XLA's large per-step host buffers are reused
# instead of page-faulted in again every step (about 15% faster CPU steps; MAXLITE_TCMALLOC=0 turns it off). A
# system package, so it is installed only where apt-get runs as root; elsewhere the line below says what to do.
apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" > /dev/null 2>&1; }
if [[ "$(uname)" == Linux ]] \
   && ! "$PYTHON" -c 'from MaxLite.runtime.allocator import tcmalloc_path as t; raise SystemExit(t() is None)'; then
  step tcmalloc "apt: libtcmalloc-minimal4 (faster CPU training), where apt-get runs as root"
  if command -v apt-get > /dev/null && [[ "$(id -u)" == 0 ]] \
     && { apt_install libtcmalloc-minimal4 || { apt-get update -q > /dev/null 2>&1 && apt_install libtcmalloc-minimal4; }; }; then
    echo "installed libtcmalloc-minimal4 (used by train.py)"
  else
    echo "note: for faster CPU training install tcmalloc (Debian/Ubuntu: libtcmalloc-minimal4; Fedora: gperftools-libs)"
  fi
fi

# Check what was installed without starting a jax runtime (on a TPU VM that would take the chips, and on a pod
# worker it would wait for the other hosts).
step check "checking the install (imports and versions, no jax runtime started)"
DEVICE="$DEVICE" "$PYTHON" -m MaxLite.runtime.install_check
timings+=("$step_name $(( SECONDS - step_start )) s")
echo "setup.sh: done in $(( SECONDS / 60 ))m $(( SECONDS % 60 ))s ($(IFS=';'; sed 's/;/, /g' <<< "${timings[*]}"))"
if [[ -n "$in_dot_venv" ]]; then
  echo "installed into .venv, this checkout's virtual environment: \`source .venv/bin/activate\` enters it (in each new shell)"
fi
