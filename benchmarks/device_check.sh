#!/bin/bash
# What needs the GPU machine (one NVIDIA GPU, 16 CPU cores, no network), in one call.
#
#   bash benchmarks/device_check.sh [cpu] [gpu-tests] [gpu-bench]     (default: cpu gpu-tests)
#   bash benchmarks/device_check.sh cpu-quiet                          (alone)
#
#   cpu        the machine's own CPU (an Intel Xeon with AVX-512, AVX512-BF16 and AMX): `benchmarks.run` as three
#              processes at once, each pinned to its own two cores, no GPU: TRL float32 (2 threads), ppojax
#              float32, ppojax mixed; merged into one report (`--merge`);
#   gpu-tests  the model / generation / attention (cuDNN's tests run only there) / LoRA / train_step tests on
#              the GPU, one line per test as it ends (`-v`), on the remaining cores; and whether a stored program
#              with Python callbacks loads there (ppojax/trainer/stored_callbacks.py stores them on CPU only until it does);
#   gpu-bench  `benchmarks.gpu` (tiny, SmolLM2, a random 1B Llama under mixed and bfloat16: update MFU and the
#              decode step against the HBM roofline; the 1B decode again with the Pallas decode kernel,
#              `--attention pallas`) and TRL on the same GPU (`trl_ppo --device cuda --bf16`);
#              ~4 min;
#   cpu-quiet  alone (no other part): `benchmarks.run` as ONE process on two cores with nothing else running:
#              TRL, then ppojax float32, SmolLM2 only (BENCH_EXTRA="--sizes tiny,smollm2" adds tiny;
#              BENCH_EXTRA="--ppojax-matmul mkl" runs ppojax's projections on MKL): peaks ~20 s, TRL ~120 s,
#              ppojax ~195 s measured + ~140 s warm-cache run, ~8 min; the report is written after ppojax's
#              measured run, so a cut in its warm-cache run loses only that figure.
# With every part, one call took ~540 s: the GPU bench ~210 s, TRL on the GPU ~45 s, the GPU tests over 150 s, a
# ppojax CPU side (tiny and SmolLM2, float32 then mixed, one process) over 530 s. Hence one process per CPU row,
# each part's own limit below, and gpu-bench left out by default.
#
# The machine has its own jax (0.11): the CPU side runs the jax/jaxlib this project pins and oneDNN's library
# (ppojax's float32 projections: the report's `matmul_implementation` says which ran), carried from here:
# run `bash benchmarks/device_wheels.sh` first (into .whl/, ignored; ~4 minutes), carry .whl/ with the call and
# give it a limit of 580 s.
set -u
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
REPO=$(pwd)
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PARTS=${*:-cpu gpu-tests}
want() { [[ " $PARTS " == *" $1 "* ]]; }
for part in $PARTS; do
  case $part in cpu|gpu-tests|gpu-bench|cpu-quiet) ;;
    *) echo "device_check.sh: unknown part '$part'; the parts are cpu, gpu-tests, gpu-bench, cpu-quiet"
       exit 2;;
  esac
done
if want cpu-quiet && [ "$PARTS" != "cpu-quiet" ]; then
  echo "device_check.sh: cpu-quiet runs alone (its figures are of an otherwise quiet machine); got: $PARTS"; exit 2
fi

{
  date -u; uname -r
  grep -m1 "model name" /proc/cpuinfo; grep -m1 "^flags" /proc/cpuinfo
  lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|Model name|L3)"
  nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  echo "C++ compiler: $(command -v g++ || command -v c++ || echo none)"
  python3 -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|jax-cuda13-plugin|flax|optax|orbax-checkpoint|chex|torch|transformers|accelerate|numpy|ml.dtypes|peft) "
} > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"

