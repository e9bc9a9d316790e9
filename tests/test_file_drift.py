"""Files a captured tree depends on: recorded from a real process, and a changed one named.

A copy of a real shared library is loaded into a real process; rewriting its build-ID
in place (same size, as a rebuilt library of the same size would be) is what CRIU
refuses at restore, and what admission must see first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from sparkrun_coldsnap.host import file_drift

SYSTEM_LIB = Path("/usr/lib/x86_64-linux-gnu/libz.so.1")


def rewrite_build_id(path: Path) -> None:
    """Flip the first byte of *path*'s GNU build-ID note in place (size unchanged)."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for segment in elf.iter_segments():
            if segment.header.p_type == "PT_NOTE":
                for note in segment.iter_notes():
                    if note["n_type"] == "NT_GNU_BUILD_ID":
                        offset = note["n_descdata_offset"] if "n_descdata_offset" in note else note["n_offset"] + 12 + ((note["n_namesz"] + 3) & ~3)
                        break
                else:
                    continue
                break
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def process_with_a_library(tmp_path):
    """A real process that maps a private copy of a system library (and keeps a file open)."""
    lib = tmp_path / "libcopy.so.1"
    shutil.copy2(SYSTEM_LIB.resolve(), lib)
    held = tmp_path / "held.txt"
    held.write_text("state\n")
    code = "import ctypes, sys, time; ctypes.CDLL(sys.argv[1]); f = open(sys.argv[2]); print('ready', flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(lib), str(held)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc, lib, held
    proc.kill()
    proc.wait()


@pytest.mark.skipif(not SYSTEM_LIB.exists(), reason="needs Debian's zlib at its usual path")
def test_a_library_rewritten_since_capture_is_named_with_its_build_id(process_with_a_library):
    proc, lib, held = process_with_a_library
    recorded = {f.path: f for f in file_drift.record([proc.pid])}
    copy = recorded[str(lib)]
    assert copy.build_id == file_drift.build_id(str(SYSTEM_LIB.resolve())) and copy.sha256 and copy.package is None
    assert recorded[str(held)].build_id is None and recorded[str(held)].sha256
    assert file_drift.differences(recorded.values()) == []

    rewrite_build_id(lib)
    os.utime(lib, ns=(time.time_ns(), time.time_ns()))
    (drifted,) = file_drift.differences(recorded.values())
    assert drifted.startswith(str(lib)) and "build-ID" in drifted and copy.build_id in drifted


def test_a_file_of_another_size_or_gone_is_named(process_with_a_library):
    proc, lib, held = process_with_a_library
    recorded = file_drift.record([proc.pid])
    held.write_text("longer state now\n")
    lib.unlink()
    drifted = file_drift.differences(recorded)
    assert "%s (missing)" % lib in drifted
    assert any(d.startswith(str(held)) and "size 17, captured 6" in d for d in drifted)


def test_the_same_bytes_touched_again_are_not_drift(process_with_a_library):
    proc, lib, _ = process_with_a_library
    recorded = file_drift.record([proc.pid])
    os.utime(lib, ns=(time.time_ns(), time.time_ns()))  # as a reinstall of the same build would
    assert file_drift.differences(recorded) == []


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="needs a host whose packages dpkg can name")
def test_a_packaged_file_is_recorded_by_its_package_not_its_bytes(process_with_a_library):
    proc, _, _ = process_with_a_library
    libc = next(f for f in file_drift.record([proc.pid]) if f.path.endswith("/libc.so.6"))
    assert libc.package and libc.package.startswith("libc6") and "=" in libc.package and libc.sha256 is None


def test_a_refusal_names_the_first_files_and_counts_the_rest():
    line = file_drift.refusal(["/a (missing)", "/b (missing)", "/c (missing)", "/d (missing)", "/e (missing)"])
    assert "/a (missing); /b (missing); /c (missing) and 2 more" in line
    assert "recapture (sparkrun coldsnap capture), or set coldsnap.on_incompatible: vanilla" in line
