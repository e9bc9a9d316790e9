"""A real OCI registry on loopback (Debian's docker-registry, CNCF distribution 2.8),
optionally with basic auth and TLS, and a TCP proxy that cuts a transfer half-way."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

BINARY = shutil.which("docker-registry") or "/usr/bin/docker-registry"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-sha256", "-days", "2", "-keyout", str(key), "-out", str(cert),
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@dataclass
class Registry:
    root: Path
    user: str | None = None
    password: str | None = None
    tls: bool = False
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    cert: Path | None = None

    @property
    def host(self) -> str:
        return "127.0.0.1:%d" % self.port

    @property
    def url(self) -> str:
        return "%s://%s" % ("https" if self.tls else "http", self.host)

    @property
    def storage(self) -> Path:
        return self.root / "storage"

    def start(self) -> Registry:
        import bcrypt

        self.root.mkdir(parents=True, exist_ok=True)
        lines = [
            "version: 0.1",
            "log: {level: warn, accesslog: {disabled: true}}",
            "storage:",
            "  filesystem: {rootdirectory: %s}" % self.storage,
            "  delete: {enabled: true}",
            "  maintenance: {uploadpurging: {enabled: false}}",
            "http:",
            "  secret: test-secret",
            "  addr: %s" % self.host,
        ]
        if self.tls:
            self.cert, key = make_cert(self.root / "certs")
            lines += ["  tls:", "    certificate: %s" % self.cert, "    key: %s" % key]
        if self.user:
            htpasswd = self.root / "htpasswd"
            htpasswd.write_text("%s:%s\n" % (self.user, bcrypt.hashpw(self.password.encode(), bcrypt.gensalt(rounds=6)).decode()))
            lines += ["auth:", "  htpasswd: {realm: test-realm, path: %s}" % htpasswd]
        config = self.root / "config.yml"
        config.write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen([BINARY, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=open(self.root / "registry.log", "wb"))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                r = requests.get(self.url + "/v2/", timeout=1, verify=str(self.cert) if self.cert else True)
                if r.status_code in (200, 401):
                    return self
            except requests.RequestException:
                pass
            assert self.proc.poll() is None, (self.root / "registry.log").read_text()
            time.sleep(0.05)
        raise AssertionError("registry did not start: %s" % (self.root / "registry.log").read_text())

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def blob_file(self, digest: str) -> Path:
        hexd = digest.split(":")[1]
        return self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexd[:2] / hexd / "data"


class CutProxy:
    """Forwards TCP to *target*, but breaks the first connection that moves more than *limit* bytes in *direction*."""

    def __init__(self, target_port: int, *, limit: int, direction: str) -> None:
        self.target_port = target_port
        self.limit = limit
        self.direction = direction  # "up" (client to registry) or "down"
        self.cut = False
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def host(self) -> str:
        return "127.0.0.1:%d" % self.port

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            state = {"moved": 0, "dead": False}
            threading.Thread(target=self._pipe, args=(client, upstream, "up", state), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, "down", state), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: str, state: dict) -> None:
        try:
            while not state["dead"]:
                data = src.recv(65536)
                if not data:
                    break
                if direction == self.direction and not self.cut:
                    state["moved"] += len(data)
                    if state["moved"] > self.limit:
                        self.cut = True
                        state["dead"] = True
                        break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()
