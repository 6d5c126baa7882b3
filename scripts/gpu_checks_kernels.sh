#!/usr/bin/env bash
# The kernel, allocator and optimizer measurements of issue 26 on one GPU, in one go (~6 min on an H100):
#   bash scripts/gpu_checks_kernels.sh OUTDIR
# 1. scripts/bench_gpu_kernels.py (GEMM ramp, fp8, memory-bound ops, SDPA kernels, CP ring work,
#    the Llama 3 8B layer eager / compile / eager with F.rms_norm: time and saved bytes);
# 2. scripts/bench_gpu_runtime.py under the caching allocator's default segments, then the
#    default, fused-AdamW and 6-block rows again under expandable segments;
# 3. the CUDA-only tests (skipped on CPU, their CPU paths tested there).
# Works from a checkout without installing (PYTHONPATH), so the GPU image's own torch is used.
# Each step runs even if an earlier one failed.
OUT=${1:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
step() { echo; echo "=== $* ($(date +%T))"; }
rc=0
step environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
step bench_gpu_kernels
timeout 300 $PY scripts/bench_gpu_kernels.py --out "$OUT" || rc=1
step bench_gpu_runtime, default segments
timeout 240 $PY -m torch.distributed.run --standalone --nproc_per_node=1 scripts/bench_gpu_runtime.py --out "$OUT" || rc=1
step bench_gpu_runtime, expandable segments
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 150 $PY -m torch.distributed.run --standalone \
    --nproc_per_node=1 scripts/bench_gpu_runtime.py --out "$OUT" --tag _expandable --rows default fused deep || rc=1
step CUDA-only tests
timeout 120 $PY -m pytest -q -p no:cacheprovider -m "" tests/unit/profiler/test_profiler.py \
    tests/unit/apply/test_loss_parallel.py tests/unit/workload/test_attention_kernels.py -k "cuda or timer or fp8 or float8" || rc=1
exit $rc
