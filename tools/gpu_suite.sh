#!/usr/bin/env bash
# The GPU lane: the course on every GPU count the machine has, through NCCL, into JSON records.
#
#   make gpu [GPU_OUT=DIR] [GPU_PARTS="tests tour ..."]      (or tools/gpu_suite.sh DIR [PART...])
#
# Runs with the machine's own CUDA torch (python3, or $PYTHON) and the runtime dependencies plus
# pytest: no virtual environment, no docs extras. PARTS (default: all, in this order):
#   env       the machine: GPUs, their links, torch, NCCL, the commit
#   tests     the gpu-marked tests (pytest -m gpu)
#   tour      the tour, every row verified, at 2 GPUs and at every larger count the machine has
#             (on GPUs it times nothing: its timings are outside the rule for fair GPU comparisons)
#   runners   every lesson's exercise runner on the reference, --backend nccl, at every count
#             (GPU_RUNNERS="02 10": only those lessons' runners)
#   cheats    every cheat fixture of tests/test_grader.py through the runner on GPUs: each scores
#             nothing on its tasks (tools/gpu_cheats.py)
#   bench     lessons 3-4: every algorithm 4 KiB .. 1 GiB against NCCL (plain memory), every one eager,
#             then 4 KiB .. 256 MiB every one replayed from a CUDA graph; then ring
#   ring      the ring against NCCL at 256 MiB (tools/gpu_ring_check.py): on registered memory
#             with its host time, and on plain memory, each eager and each replayed (NCCL's too)
# Every comparison follows the rule for fair GPU comparisons (docs/benchmarks.md): both sides
# launched alike, NCCL called directly, nothing traced; each record names its launch and inputs.
#   fused     lesson 5      ddp    lesson 6      hier   lesson 7 (tools/gpu_hierarchical.py)
#   sparse    lesson 8      recorder  lesson 9   lessons   lessons 9-12's GPU scripts, where they exist
#             (GPU_LESSONS="10 12": only those)
#   probe     the host's time per CUDA and NCCL call, which bounds every host-bound target
#             (tools/gpu_probe.py host)
# Parts that measure run at 2 GPUs and at every larger even count the machine has
# (GPU_COUNTS="4": only at 4); the lessons' scripts take every GPU of the machine.
# Every step has its own time limit and writes its output under DIR/steps/; a hang costs that
# step alone (the launcher's watchdog names where each rank waited). Last,
# tools/gpu_record.py gathers every step into DIR/lane.json: the record the benchmarks page reads.
set -uo pipefail
OUT=${1:-build/gpu}; shift || true
PARTS=${*:-env tests tour runners cheats bench fused ddp hier sparse recorder lessons probe}
PY=${PYTHON:-python3}
mkdir -p "$OUT/steps"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The GPUs may be shared: NVLink multicast stays off everywhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export COLLECTIVES_COMMIT=${COLLECTIVES_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
n=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -lt 2 ]; then echo "the GPU lane needs at least 2 GPUs (found $n)"; exit 2; fi
COUNTS=${GPU_COUNTS:-$(seq 2 2 "$n" | tr '\n' ' ')}     # 2, 4, ...: every even count up to the machine's
for p in $COUNTS; do
  if [ "$p" -gt "$n" ] || [ "$p" -lt 2 ]; then echo "GPU_COUNTS: $p GPUs asked, the machine has $n"; exit 2; fi
done
STATUS="$OUT/steps/status.tsv"
touch "$STATUS"          # parts run one call after another add to it; the last run of a step counts

