#!/usr/bin/env bash
# The GPU engine's image, made on the GPU machine without a registry: one `docker import` of a
# root file system taken from the machine itself (its Ubuntu 24.04 /usr and /etc basics, the
# torch 2.11 + CUDA 13 environment in /opt/torch/.venv) plus vLLM 0.26.0 and what it needs beyond
# that image ($WORK/engine-site, as `device.sh engine` installs it), with PATH and PYTHONPATH
# set by `docker import --change`.
#   bash benchmarks/gpu/engine_image.sh          # import it as $TAG (once: an existing tag is kept)
#   bash benchmarks/gpu/engine_image.sh sizes    # only how big it would be (du: a few seconds, nothing read)
#   bash benchmarks/gpu/engine_image.sh base     # only the machine's part, as $TAG's base: it needs no
#                                                # engine, so it can be imported while vLLM's pieces travel;
#                                                # the plain command then adds the engine's packages as one
#                                                # layer (docker cp + commit) in seconds instead of importing all
# After `docker.sh up` and `device.sh engine`.
#
# How far this is from a vendor image (vllm/vllm-openai, NGC's): the same kind of contents (an
# Ubuntu user space, CPython, torch with CUDA's pip libraries, vLLM), but built from this
# machine's own files in one or two layers rather than from a Dockerfile in many; vLLM and its extras sit
# on PYTHONPATH beside the torch environment instead of inside it; there is no ENTRYPOINT (the
# recipe's command is the whole command line: `vllm serve ...`). Like a vendor image it holds
# no driver: the driver's files the GPU path mounts into the container (launch/gpu_devices.py)
# are left out, so the container uses the host's driver as it would with NVIDIA's toolkit. Big
# packages of the machine's environment that vLLM never imports (jax, cupy, onnxruntime, ...)
# are left out to keep the import short; VENV_EXCLUDE names them.
#
# Settings (environment):
#   COLDSNAP_GPU_WORK  where device.sh keeps things (default /root/coldsnap-gpu)
#   TAG          the image's name (default coldsnap/vllm-gpu:0.26.0)
#   SYSTEM       paths under / taken whole (default: usr and the top-level links into it)
#   ETC          paths under /etc taken (default: users, the loader's cache, certificates, alternatives)
#   VENV         the Python environment (default /opt/torch/.venv), at the same path in the image
#   ENGINE_SITE  the engine's packages (default $WORK/engine-site), at /opt/engine-site in the image
#   VENV_EXCLUDE site-packages entries left out (glob patterns, space-separated)
#   PY           the plugin's interpreter, asked for the driver's files (default python3)
set -euo pipefail
WORK=${COLDSNAP_GPU_WORK:-/root/coldsnap-gpu}
TAG=${TAG:-coldsnap/vllm-gpu:0.26.0}
SYSTEM=${SYSTEM:-usr bin sbin lib lib64}
ETC=${ETC:-passwd group shadow nsswitch.conf ld.so.conf ld.so.conf.d ld.so.cache ssl ca-certificates alternatives os-release lsb-release debian_version localtime}
VENV=${VENV:-/opt/torch/.venv}
ENGINE_SITE=${ENGINE_SITE:-$WORK/engine-site}
VENV_EXCLUDE=${VENV_EXCLUDE:-jax jax-* jaxlib jaxlib-* jax_cuda13* jax_plugins cupy cupy_* cupyx onnxruntime onnxruntime-* onnx onnx-* onnx_ir* onnxscript* cv2 opencv_* tensorstore tensorstore-* tensorboard tensorboard-* tensorboard_* orbax* flax flax-* optax optax-* torch_geometric torch_geometric-* botorch botorch-* gpytorch gpytorch-* numpyro numpyro-*}
PY=${PY:-python3}
IMAGE_SITE=/opt/engine-site
export PYTHONPATH=${PYTHONPATH:-$WORK/plugin-site}

[ "${1:-}" = base ] && needed=("$VENV") || needed=("$VENV" "$ENGINE_SITE")
for p in "${needed[@]}"; do [ -d "$p" ] || { echo "$p is missing: run device.sh engine first (or set VENV / ENGINE_SITE)" >&2; exit 1; }; done
site=$(ls -d "$VENV"/lib/python3.*/site-packages)
py_minor=$(basename "$(dirname "$site")")

# What tar takes, as paths relative to / (tar -C /): those that exist here.
members=()
for p in $SYSTEM; do if [ -e "/$p" ] || [ -L "/$p" ]; then members+=("$p"); fi; done
for p in $ETC; do if [ -e "/etc/$p" ] || [ -L "/etc/$p" ]; then members+=("etc/$p"); fi; done
members+=("${VENV#/}")
# Left out: the driver's files (mounted from the host into every GPU container, as the hook of
# NVIDIA's toolkit would) and the exclusions of the environment. Bytecode caches stay: without
# them every container would compile vLLM's modules again at its start.
excludes=()
while read -r f; do if [ -n "$f" ]; then excludes+=(--exclude="${f#/}"); fi; done < <("$PY" -c 'from sparkrun_coldsnap.launch import gpu_devices; print("\n".join(gpu_devices.driver_files()))')
for e in $VENV_EXCLUDE; do excludes+=(--exclude="${site#/}/$e"); done

