#!/bin/bash
# Many asynchronous CPU runs at once, to catch rare crashes (the trainer's gloo all-gather
# crashed twice on busy many-core hosts: docs/results.md). Each run is the default job one
# step ahead, pinned to 2 cores; every third syncs through the controller.
#
#   bash scripts/stress_async_cpu.sh start 12 8 [steps]   # 12 runs on cores 8-31, seeds 0-11
#   bash scripts/stress_async_cpu.sh report [dir]         # crash lines, progress; py-spy dumps
#                                                         # of runs silent for 60 s into dir
# Runs write to /tmp/stress. They end with the shell session that started them on the GPU
# machine, so start and report in one device call.
set -u
case "$1" in
start)
  n=$2 first=$3 steps=${4:-1200}
  mkdir -p /tmp/stress
  for i in $(seq 0 $((n - 1))); do
    c=$((first + 2 * i)) extra=""
    [ $((i % 3)) -eq 2 ] && extra="--weight_sync.transport=controller"
    CUDA_VISIBLE_DEVICES= nohup taskset -c $c,$((c + 1)) ./run_train.sh \
      --parallelism.device=cpu --checkpoint.interval=0 --rollout.max_staleness=1 \
      --training.steps=$steps --job.seed=$i --job.output_dir=/tmp/stress \
      --job.run_name=s$i $extra >/tmp/stress/s$i.log 2>&1 &
  done ;;
report)
  out=${2:-/tmp/stress/report}; PATH=$PATH:/tmp/site/bin  # the GPU bundle puts py-spy there
  mkdir -p "$out"
  tree() { for c in $(ps -o pid= --ppid "$1"); do echo "$c"; tree "$c"; done; }
  for f in /tmp/stress/s*.log; do
    n=$(basename "$f" .log)
    echo "== $n: $(grep -aE 'malloc|corrupt|sig=|SIGSEGV|SIGABRT|double free|failed' "$f" | head -2 | cut -c1-300)"
    tail -c 200 "$f" | tr '\r' '\n' | tail -1
    if [ $(($(date +%s) - $(stat -c %Y "$f"))) -gt 60 ]; then
      top=$(pgrep -f "job.run_name=$n\b" | head -1)
      for p in ${top:+$top $(tree "$top")}; do py-spy dump --pid "$p" >"$out/$n.$p.spy" 2>&1; done
      cp -r "/tmp/stress/$n/logs" "$out/$n.logs" 2>/dev/null
    fi
  done ;;
*) echo "usage: $0 start N FIRST_CORE [STEPS] | report [DIR]" >&2; exit 2 ;;
esac
