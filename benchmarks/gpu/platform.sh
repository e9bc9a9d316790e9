# pip's platform flags for wheels the GPU machine can install (x86_64, CPython 3.12, its glibc):
# sourced by the prepare_carry scripts.
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any --platform linux_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for x in 5 12 17 24 26 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${x}_x86_64"); done
