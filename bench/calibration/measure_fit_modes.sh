#!/bin/bash
# Measures llama.cpp's own memory estimates (llama-fit-params --fit-print) for planner calibration.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
exec > >(tee -a $OUT/main.log) 2>&1
date; nproc; nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
which nvcc cmake ninja; nvcc --version | tail -2
cd .carry/llama.cpp
if [ ! -x build/bin/llama-fit-params ]; then
  cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_BUILD_TYPE=Release > $OUT/cmake.log 2>&1 || { tail -40 $OUT/cmake.log; exit 1; }
  grep -i -E 'nccl|cublas|cuda' $OUT/cmake.log | head
  SECONDS=0
  cmake --build build -j $(nproc) --target llama-fit-params > $OUT/build.log 2>&1 || { tail -40 $OUT/build.log; exit 1; }
  echo "build took $SECONDS s"
fi
BIN=$PWD/build/bin
mkdir -p /tmp/m
if [ ! -f /tmp/m/qwen.gguf ]; then
PYTHONPATH=$PWD/gguf-py:$ROOT/tests:$ROOT python3 - <<'PY'
from pathlib import Path
from ggufmodels import write_qwen35, write_llama
write_qwen35(Path('/tmp/m/qwen.gguf'), full_size=True)
write_llama(Path('/tmp/m/llama8b.gguf'), n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
            n_vocab=128256, context_length=131072, weight_type='q8_0', full_size=True)
PY
fi
ls -la /tmp/m
fp() { echo "=== $*"; timeout 120 $BIN/llama-fit-params --fit-print on -fa on "$@" 2>&1 | grep -E '^(CUDA|Meta|Host)' ; }
Q=/tmp/m/qwen.gguf; L=/tmp/m/llama8b.gguf
KV="-ctk q8_0 -ctv q8_0"
for ub in 256 512 1024 2048; do fp -m $Q -sm none -c 32768 $KV -np 1 -ub $ub -b 2048; done
fp -m $Q -sm none -c 229376 $KV -np 1 -ub 512
fp -m $Q -sm none -c 131072 $KV -np 1 -ub 512
fp -m $Q -sm none -c 32768 -ctk f16 -ctv f16 -np 1 -ub 512
fp -m $Q -sm none -c 32768 $KV -np 1 -ub 512 -b 512
fp -m $Q -sm none -c 229376 $KV -np 4 -ub 512
for ub in 256 512 1024; do fp -m $L -sm none -c 32768 $KV -np 1 -ub $ub; done
fp -m $L -sm none -c 131072 $KV -np 1 -ub 512
fp -m $L -sm none -c 32768 $KV -np 1 -ub 512 -fa off
for ts in 1,1 2,3 1,4; do fp -m $Q -sm tensor -ts $ts -c 32768 $KV -np 1 -ub 512; done
for ts in 1,1 1,4; do fp -m $Q -sm tensor -ts $ts -c 229376 $KV -np 1 -ub 512; done
fp -m $Q -sm tensor -ts 1,1 -c 32768 $KV -np 1 -ub 1024
for ts in 1,1 1,4; do fp -m $L -sm tensor -ts $ts -c 32768 $KV -np 1 -ub 512; done
fp -m $Q -sm layer -ts 2,3 -c 32768 $KV -np 1 -ub 512
fp -m $Q -sm layer -ts 2,3 -c 229376 $KV -np 1 -ub 512
fp -m $Q -sm layer -ts 1,1 -c 32768 $KV -np 1 -ub 1024
fp -m $L -sm layer -ts 1,1 -c 32768 $KV -np 1 -ub 512
fp -m $L -sm layer -ts 1,1 -c 131072 $KV -np 1 -ub 512
fp -m $L -sm layer -ts 1,3 -c 32768 $KV -np 1 -ub 512
date
python3 -c "
import torch, subprocess
x = torch.empty(1, device='cuda')
print('torch context:', subprocess.run(['nvidia-smi','--query-gpu=memory.used','--format=csv,noheader'],capture_output=True,text=True).stdout)
"
