#!/usr/bin/env bash
# The several-GPU measurements (docs/benchmarks.md "Several GPUs"), on one 4-GPU host, in
# stages; runs that need disjoint GPUs go side by side (CUDA_VISIBLE_DEVICES), each run on
# GPUs of its own. Results: $RESULTS/<stage>/bench_async.json and logs; a table per stage.
#
#   RESULTS=/tmp/i30 bash scripts/bench_placement.sh            # every stage
#   RESULTS=/tmp/i30 bash scripts/bench_placement.sh s4 s5      # some stages
#
# s1: 1 GPU shared (trainer and generator on one GPU), 64 and 256 rollouts, N = 0 and 1
#     (side by side on GPUs 2 and 3), and `pytest -m "gpu and not vllm"` on GPUs 0-1
# s2: tests/test_two_gpus.py, both backends (waits for vLLM in /tmp/vsite), on GPUs 0-1;
#     1 trainer GPU + 1 generator GPU, 64 rollouts, N = 0 and 1, on GPUs 2-3
# s3: the same at 256 rollouts on GPUs 0-1; weight transports across GPUs 2-3
# s4: 1 trainer + 3 generator GPUs, N = 0 and 1; the 0.6B with FSDP over 2 trainer GPUs + 2
#     generator GPUs, N = 1; the Qwen3-4B shape the same way
#
# On a 2-GPU host (RESULTS=... bash scripts/bench_placement.sh t1 t2 t3 t4 t5):
# t1: 1 GPU shared, 64 rollouts on GPU 0 beside 256 rollouts on GPU 1, N = 0, 1, 1s
# t2: 1 trainer GPU + 1 generator GPU, 64 rollouts, N = 0, 1, 1s
# t3: tests/test_two_gpus.py (native; vllm too once /tmp/vsite holds vLLM), then the weight
#     transports and the weight-sync time across the two GPUs
# t4: 1 trainer GPU + 1 generator GPU, 256 rollouts, N = 0, 1, 1s
# t5: the Qwen3-4B shape, FSDP over both GPUs, a generator on each (shared), N = 1
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-/tmp/bench_placement}
mkdir -p "$RESULTS"
COMMON="--warm_start.steps=40 --training.steps=8 --validation.interval=0 --checkpoint.interval=0"
SKIP=3

async() {  # async <gpus> <out> <layout> <prompts> [staleness...] (default N = 0 and 1)
  local gpus=$1 out=$2 layout=$3 prompts=$4; shift 4
  CUDA_VISIBLE_DEVICES=$gpus python scripts/bench_async.py --out "$RESULTS/$out" \
    --layouts "$layout" --staleness ${*:-0 1} --prompts $prompts --skip $SKIP \
    --common "$COMMON" > "$RESULTS/$out.log" 2>&1
}

s1() {
  CUDA_VISIBLE_DEVICES=0,1 python -m pytest -m "gpu and not vllm" -o addopts="" -q \
    > "$RESULTS/s1_pytest_gpu.log" 2>&1 &
  async 2 s1_shared_p8 1+1:shared 8 &
  async 3 s1_shared_p32 1+1:shared 32 &
  wait
}

s2() {  # the 2-GPU tests of both backends beside the split runs at 64 rollouts
  (
    for _ in $(seq 60); do [ -d /tmp/vsite/vllm ] && break; sleep 10; done
    source .vllm5/install.sh
    CUDA_VISIBLE_DEVICES=0,1 python -m pytest -o addopts="" -q tests/test_two_gpus.py \
      > "$RESULTS/s2_pytest_two_gpus.log" 2>&1
  ) &
  async 2,3 s2_split_p8 1+1 8 &
  wait
}

s3() {  # the split runs at 256 rollouts beside the weight transports
  async 0,1 s3_split_p32 1+1 32 &
  (
    export CUDA_VISIBLE_DEVICES=2,3
    python scripts/bench_gpu_transport.py --out "$RESULTS/s3_transport"
    for g in 1 0; do
      python scripts/bench_weight_sync.py --generator-gpu $g --out "$RESULTS/s3_sync_06b_gpu$g"
    done
  ) > "$RESULTS/s3_transport.log" 2>&1 &
  wait
}

s4() {  # all four GPUs, most wanted first
  export CUDA_VISIBLE_DEVICES=0,1,2,3
  python scripts/bench_async.py --out "$RESULTS/s4_1p3" --layouts 1+3 --staleness 0 1 \
    --prompts 32 8 --skip $SKIP --common "$COMMON" > "$RESULTS/s4_1p3.log" 2>&1
  python scripts/bench_async.py --out "$RESULTS/s4_2p2" --layouts 2+2 --staleness 1 \
    --prompts 32 --skip $SKIP --common "$COMMON" > "$RESULTS/s4_2p2.log" 2>&1
  python scripts/bench_async.py --out "$RESULTS/s4_4b" --layouts 2+2 --staleness 1 --prompts 8 \
    --skip $SKIP --common "$COMMON --model.flavor=4B --batcher.rows_per_microbatch=2" \
    > "$RESULTS/s4_4b.log" 2>&1
}

t1() {
  async 0 t1_shared_p8 1+1:shared 8 0 1 1s &
  async 1 t1_shared_p32 1+1:shared 32 0 1 1s &
  wait
}

t2() { async 0,1 t2_split_p8 1+1 8 0 1 1s; }

t3() (  # a subshell: the GPU list stays inside it
  export CUDA_VISIBLE_DEVICES=0,1
  python -m pytest -o addopts="" -q tests/test_two_gpus.py -k native \
    > "$RESULTS/t3_pytest_two_gpus_native.log" 2>&1
  python scripts/bench_gpu_transport.py --out "$RESULTS/t3_transport" > "$RESULTS/t3_transport.log" 2>&1
  for g in 1 0; do
    python scripts/bench_weight_sync.py --generator-gpu $g --out "$RESULTS/t3_sync_06b_gpu$g" \
      > "$RESULTS/t3_sync_06b_gpu$g.log" 2>&1
  done
  if [ -d /tmp/vsite/vllm ]; then
    (source .vllm5/install.sh && python -m pytest -o addopts="" -q tests/test_two_gpus.py -k vllm) \
      > "$RESULTS/t3_pytest_two_gpus_vllm.log" 2>&1
  fi
)

t4() { async 0,1 t4_split_p32 1+1 32 0 1 1s; }

t5() {
  CUDA_VISIBLE_DEVICES=0,1 python scripts/bench_async.py --out "$RESULTS/t5_4b" --layouts 2+2:shared \
    --staleness 1 --prompts 8 --skip $SKIP \
    --common "$COMMON --model.flavor=4B --batcher.rows_per_microbatch=2" > "$RESULTS/t5_4b.log" 2>&1
}

stages=${*:-s1 s2 s3 s4}
for s in $stages; do
  echo "$(date +%T) $s start" >> "$RESULTS/progress.txt"
  $s
  echo "$(date +%T) $s done" >> "$RESULTS/progress.txt"
done
echo "$(date +%T) all done" >> "$RESULTS/progress.txt"
