#!/usr/bin/env bash
# skopeo with sigstore signing and verification, for the signature tests.
#
# Debian 13's skopeo (1.18) signs with --sign-by-sigstore-private-key and checks sigstoreSigned
# policies; Debian 12's (1.9.3) has sigstore switched off ("Debian-local change: sigstore
# disabled"). On Debian 12 the release-13 package and the C library it was built against are
# downloaded with apt into a private directory, nothing installed on the host, and a wrapper runs
# that skopeo with that library's loader. Prints the skopeo to use.
set -euo pipefail
if command -v skopeo >/dev/null 2>&1 && ! skopeo --version | grep -qE 'version 1\.[0-9]\.'; then
  command -v skopeo
  exit 0
fi
. /etc/os-release
if [ "${VERSION_CODENAME:-}" != "bookworm" ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-upgrade skopeo >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q --no-upgrade skopeo >/dev/null; }
  command -v skopeo
  exit 0
fi
# The libraries release 13's skopeo links besides the C library keep their sonames in
# release 12: this host's own packages of them.
need=(libgpgme11 libassuan0 libgpg-error0 libsqlite3-0)
if ! dpkg-query -W -f='${Status}\n' "${need[@]}" 2>/dev/null | grep -c "install ok installed" | grep -qx "${#need[@]}"; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-upgrade "${need[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q --no-upgrade "${need[@]}" >/dev/null; }
fi
dest="${XDG_DATA_HOME:-$HOME/.local/share}/sparkrun-coldsnap/skopeo"
if [ ! -x "$dest/bin/skopeo" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
  # The Debian archive this host already installs from, its release-13 suite.
  uri="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {print $2; exit}')"
  [ -n "$uri" ] || uri="$(awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' /etc/apt/sources.list 2>/dev/null | head -1)"
  [ -n "$uri" ] || { echo "no Debian archive in the apt sources: install skopeo 1.10 or later yourself" >&2; exit 1; }
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri trixie main" >"$work/sources.list"
  apt_opts=(-o "Dir::Etc::sourcelist=$work/sources.list" -o "Dir::Etc::sourceparts=-" -o "Dir::State::lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Sandbox::User=root")
  apt-get "${apt_opts[@]}" update -q >/dev/null
  (cd "$work" && apt-get "${apt_opts[@]}" download -q skopeo libc6/trixie >/dev/null)
  rm -rf "$dest.new" && mkdir -p "$dest.new/bin"
  dpkg-deb -x "$work"/skopeo_*.deb "$dest.new/skopeo"
  dpkg-deb -x "$work"/libc6_*.deb "$dest.new/libc"
  cat >"$dest.new/bin/skopeo" <<WRAP
#!/bin/sh
here="\$(dirname "\$(dirname "\$(readlink -f "\$0")")")"
lib="\$here/libc/usr/lib/x86_64-linux-gnu"
exec "\$lib/ld-linux-x86-64.so.2" --library-path "\$lib:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu" "\$here/skopeo/usr/bin/skopeo" "\$@"
WRAP
  chmod +x "$dest.new/bin/skopeo"
  rm -rf "$dest" && mv "$dest.new" "$dest"
fi
echo "$dest/bin/skopeo"
