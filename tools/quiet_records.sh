#!/usr/bin/env bash
# Remake, on a quiet host, every CPU and simulated-cluster timing record whose figure or table a
# page shows (lessons 1-14 and the benchmarks pages), into an output folder.
#
#   tools/quiet_records.sh OUTDIR [PART...]          (default: every part, in the order below)
#   PYTHON=python3 tools/quiet_records.sh /tmp/quiet p2p ring-sweep
#   tools/quiet_records.sh --list                    (the parts, their commands and wall times)
#   QUIET_LIMIT=60 tools/quiet_records.sh /tmp/try fr-trace     (every part's time limit capped)
#
# For a host with idle cores to spare: at least 2 per rank (16 cores for the 4- to 8-rank worlds),
# nothing else running. Runs with $PYTHON (default .venv/bin/python; on a GPU machine its own
# python3, whose torch the records name) from the repository root. The simulated-cluster parts
# (marked "cluster") need root and iproute2: run as root, or the script runs them through sudo -E.
#
# Each part runs the page's own command (the one the record names, so the page's source line reads
# the same), with a time limit, in this tree: the records land in docs/img, docs/data and
# docs/snippets as usual. Then every file the part wrote under docs/ is packed into
# OUTDIR/PART.tar.gz (paths relative to the repository root: `tar xzf PART.tar.gz` in a checkout
# puts them in place), its log into OUTDIR/PART.log, and one line "PART exit seconds" into
# OUTDIR/status.tsv. OUTDIR/env.txt names the host: cores, load average, torch, root, iproute2.
#
# Wall times (seconds, the third column; --list prints them): the parts without a cluster measured
# on a quiet 16-core x86 host with torch 2.11 CPU (an NVIDIA H200 machine's CPUs, GPUs hidden);
# all of them together take about 4 minutes. The cluster parts ("?") were not timed there: that
# host had no iproute2. Each writes its time into OUTDIR/status.tsv; until then count each at its
# limit, so that one call of at most 9 minutes runs the parts whose limits add up to 540 s.
#
# A host without iproute2 (ip, tc): on a machine that has it, `tools/quiet_records.sh --pack-iproute
# DIR` copies ip, tc and their libraries into DIR; carry DIR there and set QUIET_TOOLS=DIR.
set -uo pipefail
cd "$(dirname "$0")/.."

