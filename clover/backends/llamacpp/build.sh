#!/usr/bin/env bash
# Build stock llama.cpp for Clover's llama.cpp back end (`make llamacpp`, docs/llamacpp.md): fetch the
# pinned llama-cpp-python sdist from PyPI (its vendored llama.cpp has the qwen3next architecture),
# check its hash, unpack it and build only libllama (shared) and llama-simple, cmake Release; then the
# same source with patches/clover-block-diffusion.patch applied (block diffusion for the engine's
# llama.cpp runner), libllama only, into clover/.
# `build.sh BUILD_DIR server` instead builds stock llama-server (bench/serve_peer.py, `make llama-server`)
# in the same stock/ tree, so libllama and ggml are compiled once for both.
# Usage: build.sh [BUILD_DIR [server]] (default build/llamacpp); PIP (default pip), JOBS (default 2).
set -euo pipefail
PATCH=$(cd "$(dirname "$0")" && pwd)/patches/clover-block-diffusion.patch
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
OUT=${1:-build/llamacpp}
WHAT=${2:-lib}
PIP=${PIP:-pip}
JOBS=${JOBS:-2}
SDIST=llama_cpp_python-$VERSION
mkdir -p "$OUT"
cd "$OUT"
if [ ! -f "$SDIST.tar.gz" ]; then
  # --no-binary names the one package: `:all:` would also build the sdist's build dependencies
  # (scikit-build-core, cmake, ...) from source to read its metadata
  $PIP download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d .
fi
echo "$SHA256  $SDIST.tar.gz" | sha256sum -c --quiet -
if [ ! -d "$SDIST/vendor/llama.cpp" ]; then
  tar xzf "$SDIST.tar.gz"
fi
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
# ggml's AMX int8 path (compiled in by -march=native on Sapphire Rapids and later) segfaults inside
# llama_decode on these models' small dims for every quantised type (q8_0, q4_0, q4_K; f32/bf16 do not
# use it): build without AMX, so quantised GGUFs run ggml's AVX-512 repacked kernels, as on other CPUs.
NO_AMX=""
if echo 'int main(){return 0;}' | ${CC:-cc} -x c -mno-amx-int8 -o /dev/null - 2>/dev/null; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
configure() {  # source dir, build dir (configured again when made with other flags)
  if [ ! -f "$2/CMakeCache.txt" ] || ! grep -q "^CMAKE_CXX_FLAGS:STRING=$NO_AMX\$" "$2/CMakeCache.txt"; then
    rm -rf "$2"
    cmake -S "$1" -B "$2" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
      -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON >/dev/null
  fi
}
configure "$SDIST/vendor/llama.cpp" stock
if [ "$WHAT" = server ]; then
  # the tools' targets added to the same tree (cmake keeps the rest of its cache); no web UI, which
  # would be fetched from the network
  cmake -S "$SDIST/vendor/llama.cpp" -B stock -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
  cmake --build stock -j "$JOBS" --target llama-server
  echo "stock llama-server built in $OUT/stock/bin"
  exit 0
fi
cmake --build stock -j "$JOBS" --target llama llama-simple
echo "stock llama.cpp built in $OUT/stock/bin"
# the patched copy: re-made whenever the patch changes
if [ ! -f clover-src/.patch.sha256 ] || ! sha256sum -c --quiet clover-src/.patch.sha256 2>/dev/null; then
  rm -rf clover-src
  cp -rp "$SDIST/vendor/llama.cpp" clover-src  # -p: unpatched files keep their times, no rebuild
  (cd clover-src && patch -p1 --quiet < "$PATCH")
  (cd clover-src && sha256sum "$PATCH" > .patch.sha256)
fi
configure clover-src clover
cmake --build clover -j "$JOBS" --target llama
echo "patched llama.cpp (Clover block diffusion) built in $OUT/clover/bin"
