#!/bin/bash
# On the GPU machine (device): build libggml-cuda of the pinned llama.cpp for one architecture
# with the machine's toolkit, then read its device code as the fleet's packing does
# (bench/cuda_pack_check.py). Carried: .carry/llama.cpp.git. Output: $OUT (build.log,
# results.json). ARCH defaults to the machine's own (90-real on H100/H200).
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${ARCH:-90-real}
COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f
SRC=/tmp/llama.cpp BUILD=/tmp/llamarig-build
export PATH=/usr/local/cuda/bin:$PATH
rm -rf "$SRC" "$BUILD"
git clone -q .carry/llama.cpp.git "$SRC" && git -C "$SRC" -c advice.detachedHead=false checkout -q "$COMMIT"
started=$(date +%s)
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$SRC" -B "$BUILD" "${generator[@]}" -DGGML_CUDA=ON -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CUDA_ARCHITECTURES=$ARCH" \
  -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > "$OUT/build.log" 2>&1
cmake --build "$BUILD" --target ggml-cuda -j "$(nproc)" >> "$OUT/build.log" 2>&1
echo "build seconds: $(( $(date +%s) - started ))" | tee -a "$OUT/build.log"
ls -l "$BUILD/bin" | tee -a "$OUT/build.log"
PYTHONPATH=$PWD python3 bench/cuda_pack_check.py "$BUILD" "$ARCH" /usr/local/cuda/bin/cuobjdump
