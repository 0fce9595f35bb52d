#!/usr/bin/env bash
# Build stock llama.cpp for Clover's llama.cpp back end (`make llamacpp`, docs/llamacpp.md): fetch the
# pinned llama-cpp-python sdist from PyPI (its vendored llama.cpp has the qwen3next architecture),
# check its hash, unpack it and build only libllama (shared) and llama-simple, cmake Release.
# Usage: build.sh [BUILD_DIR] (default build/llamacpp); PIP (default pip), JOBS (default 2).
set -euo pipefail
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
OUT=${1:-build/llamacpp}
PIP=${PIP:-pip}
JOBS=${JOBS:-2}
SDIST=llama_cpp_python-$VERSION
mkdir -p "$OUT"
cd "$OUT"
if [ ! -f "$SDIST.tar.gz" ]; then
  $PIP download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
fi
echo "$SHA256  $SDIST.tar.gz" | sha256sum -c --quiet -
if [ ! -d "$SDIST/vendor/llama.cpp" ]; then
  tar xzf "$SDIST.tar.gz"
fi
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
if [ ! -f stock/CMakeCache.txt ]; then
  cmake -S "$SDIST/vendor/llama.cpp" -B stock "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON >/dev/null
fi
cmake --build stock -j "$JOBS" --target llama llama-simple
echo "llama.cpp built in $OUT/stock/bin"
