"""Unpacking a capsule's layers: one zstd frame (as capsules were packed before frames)
against independent frames decompressed and written several at once.

Takes a capsule from a store, unpacks it once to get its process images, packs them both
ways into a scratch store beside it, then alternates unpacking each into memory staging
(/dev/shm, where restores unpack) and prints the medians. The blobs are read from the page
cache (the step measured is the decompression and the writes, not the disk).

    sudo .venv/bin/python benchmarks/unpack_bench.py --store .work/demo-store --ref tiny-vllm-cpu:latest --samples 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import zstandard

from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.capsule import open_capsule
from sparkrun_coldsnap.capsule.pack import ZSTD_LEVEL, pack_unit, unpack_layer
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
from sparkrun_coldsnap.capsule.zstd_frames import default_threads


def one_frame_layers(images: Path, unit: str, store: CapsuleStore, scratch: Path) -> list[Descriptor]:
    """The unit's images as one tar in one zstd frame per part, the way capsules were packed before."""
    out = []
    pages = sorted(p for p in images.iterdir() if p.is_file() and p.name.startswith("pages-"))
    state = sorted(p for p in images.rglob("*") if p.is_file() and p not in set(pages))
    for part, files in (("state", state), ("pages", pages)):
        blob = scratch / ("%s-%s.tar.zst" % (unit, part))
        with open(blob, "wb") as raw, zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1).stream_writer(raw, closefd=False) as z, tarfile.open(fileobj=z, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for p in files:
                tar.add(str(p), arcname="%s/%s" % (unit, p.relative_to(images).as_posix()))
        out.append(store.put_bytes(blob.read_bytes(), media.LAYER_TAR_ZSTD))
        blob.unlink()
    return out


def timed_unpack(store: CapsuleStore, layers: list[Descriptor], dest: Path) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    t = time.monotonic()
    for d in layers:
        unpack_layer(store, d, dest)
    seconds = time.monotonic() - t
    shutil.rmtree(dest, ignore_errors=True)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--samples", type=int, default=5)
    args = ap.parse_args()
    source = CapsuleStore(args.store)
    cap = open_capsule(source, args.ref)
    work = Path(tempfile.mkdtemp(prefix="unpack-bench-", dir="/dev/shm"))
    try:
        unpacked = work / "images"
        for d in cap.layers:
            unpack_layer(source, d, unpacked)
        units = sorted(p.name for p in unpacked.iterdir())
        scratch = CapsuleStore(work / "store").init()
        staging = work / "store" / "staging-bench"
        staging.mkdir()
        framed: list[Descriptor] = []
        single: list[Descriptor] = []
        t = time.monotonic()
        for unit in units:
            for layer in pack_unit(unpacked / unit, unit, staging):
                scratch.publish_blob_file(layer.path, layer.digest, layer.size)
                framed.append(layer.descriptor())
        pack_seconds = time.monotonic() - t
        t = time.monotonic()
        for unit in units:
            single += one_frame_layers(unpacked / unit, unit, scratch, staging)
        pack_single_seconds = time.monotonic() - t  # into memory and then the store: a little more than packing alone
        image_bytes = sum(p.stat().st_size for p in unpacked.rglob("*") if p.is_file())
        shutil.rmtree(unpacked)
        times: dict[str, list[float]] = {"one frame": [], "frames": []}
        for i in range(args.samples):
            for name, layers in (("one frame", single), ("frames", framed)) if i % 2 == 0 else (("frames", framed), ("one frame", single)):
                times[name].append(timed_unpack(scratch, layers, work / "dest"))
                print("sample %d/%d  %-9s  %.2f s" % (i + 1, args.samples, name, times[name][-1]), flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        print("packed in %.2f s as frames, %.2f s as one frame" % (pack_seconds, pack_single_seconds))
        print("unpacked %.2f GB of images, %d threads: one frame %.2f s (%.2f GB/s), frames %.2f s (%.2f GB/s), %.2fx" % (
            image_bytes / 1e9, default_threads(), med["one frame"], image_bytes / med["one frame"] / 1e9, med["frames"], image_bytes / med["frames"] / 1e9,
            med["one frame"] / med["frames"]))  # fmt: skip
        print(json.dumps({
            "capsule": args.ref, "image_bytes": image_bytes, "threads": default_threads(), "cpus": os.cpu_count(), "pack_seconds": {"frames": round(pack_seconds, 3), "one frame": round(pack_single_seconds, 3)},
            "layer_bytes": {"one frame": sum(d.size for d in single), "frames": sum(d.size for d in framed)}, "samples": times,
            "median_seconds": {k: round(v, 3) for k, v in med.items()},
        }))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
