#!/bin/bash
# Build the GPU payload for pure-Python vLLM (0.32.0 or 0.33.0) on a CPU machine (needs pip + PyPI;
# python3 >= 3.9).
# usage: [VLLM_VERSION=0.33.0] bash tools/gpu_vllm/build_payload.sh DEST
#        e.g. DEST=.gpu-vllm in your checkout (git-ignored); the payload stages one version.
# env:   VLLM_VERSION=0.32.0 | 0.33.0 (default 0.33.0)
#        VLLM_WHEEL=path/to/vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl (else: pip download,
#                ~330 MB)
#        WORK=dir for downloads (default: a temp dir, removed at the end unless WORK is given)
#        TINY_PY=python with torch+transformers(>=5.2)+tokenizers+safetensors: pre-build the tiny models into
#                DEST/tiny.tgz (else setup.sh builds them on the GPU machine with make_tiny.py, ~10 s)
#        TRITON_CACHE=triton cache brought back from a device run (default: the first present of
#                artifacts/gpu_vllm/triton_cache_$VLLM_VERSION.tar.xz in this checkout and the shared
#                harness's ../shared/gpu-vllm/artifacts/triton_cache.tgz; TRITON_CACHE=none leaves it out).
#                It saves ~110 s of Triton JIT + autotuning on the first hybrid/DFlash start of a fresh
#                machine; the cache is keyed by kernel source, so kernels a version changed compile anew.
#        COMPILE_CACHE=vLLM's torch.compile cache brought back from a device run (default:
#                artifacts/gpu_vllm/compile_cache_$VLLM_VERSION.tar.xz if present; none leaves it out).
# result: DEST/{vllm_py.tgz (~10 MB), whl/ (~28 wheels, ~19 MB), modelinfos/, scripts, VLLM_VERSION,
#         [tiny.tgz ~14 MB], [triton_cache.tar.xz or .tgz ~10 MB], [compile_cache.tar.xz]}  -- about 50 MB in all, under the 64 MiB a device
#         call carries
set -euo pipefail
DEST=${1:?usage: build_payload.sh DEST}; HERE=$(cd "$(dirname "$0")" && pwd)
V=${VLLM_VERSION:-0.33.0}
case "$V" in 0.32.0|0.33.0) ;; *) echo "VLLM_VERSION must be 0.32.0 or 0.33.0, got $V" >&2; exit 2;; esac
mkdir -p "$DEST/whl"; DEST=$(cd "$DEST" && pwd); rm -f "$DEST"/whl/*.whl "$DEST/tiny.tgz"
if [ -n "${WORK:-}" ]; then mkdir -p "$WORK"; KEEP=1; else WORK=$(mktemp -d); KEEP=0; fi
WHEEL=${VLLM_WHEEL:-}
if [ -z "$WHEEL" ]; then
  python3 -m pip download -q --no-deps -d "$WORK" "vllm==$V"
  WHEEL=$(ls "$WORK"/vllm-"$V"-*.whl)
fi
# 1. pure-Python tree: drop every .so, the Rust binary, C/CUDA headers and web assets; write the op
#    schemas of this version's _C_stable_libtorch for the stand-in, check the MoE stand-in's
#    against _moe_C_stable_libtorch; patch; tar
T=$WORK/tree; rm -rf "$T"; mkdir -p "$T"
(cd "$T" && unzip -q "$WHEEL" -x '*.so' 'vllm/vllm-rs' \
  && find vllm -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cuh' -o -name '*.inl' -o -name '*.cu' \
       -o -name '*.cpp' -o -name '*.js' -o -name '*.css' -o -name '*.jpg' \) -delete \
  && find vllm -type d -empty -delete && rm -f "vllm-$V.dist-info/RECORD")
unzip -q -o "$WHEEL" vllm/_C_stable_libtorch.abi3.so vllm/_moe_C_stable_libtorch.abi3.so -d "$WORK/so"
python3 "$HERE/extract_schemas.py" "$WORK/so/vllm/_C_stable_libtorch.abi3.so" "$T/vllm" \
  "$T/vllm/_C_stable_libtorch_schemas.txt"
python3 "$HERE/extract_schemas.py" --check "$WORK/so/vllm/_moe_C_stable_libtorch.abi3.so" \
  "$HERE/_moe_C_stable_libtorch.py"
python3 "$HERE/apply_patches.py" "$T"
(cd "$T" && tar -cf - vllm "vllm-$V.dist-info" | gzip -6 > "$DEST/vllm_py.tgz")
# 2. runtime deps missing from the GPU image, as cp312 manylinux wheels, no dependency resolution
#    (this list is complete for the LLM offline path of both versions; everything else comes from the
#    image; 0.33 adds orjson, imported by its OpenAI server utilities)
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d $DEST/whl"
for n in 17 24 26 27 28 31 34 35; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
EXTRA=""; [ "$V" = 0.33.0 ] && EXTRA="orjson==3.11.6"
python3 -m pip download -q $P pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 msgspec==0.23.0 pyzmq==27.3.0 cachetools==8.0.2 \
  cbor2==6.3.0 pybase64==1.5.1 blake3==1.0.11 oss-harmony==0.0.11 openai==3.57.0 jiter==0.19.0 distro==1.9.0 \
  sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 \
  fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 \
  compressed-tensors==0.17.0 loguru==0.7.3 $EXTRA
# 3. scripts, model-info cache (valid for the unmodified model files of that version; none kept for
#    0.33.0: vLLM computes it in a subprocess on first use), optional extras
cp "$HERE"/{setup.sh,go.sh,run_llm.py,make_tiny.py,compare.py,importtime_summary.py} "$DEST/"
echo "$V" > "$DEST/VLLM_VERSION"
rm -rf "$DEST/modelinfos"; mkdir -p "$DEST/modelinfos"
if [ -d "$HERE/modelinfos/$V" ]; then cp "$HERE/modelinfos/$V"/*.json "$DEST/modelinfos/"; fi
if [ -n "${TINY_PY:-}" ]; then
  rm -rf "$WORK/tiny" && "$TINY_PY" "$HERE/make_tiny.py" "$WORK/tiny" | tail -1 \
    && tar -czf "$DEST/tiny.tgz" -C "$WORK/tiny" .
fi
if [ -z "${TRITON_CACHE:-}" ]; then
  TRITON_CACHE=$HERE/../../artifacts/gpu_vllm/triton_cache_$V.tar.xz
  [ -f "$TRITON_CACHE" ] || TRITON_CACHE=$HERE/../../../shared/gpu-vllm/artifacts/triton_cache.tgz
fi
rm -f "$DEST"/triton_cache.* "$DEST"/compile_cache.*
if [ "$TRITON_CACHE" != none ] && [ -f "$TRITON_CACHE" ]; then
  case "$TRITON_CACHE" in *.tar.xz) cp "$TRITON_CACHE" "$DEST/triton_cache.tar.xz" ;;
                          *) cp "$TRITON_CACHE" "$DEST/triton_cache.tgz" ;; esac
fi
COMPILE_CACHE=${COMPILE_CACHE:-$HERE/../../artifacts/gpu_vllm/compile_cache_$V.tar.xz}
if [ "$COMPILE_CACHE" != none ] && [ -f "$COMPILE_CACHE" ]; then cp "$COMPILE_CACHE" "$DEST/compile_cache.tar.xz"; fi
[ "$KEEP" = 1 ] || rm -rf "$WORK"
du -sh "$DEST"; ls "$DEST"
