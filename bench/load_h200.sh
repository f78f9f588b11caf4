#!/bin/bash
# bench/load.py on the one-H200 machine (issue 29): builds llama-server and llama-batched-bench
# of the pinned commit for sm_90 from the carried mirror (.carry/llama.cpp.git), writes the
# random-weight 8B Q8_0 model (bench/models.py) meanwhile, then bench/load_gpu.py. Results in
# $OUT/load (load-*.json, *.png, server logs) and $OUT/load.log; $OUT/load/EXIT when done.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
W=/srv/llamarig
R=${LOAD_OUT:-$W/out-load}
mkdir -p "$W/models" "$R"
rm -f "$R/EXIT"
trap 'echo $? > "$R/EXIT"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl  # bench/load.py imports llamarig (as bench/run.sh's runs do)
export PYTHONPATH=/tmp/site:$PWD
[ -d $W/llama.cpp.git ] || cp -a .carry/llama.cpp.git $W/llama.cpp.git
[ -d $W/src ] || git clone -q $W/llama.cpp.git $W/src
git --git-dir=$W/llama.cpp.git show HEAD:models/ggml-vocab-llama-bpe.gguf > $W/vocab.gguf
(
  cmake -S $W/src -B $W/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90-real -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF \
    && cmake --build $W/build --target llama-server llama-batched-bench -j 16 \
    && echo "build done"
) > "$R/build.log" 2>&1 &
build=$!
[ -f $W/models/llama-8b-q8_0.gguf ] || python3 bench/models.py $W/models $W/vocab.gguf llama-8b
wait $build
# LOAD_VARIANTS: which flag sets of bench/load_gpu.py (default: its DEFAULT_VARIANTS).
python3 bench/load_gpu.py $W/build/bin $W/models/llama-8b-q8_0.gguf "$R" ${LOAD_VARIANTS:-}
