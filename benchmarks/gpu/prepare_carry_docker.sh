#!/usr/bin/env bash
# Prepare, on the CPU machine (Debian 12), the Docker that the GPU machine lacks: Debian's
# docker.io, containerd, runc and tini, plus every library their binaries link beyond glibc
# (found with ldd on the unpacked binaries, not guessed), as .deb files in pieces that travel.
#   bash benchmarks/gpu/prepare_carry_docker.sh [DIR]      (default .carry/gpu/docker, ignored by git)
# There `bash benchmarks/gpu/docker.sh stash` keeps each carried piece and `docker.sh up` unpacks
# them with `dpkg -x` (nothing is installed: the binaries run through wrappers that give them,
# and only them, LD_LIBRARY_PATH).
# Pieces: DIR/part0, DIR/part1, ... each under 58 MiB (PIECE_MIB), so one piece and the work tree fit in the
# 64 MiB a command carries; a .deb larger than that is split into .partNN files, joined there.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.carry/gpu/docker}
LIMIT=$((${PIECE_MIB:-58} * 1024 * 1024))
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
mkdir -p "$SCRATCH/debs" "$SCRATCH/root"
rm -rf "$OUT"
mkdir -p "$OUT"

# The four packages whose binaries the machine runs (docker-init is tini).
(cd "$SCRATCH/debs" && apt-get download -q docker.io containerd runc tini >/dev/null)
for f in "$SCRATCH"/debs/*.deb; do dpkg -x "$f" "$SCRATCH/root"; done

# What they link: ldd lists the whole closure. glibc's own libraries stay the machine's (its
# glibc 2.39 is newer than Debian 12's 2.36; libraries built for 2.36 run on it, not the other way).
GLIBC='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl)\.so'
mapfile -t BINS < <(find "$SCRATCH/root" -type f -perm -u+x -exec sh -c 'head -c4 "$1" | grep -q ELF && echo "$1"' _ {} \;)
echo "ELF binaries: ${#BINS[@]}"
libs=$(for b in "${BINS[@]}"; do ldd "$b" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1 " " $3}'; done | sort -u)
echo "$libs" | awk '{print "  links " $1}'
# Each library's Debian package (dpkg knows the /usr/lib or /lib spelling, whichever it installed).
pkgs=$(echo "$libs" | awk '{print $1, $2}' | grep -Ev "$GLIBC" | while read -r name path; do
  real=$(readlink -f "$path")
  for p in "$path" "$real" "/usr$path" "/usr$real" "${path#/usr}" "${real#/usr}"; do
    dpkg -S "$p" 2>/dev/null | head -1 | cut -d: -f1 && break
  done || echo "no package owns $name ($path)" >&2
done | sort -u)
echo "library packages: $(echo "$pkgs" | tr '\n' ' ')"
# shellcheck disable=SC2086  # one package name a word
(cd "$SCRATCH/debs" && apt-get download -q $pkgs >/dev/null)

# Every library the binaries link must now be in the carried set: unpack all, ask ldd again with
# only the unpacked libraries and glibc (the machine's) to go on.
for f in "$SCRATCH"/debs/*.deb; do dpkg -x "$f" "$SCRATCH/root"; done
LIBS="$SCRATCH/root/usr/lib/x86_64-linux-gnu:$SCRATCH/root/lib/x86_64-linux-gnu"
missing=$(for b in "${BINS[@]}"; do LD_LIBRARY_PATH=$LIBS ldd "$b" 2>/dev/null | awk '$2 == "=>" {print $1 " " $3}'; done \
  | grep -Ev "$GLIBC" | grep -v "$SCRATCH" | sort -u || true)
if [ -n "$missing" ]; then
  echo "libraries not in the carried packages:"; echo "$missing"; exit 1
fi

# Pieces of at most PIECE_MIB; a .deb above that is split (docker.sh joins NAME.partNN back).
# A new piece is started when the next file does not fit (a split one's pieces each get their own).
part=-1 used=$LIMIT
while read -r size f; do
  if [ "$size" -gt "$LIMIT" ]; then
    split -b "${PIECE_MIB:-58}m" -d "$f" "$SCRATCH/$(basename "$f").part"
    for p in "$SCRATCH/$(basename "$f")".part*; do
      part=$((part + 1)) used=$LIMIT; mkdir -p "$OUT/part$part"; mv "$p" "$OUT/part$part/"
    done
    continue
  fi
  if [ $((used + size)) -gt "$LIMIT" ]; then part=$((part + 1)) used=0; mkdir -p "$OUT/part$part"; fi
  cp "$f" "$OUT/part$part/"
  used=$((used + size))
done < <(stat -c '%s %n' "$SCRATCH"/debs/*.deb | sort -rn)
(cd "$SCRATCH/debs" && sha256sum ./*.deb) > "$OUT/part$part/SHA256SUMS"
ls -l "$OUT"/part*/
du -sh "$OUT"/part*
for b in usr/bin/docker usr/sbin/dockerd usr/bin/containerd usr/bin/containerd-shim-runc-v2 usr/sbin/runc usr/bin/tini-static usr/sbin/docker-proxy; do
  [ -x "$SCRATCH/root/$b" ] || { echo "the packages brought no $b" >&2; exit 1; }
done
"$SCRATCH/root/usr/sbin/dockerd" --version
