"""sparkrun-coldsnap: capture an initialized inference workload once, restore it in seconds."""

__version__ = "0.1.0"
