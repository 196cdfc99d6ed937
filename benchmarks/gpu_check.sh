#!/usr/bin/env bash
# One command that proves treegraft on a CUDA machine with no model hub, in under 8 minutes:
#   0. (--device cpu only) every Triton kernel compiles for sm_80 and sm_90 (benchmarks/compile_kernels.py: ahead
#      of time, no GPU needed; on a GPU, step 1 compiles them for the GPU at hand and device time is not spent here);
#   1. every Triton kernel against its reference at real sizes (vocab 151,936, trees 16-128 nodes), and
#      every method exactly against `ar` on random-weight Qwen3-shaped models in fp32 and bf16
#      (benchmarks/gpu_check.py; any mismatch fails the script);
#   2. the kernel micro-benchmark table (benchmarks/verify_kernels.py);
#   3. host overhead and host-device synchronisations per step, per method (benchmarks/host_overhead.py;
#      on CUDA the driver's own count too, and a second table with the forwards replayed from CUDA graphs);
#   4. the CUDA-graph speedup of the verify and drafter forwards (benchmarks/compile_speedup.py: --compile off,
#      static and cudagraphs on a Qwen3-8B-shaped target; every mode must give the same tokens);
#   5. tree steps on the block KV cache against transformers' DynamicCache on a 36-layer Qwen3-8B-shaped target
#      after 2k and 16k tokens of context (benchmarks/kv_cache.py; logits compared).
# Usage: benchmarks/gpu_check.sh [--device cuda|cpu] [--small] [--profile]
#   --device cpu --small is the smoke run that works anywhere (kernels interpreted, tiny shapes).
#   --profile adds, after step 3, where the host time of the costliest methods goes (benchmarks/host_profile.py; about
#   20 s more, so the whole run may pass 8 minutes).
#   PYTHON=/path/to/python picks the interpreter (default: python), e.g. a venv's that holds torch.
# Exits non-zero when a check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEVICE=cuda
SMALL=""
PROFILE=""
PYTHON="${PYTHON:-python}"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --small) SMALL="--small"; shift ;;
    --profile) PROFILE=1; shift ;;
    *) echo "usage: $0 [--device cuda|cpu] [--small] [--profile]" >&2; exit 2 ;;
  esac
done
if [ "$DEVICE" = "cpu" ]; then
  export TRITON_INTERPRET=1  # the kernels run in triton's interpreter on CPU tensors
fi
if [ -n "$SMALL" ]; then
  NODES="8 32"; VOCAB="512"; REPS=2; REPEATS=1; NEW=16
  KV="--shape small --layers 4 --contexts 64 512 --steps 2 --repeats 1"
else
  NODES="16 32 64 128"; VOCAB="151936"; REPS=5; REPEATS=3; NEW=64
  KV="--shape qwen3-8b --layers 36 --dtype bf16 --contexts 2048 16384"
fi
status=0
started=$(date +%s)
step() { echo; echo "== $1 ($(( $(date +%s) - started ))s)"; }

if [ "$DEVICE" = "cpu" ]; then
  step "0. every kernel compiles for A100 and H100/H200 (ahead of time)"
  if [ -n "$SMALL" ]; then ARCH="90"; else ARCH="80 90"; fi
  "$PYTHON" benchmarks/compile_kernels.py --arch $ARCH $SMALL || status=1
fi

step "1. kernels and methods against their references"
"$PYTHON" benchmarks/gpu_check.py --device "$DEVICE" $SMALL || status=1

step "2. kernel micro-benchmark"
"$PYTHON" benchmarks/verify_kernels.py --device "$DEVICE" --nodes $NODES --vocab $VOCAB --reps $REPS || status=1

step "3. host overhead and synchronisations per step (tiny pair)"
OMP_NUM_THREADS=1 "$PYTHON" benchmarks/host_overhead.py --device "$DEVICE" --repeats $REPEATS --max-new-tokens $NEW || status=1
if [ "$DEVICE" = "cuda" ]; then  # the same with the forwards replayed from CUDA graphs: what is left is host work
  OMP_NUM_THREADS=1 "$PYTHON" benchmarks/host_overhead.py --device cuda --compile cudagraphs --repeats $REPEATS \
    --max-new-tokens $NEW || status=1
fi
if [ -n "$PROFILE" ]; then
  if [ "$DEVICE" = "cuda" ]; then MODE="cudagraphs"; else MODE="off"; fi
  step "3b. where the host time goes, per function (--compile $MODE)"
  OMP_NUM_THREADS=1 "$PYTHON" benchmarks/host_profile.py --device "$DEVICE" --compile "$MODE" --passes 1 --top 12 \
    --methods graft all-mid dense --max-new-tokens $NEW || status=1
fi

step "4. CUDA-graph speedup of the verify and drafter forwards"
"$PYTHON" benchmarks/compile_speedup.py --device "$DEVICE" $SMALL || status=1

step "5. tree steps on the block KV cache against transformers' DynamicCache"
"$PYTHON" benchmarks/kv_cache.py --device "$DEVICE" $KV || status=1

echo
if [ $status -eq 0 ]; then echo "gpu_check.sh: all checks passed in $(( $(date +%s) - started ))s"; else echo "gpu_check.sh: FAILED"; fi
exit $status
