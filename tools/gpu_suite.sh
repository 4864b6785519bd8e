#!/usr/bin/env bash
# Everything the course tests and measures on GPUs, in one run (one process per GPU, NCCL).
#   tools/gpu_suite.sh OUTDIR [PART]     PART: all (default) | tests | allreduce | rest
# Runs the gpu-marked tests, then the all-reduce, fused and DDP benchmarks and the tour,
# and packs every table, JSON and plot into OUTDIR/gpu-results.tar.gz.
set -uo pipefail
OUT=${1:-gpu-results}
PART=${2:-all}
want() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
{
  date -u +"%Y-%m-%d %H:%M UTC"
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())), torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))"
  env | grep -E '^NCCL_|MULTICAST|NVSHMEM' | sort
  nvidia-smi topo -m | head -6
} > "$WORK/versions.txt" 2>&1
cat "$WORK/versions.txt"
step() { echo "=== $*"; "$@" 2>&1 | grep -v -E "Warning|warnings.warn" ; }
{
  four=$(( n >= 4 ? 4 : 2 ))
  if want tests; then
  step python3 -m pytest -m gpu -q -p no:cacheprovider tests
  fi
  if want allreduce; then
  step python3 -m collectives bench --backend nccl --world "$four" --algo ring,multi_ring,pipelined_ring,halving_doubling,tree \
       --sizes 1M..256M --iters 20 --warmup 5 --out "$WORK/allreduce-p$four"
  step python3 -m collectives bench --backend nccl --world "$four" --algo ring,multi_ring --sizes 64M,256M \
       --iters 20 --warmup 5 --plain-memory --out "$WORK/allreduce-p$four-plain"
  CUDA_VISIBLE_DEVICES=0,1 step python3 -m collectives bench --backend nccl --world 2 \
       --algo ring,pipelined_ring,halving_doubling --sizes 1M..256M --iters 20 --warmup 5 --out "$WORK/allreduce-p2"
  CUDA_VISIBLE_DEVICES=0,1 step python3 -m collectives bench --backend nccl --world 2 --algo ring --sizes 256M \
       --iters 20 --warmup 5 --plain-memory --out "$WORK/allreduce-p2-plain"
  fi
  if want rest; then
  step python3 -m collectives bench-fused --backend nccl --world "$four" --numel 4096 --out "$WORK/fused-p$four"
  CUDA_VISIBLE_DEVICES=0,1 step python3 -m collectives bench-ddp --backend nccl --world 2 --out "$WORK/ddp-p2"
  step python3 -m collectives tour --backend nccl --world "$four" --size 64M --json "$WORK/tour-p$four.json"
  fi
} 2>&1 | tee "$WORK/log.txt"
mkdir -p "$OUT"
tar -czf "$OUT/gpu-$PART.tar.gz" -C "$WORK" .
cp "$WORK/log.txt" "$OUT/log-$PART.txt"