# name | limit (s) | measured (s, "?" if not yet timed) | cluster? | commands (";"-separated)
PARTS_TABLE='
p2p            |  60 | 6   |         | $PY tools/draw_lesson_diagrams.py --measure
ring-steps     |  60 | 7   |         | $PY tools/lesson04_figures.py --only steps --only pipelining
ring-sweep     | 540 | ?   | cluster | $PY tools/lesson04_figures.py --only sweep
fused          |  90 | 10  |         | $PY tools/lesson05_figures.py
ddp            | 200 | 51  |         | $PY tools/lesson06_figures.py
hier-sizes     | 540 | ?   | cluster | $PY -m collectives bench-hier sizes --sizes 64M --out docs/data/bench-hier; $PY -m collectives bench-hier sizes --sizes 64M --rails --out docs/data/bench-hier/rails; $PY tools/lesson07_figures.py --records docs/data/bench-hier
hier-crossover | 540 | ?   | cluster | $PY -m collectives bench-hier crossover --out docs/data/bench-hier; $PY tools/lesson07_figures.py --records docs/data/bench-hier
hier-machines  | 540 | ?   | cluster | $PY -m collectives bench-hier machines --out docs/data/bench-hier; $PY tools/lesson07_figures.py --records docs/data/bench-hier
hier-inflight  | 540 | ?   | cluster | $PY -m collectives bench-hier inflight --out docs/data/bench-hier; $PY tools/lesson07_figures.py --records docs/data/bench-hier
hier-train     | 540 | ?   | cluster | $PY -m collectives bench-hier train --out docs/data/bench-hier; $PY tools/lesson07_figures.py --records docs/data/bench-hier
hier-host-cost |  90 | 12  |         | $PY -m collectives bench-hier host-cost --out docs/data/bench-hier/host-cost/after; $PY tools/lesson07_figures.py --records docs/data/bench-hier
hier-figures   |  60 | 10  |         | $PY tools/lesson07_figures.py --records docs/data/bench-hier
sparse-bench   | 540 | ?   | cluster | $PY -m collectives bench-sparse --cluster --iters 3 --sweep 0.001,0.01,0.05,0.1,0.25,0.5 --json docs/data/08-sparse-bench.json; $PY tools/lesson08_figures.py
sparse-train   | 540 | ?   | cluster | $PY -m collectives bench-sparse-train --seeds 5 --publish
sparse-cnn     | 540 | ?   | cluster | $PY -m collectives bench-sparse-train --plan cnn --seeds 5 --publish
recorder       |  90 | 10  |         | $PY -m collectives bench-recorder --iters 100 --blocks 7 --snippet docs/snippets/bench-recorder.md --record docs/img
fr-trace       |  60 | 14  |         | $PY tools/lesson09_fr_trace.py --record docs/img
sharded        | 150 | 28  |         | $PY -m collectives bench-sharded --layers 8 --width 1024 --batch 64 --img docs/img; $PY tools/lesson10_figures.py
sharded-cluster| 540 | ?   | cluster | $PY -m collectives bench-sharded --cluster --img docs/img
a2a-local      |  60 | 10  |         | $PY -m collectives bench-alltoall local --sizes 4K..16M --iters 5 --out docs/data/11-alltoall; $PY tools/lesson11_figures.py --records docs/data/11-alltoall
a2a-cluster    | 540 | ?   | cluster | $PY -m collectives bench-alltoall cluster --sizes 64K,1M,4M --iters 5 --out docs/data/11-alltoall; $PY tools/lesson11_figures.py --records docs/data/11-alltoall
a2a-moe        |  60 | 10  |         | $PY -m collectives bench-alltoall moe --tokens 1024 --hidden 256 --ffn 1024 --skews 0,2,4,8 --factors 1.25,100 --iters 3 --out docs/data/11-alltoall; $PY tools/lesson11_figures.py --records docs/data/11-alltoall
a2a-host       |  60 | 12  |         | $PY -m collectives bench-alltoall host --before docs/data/11-alltoall/bench-alltoall-host-before.json --out docs/data/11-alltoall; $PY tools/lesson11_figures.py --records docs/data/11-alltoall
a2a-figures    |  60 | 5   |         | $PY tools/lesson11_figures.py --records docs/data/11-alltoall
symmetric      | 120 | 18  |         | $PY -m collectives bench-symmetric --json docs/data/12-symmetric-cpu.json --record 12-bench-cpu
sharded-agree  | 120 | ?   |         | $PY -m collectives bench-sharded-agreement
sharded-p3     | 150 | ?   |         | $PY -m collectives bench-sharded --world 3 --layers 4 --width 1024 --only fsdp2,zero3,zero3_torch --out docs/data/10-sharded-p3
a2a-dedup      | 540 | ?   | cluster | $PY -m collectives bench-alltoall dedup --tokens 2048 --hidden 1024 --out docs/data/11-alltoall
tp             | 120 | ?   |         | $PY -m collectives bench-tp --json docs/data/13-tp-cpu.json --record 13-bench-cpu; $PY -m collectives bench-tp --counts
pp             | 120 | ?   |         | $PY -m collectives bench-pp --img docs/img
pp-cluster     | 540 | ?   | cluster | $PY -m collectives bench-pp --cluster --img docs/img
bench          | 120 | 20  |         | $PY -m collectives bench --json docs/data/bench-cpu.json --out build/bench-cpu; $PY tools/bench_charts.py
pipeline       |  60 | ?   |         | $PY -m collectives bench-pp --img docs/img
pipeline-cluster| 540 | ?  | cluster | $PY -m collectives bench-pp --cluster --img docs/img
'
field() { echo "$1" | cut -d'|' -f"$2" | sed 's/^ *//; s/ *$//'; }

if [ "${1:-}" = "--list" ] || [ "${1:-}" = "-l" ]; then
  echo "$PARTS_TABLE" | grep -v '^$' | while IFS= read -r row; do
    printf '%-16s %4ss limit  %4s s  %-8s %s\n' "$(field "$row" 1)" "$(field "$row" 2)" "$(field "$row" 3)" \
           "$(field "$row" 4)" "$(field "$row" 5)"
  done
  exit 0