if [ "${1:-}" = sizes ]; then
  # du walks the names only (tar would read every byte): the left-out packages are counted apart.
  echo "taken from /: ${members[*]}; $ENGINE_SITE as $IMAGE_SITE"
  (cd / && du -sch "${members[@]}" "$ENGINE_SITE" 2>/dev/null | tail -n 1 | sed 's/total$/in all, the left-out below included/')
  (cd "$site" && for e in $VENV_EXCLUDE; do for m in $e; do [ -e "$m" ] && echo "$m"; done; done | xargs -r du -sch | tail -n 1 | sed 's/total$/left out of the environment/')
  exit 0
fi
if docker image inspect "$TAG" > /dev/null 2>&1; then
  echo "image $TAG already here: $(docker image inspect --format '{{.Id}}' "$TAG")"; exit 0
fi
BASE_TAG=${TAG%:*}-base:${TAG##*:}
BASE_PID=$WORK/image-base.pid
if [ "${1:-}" != base ] && [ -s "$BASE_PID" ]; then
  # A base import started earlier (in the background) is awaited rather than done twice.
  while kill -0 "$(cat "$BASE_PID")" 2>/dev/null; do sleep 1; done
fi

# `vllm` in the recipe's command is the engine's console script: it must start the torch
# environment's Python (pip writes the interpreter that installed it), or torch is not found.
if [ -e "$ENGINE_SITE/bin/vllm" ] && ! head -n1 "$ENGINE_SITE/bin/vllm" | grep -q "^#!$VENV/bin/python"; then
  echo "$ENGINE_SITE/bin/vllm starts $(head -n1 "$ENGINE_SITE/bin/vllm"), not $VENV's Python: install the engine with $VENV/bin/python3 -m pip (device.sh engine)" >&2
  exit 1
fi
# The directories every Linux program expects that the machine's parts above do not bring
# (docker makes /proc, /sys, /dev and /etc/hosts itself): /tmp for vLLM's sockets and temporary
# files, HOME, /run, /var/tmp.
skel=$(mktemp -d)
trap 'rm -rf "$skel"' EXIT
mkdir -p "$skel/tmp" "$skel/var/tmp" "$skel/root" "$skel/run" "$skel/home"
chmod 1777 "$skel/tmp" "$skel/var/tmp"
chmod 700 "$skel/root"
start=$(date +%s%N)
# The image's settings, the same whether it is imported whole or as a base with a layer on top.
changes=(--change "ENV PATH=$VENV/bin:$IMAGE_SITE/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
         --change "ENV PYTHONPATH=$IMAGE_SITE" --change "ENV VIRTUAL_ENV=$VENV"
         --change "WORKDIR /root" --change "CMD [\"$VENV/bin/python3\"]")
if [ "${1:-}" = base ]; then
  if docker image inspect "$BASE_TAG" > /dev/null 2>&1; then echo "image $BASE_TAG already here"; exit 0; fi
  echo $$ > "$BASE_PID"
  # The engine's directory, empty: the layer on top copies into it.
  mkdir -p "$skel$IMAGE_SITE"
  tar -C / -c --numeric-owner "${excludes[@]}" "${members[@]}" -C "$skel" tmp var/tmp root run home "${IMAGE_SITE#/}" \
    | docker import "${changes[@]}" --message "the GPU machine's $py_minor and $VENV, imported by benchmarks/gpu/engine_image.sh base" - "$BASE_TAG"
  echo "imported $BASE_TAG in $(( ($(date +%s%N) - start) / 1000000 )) ms"
  rm -f "$BASE_PID"
  exit 0
fi
if docker image inspect "$BASE_TAG" > /dev/null 2>&1; then
  # The engine's packages as one layer on the base: a container of it, the site copied in, committed.
  cid=$(docker create "$BASE_TAG")
  trap 'rm -rf "$skel"; docker rm "$cid" > /dev/null' EXIT
  docker cp "$ENGINE_SITE/." "$cid:$IMAGE_SITE"
  docker commit --message "$ENGINE_SITE as $IMAGE_SITE" "$cid" "$TAG" > /dev/null
  echo "layered $ENGINE_SITE on $BASE_TAG as $TAG in $(( ($(date +%s%N) - start) / 1000000 )) ms: $(docker image inspect --format '{{.Id}} {{.Size}} bytes' "$TAG")"
  docker run --rm --network none "$TAG" python3 -c "import sys; print(sys.version.split()[0], sys.prefix); import importlib.util as u; print('engine packages from', u.find_spec('${PROBE_MODULE:-vllm}').origin)"
  exit 0
fi
# One stream, two roots: the machine's files at their own paths, the engine's packages renamed
# to IMAGE_SITE (the transform applies to that root's members only: none of / starts so).
name=$(basename "$ENGINE_SITE")
tar -C / -c --numeric-owner "${excludes[@]}" --transform="s,^$name\\(/\\|\$\\),${IMAGE_SITE#/}\\1," \
    "${members[@]}" -C "$(dirname "$ENGINE_SITE")" "$name" -C "$skel" tmp var/tmp root run home \
  | docker import "${changes[@]}" \
      --message "the GPU machine's $py_minor, $VENV and $ENGINE_SITE, imported by benchmarks/gpu/engine_image.sh" \
      - "$TAG"
echo "imported $TAG in $(( ($(date +%s%N) - start) / 1000000 )) ms: $(docker image inspect --format '{{.Id}} {{.Size}} bytes' "$TAG")"
# The image runs its Python with the engine's packages ahead of the environment's.
docker run --rm --network none "$TAG" python3 -c "import sys; print(sys.version.split()[0], sys.prefix); import importlib.util as u; print('engine packages from', u.find_spec('${PROBE_MODULE:-vllm}').origin)"
