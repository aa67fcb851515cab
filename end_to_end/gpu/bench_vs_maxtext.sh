#!/usr/bin/env bash
# MaxLite beside MaxText (479dd99) on one GPU, same shapes and settings, plus an xplane trace of one step of each.
# Run from the repo root ON the GPU machine (no network), with .gpu_carry/ made by end_to_end/gpu/fetch.sh:
#
#   bash end_to_end/gpu/bench_vs_maxtext.sh            (device tool: carry [".gpu_carry"], timeout_s 600)
#
# Rows: Llama 3.2 1B at 8x4096 and 3B at 4x4096 tokens per step; bf16 activations, float32 weights, remat full,
# synthetic data, 20 steps. Writes $OUT (./gpu_out when unset):
#   <row>-maxtext.log, <row>-maxlite.log, <row>-maxlite-profile.log   each tool's full output
#   profiles/<row>-<system>/tensorboard/plugins/profile/*/*.xplane.pb  one traced step (step 5) of each
#   runs.tsv (rc and seconds of each command), summary.txt, summary.json
# MaxText traces step 5 inside its timed run (that step, the two after it and the last are left out of its median);
# MaxLite's benchmark.py keeps no output directory, so MaxLite's trace is a separate 7-step MaxLite/train.py run, done
# last (the shared JAX compilation cache spares it most of the compile).
# Every command runs under `timeout`, all within GPU_BENCH_BUDGET_S (540 s); a failed command does not stop the rest.
#
# GPU_BENCH_SMOKE=1: tiny shapes (2 layers, emb 256, vocab 32000, seq 256, batch 1, 12 steps) on whatever jax finds,
# hardware=cpu and attention=dot_product: a CPU rehearsal of the whole script.
set -u
cd "$(dirname "$0")/../.."
REPO=$PWD
T0=$SECONDS
BUDGET=${GPU_BENCH_BUDGET_S:-540}
OUT=${OUT:-$REPO/gpu_out}
mkdir -p "$OUT/profiles"
OUT=$(cd "$OUT" && pwd)
SITE=${GPU_BENCH_SITE:-/tmp/site}
PY=${PYTHON:-python3}
SMOKE=${GPU_BENCH_SMOKE:-0}
CARRY=$REPO/.gpu_carry
RUNS=$OUT/runs.tsv
printf 'name\trc\tseconds\ttimeout_s\n' > "$RUNS"

left() { echo $((BUDGET - (SECONDS - T0))); }

# run NAME CAP_S CMD...: CMD under timeout (CAP_S, or less as the budget runs out), output to $OUT/NAME.log.
run() {
  local name=$1 cap=$2
  shift 2
  local t=$(($(left) - 25))  # keep room for the summary and timeout's kill grace
  ((t > cap)) && t=$cap
  if ((t < 30)); then
    echo "== $name: skipped, $(left) s of the budget left" | tee "$OUT/$name.log"
    printf '%s\tskipped\t0\t0\n' "$name" >> "$RUNS"
    return
  fi
  echo "== $name (timeout ${t}s, $(left) s of the budget left)"
  local s=$SECONDS
  timeout --kill-after=10 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - s))" "$t" >> "$RUNS"
  echo "   rc=$rc in $((SECONDS - s)) s; last lines:"
  tail -n 3 "$OUT/$name.log" | cut -c1-300 | sed 's/^/   | /'
}

echo "== installing $(ls "$CARRY"/wheels/*.whl | wc -l) wheels into $SITE"
timeout 120 "$PY" -m pip install --quiet --upgrade --no-index --no-deps --disable-pip-version-check --target "$SITE" \
  "$CARRY"/wheels/*.whl > "$OUT/pip.log" 2>&1 || { echo "pip install failed:"; tail -n 20 "$OUT/pip.log"; }
# Fallback wheels (small dependencies a GPU image may lack): only those whose distribution is not installed.
mapfile -t missing < <("$PY" - "$CARRY"/wheels/fallback/*.whl <<'PYEOF'
import importlib.metadata as md, os, sys
for wheel in sys.argv[1:]:
  try:
    md.distribution(os.path.basename(wheel).split("-")[0])
  except md.PackageNotFoundError:
    print(wheel)
PYEOF
)
if ((${#missing[@]})); then
  echo "== fallback wheels for what this python lacks: ${missing[*]##*/}"
  timeout 60 "$PY" -m pip install --quiet --upgrade --no-index --no-deps --disable-pip-version-check --target "$SITE" \
    "${missing[@]}" >> "$OUT/pip.log" 2>&1 || { echo "pip install failed:"; tail -n 20 "$OUT/pip.log"; }
fi
export PYTHONPATH=$SITE:$REPO
export DECOUPLE_GCLOUD=TRUE
# jax takes 75% of GPU memory by default; the 3B row (float32 weights + Adam, ~51 GB) wants more on an H100.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# Shared by both systems; only MaxLite's profile run (same program as its benchmark run) hits it.
JAX_CACHE=${GPU_BENCH_JAX_CACHE:-/tmp/gpu_bench_jax_cache}
export JAX_COMPILATION_CACHE_DIR=$JAX_CACHE

(nvidia-smi || echo "no nvidia-smi") 2>&1 | tee "$OUT/nvidia-smi.txt"
timeout 120 "$PY" -c "import jax, jaxlib, flax, optax; print('python', __import__('sys').version.split()[0], \
'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())" 2>&1 \
  | tail -n 5 | tee "$OUT/jax.txt"

