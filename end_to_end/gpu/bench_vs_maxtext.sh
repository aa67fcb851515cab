#!/usr/bin/env bash
# MaxLite beside MaxText (479dd99) on one GPU, same shapes and settings, plus an xplane trace of one step of each.
# Run from the repo root ON the GPU machine (no network), with .gpu_carry/ made by end_to_end/gpu/fetch.sh:
#
#   bash end_to_end/gpu/bench_vs_maxtext.sh            (device tool: carry [".gpu_carry"], timeout_s 600)
#
# Rows: Llama 3.2 1B at 8x4096 and 3B at 4x4096 tokens per step; bf16 activations, float32 weights, remat full,
# synthetic data, 20 steps; then MaxLite alone on variants of them (remat_policy=none, XLA's Triton GEMMs off,
# fp8), in order of need: whatever the budget cannot fit is skipped and says so.
# Writes $OUT (./gpu_out when unset):
#   <name>.log          each command's full output (<row>-maxtext, <row>-maxlite, <row>-<variant>-maxlite)
#   profiles/<name>/tensorboard/plugins/profile/*/*.xplane.pb  one traced step (step 5) of each row of each system,
#                       inside its timed run (MaxText leaves that step and the two after out of its median; MaxLite's
#                       median over 17 steps is the same with or without it)
#   runs.tsv (rc and seconds of each command), summary.txt, summary.json, trace_top.txt (trace_top.py of each trace)
# RESULTS=DIR also packs what the device tool can bring back (8 files at most) into DIR: summary.txt,
# trace_top.txt, logs.tgz (all but the traces) and each trace gzipped:
#   device tool: run(command="OUT_DIR=$OUT; OUT=/tmp/gpu_work RESULTS=$OUT_DIR bash end_to_end/gpu/bench_vs_maxtext.sh",
#                    carry=[".gpu_carry"], timeout_s=600)
# GPU_BENCH_PLAN: first (the first session's rows and variants), cublas (the second's), uniform (for the next).
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
TRACES=()
# maxtext ROW BATCH SEQ CAP [XLA_FLAGS=...]: MaxText's run of ROW, tracing step 5 inside its timed run.
maxtext() {
  local row=$1 batch=$2 seq=$3 cap=$4
  shift 4
  local shp common
  read -r -a shp <<< "$(shape "$row")"
  common=(per_device_batch_size=$batch max_target_length=$seq dtype=bfloat16 weight_dtype=float32 remat_policy=full)
  run "$row-maxtext" "$cap" env "$@" PYTHONPATH="$CARRY/maxtext/src:$PYTHONPATH" bash -c 'cd "$0" && exec "$@"' \
    "$CARRY/maxtext" "$PY" -m maxtext.trainers.pre_train.train src/maxtext/configs/base.yml \
    run_name="$row-maxtext" base_output_directory="$OUT/profiles" steps=$STEPS "${common[@]}" "${shp[@]}" \
    "${LLAMA_KEYS[@]}" "${HW[@]}" "${MAXTEXT_FIXED[@]}" "${PROFILE_KEYS[@]}"
  TRACES+=("$row-maxtext")
}
# maxlite ROW BATCH SEQ CAP NAME [PROFILE] [KEY=VALUE ...]: MaxLite's benchmark.py on ROW's shape, same settings as
# MaxText's unless the extra keys say otherwise; PROFILE=1 traces step 5 inside the timed run (its median of 17
# steps leaves the traced one out in effect).
maxlite() {
  local row=$1 batch=$2 seq=$3 cap=$4 name=$5 profile=$6
  shift 6
  local model shp
  if [[ $SMOKE == 1 ]]; then
    read -r -a shp <<< "$(shape "$row")"
    model=(model_name=${row/smoke/llama3.2} "${shp[@]}")
  else
    model=(model_name=$row)
  fi
  local extra=(enable_checkpointing=false) keys=() envs=()
  for a in "$@"; do [[ $a == XLA_FLAGS=* ]] && envs+=("$a") || keys+=("$a"); done
  if [[ $profile == 1 ]]; then
    extra+=("${PROFILE_KEYS[@]}" base_output_directory="$OUT/profiles" run_name="$name")
    TRACES+=("$name")
  fi
  run "$name" "$cap" env "${envs[@]}" "$PY" end_to_end/benchmark.py configs/bench.yml "${model[@]}" per_device_batch_size=$batch \
    max_target_length=$seq dtype=bfloat16 weight_dtype=float32 remat_policy=full "${ML_ATTN[@]}" steps=$STEPS \
    "${extra[@]}" "${keys[@]}"
  SUMMARY_ARGS+=("${name%-maxlite}=$((batch * seq))")
}

