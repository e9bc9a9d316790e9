"""Admission that knows the workload a run replaces: what it holds is freed before the restore."""

from __future__ import annotations

import uuid


def test_what_the_replaced_workload_holds_does_not_refuse_a_restore_into_the_host_namespaces(tmp_path):
    """GPU drivers restore into the host's namespaces: the captured PIDs and shared files must be
    free, unless the workload holding them is the one the run replaces (stopped before the restore)."""
    import subprocess
    import sys

    from sparkrun_coldsnap.criu import tree as criu_tree
    from sparkrun_coldsnap.documents.unit_image import SharedFile, UnitImage

    shm = tmp_path / ("psm_" + uuid.uuid4().hex[:8])
    shm.write_bytes(b"\0" * 64)
    holder = subprocess.Popen([sys.executable, "-c", "import sys,time; f=open(sys.argv[1]); print('up', flush=True); time.sleep(60)", str(shm)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        unit = UnitImage(
            name="solo", host="localhost", driver="n610", root_pid=holder.pid, pids=(holder.pid,), pid_namespace=False,
            shared_files=(SharedFile(path=str(shm), size=64, mode=0o600, stored="shm/0"),),
        )  # fmt: skip
        problems = criu_tree.restore_problems(unit)
        assert len(problems) == 2 and "captured PID %d is taken" % holder.pid in problems[0] and "is in use by pid %d" % holder.pid in problems[1]
        assert criu_tree.restore_problems(unit, replacing=frozenset({holder.pid})) == []
    finally:
        holder.kill()
        holder.wait()