if [[ $SMOKE == 1 ]]; then
  STEPS=12
  HW=(hardware=cpu attention=dot_product)
  ML_ATTN=(attention=dot_product)
  ROWS=("smoke-1b 1 256" "smoke-3b 1 256")
else
  STEPS=20
  HW=(hardware=gpu attention=cudnn_flash_jax)
  ML_ATTN=()
  ROWS=("llama3.2-1b 8 4096" "llama3.2-3b 4 4096")
fi

# shape MODEL: MaxText's keys for that model (479dd99 has no model file for Llama 3.2; values from
# configs/models/llama3.2-*.yml). MaxLite gets model_name=MODEL, plus the same tiny overrides in smoke mode.
shape() {
  case $1 in
    llama3.2-1b)
      echo base_emb_dim=2048 base_num_query_heads=32 base_num_kv_heads=8 head_dim=64 base_mlp_dim=8192 \
        base_num_decoder_layers=16 vocab_size=128256 ;;
    llama3.2-3b)
      echo base_emb_dim=3072 base_num_query_heads=24 base_num_kv_heads=8 head_dim=128 base_mlp_dim=8192 \
        base_num_decoder_layers=28 vocab_size=128256 ;;
    smoke-*)
      echo base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=2 head_dim=64 base_mlp_dim=1024 \
        base_num_decoder_layers=2 vocab_size=32000 ;;
  esac
}
LLAMA_KEYS=(decoder_block=llama2 logits_via_embedding=true normalization_layer_epsilon=1.0e-5
  rope_max_timescale=500000 rope_type=llama3.1)
MAXTEXT_FIXED=(dataset_type=synthetic enable_checkpointing=false skip_jax_distributed_system=true
  enable_goodput_recording=false monitor_goodput=false enable_gcp_goodput_metrics=false)
PROFILE_KEYS=(profiler=xplane skip_first_n_steps_for_profiler=5 profiler_steps=1)

SUMMARY_ARGS=()
PROFILE_RUNS=()
for spec in "${ROWS[@]}"; do
  read -r row batch seq <<< "$spec"
  read -r -a shp <<< "$(shape "$row")"
  common=(per_device_batch_size=$batch max_target_length=$seq dtype=bfloat16 weight_dtype=float32 remat_policy=full)
  if [[ $SMOKE == 1 ]]; then
    mlmodel=(model_name=${row/smoke/llama3.2} "${shp[@]}")
  else
    mlmodel=(model_name=$row)
  fi
  SUMMARY_ARGS+=("$row=$((batch * seq))")

  run "$row-maxtext" 180 env PYTHONPATH="$CARRY/maxtext/src:$PYTHONPATH" bash -c 'cd "$0" && exec "$@"' \
    "$CARRY/maxtext" "$PY" -m maxtext.trainers.pre_train.train src/maxtext/configs/base.yml \
    run_name="$row-maxtext" base_output_directory="$OUT/profiles" steps=$STEPS "${common[@]}" "${shp[@]}" \
    "${LLAMA_KEYS[@]}" "${HW[@]}" "${MAXTEXT_FIXED[@]}" "${PROFILE_KEYS[@]}"

  run "$row-maxlite" 150 "$PY" end_to_end/benchmark.py configs/bench.yml "${mlmodel[@]}" "${common[@]}" \
    "${ML_ATTN[@]}" steps=$STEPS enable_checkpointing=false

  PROFILE_RUNS+=("$row|${mlmodel[*]} ${common[*]} ${ML_ATTN[*]}")
done

for p in "${PROFILE_RUNS[@]}"; do
  row=${p%%|*}
  read -r -a args <<< "${p#*|}"
  run "$row-maxlite-profile" 90 "$PY" MaxLite/train.py configs/bench.yml "${args[@]}" steps=7 "${PROFILE_KEYS[@]}" \
    base_output_directory="$OUT/profiles" run_name="$row-maxlite" enable_checkpointing=false jax_cache_dir="$JAX_CACHE"
done

# If time is left: MaxLite's 1B row with XLA's Triton GEMM fusions off (every projection through cuBLAS). The first
# H200 trace had 184 ms of its step in four Triton GEMM fusions against MaxText's 12 ms; a deviceless H100 compile
# here cannot tell which dots the autotuner keeps in Triton, so this measures the flag instead of guessing.
if [[ $SMOKE != 1 ]]; then
  run "llama3.2-1b-cublas-maxlite" 150 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" \
    "$PY" end_to_end/benchmark.py configs/bench.yml model_name=llama3.2-1b per_device_batch_size=8 \
    max_target_length=4096 dtype=bfloat16 weight_dtype=float32 remat_policy=full steps=$STEPS enable_checkpointing=false
  SUMMARY_ARGS+=("llama3.2-1b-cublas=32768")
  # Hopper's fp8 tensor cores (issue 54 item 3): the projections in fp8 through Qwix, same row.
  run "llama3.2-1b-fp8-maxlite" 150 "$PY" end_to_end/benchmark.py configs/bench.yml model_name=llama3.2-1b \
    per_device_batch_size=8 max_target_length=4096 dtype=bfloat16 weight_dtype=float32 remat_policy=full \
    quantization=fp8 use_qwix_quantization=true steps=$STEPS enable_checkpointing=false
  SUMMARY_ARGS+=("llama3.2-1b-fp8=32768")
fi

"$PY" end_to_end/gpu/summarize.py "$OUT" "${SUMMARY_ARGS[@]}"
echo "== done in $((SECONDS - T0)) s; outputs in $OUT"
