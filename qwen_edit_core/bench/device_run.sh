#!/usr/bin/env bash
# The real-size benchmarks of BENCHMARKS.md ("Real size: speed and memory levers") on a CUDA machine, one part
# per run (about 5-8 minutes each on an H100 80 GB):
#   bash qwen_edit_core/bench/device_run.sh targets | sample | levers1 | levers2   (in that order of priority: the
#   first two measure the targets, the last two each lever alone)
# or both targets in one run of about 9.5 minutes, each time-boxed (ALL_S seconds in all, default 570): the
# training targets in 4 steps, then the sampler's levers and 20-step edits (s/step: a 50-step edit is 2.5x):
#   bash qwen_edit_core/bench/device_run.sh all
# Writes <part>.log and device.txt under $OUT (default /tmp/qwen-edit-bench).
# Needs torch, transformers, peft, accelerate and pyyaml; if diffusers is missing, it installs the wheels in
# .whl/ (git-ignored), which a machine with internet access downloads with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl diffusers==0.42.1 importlib_metadata
set -euo pipefail
part=${1:?usage: device_run.sh targets|sample|levers1|levers2|all}
out=${OUT:-/tmp/qwen-edit-bench}
mkdir -p "$out"
if ! python3 -c "import diffusers" 2>/dev/null; then
    ls .whl/*.whl >/dev/null || { echo "no diffusers and no .whl/ wheels: see this script's header" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, diffusers, transformers, peft; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} > "$out/device.txt" 2>&1
bench="python3 -m qwen_edit_core.cli bench"
case $part in
    targets) $bench train --real-size --device cuda:0 --steps 6 \
                 --variants "+ fp8 backward,memory_budget_gb 16" ;;
    sample)  $bench sample --real-size --device cuda:0 --steps 50 --repeats 3 ;;
    levers1) $bench train --real-size --device cuda:0 --steps 6 \
                 --variants "ours (checkpointing),+ compile,+ fp8 base" ;;
    levers2) $bench train --real-size --device cuda:0 --steps 6 \
                 --variants "+ cuDNN attention,+ selective checkpointing (budget 76)" ;;
    all) total=${ALL_S:-570}
         timeout $((total * 56 / 100)) $bench train --real-size --device cuda:0 --steps 4 \
             --variants "+ fp8 backward,memory_budget_gb 16" || echo "train part ended with $?"
         timeout $((total - SECONDS - 10)) python3 -c "import logging; logging.basicConfig(level=logging.INFO)
from qwen_edit_core.bench.sample import _real; _real('cuda:0', steps=20, repeats=2)" || echo "sample part ended with $?" ;;
    *) echo "unknown part $part: targets, sample, levers1, levers2 or all" >&2; exit 2 ;;
esac 2>&1 | tee "$out/$part.log"
