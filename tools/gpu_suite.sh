#!/usr/bin/env bash
# Everything the course tests and measures on GPUs (one process per GPU, NCCL).
#   tools/gpu_suite.sh OUTDIR [PART...]     PART: ringcheck | allreduce | registered | tests | fused | ddp | tour
#                                           (default: all)
# Every step has a time limit of its own, and the log is written to OUTDIR/log.txt as it
# goes, so one hang costs one step. Tables, JSON and plots are packed into OUTDIR/gpu.tar.gz.
set -uo pipefail
OUT=${1:-gpu-results}; shift || true
PARTS=${*:-ringcheck allreduce registered tests fused ddp hier tour}
mkdir -p "$OUT"
WORK=$(mktemp -d)
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
four=$(( n >= 4 ? 4 : 2 ))
{
  date -u +"%Y-%m-%d %H:%M UTC"
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())), torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))"
  env | grep -E '^NCCL_|MULTICAST|NVSHMEM' | sort
} 2>&1 | tee -a "$LOG"
step() {  # step SECONDS command...
  local limit=$1; shift
  echo "=== $* (limit ${limit}s)" | tee -a "$LOG"
  timeout -k 10 "$limit" "$@" 2>&1 | grep --line-buffered -v -E "Warning|warnings.warn" | tee -a "$LOG"
  echo "=== exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
for part in $PARTS; do case $part in
  ringcheck)   # the library ring on registered memory: exactness, ratio, host time
    export PYTHONPATH=$PWD
    for size in ${RING_SIZES:-64M 256M}; do   # one process per size: registration is once per process
      step 90 torchrun --nproc-per-node "$four" tools/gpu_ring_check.py --size $size
      CUDA_VISIBLE_DEVICES=0,1 step 90 torchrun --nproc-per-node 2 tools/gpu_ring_check.py --size $size
    done ;;
  allreduce)   # plain memory
    step 200 python3 -m collectives bench --backend nccl --world "$four" --algo ring,multi_ring,halving_doubling \
         --sizes 1M..256M --iters 20 --warmup 5 --timeout 150 --out "$WORK/allreduce-p$four"
    CUDA_VISIBLE_DEVICES=0,1 step 160 python3 -m collectives bench --backend nccl --world 2 \
         --algo ring,halving_doubling --sizes 1M..256M --iters 20 --warmup 5 --timeout 120 --out "$WORK/allreduce-p2" ;;
  registered)  # the sweep on NCCL-registered memory: one world per size
    step 200 python3 -m collectives bench --backend nccl --world "$four" --algo ring,halving_doubling \
         --sizes 64M,256M --iters 20 --warmup 5 --registered-memory --timeout 90 --out "$WORK/registered-p$four"
    CUDA_VISIBLE_DEVICES=0,1 step 160 python3 -m collectives bench --backend nccl --world 2 \
         --algo ring,halving_doubling --sizes 64M,256M --iters 20 --warmup 5 --registered-memory \
         --timeout 90 --out "$WORK/registered-p2" ;;
  tests)
    step 300 python3 -m pytest -m gpu -q -p no:cacheprovider -x --timeout 200 tests ;;
  fused)
    step 150 python3 -m collectives bench-fused --backend nccl --world "$four" --numel 4096 --out "$WORK/fused-p$four" ;;
  ddp)
    CUDA_VISIBLE_DEVICES=0,1 step 150 python3 -m collectives bench-ddp --backend nccl --world 2 --out "$WORK/ddp-p2" ;;
  hier)        # lesson 7: hierarchical all-reduce against NCCL, layouts (1, 2) and (2, 1), 256 MiB
    CUDA_VISIBLE_DEVICES=0,1 step 200 python3 tools/gpu_hierarchical.py --world 2 --size 256M ;;
  tour)
    step 200 python3 -m collectives tour --backend nccl --world "$four" --size 64M --json "$WORK/tour-p$four.json" ;;
esac; done
tar -czf "$OUT/gpu-$(echo $PARTS | tr ' ' '-').tar.gz" -C "$WORK" .
