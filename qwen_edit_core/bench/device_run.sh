#!/usr/bin/env bash
# The real-size benchmarks of BENCHMARKS.md ("Real size: speed and memory levers") on a CUDA machine, one part
# per run (about 5-8 minutes each on an H100 80 GB):
#   bash qwen_edit_core/bench/device_run.sh targets | sample | attention | varlen | levers1 | levers2   (in that
#   order of priority: the first two measure the targets, attention times every offered kernel alone (its JSON
#   line, kept as attention.json, is the speed/attention.py FASTEST_FIRST row "auto" reads) and one block compiled
#   with dynamic=True against dynamic=None with the sequence dims marked, varlen checks variable-length attention
#   against the key mask on the GPU, the last two each lever alone)
# or the targets and the check in one run of at most 9 minutes, each part time-boxed (ALL_S seconds in all,
# default 530): the training targets in 4 steps at a real prompt's length (1,409 text tokens at 1024^2 Edit,
# a multiple-of-64 row beside it), the sampler's levers and 20-step edits with where their seconds go (s/step:
# a 50-step edit is 2.5x), the attention kernels and dynamic shapes, then varlen. Every row prints the attention kernels it ran (profiler names), the
# reserved and (training) pinned host GiB; device.txt lists the attention kernels this torch and GPU offer:
#   bash qwen_edit_core/bench/device_run.sh all
# The memory_budget_gb 16 row runs in a fresh process through the planned loader (bench/train_planned.py).
# The same "all" on the CPU at toy sizes (one block, 128^2; fp8 off), to catch an import or plumbing error before
# any GPU time is spent (about 10-20 minutes on a busy 2-core machine):
#   bash qwen_edit_core/bench/device_run.sh smoke
# The ComfyUI Train node's job on a 24 GiB card (the fp8 file, lent; the device capped to 24 GiB), its reserved
# peak and pinned host bytes beside the simulated row's (about 8 minutes, half of it the simulation on the CPU):
#   bash qwen_edit_core/bench/device_run.sh comfyui24
# Writes <part>.log and device.txt under $OUT (default /tmp/qwen-edit-bench).
# Runs on torch 2.11 or later: every torch call on its path is in 2.11.0's sources, or guarded
# (torch.compile's recompile_limit, varlen attention, host memory statistics, torch.accelerator.empty_host_cache).
# Needs torch, transformers, peft, accelerate and pyyaml; if diffusers is missing, it installs the wheels in
# .whl/ (git-ignored), which a machine with internet access downloads with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl diffusers==0.42.1 importlib_metadata
set -euo pipefail
part=${1:?usage: device_run.sh targets|sample|attention|varlen|levers1|levers2|comfyui24|all|smoke}
py=${PYTHON:-python3}
out=${OUT:-/tmp/qwen-edit-bench}
mkdir -p "$out"
if ! $py -c "import diffusers" 2>/dev/null; then
    ls .whl/*.whl >/dev/null || { echo "no diffusers and no .whl/ wheels: see this script's header" >&2; exit 2; }
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# "all" and "smoke": the device and the sizes (python keyword arguments) of every part
if [ "$part" = smoke ]; then
    dev=cpu size=", layers=1, side=128" edit=2 attn="image_tokens=128, texts=(70, 65, 77)" total=${ALL_S:-3000}
else
    dev=cuda:0 size="" edit=20 attn="" total=${ALL_S:-530}
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
  $py -c "import torch, diffusers, transformers, peft; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  $py -c "from qwen_edit_core import speed; print('attention kernels offered:', speed.offered_kernels('$dev'))"
} > "$out/device.txt" 2>&1 || true  # what this machine offers; never fatal
logged="import logging; logging.basicConfig(level=logging.INFO)"
bench="$py -m qwen_edit_core.cli bench"
case $part in
    targets) $bench train --real-size --device cuda:0 --steps 6 \
                 --variants "+ fp8 backward,memory_budget_gb 16" ;;
    sample)  $bench sample --real-size --device cuda:0 --steps 50 --repeats 3 ;;
    attention) $bench attention --device cuda:0 --repeats 5 ;;
    varlen)  $bench batching --real-size --device cuda:0 --repeats 3 ;;
    levers1) $bench train --real-size --device cuda:0 --steps 6 \
                 --variants "ours (checkpointing),+ compile,+ fp8 base" ;;
    comfyui24) $py -c "$logged
from qwen_edit_core.bench.train_comfyui import run; run('cuda:0', steps=4)" ;;
    levers2) $bench train --real-size --device cuda:0 --steps 6 \
                 --variants "+ cuDNN attention,+ selective checkpointing (budget 76)" ;;
    all|smoke)
         timeout $((total * 57 / 100)) $py -c "$logged
from qwen_edit_core.bench.train import _real
_real('$dev', steps=4, variants=['+ fp8 backward', 'memory_budget_gb 16']$size)" || echo "train part ended with $?"
         timeout $((total * 85 / 100 - SECONDS)) $py -c "$logged
from qwen_edit_core.families.qwen_image.sample_bench import _real; _real('$dev', steps=$edit, repeats=2$size)" || echo "sample part ended with $?"
         timeout $((total * 95 / 100 - SECONDS)) $py -c "$logged
from qwen_edit_core.bench.attention import run; run('$dev', repeats=3, $attn)" || echo "attention part ended with $?"
         timeout $((total - SECONDS)) $py -c "$logged
from qwen_edit_core.bench.batching import run; run(real_size='$dev' != 'cpu', device='$dev', repeats=2)" \
             || echo "varlen part ended with $?" ;;
    *) echo "unknown part $part: targets, sample, attention, varlen, levers1, levers2, comfyui24, all or smoke" >&2
       exit 2 ;;
esac 2>&1 | tee "$out/$part.log"
if grep -q '^{"capability"' "$out/$part.log"; then  # the per-kernel timings, when this part measured them
    grep '^{"capability"' "$out/$part.log" > "$out/attention.json"
fi
