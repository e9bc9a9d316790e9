"""Start an engine module, stopping after its imports until told to go on (the n580 boundary).

    python template_launcher.py MODULE PRELOAD[,PRELOAD...] -- ENGINE ARGS...

Imports PRELOAD (the engine's heavy modules: torch, transformers, the engine
itself), prints a ready line, then waits for SIGUSR1 without having touched
CUDA. A capture dumps the process at this point; after a restore (or right
after the capture) SIGUSR1 lets it run MODULE as ``__main__`` with ENGINE ARGS,
exactly as ``python -m MODULE ENGINE ARGS...`` would have.

Standalone on purpose: it runs in the engine's environment, which does not
have the plugin installed.
"""

import importlib
import os
import runpy
import signal
import sys
import time

READY = "coldsnap-template: ready"


def main() -> None:
    if len(sys.argv) < 4 or "--" not in sys.argv:
        sys.exit("usage: template_launcher.py MODULE PRELOAD[,PRELOAD...] -- ARGS...")
    module, preload = sys.argv[1], [m for m in sys.argv[2].split(",") if m]
    args = sys.argv[sys.argv.index("--") + 1 :]
    t = time.monotonic()
    for name in preload:
        importlib.import_module(name)
    # Block first so a SIGUSR1 sent at any moment after the ready line is kept.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    print("%s pid=%d after %.1f s" % (READY, os.getpid(), time.monotonic() - t), flush=True)
    signal.sigwait({signal.SIGUSR1})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    print("coldsnap-template: continuing into %s" % module, flush=True)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
