#!/usr/bin/env bash
# Prepare, on the CPU machine, the wheels a real SGLang server needs on the GPU machine, which
# reaches no package registry: only what that machine's image lacks, for a target directory of
# SGLang's own (not the vLLM engine's), installed there with --no-deps --no-index.
# Each sub-folder part0, part1, ... holds at most 60 MiB, so one command carries it. A wheel over
# 60 MiB (sglang-kernel) travels as pieces STEM.partNN beside a file STEM.NAME holding the wheel's
# file name; SHA256SUMS checks the wheels once they are put back together.
#   bash benchmarks/gpu/prepare_carry_sglang.sh [DIR]      (default .carry/gpu-sglang, ignored by git)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.carry/gpu-sglang}
LIMIT=$((60 * 1024 * 1024))
rm -rf "$OUT"/part* "$OUT/whole" "$OUT/pieces"
mkdir -p "$OUT/whole" "$OUT/pieces"
source benchmarks/gpu/platform.sh

# SGLang 0.5.17 is the newest release that pins torch 2.11.0 (and torchaudio 2.11.0), the machine's
# own; sglang-kernel 0.4.5 is its CUDA 13 build; torch-memory-saver ships CUDA 13 hooks
# (--enable-memory-saver). transformers is SGLang's pin, 5.12.1: with the machine's 5.17 importing
# SGLang fails ("'qwen3_asr' is already used by a Transformers config"); it wants tokenizers <= 0.23.0.
# flashinfer is imported on CUDA whatever the backends (sampler, fp8 utils); its optional stacks
# (nvidia-cutlass-dsl, nvidia-cudnn-frontend, nccl4py, cuda-tile) are never imported here.
# apache-tvm-ffi builds SGLang's JIT kernels (RoPE, KV-cache store, RMSNorm) with the machine's nvcc.
# The rest is what SGLang's server imports (fastapi, uvicorn, pydantic, openai, xgrammar, msgspec,
# pyzmq, ...) with their own requirements, less what the image has.
# Left out of SGLang's Requires-Dist, since serving a plain bf16 model never imports them: anthropic,
# blobfile, datasets, easydict, flash-attn-4, helion, humming-kernels, interegular, kernels,
# llguidance, mistral-common, modelscope, nvidia-cutlass-dsl, nvidia-mathdx, openai-harmony, outlines,
# py-spy, quack-kernels, sgl-deep-gemm, smg-grpc-servicer, tilelang, tokenspeed-mla, torchao,
# torchcodec, watchfiles (cuda-python's modules come with the image's cuda-bindings).
# sglang/utils.py imports IPython.display, which needs only traitlets (and the image's pygments):
# the interactive shell's own requirements (jedi, prompt-toolkit, pexpect, stack-data, ...) are left out.
pip download --quiet --no-deps "${PLAT[@]}" -d "$OUT/whole" \
  "sglang==0.5.17" "sglang-kernel==0.4.5" "torch-memory-saver==0.0.9.post1" \
  "transformers==5.12.1" "tokenizers==0.22.2" "flashinfer-python==0.6.15.post1" "apache-tvm-ffi==0.1.11" \
  "xgrammar==0.2.1" "openai==2.6.1" distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 \
  "pydantic==2.14.4" "pydantic-core==2.50.5" annotated-types==0.8.0 typing-inspection==0.4.5 \
  "fastapi==0.136.3" starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 \
  msgspec==0.23.0 orjson==3.13.0 pyzmq==27.3.0 pybase64==1.5.1 partial-json-parser==0.2.1.1.post7 \
  setproctitle==1.3.8 zstandard==0.25.0 dill==0.4.1 gguf==0.19.0 compressed-tensors==0.20.1 loguru==0.7.3 \
  soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  ipython==9.18.1 traitlets==5.16.1
(cd "$OUT/whole" && sha256sum -- *.whl > ../pieces/SHA256SUMS)

# Wheels over 60 MiB go in pieces.
for w in "$OUT"/whole/*.whl; do
  if [ "$(stat -c %s "$w")" -gt "$LIMIT" ]; then
    stem=$(basename "$w" | sed 's/-.*//')
    split -b 60m -d "$w" "$OUT/pieces/$stem.whl.part"
    basename "$w" > "$OUT/pieces/$stem.whl.NAME"
    rm "$w"
  fi
done
mv "$OUT"/whole/*.whl "$OUT/pieces/"
rmdir "$OUT/whole"

# Pack pieces and wheels, largest first, into sub-folders of at most 60 MiB each.
python3 - "$OUT" "$LIMIT" <<'PY'
import os, sys
out, limit = sys.argv[1], int(sys.argv[2])
src = os.path.join(out, "pieces")
files = sorted(os.listdir(src), key=lambda f: (-os.path.getsize(os.path.join(src, f)), f))
bins = []
for f in files:
    size = os.path.getsize(os.path.join(src, f))
    for b in bins:
        if b[0] + size <= limit:
            break
    else:
        b = [0, []]
        bins.append(b)
    b[0] += size
    b[1].append(f)
for i, (_, names) in enumerate(bins):
    os.makedirs(os.path.join(out, "part%d" % i))
    for f in names:
        os.rename(os.path.join(src, f), os.path.join(out, "part%d" % i, f))
os.rmdir(src)
PY
du -sh --apparent-size "$OUT"/part*
echo "$(ls "$OUT" | wc -l) folders, $(find "$OUT" -name '*.whl' -o -name '*.NAME' | wc -l) wheels, $(du -sh --apparent-size "$OUT" | cut -f1) in all"
