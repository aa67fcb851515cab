#!/usr/bin/env bash
# Install MaxLite's dependencies into the current Python environment.
#   DEVICE=cpu (default) | tpu | gpu   which jax backend to install
#   AOT=1 (default) | 0   also fetch libtpu into .deps/libtpu for train_compile.py (compile for TPU
#                         topologies on this machine; kept off the import path so CPU runs stay quiet)
#   MODE=pinned (default) | stable | nightly
#     pinned:  the versions in requirements.txt (tested together)
#     stable:  the newest releases of the same packages
#     nightly: pre-releases of jax/jaxlib on top of stable
# Usage: bash setup.sh            (then: python MaxLite/train.py configs/base.yml)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

DEVICE="${DEVICE:-cpu}"
MODE="${MODE:-pinned}"
PYTHON="${PYTHON:-python3}"
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check --quiet "$@"; }

case "$DEVICE" in cpu|tpu|gpu) ;; *) echo "error: DEVICE=$DEVICE is not one of cpu, tpu, gpu" >&2; exit 2;; esac
JAX_VERSION="$(sed -n 's/^jax==//p' requirements.txt)"

case "$MODE" in
  pinned)
    pip_install -r requirements.txt
    case "$DEVICE" in
      tpu) pip_install "jax[tpu]==${JAX_VERSION}" ;;
      gpu) pip_install "jax[cuda12]==${JAX_VERSION}" ;;
    esac ;;
  stable|nightly)
    # Everything in requirements.txt, unpinned.
    mapfile -t packages < <(sed -n 's/==.*//p' requirements.txt)
    pip_install --upgrade "${packages[@]}"
    extra=""
    case "$DEVICE" in tpu) extra="[tpu]" ;; gpu) extra="[cuda12]" ;; esac
    if [[ "$MODE" == nightly ]]; then
      pip_install --upgrade --pre "jax${extra}" jaxlib
    elif [[ -n "$extra" ]]; then
      pip_install --upgrade "jax${extra}"
    fi ;;
  *) echo "error: MODE=$MODE is not one of pinned, stable, nightly" >&2; exit 2 ;;
esac
pip_install -r requirements-test.txt

if [[ "${AOT:-1}" == 1 && "$DEVICE" != tpu ]]; then
  # The libtpu build this jax release asks for (its `tpu` extra), as a plain directory.
  LIBTPU_SPEC="$("$PYTHON" -c 'import importlib.metadata as m, re; print(next(re.sub(r";.*", "", r).replace(" ", "") for r in m.requires("jax") if r.startswith("libtpu")))')"
  if [[ ! -f .deps/libtpu/libtpu/libtpu.so ]] || ! grep -qx "$LIBTPU_SPEC" .deps/libtpu/.spec 2>/dev/null; then
    rm -rf .deps/libtpu
    pip_install --no-deps --target .deps/libtpu "$LIBTPU_SPEC"
    echo "$LIBTPU_SPEC" > .deps/libtpu/.spec
  fi
fi

"$PYTHON" - <<'PY'
import jax
print(f"MaxLite set-up done: jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} device(s)")
PY