# REHEARSE=1: a dry run on any machine (no carried wheels: the python3 on PATH must have jax and torch; extra
# benchmark arguments in BENCH_EXTRA, e.g. --quick), to check this script before spending device time.
if [ -z "${REHEARSE:-}" ]; then
  PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
  $PIP --target /tmp/site_any .whl/any/*.whl || exit 1
  $PIP --target /tmp/site_flax .whl/cpu/{flax,optax,chex,orbax}*.whl || exit 1
  $PIP --target /tmp/site_jax10 .whl/cpu/jax-*.whl || exit 1
  tar xJf .whl/cpu/jaxlib.tar.xz -C /tmp/site_jax10 || exit 1
  # A regular (empty) jax_plugins package ahead of the machine's: jax 0.10 then finds none of its 0.11 CUDA plugins
  mkdir -p /tmp/site_jax10/jax_plugins && touch /tmp/site_jax10/jax_plugins/__init__.py
  # oneDNN's library where device_wheels.sh prebuilt stacked_matmul's handlers for, and those handlers in the
  # cache stacked_matmul reads (the machine's g++, if any, would build the same)
  mkdir -p /tmp/site_onednn && tar xJf .whl/cpu/onednn.tar.xz -C /tmp/site_onednn || exit 1
  FFI_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/ppojax/ffi
  mkdir -p "$FFI_CACHE" && cp .whl/ffi/*.so "$FFI_CACHE"/ || exit 1
  stamp "packages ready"
fi

# Two CPUs on distinct physical cores for each CPU row; the GPU side gets every CPU of the other cores.
lscpu -p=CPU,CORE | grep -v '^#' > /tmp/topo
mapfile -t FIRST < <(awk -F, '!seen[$2]++ {print $1}' /tmp/topo)
pick() { echo "${FIRST[$(( $1 % ${#FIRST[@]} ))]}"; }  # wraps round on a machine of fewer cores (a rehearsal)
CPU_TRL="$(pick 0),$(pick 1)"; CPU_F32="$(pick 2),$(pick 3)"; CPU_MIXED="$(pick 4),$(pick 5)"
USED_CORES=$(awk -F, -v a="$CPU_TRL,$CPU_F32,$CPU_MIXED" 'BEGIN{n=split(a,x,","); for(i=1;i<=n;i++) c[x[i]]=1}
  c[$1]{print $2}' /tmp/topo | sort -u | tr '\n' ' ')
CPU_GPU=$(awk -F, -v used=" $USED_CORES" 'index(used, " " $2 " ")==0 {print $1}' /tmp/topo | paste -sd,)
CPU_GPU=${CPU_GPU:-$(cut -d, -f1 /tmp/topo | paste -sd,)}
stamp "parts: $PARTS; CPUs: TRL $CPU_TRL, ppojax $CPU_F32, ppojax mixed $CPU_MIXED, GPU $CPU_GPU"

CPU_ENV="env JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES= PPOJAX_BENCH_PYTHON=${PPOJAX_BENCH_PYTHON:-python3}
  PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site_jax10:/tmp/site_flax:/tmp/site_any:/tmp/site_onednn:$REPO"
BENCH="python3 -m benchmarks.run --threads 2 --smollm2-dir random ${BENCH_EXTRA:-}"
if want cpu-quiet; then
  stamp "cpu-quiet: one benchmarks.run process on CPUs $CPU_TRL, nothing else running"
  QUIET_SIZES="--sizes smollm2"  # unless BENCH_EXTRA (in $BENCH) names the sizes (or --quick)
  [[ "${BENCH_EXTRA:-}" == *--sizes* || "${BENCH_EXTRA:-}" == *--quick* ]] && QUIET_SIZES=""
  # benchmarks.run builds the in-place handlers and measures the library 'auto' takes on this CPU first (once per
  # machine, like an install: `python -m ppojax.backends.cpu.matmul_tuning`), not inside a measured first update
  $CPU_ENV JAX_COMPILATION_CACHE_DIR=/tmp/jc_quiet taskset -c "$CPU_TRL" timeout 560 $BENCH \
    $QUIET_SIZES --json "$OUT/cpu_quiet.json" > "$OUT/cpu_quiet.log" 2>&1
  grep -v "^WARNING\|plugin" "$OUT/cpu_quiet.log" | tail -n 40
  stamp "all done"; exit 0
fi
PIDS=()
if want cpu; then
  # the three rows at once, each on its own two cores; every report is written after each side it finishes
  $CPU_ENV JAX_COMPILATION_CACHE_DIR=/tmp/jc_trl taskset -c "$CPU_TRL" $BENCH --only trl \
    --json /tmp/cpu_trl.json > /tmp/cpu_trl.log 2>&1 &
  PIDS+=($!)
  $CPU_ENV JAX_COMPILATION_CACHE_DIR=/tmp/jc_f32 taskset -c "$CPU_F32" $BENCH --only ppojax \
    --json /tmp/cpu_f32.json > /tmp/cpu_f32.log 2>&1 &
  PIDS+=($!)
  $CPU_ENV JAX_COMPILATION_CACHE_DIR=/tmp/jc_mixed taskset -c "$CPU_MIXED" $BENCH --only ppojax \
    --ppojax-precisions mixed --json /tmp/cpu_mixed.json > /tmp/cpu_mixed.log 2>&1 &
  PIDS+=($!)
fi

# GPU side: the project's flax/optax pins if they import with this machine's jax, else the machine's own.
GPU_PATH=/tmp/site_flax:/tmp/site_any:$REPO
if ! PYTHONPATH=$GPU_PATH python3 -c "import flax.nnx, optax, orbax.checkpoint, ppojax.rl.program" 2> /tmp/smoke.err; then
  tail -1 /tmp/smoke.err; GPU_PATH=/tmp/site_any:$REPO; stamp "GPU side: the machine's flax/optax"
fi
GPU_ENV="env PYTHONPATH=$GPU_PATH PYTHONUNBUFFERED=1 PPOJAX_XLA_CPU_OPTIONS=0"
if want gpu-tests; then
  stamp "tests on the GPU"
  # float32 products at full precision (no TF32), as the references they are compared with; compiled as users'
  # programs are (the suite's cheap CPU compiles off: tests/xla_test_flags.py)
  $GPU_ENV JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false PPOJAX_TESTS_FULL_OPTIMIZATION=1 \
    taskset -c "$CPU_GPU" \
    timeout 300 python3 -m pytest -v -p no:cacheprovider -p no:benchmark -n 4 -rfEs tests/test_attention.py \
    tests/test_generate.py tests/test_models.py tests/test_forward.py tests/test_lora.py tests/test_train_step.py \
    "tests/test_compile_cache.py::test_a_program_with_host_callbacks_is_loaded_with_the_loading_process_callbacks" \
    > "$OUT/pytest_gpu.txt" 2>&1
  grep -E "FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest_gpu.txt" | tail -15
fi
if want gpu-bench; then
  stamp "benchmarks.gpu"
  $GPU_ENV taskset -c "$CPU_GPU" timeout 240 python3 -m benchmarks.gpu --only tiny,smollm2,llama1b \
    --json "$OUT/gpu.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | cut -c1-300
  stamp "benchmarks.gpu: the Pallas decode kernel at 1B"
  $GPU_ENV taskset -c "$CPU_GPU" timeout 120 python3 -m benchmarks.gpu --only llama1b --precisions bfloat16 \
    --attention pallas --json "$OUT/gpu_pallas.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | cut -c1-300
  stamp "TRL on the GPU"
  $GPU_ENV taskset -c "$CPU_GPU" timeout 100 python3 -m benchmarks.trl_ppo --size smollm2 --device cuda --bf16 \
    --json "$OUT/trl_gpu.json" 2>&1 | tail -1
fi
stamp "GPU side done"

if [ ${#PIDS[@]} -gt 0 ]; then
  # what is left of a 550 s budget (the call's limit is 580 s): the reports keep every side finished by then
  while kill -0 "${PIDS[@]}" 2>/dev/null; do
    [ $(( $(date +%s) - T0 )) -gt 550 ] && { stamp "CPU rows cut off"; kill "${PIDS[@]}" 2>/dev/null; break; }
    sleep 5
  done
  stamp "CPU rows done"
  $CPU_ENV python3 -m benchmarks.run --merge /tmp/cpu_trl.json /tmp/cpu_f32.json /tmp/cpu_mixed.json \
    --json "$OUT/cpu_merged.json"
  tail -n 3 /tmp/cpu_trl.log /tmp/cpu_f32.log /tmp/cpu_mixed.log > "$OUT/cpu_logs.txt"
fi
stamp "all done"
