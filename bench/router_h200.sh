#!/bin/bash
# bench/router_gpu.py on the one-H200 machine (issue 30): builds llama-server of the pinned
# commit for sm_90 from the carried mirror (.carry/llama.cpp.git) while the random-weight 8B and
# 32.5B Q8_0 models are written (bench/models.py), then serves both through one router from the
# presets llamarig renders. Results in $R (router.json, router logs, presets) and $R/run.log;
# $R/EXIT when done. Carry .carry/llama.cpp.git and .whl (the wheels llamarig imports).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
W=/srv/llamarig
R=${ROUTER_OUT:-$W/out-router}
mkdir -p "$W/models" "$R"
rm -f "$R/EXIT"
trap 'echo $? > "$R/EXIT"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
[ -d $W/llama.cpp.git ] || cp -a .carry/llama.cpp.git $W/llama.cpp.git
[ -d $W/src ] || git clone -q $W/llama.cpp.git $W/src
git --git-dir=$W/llama.cpp.git show HEAD:models/ggml-vocab-llama-bpe.gguf > $W/vocab.gguf
start=$(date +%s)
(
  cmake -S $W/src -B $W/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90-real -DLLAMA_BUILD_TESTS=OFF -DGGML_CUDA_NCCL=OFF \
    && cmake --build $W/build --target llama-server -j 16 \
    && echo "build: $(( $(date +%s) - start )) s"
) > "$R/build.log" 2>&1 &
build=$!
python3 bench/models.py $W/models $W/vocab.gguf llama-8b llama-32b
echo "models written after $(( $(date +%s) - start )) s"
wait $build
tail -1 "$R/build.log"
python3 bench/router_gpu.py $W/build/bin $W/models "$R"