step() {  # step NAME SECONDS command...: run it with a limit; its output into steps/NAME.txt
  local name=$1 limit=$2; shift 2
  limit=$(( limit < ${GPU_STEP_LIMIT:-100000} ? limit : ${GPU_STEP_LIMIT:-100000} ))   # a cap for short runs
  local t0=$SECONDS
  echo "=== $name: $* (limit ${limit}s)" | tee -a "$LOG"
  timeout -k 10 "$limit" "$@" >"$OUT/steps/$name.txt" 2>&1
  local rc=$?
  grep -v -E "Warning|warnings.warn" "$OUT/steps/$name.txt" | tail -n 40 | tee -a "$LOG"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" >>"$STATUS"
  echo "=== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}
on2() { CUDA_VISIBLE_DEVICES=0,1 "$@"; }
ringchecks() {  # the ring against NCCL at 256 MiB: registered memory, then plain; each eager, then replayed
  for p in $COUNTS; do
    pin=$([ "$p" = 2 ] && echo on2)
    for memory in 256M plain; do
      for how in eager graph; do
        name="ringcheck-p$p-$memory$([ "$how" = graph ] && echo -graph)"
        $pin step "$name" 120 torchrun --nproc-per-node "$p" tools/gpu_ring_check.py --size 256M \
             $([ "$memory" = plain ] && echo --plain) --launch "$how" --json "$OUT/steps/$name.json"
      done
    done
  done
}

for part in $PARTS; do case $part in
  env)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      nvidia-smi topo -m; } >"$OUT/steps/topology.txt" 2>&1 ;;
  tests)
    step tests 420 $PY -m pytest -m gpu -q -p no:cacheprovider --timeout 240 tests ;;
  tour)
    for p in $COUNTS; do
      step "tour-p$p" 300 $PY -m collectives tour --backend nccl --world "$p" --size 64M --json "$OUT/steps/tour-p$p.json"
    done ;;
  runners)
    for p in $COUNTS; do
      pin=$([ "$p" = 2 ] && echo on2); tag=$([ "$p" = 2 ] || echo "-p$p")
      for ex in lessons/[0-9][0-9]_*/exercise.py; do
        nn=$(basename "$(dirname "$ex")" | cut -c1-2)
        case " ${GPU_RUNNERS:-$nn} " in *" $nn "*) ;; *) continue ;; esac
        $pin step "runner-$nn$tag" 240 $PY "$ex" --impl reference --backend nccl --world "$p" --timeout 60
      done
    done ;;
  cheats)
    step cheats 900 $PY tools/gpu_cheats.py "$OUT/steps/cheats" ;;
  bench)
    for p in $COUNTS; do
      pin=$([ "$p" = 2 ] && echo on2)
      $pin step "bench-p$p" 420 $PY -m collectives bench --backend nccl --world "$p" --sizes 4K..1G \
           --launch eager --iters 10 --warmup 3 --timeout 360 --json "$OUT/steps/bench-p$p.json" \
           --out "$OUT/steps/bench-p$p"
      $pin step "bench-graph-p$p" 420 $PY -m collectives bench --backend nccl --world "$p" --sizes 4K..256M \
           --launch graph --iters 10 --warmup 3 --timeout 360 --json "$OUT/steps/bench-graph-p$p.json" \
           --out "$OUT/steps/bench-graph-p$p"
    done
    ringchecks ;;
  ring)
    ringchecks ;;
  fused)
    for p in $COUNTS; do
      pin=$([ "$p" = 2 ] && echo on2)
      $pin step "fused-p$p" 200 $PY -m collectives bench-fused --backend nccl --world "$p" --count 1000 \
          --numel 4096 --launch eager --out "$OUT/steps/fused-p$p"
      # the rule for fair GPU comparisons: every case replayed from a CUDA graph, NCCL's included
      $pin step "fused-graph-p$p" 200 $PY -m collectives bench-fused --backend nccl --world "$p" --count 1000 \
          --numel 4096 --launch graph --out "$OUT/steps/fused-graph-p$p"
    done ;;
  ddp)
    for p in $COUNTS; do
      pin=$([ "$p" = 2 ] && echo on2)
      # 60 rounds: the reducer and DDP differ by less than one run's noise over 20 (±3 %)
      # every variant eager and untraced, one step of each per round (a training step is not replayed)
      $pin step "ddp-p$p" 200 $PY -m collectives bench-ddp --backend nccl --world "$p" --steps 60 \
          --launch eager --out "$OUT/steps/ddp-p$p"
    done ;;
  hier)
    for p in $COUNTS; do
      pin=$([ "$p" = 2 ] && echo on2)
      $pin step "hier-p$p" 300 $PY tools/gpu_hierarchical.py --world "$p" --size 256M --launch eager \
           --json "$OUT/steps/hier-p$p.json"
      $pin step "hier-graph-p$p" 300 $PY tools/gpu_hierarchical.py --world "$p" --size 256M --launch graph \
           --json "$OUT/steps/hier-graph-p$p.json"
    done ;;
  sparse)
    for p in $COUNTS; do
      pin=$([ "$p" = 2 ] && echo on2)
      $pin step "sparse-p$p" 300 $PY -m collectives bench-sparse --backend nccl --world "$p" --size 256M \
          --sweep 0.001,0.003,0.01,0.03,0.1 --json "$OUT/steps/sparse-p$p.json"
    done ;;
  recorder)
    for p in $COUNTS; do
      pin=$([ "$p" = 2 ] && echo on2)
      $pin step "recorder-p$p" 200 $PY -m collectives bench-recorder --backend nccl --world "$p" --no-detail \
          --out "$OUT/steps/recorder-p$p"
    done ;;
  lessons)
    for nn in ${GPU_LESSONS:-09 10 11 12}; do      # GPU_LESSONS="10 12": only those lessons' scripts
      [ -f "tools/gpu_lesson$nn.py" ] || continue
      extra=GPU_LESSON${nn}_ARGS      # e.g. GPU_LESSON12_ARGS="--quick": a shorter run of that lesson
      step "lesson$nn" 420 $PY "tools/gpu_lesson$nn.py" --out "$OUT/steps/lesson$nn" ${!extra:-}
    done ;;
  probe)
    on2 step probe-host 120 $PY tools/gpu_probe.py host --world 2 --json "$OUT/steps/probe-host.json" ;;
  *) echo "unknown part: $part"; exit 2 ;;
esac; done
$PY tools/gpu_record.py "$OUT" | tee -a "$LOG"