if [[ $SMOKE == 1 ]]; then R1=(smoke-1b 1 256); R3=(smoke-3b 1 256); else R1=(llama3.2-1b 8 4096); R3=(llama3.2-3b 4 4096); fi
B1=${R1[0]} B3=${R3[0]}
# In order of what the issue needs most, so that what the budget cuts is the least needed: both rows at the same
# settings, MaxLite's own choice of remat (an H200 holds these activations), XLA's Triton GEMMs off (the first H200
# trace had 184 ms of MaxLite's step in four Triton GEMM fusions, MaxText 12 ms; a deviceless H100 compile cannot
# tell which dots the autotuner keeps in Triton), fp8.
if [[ ${GPU_BENCH_PLAN:-first} == first ]]; then
  maxtext "${R1[@]}" 150
  maxlite "${R1[@]}" 120 "$B1-maxlite" 1
  maxtext "${R3[@]}" 170
  maxlite "${R3[@]}" 130 "$B3-maxlite" 1
  maxlite "${R1[@]}" 100 "$B1-noremat-maxlite" 0 remat_policy=none
  maxlite "${R3[@]}" 120 "$B3-noremat-maxlite" 0 remat_policy=none
  maxlite "${R1[@]}" 100 "$B1-cublas-maxlite" 0 "XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false"
  maxlite "${R1[@]}" 100 "$B1-fp8-maxlite" 0 quantization=fp8 use_qwix_quantization=true
elif [[ $GPU_BENCH_PLAN == uniform ]]; then
  # The third session's: the cublas plan below on the same data in both systems (synthetic_tokens=uniform is MaxText's
  # synthetic data), with RoPE's pad-free backward; then MaxLite's own patterns (is the 28 ms scatter-add the data's
  # doing?) and fp8.
  CUBLAS="XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false"
  maxlite "${R1[@]}" 100 "$B1-maxlite" 1 synthetic_tokens=uniform
  maxtext "${R1[@]}" 110 "$CUBLAS"
  maxlite "${R3[@]}" 100 "$B3-maxlite" 1 synthetic_tokens=uniform
  maxtext "${R3[@]}" 110 "$CUBLAS"
  maxlite "${R1[@]}" 80 "$B1-patterns-maxlite" 0
  maxlite "${R1[@]}" 100 "$B1-fp8-maxlite" 0 quantization=fp8 use_qwix_quantization=true synthetic_tokens=uniform
else
  # GPU_BENCH_PLAN=cublas, the second session's: MaxLite as it now compiles on a GPU (gpu_triton_gemm=false, so its
  # dots call cuBLAS) against MaxText with the flag its own GPU recipes set (configs/gpu/a3/*.sh), both traced in
  # full (the profiler now waits for the traced step); then the embedding gradient as a matmul, and fp8.
  CUBLAS="XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false"
  maxlite "${R1[@]}" 100 "$B1-maxlite" 1
  maxtext "${R1[@]}" 110 "$CUBLAS"
  maxlite "${R3[@]}" 100 "$B3-maxlite" 1
  maxtext "${R3[@]}" 110 "$CUBLAS"
  maxlite "${R1[@]}" 80 "$B1-iota-maxlite" 0 use_iota_embed=true
  maxlite "${R1[@]}" 200 "$B1-fp8-maxlite" 0 quantization=fp8 use_qwix_quantization=true
fi

"$PY" end_to_end/gpu/summarize.py "$OUT" "${SUMMARY_ARGS[@]}"

# Where each traced step's GPU time went (read here, so the numbers come back even if a trace is too big to).
for name in "${TRACES[@]}"; do
  for pb in "$OUT"/profiles/"$name"/tensorboard/plugins/profile/*/*.xplane.pb; do
    [[ -f $pb ]] && timeout 60 "$PY" end_to_end/gpu/trace_top.py "$pb" --top 30 >> "$OUT/trace_top.txt" 2>&1
  done
done

# The device tool brings back at most 8 files from its $OUT, two folders deep: pack them (RESULTS, when set).
if [[ -n ${RESULTS:-} ]]; then
  mkdir -p "$RESULTS"
  cp "$OUT"/summary.txt "$OUT"/trace_top.txt "$RESULTS"/ 2>/dev/null
  (cd "$OUT" && tar czf "$RESULTS/logs.tgz" --exclude='*.xplane.pb' --exclude='*.trace.json.gz' .)
  for name in "${TRACES[@]}"; do
    pb=$(ls "$OUT"/profiles/"$name"/tensorboard/plugins/profile/*/*.xplane.pb 2>/dev/null | tail -n 1)
    [[ -n $pb ]] && gzip -c "$pb" > "$RESULTS/$name.xplane.pb.gz"
  done
  ls -la "$RESULTS"
fi
echo "== done in $((SECONDS - T0)) s; outputs in $OUT"
