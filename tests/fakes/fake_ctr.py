"""FAKE of containerd's ``ctr`` for the few calls the plugin makes, keeping containerd's rules.

State is a JSON file (``FAKE_CTR_STATE``) per socket path: ``{"tasks": {id: status},
"containers": [id, ...]}``, and every call is appended to ``FAKE_CTR_CALLS``. The rules the
plugin's cleanup depends on, as containerd 1.x behaved on the test machine:
- ``tasks delete`` of a RUNNING task fails (it must be stopped first); of a CREATED or
  STOPPED one it succeeds (the shim then exits);
- ``tasks kill`` of a CREATED task whose runc state never came to be fails with "not found";
  of a RUNNING one it stops it;
- ``containers delete`` of a container that still has a task fails.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    with open(os.environ["FAKE_CTR_CALLS"], "a") as f:
        f.write(" ".join(argv) + "\n")
    assert argv[0] == "-a" and argv[2] == "-n" and argv[3] == "moby", argv
    path = os.environ["FAKE_CTR_STATE"]
    with open(path) as f:
        everything = json.load(f)
    if argv[1] not in everything:
        print('ctr: failed to dial "%s": connection refused' % argv[1], file=sys.stderr)
        return 1
    state = everything[argv[1]]
    kind, verb, rest = argv[4], argv[5], argv[6:]
    tasks, containers = state["tasks"], state["containers"]
    code = 0
    if verb == "ls":
        print("\n".join(tasks if kind == "tasks" else containers))
    elif kind == "tasks" and verb == "delete":
        cid = rest[-1]
        if cid not in tasks:
            print("ctr: no such task", file=sys.stderr)
            code = 1
        elif tasks[cid] == "RUNNING":
            print("ctr: task must be stopped before deletion: running: failed precondition", file=sys.stderr)
            code = 1
        else:
            del tasks[cid]
    elif kind == "tasks" and verb == "kill":
        cid = rest[-1]
        if tasks.get(cid) != "RUNNING":
            print("ctr: no such container: not found", file=sys.stderr)
            code = 1
        else:
            tasks[cid] = "STOPPED"
    elif kind == "containers" and verb == "delete":
        cid = rest[-1]
        if cid in tasks:
            print("ctr: cannot delete a container with an existing task: failed precondition", file=sys.stderr)
            code = 1
        elif cid in containers:
            containers.remove(cid)
    else:
        print("ctr: FAKE does not know %s %s" % (kind, verb), file=sys.stderr)
        code = 2
    with open(path, "w") as f:
        json.dump(everything, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
