#!/usr/bin/env bash
# The two-host tests start their own sshd in each network namespace. Without a system sshd,
# Debian's openssh-server is unpacked (never installed) into .work/openssh: installing it
# would upgrade openssh-client to the package's exact version and leave a service behind.
# Idempotent; prints the sshd it found or made.
set -euo pipefail
cd "$(dirname "$0")/.."
for sshd in /usr/sbin/sshd "$PWD/.work/openssh/usr/sbin/sshd"; do
  if [ -x "$sshd" ]; then echo "$sshd"; exit 0; fi
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "==> unpacking openssh-server into .work/openssh for the two-host tests" >&2
# sshd, the sftp server scp talks to (OpenSSH >= 9 copies over SFTP) and libwrap, the one
# library sshd links that a minimal Debian lacks.
(cd "$work" && apt-get download -q openssh-server openssh-sftp-server libwrap0 >/dev/null 2>&1) \
  || { echo "apt-get download openssh-server failed: run apt-get update, or install openssh-server" >&2; exit 1; }
mkdir -p .work
rm -rf .work/openssh.partial
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" .work/openssh.partial; done
mv .work/openssh.partial .work/openssh
echo "$PWD/.work/openssh/usr/sbin/sshd"