fi
if [ "${1:-}" = "--pack-iproute" ] && [ -n "${2:-}" ]; then
  mkdir -p "$2/bin" "$2/lib"
  for exe in ip tc; do cp "$(command -v $exe)" "$2/bin/"; done
  ldd "$2/bin/ip" "$2/bin/tc" | awk '$3 ~ /^\// {print $3}' | sort -u | grep -v -E '/libc\.so|/libm\.so|/ld-linux' \
    | xargs -I{} cp -L {} "$2/lib/"
  ls "$2/bin" "$2/lib"; exit 0
fi
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: tools/quiet_records.sh OUTDIR [PART...]   (tools/quiet_records.sh --list: the parts)" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd); shift
ALL=$(echo "$PARTS_TABLE" | grep -v '^$' | cut -d'|' -f1 | tr -d ' ' | tr '\n' ' ')
WANT=${*:-$ALL}
for part in $WANT; do
  case " $ALL " in *" $part "*) ;; *) echo "unknown part: $part (the parts: $ALL)" >&2; exit 2 ;; esac
done

PY=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_VISIBLE_DEVICES=""
export COLLECTIVES_COMMIT=${COLLECTIVES_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
if [ -n "${QUIET_TOOLS:-}" ]; then   # ip and tc carried from another host (--pack-iproute)
  QUIET_TOOLS=$(cd "$QUIET_TOOLS" && pwd)
  export PATH="$QUIET_TOOLS/bin:$PATH" LD_LIBRARY_PATH="$QUIET_TOOLS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -E"

{ echo "date: $(date -u +%FT%TZ)"; echo "cores: $(nproc)"; echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "torch: $($PY -c 'import torch; print(torch.__version__)' 2>&1)"; echo "python: $PY"
  echo "root: $([ "$(id -u)" = 0 ] && echo yes || echo "no (cluster parts through sudo -E)")"
  echo "iproute2: $(command -v ip || echo missing)  tc: $(command -v tc || echo missing)"
  echo "commit: $COLLECTIVES_COMMIT"; } >"$OUT/env.txt"
cat "$OUT/env.txt"
if [ "$(nproc)" -lt 8 ]; then
  echo "warning: $(nproc) cores; these records are meant for a host with 2 idle cores per rank" | tee -a "$OUT/env.txt"
fi

for part in $WANT; do
  row=$(echo "$PARTS_TABLE" | grep -E "^$part *\|")
  limit=$(field "$row" 2); cluster=$(field "$row" 4); cmds=$(field "$row" 5)
  limit=$(( limit < ${QUIET_LIMIT:-100000} ? limit : ${QUIET_LIMIT:-100000} ))     # a cap for trial runs
  stamp="$OUT/.stamp-$part"; touch "$stamp"; sleep 1
  t0=$SECONDS; rc=0
  echo "=== $part (limit ${limit}s, load $(cut -d' ' -f1-3 /proc/loadavg))" | tee "$OUT/$part.log"
  IFS=';' read -ra steps <<<"$cmds"
  for cmd in "${steps[@]}"; do
    cmd=$(echo "${cmd//\$PY/$PY}" | sed 's/^ *//')
    left=$(( limit - (SECONDS - t0) )); [ "$left" -gt 5 ] || { rc=124; break; }
    pre=""; [ "$cluster" = cluster ] && pre=$SUDO
    echo "--- $cmd" | tee -a "$OUT/$part.log"
    # shellcheck disable=SC2086
    timeout -k 10 "$left" $pre $cmd >>"$OUT/$part.log" 2>&1; rc=$?
    [ "$rc" = 0 ] || break
  done
  secs=$((SECONDS - t0))
  (find docs -type f -newer "$stamp" -print0 | tar czf "$OUT/$part.tar.gz" --null -T -) 2>>"$OUT/$part.log"
  rm -f "$stamp"
  printf '%s\t%s\t%s\n' "$part" "$rc" "$secs" >>"$OUT/status.tsv"
  echo "=== $part: exit $rc in ${secs}s; $(tar tzf "$OUT/$part.tar.gz" | wc -l) files in $part.tar.gz" \
    | tee -a "$OUT/$part.log"
  grep -v -E "Warning|warnings.warn" "$OUT/$part.log" | tail -n 6
done
