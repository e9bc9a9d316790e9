"""What encrypting a capsule's layers costs: the cipher's throughput, and a restore's unpacking
of the same layers with and without encryption, in the same run.

Synthetic process images shaped like the 8B vLLM capsule's (docs/benchmarks.md: 2.29 GB of
images, most of it zero pages, packed into 0.38 GB of layers; the weights stay outside the
capsule) are packed into a capsule in a scratch store, which is then encrypted for an RSA and an
EC P-256 recipient. Each sample, in alternating order: encrypt the capsule's layers (``encrypt
--as``), unpack the plaintext layers and the encrypted ones into memory staging (/dev/shm, where
restores unpack), and the cipher alone (encrypt and decrypt of every layer to nowhere). Layer
blobs are read from the page cache: what is measured is the CPU, not the disk. Medians.

    .venv/bin/python benchmarks/encryption_cost.py --images-gb 2.29 --random-gb 0.36 --samples 3
    .venv/bin/python benchmarks/encryption_cost.py --images-gb 2.2357 --layers-gb 0.3764 --samples 3   # the container capsule of 2026-12-07
    .venv/bin/python benchmarks/encryption_cost.py --images-gb 0.02 --random-gb 0.005 --samples 1   # a check that it runs

With ``--store`` and ``--ref`` the images are a real one-unit capsule's instead (unpacked from it
and packed again into the scratch store, which leaves the store as it was):

    .venv/bin/python benchmarks/encryption_cost.py --store ~/.local/share/sparkrun-coldsnap/store --ref qwen-8b:latest --samples 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec, rsa

from sparkrun_coldsnap.capsule import capsule_crypto, layer_crypto
from sparkrun_coldsnap.capsule.capsule import open_capsule
from sparkrun_coldsnap.capsule.pack import unpack_layer
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
from sparkrun_coldsnap.capsule.zstd_frames import default_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import make_capsule  # noqa: E402

MIB = 1 << 20


class _Nowhere:
    def write(self, data: bytes) -> int:
        return len(data)


def write_images(images: Path, images_bytes: int, random_bytes: int) -> None:
    """A unit's images: a little state, random pages (weights-like memory), and zero pages (KV cache)."""
    images.mkdir(parents=True)
    (images / "core-1.img").write_bytes(os.urandom(64 << 10))
    with open(images / "pages-1.img", "wb") as f:
        left = random_bytes
        while left > 0:
            f.write(os.urandom(min(left, 16 * MIB)))
            left -= 16 * MIB
    with open(images / "pages-2.img", "wb") as f:  # zeros with a random page every MiB, as a KV cache mostly is
        for _ in range(max(images_bytes - random_bytes, MIB) // MIB):
            f.write(os.urandom(4096) + bytes(MIB - 4096))


def real_images(store_path: Path | None, ref: str, work: Path) -> Path:
    """The process images of capsule *ref*'s one unit, unpacked under *work*."""
    store = CapsuleStore(store_path) if store_path else CapsuleStore(Path("~/.local/share/sparkrun-coldsnap/store").expanduser())
    cap = open_capsule(store, ref)
    if len(cap.config.units) != 1:
        raise SystemExit("capsule %s has %d units: the bench packs one" % (ref, len(cap.config.units)))
    for d in cap.layers:
        unpack_layer(store, d, work / "unpacked")
    return work / "unpacked" / cap.config.units[0].name


def timed(fn: Any) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def unpack_all(store: CapsuleStore, layers: list[Descriptor], dest: Path, keys: list[Any]) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    for d in layers:
        unpack_layer(store, d, dest, keys=keys)
    shutil.rmtree(dest, ignore_errors=True)


def cipher_only(store: CapsuleStore, plain: list[Descriptor], sealed: list[Descriptor], recipients: list[Any], keys: list[Any]) -> tuple[float, float]:
    """Seconds to encrypt the plaintext layers and to decrypt (with the HMAC check) the encrypted ones, writing nothing."""
    t = time.monotonic()
    for d in plain:
        with store.open_blob(d) as blob:
            layer_crypto.encrypt_stream(blob, d, _Nowhere(), recipients)  # type: ignore[arg-type]
    enc = time.monotonic() - t
    t = time.monotonic()
    for d in sealed:
        with store.open_blob(d) as blob:
            layer_crypto.decrypt_stream(blob, d, _Nowhere(), keys)  # type: ignore[arg-type]
    return enc, time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images-gb", type=float, default=2.29, help="process images of the capsule's one unit (the 8B capsule: 2.29)")
    ap.add_argument("--random-gb", type=float, default=0.36, help="of which incompressible (the rest mostly zero pages)")
    ap.add_argument("--layers-gb", type=float, default=None, help="instead of --random-gb: the packed layers' size to aim at (the 8B container capsule: 0.3764)")
    ap.add_argument("--store", type=Path, default=None, help="with --ref: take the images of this store's capsule")
    ap.add_argument("--ref", default=None, help="a one-unit capsule in --store whose images are measured")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None, help="scratch directory (default: /dev/shm)")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the result here")
    args = ap.parse_args()
    if args.layers_gb is not None:
        # A zero-page MiB packs to about its one random page: 1/256 of it.
        args.random_gb = (args.layers_gb - args.images_gb / 256) / (1 - 1 / 256)
        if not 0 < args.random_gb <= args.images_gb:
            raise SystemExit("--layers-gb %s cannot come from --images-gb %s of images: give between %.4f and %s" % (args.layers_gb, args.images_gb, args.images_gb / 256, args.images_gb))
    work = Path(tempfile.mkdtemp(prefix="encryption-cost-", dir=args.work))
    try:
        images = real_images(args.store, args.ref, work) if args.ref else work / "images"
        if not args.ref:
            write_images(images, int(args.images_gb * 1e9), int(args.random_gb * 1e9))
        image_bytes = sum(p.stat().st_size for p in images.rglob("*") if p.is_file())
        store = CapsuleStore(work / "store").init()
        plain_cap = make_capsule(store, work, "bench", images=images)
        shutil.rmtree(images)
        rsa_key, ec_key = rsa.generate_private_key(65537, 3072), ec.generate_private_key(ec.SECP256R1())
        recipients = [rsa_key.public_key(), ec_key.public_key()]
        keys: list[Any] = [ec_key]
        plain = plain_cap.layers
        layer_bytes = sum(d.size for d in plain)
        times: dict[str, list[float]] = {"encrypt capsule": [], "unpack plain": [], "unpack encrypted": [], "cipher encrypt": [], "cipher decrypt": []}
        sealed: list[Descriptor] = []
        for i in range(args.samples):
            times["encrypt capsule"].append(timed(lambda: capsule_crypto.encrypt(store, "bench:latest", recipients, target="bench:enc")))
            sealed = open_capsule(store, "bench:enc").layers
            order = [("unpack plain", plain, []), ("unpack encrypted", sealed, keys)]
            for name, layers, k in order if i % 2 == 0 else order[::-1]:
                times[name].append(timed(lambda layers=layers, k=k: unpack_all(store, layers, work / "dest", k)))
            enc, dec = cipher_only(store, plain, sealed, recipients, keys)
            times["cipher encrypt"].append(enc)
            times["cipher decrypt"].append(dec)
            print("sample %d/%d  %s" % (i + 1, args.samples, "  ".join("%s %.3f s" % (k, v[-1]) for k, v in times.items())), flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "image_bytes": image_bytes, "layer_bytes": layer_bytes, "layers": len(plain), "samples": args.samples, "threads": default_threads(), "cpus": os.cpu_count(),
            "median_seconds": {k: round(v, 4) for k, v in med.items()},
            "layer_gb_per_s": {k: round(layer_bytes / v / 1e9, 3) for k, v in med.items() if v > 0},
            "unpack_added_seconds": round(med["unpack encrypted"] - med["unpack plain"], 4),
            "unpack_added_fraction": round(med["unpack encrypted"] / med["unpack plain"] - 1, 4) if med["unpack plain"] > 0 else None,
            "unpack_ratio": round(med["unpack encrypted"] / med["unpack plain"], 4) if med["unpack plain"] > 0 else None,
            "layer_mb_per_s": {k: round(layer_bytes / v / 1e6, 1) for k, v in med.items() if v > 0},
            "all_seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        }  # fmt: skip
        print("%.2f GB of images in %.3f GB of layers: encrypt %.2f GB/s, decrypt %.2f GB/s (cipher alone); a restore's unpacking %.3f s plain, %.3f s encrypted (+%.3f s, x%.3f)" % (
            image_bytes / 1e9, layer_bytes / 1e9, result["layer_gb_per_s"]["cipher encrypt"], result["layer_gb_per_s"]["cipher decrypt"], med["unpack plain"], med["unpack encrypted"],
            result["unpack_added_seconds"], result["unpack_ratio"] or 0))  # fmt: skip
        print(json.dumps(result))
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
