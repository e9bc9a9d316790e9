"""skopeo as the signature tests run it: its sigstore policy and registries.d, written per test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path


def locate() -> str | None:
    """The skopeo scripts/install_skopeo.sh provided, else one on PATH that has sigstore (1.10 or later)."""
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    for candidate in (os.environ.get("COLDSNAP_TEST_SKOPEO"), str(data / "sparkrun-coldsnap" / "skopeo" / "bin" / "skopeo"), shutil.which("skopeo")):
        if not candidate or not Path(candidate).is_file():
            continue
        out = subprocess.run([candidate, "--version"], capture_output=True, text=True, check=False).stdout.split()
        version = tuple(int(x) for x in out[-1].split(".")[:2]) if out and out[-1][:1].isdigit() else (0, 0)
        if version >= (1, 10):
            return candidate
    return None


class Skopeo:
    """Runs skopeo against one loopback registry, sigstore attachments on, under a policy that
    demands a sigstore signature by *public_key* for that registry (or accepts anything)."""

    def __init__(self, binary: str, registry_host: str, workdir: Path) -> None:
        self.binary = binary
        self.host = registry_host
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        registries_d = self.dir / "registries.d"
        registries_d.mkdir(exist_ok=True)
        (registries_d / "registry.yaml").write_text("docker:\n  %s:\n    use-sigstore-attachments: true\n" % registry_host)

    def policy(self, public_key: Path | None) -> Path:
        rule = {"type": "sigstoreSigned", "keyPath": str(public_key), "signedIdentity": {"type": "matchRepoDigestOrExact"}} if public_key else {"type": "insecureAcceptAnything"}
        path = self.dir / "policy.json"
        doc = {"default": [{"type": "reject"}], "transports": {"docker": {self.host: [rule]}, "dir": {"": [{"type": "insecureAcceptAnything"}]}}}
        path.write_text(json.dumps(doc))
        return path

    def run(self, *args: str, public_key: Path | None = None) -> subprocess.CompletedProcess:
        argv = [self.binary, "--policy", str(self.policy(public_key)), "--registries.d", str(self.dir / "registries.d"), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)

    def copy_to_dir(self, reference: str, target: Path, *, public_key: Path | None) -> subprocess.CompletedProcess:
        """``skopeo copy docker://REFERENCE dir:TARGET``: fails where the policy refuses the source."""
        return self.run("copy", "--src-tls-verify=false", "docker://" + reference, "dir:%s" % target, public_key=public_key)

    def copy_signed(self, source: str, target: str, key: Path, passphrase_file: Path) -> subprocess.CompletedProcess:
        """``skopeo copy`` between two repositories of the registry, signing the copy with a sigstore private key."""
        return self.run(
            "copy", "--src-tls-verify=false", "--dest-tls-verify=false", "--sign-by-sigstore-private-key", str(key), "--sign-passphrase-file", str(passphrase_file),
            "docker://" + source, "docker://" + target,
        )  # fmt: skip
