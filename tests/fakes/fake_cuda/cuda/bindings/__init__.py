"""FAKE ``cuda.bindings`` (tests only): see ``driver.py``."""
