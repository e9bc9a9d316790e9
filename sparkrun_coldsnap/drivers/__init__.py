"""Snapshot drivers: capture and restore of a launch unit's process tree (CRIU, CUDA checkpoint, templates)."""
