#!/usr/bin/env bash
# Prepare .gpu_carry/ for end_to_end/gpu/bench_vs_maxtext.sh, on a machine WITH network (the GPU machine has none):
#   .gpu_carry/wheels/   py3.12 manylinux x86_64 wheels that MaxLite and MaxText need beyond what the GPU machine has
#                        (jax 0.11.2 + CUDA 13 plugin, flax, optax, orbax, transformers, torch are preinstalled there)
#   .gpu_carry/maxtext/  MaxText at commit 479dd99946c5, its src/ only
# Usage (repo root): bash end_to_end/gpu/fetch.sh [MAXTEXT_GIT_DIR]
# Then hand the GPU session `carry: [".gpu_carry"]` and have it run `bash end_to_end/gpu/bench_vs_maxtext.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu_carry
MAXTEXT_GIT=${1:-${MAXTEXT_GIT:-/work/.mirror/AI-Hypercomputer+maxtext/repo}}
MAXTEXT_COMMIT=479dd99946c5
PY=${PYTHON:-python3}

WHEELS=(
  # MaxLite's
  grain==0.2.18 array_record==0.8.6 tensorboardX==2.6.5 qwix==0.1.8
  # MaxText's extras (see shared/gpu/README.md)
  annotated_types==0.8.0 aqtp==0.9.0 drjax==0.2.1 einshape==1.0 fastapi==0.165.0 immutabledict==4.3.1
  importlib_metadata==10.2.0 jaxtyping==0.3.11 ml_collections==1.1.0 omegaconf==2.3.1 opentelemetry_api==1.45.2
  pathwaysutils==0.1.11 portpicker==1.6.0 pydantic==2.14.4 pydantic_core==2.50.5 starlette==1.10.0 tokamax==0.0.12
  typeguard==2.13.3 typing_inspection==0.4.5 uvicorn==0.54.0 wadler_lindig==0.1.8
)

mkdir -p "$CARRY/wheels"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$CARRY/wheels" "${WHEELS[@]}"

# Dependencies of the wheels above and of MaxText that a GPU image may lack (seen missing in a python with only jax,
# flax, optax, orbax and transformers; pillow and sympy usually come with torch/torchvision): bench_vs_maxtext.sh
# installs each only where its distribution is absent, so none shadows an installed one.
FALLBACK=(
  annotated_doc==0.0.7 lazy_importer==0.1.0 cloudpickle==3.1.3 click==8.5.1 h11==0.16.0 anyio==4.16.0
  prometheus_client==0.26.0 aiofiles==25.1.0 humanize==4.17.0 zipp==4.1.2 simplejson==4.3.0
  pillow==13.0.0 sympy==1.14.0 mpmath==1.3.0
)
mkdir -p "$CARRY/wheels/fallback"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d "$CARRY/wheels/fallback" "${FALLBACK[@]}"

# antlr4-python3-runtime 4.9.3 (omegaconf's) is published as an sdist only: build its (pure-Python) wheel once.
if ! ls "$CARRY"/wheels/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
  "$PY" -m pip wheel --no-deps --no-binary=:all: -w "$CARRY/wheels" antlr4-python3-runtime==4.9.3
fi

# MaxText's src/ at the pinned commit (no .git; the tokenizers present are a few MiB in all: kept).
rm -rf "$CARRY/maxtext"
mkdir -p "$CARRY/maxtext"
# A partial mirror may lack some large blobs (tokenizers of models not benchmarked here), which makes `git archive`
# stop: stage src/ into a throw-away index instead, drop the absent files from it and check the rest out.
export GIT_DIR="$MAXTEXT_GIT" GIT_INDEX_FILE
GIT_INDEX_FILE=$(mktemp -u /tmp/maxtext-index.XXXXXX)
git read-tree "$MAXTEXT_COMMIT:src"
git ls-files -s | while read -r _ sha _ path; do
  if ! git cat-file -e "$sha" 2>/dev/null; then
    echo "left out (absent from the mirror): src/$path"
    git update-index --force-remove "$path"
  fi
done
git --work-tree="$PWD/$CARRY/maxtext" checkout-index -a --prefix="$PWD/$CARRY/maxtext/src/"
rm -f "$GIT_INDEX_FILE"
unset GIT_DIR GIT_INDEX_FILE
# Notebooks are not needed to train and are the largest non-code files.
find "$CARRY/maxtext" -name '*.ipynb' -delete
echo "$MAXTEXT_COMMIT" > "$CARRY/maxtext/COMMIT"

ls "$CARRY/wheels" "$CARRY/wheels/fallback"
du -sh "$CARRY/wheels"; du -sh "$CARRY/maxtext"; du -sh "$CARRY"
total_kib=$(du -sk "$CARRY" | cut -f1)
if (( total_kib > 60 * 1024 )); then
  echo "error: $CARRY is ${total_kib} KiB, over the 64 MiB a device call carries (keep a margin)" >&2
  exit 1
fi
