#!/usr/bin/env bash
# The GPU checks of the CUDA reducer, as one prepared run on a machine with an NVIDIA GPU
# (build first with scripts/device-build.sh and carry .device/). Everything lands in $OUT:
# the device, the CUDA tests (integer results bit-identical to the CPU's on random
# inputs), `cohort bench reduce` on the GPU and on the CPU, and secure aggregation's
# unmasking of n = 1,000, d = 1,000,000 with 10% dropout on the GPU, transfers included.
set -uo pipefail
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
    [ -d "$dir" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$dir"
done
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
./.device/aggregation-tests cuda --nocapture --test-threads 1 > "$OUT/cuda-tests.txt" 2>&1
echo "cuda tests: exit $?" >> "$OUT/summary.txt"
./.device/cohort bench reduce --reducer cuda --n 100 --d 1000000 > "$OUT/reduce-cuda.jsonl" 2>> "$OUT/stderr.txt"
echo "bench reduce cuda: exit $?" >> "$OUT/summary.txt"
./.device/cohort bench reduce --reducer cuda --n 1000 --d 1000000 --batch 16 > "$OUT/reduce-cuda-1000.jsonl" 2>> "$OUT/stderr.txt"
./.device/cohort bench reduce --reducer cpu --n 100 --d 1000000 > "$OUT/reduce-cpu.jsonl" 2>> "$OUT/stderr.txt"
./.device/cohort bench secagg --reducer cuda --n 1000 --d 1000000 --dropout 0.1 --repeats 1 \
    > "$OUT/secagg-cuda.jsonl" 2>> "$OUT/stderr.txt"
echo "bench secagg cuda: exit $?" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; tail -5 "$OUT/cuda-tests.txt"; cat "$OUT"/reduce-cuda.jsonl
