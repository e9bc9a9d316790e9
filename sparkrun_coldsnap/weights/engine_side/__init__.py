"""Code that runs inside the engine's own processes and interpreter, not the plugin's.

Each module here imports only the standard library and what the engine already has
(torch): its directory is put on the engine's ``PYTHONPATH`` and the module is imported
by its bare name, in the engine's environment.
"""

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent
