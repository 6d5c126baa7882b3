#!/usr/bin/env bash
# The GPU acceptance run of the profiler issue, in one go (one GPU node, ~5 min on an H100):
#   bash scripts/gpu_checks.sh OUTDIR
# 1. the CUDA-event timer test; 2. bench_profiler on gpt2-small and llama2-7b-shaped blocks
# (per-op sum vs eager step, block reuse vs naive); 3. the shipped profile (gpt2-small and
# llama2-7b, TP 1/2/4/8 shard shapes, microbatch 1/2/4); 4. nest-fx plan with that profile;
# 5. auto_parallelize on one CUDA rank (NCCL). Works from a checkout without installing
# (PYTHONPATH), so a GPU image's own torch is used. Each step runs even if an earlier one failed.
OUT=${1:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LLAMA7B_BLOCKS="llama:hidden=4096,layers=4,heads=32,ffn=11008,seq=4096,vocab=32000"
step() { echo; echo "=== $* ($(date +%T))"; }
rc=0
step environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
step timer test
timeout 300 $PY -m pytest -q -p no:cacheprovider tests/unit/profiler/test_profiler.py -k "timer" || rc=1
step bench_profiler
timeout 600 $PY scripts/bench_profiler.py --device cuda --dtype bf16 --mbs 1 2 4 --repeats 10 \
    --models gpt2-small "$LLAMA7B_BLOCKS" --json "$OUT/bench_profiler_h100.json" || rc=1
step profile
timeout 600 $PY -m nest_fx profile gpt2-small --device cuda --tp 1,2,4,8 --mbs 1,2,4 --repeats 10 --quiet --out "$OUT/h100-bf16.json" || rc=1
timeout 600 $PY -m nest_fx profile llama2-7b --device cuda --tp 1,2,4,8 --mbs 1,2 --repeats 10 --quiet --append --out "$OUT/h100-bf16.json" || rc=1
step plan with the profile
timeout 300 $PY -m nest_fx plan --model llama2-7b --cluster dgx-h100:1024 --profile "$OUT/h100-bf16.json" --quiet || rc=1
step auto_parallelize on one CUDA rank
timeout 300 torchrun --standalone --nproc_per_node=1 examples/train_gpt.py --auto --steps 8 || rc=1
exit $rc
