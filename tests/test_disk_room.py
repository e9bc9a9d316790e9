"""The room checks of a capture: before the dump, the estimate from smaps_rollup (and what the
CUDA checkpoint moves into host memory) and the one-line refusal; before the engine starts, the
native weight payload against the room where payloads go (a small tmpfs, for real)."""

from __future__ import annotations

from test_fault_store import tmpfs

from sparkrun_coldsnap.host import disk_room
from sparkrun_coldsnap.weights import model_files, native_payload

ROLLUP = """55ba5cfe2000-7ffd9bd36000 ---p 00000000 00:00 0                          [rollup]
Rss:              900000 kB
Pss:              700000 kB
Pss_Anon:         400000 kB
Pss_File:         200000 kB
Pss_Shmem:        100000 kB
Anonymous:        400000 kB
Swap:               5000 kB
SwapPss:            2000 kB
"""


def test_the_estimate_counts_anonymous_shared_memory_and_swapped_pages(tmp_path):
    for pid in (10, 11):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "smaps_rollup").write_text(ROLLUP)
    # File pages are not written by a dump; a process gone meanwhile counts nothing.
    assert disk_room.dump_estimate([10, 11, 12], proc=tmp_path) == 2 * (400000 + 100000 + 2000) * 1024


def test_shortfall_names_the_place_and_the_numbers(tmp_path):
    assert disk_room.shortfall(1 << 20, [(tmp_path / "not" / "yet", 2.0, "the images")]) is None
    line = disk_room.shortfall(10**18, [(tmp_path, 1.0, "fine"), (tmp_path / "later", 2.0, "the images")])
    assert line.startswith("not enough disk space for the capture: fine needs about 1000000000.0 GB in %s, " % tmp_path)
    assert line.endswith("GB are free there")


def test_the_native_payload_is_refused_before_the_engine_starts_where_the_weights_cannot_fit(tmp_path, use_settings):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "model-00001.safetensors").write_bytes(b"w" * (3 << 20))
    (model / "sub" / "extra.bin").write_bytes(b"w" * (1 << 20))
    (model / "tokenizer.json").write_bytes(b"t" * (5 << 20))  # not weights
    (model / ".payload.safetensors").write_bytes(b"h" * (7 << 20))  # hidden: not the model's
    assert model_files.weight_bytes(model) == 4 << 20 and model_files.weight_bytes(tmp_path / "absent") == 0
    with tmpfs(tmp_path / "small", "2m") as mnt:
        use_settings(home=mnt / "home")
        line = native_payload.room_problem(model)
        assert line is not None and line.startswith("not enough disk space for the capture: the native weight payload (the model's weights as loaded) needs about 0.0 GB in %s" % native_payload.root()), line
        assert native_payload.room_problem(None) is None
    use_settings(home=tmp_path / "home")
    assert native_payload.room_problem(model) is None
