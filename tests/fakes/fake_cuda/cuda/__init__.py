"""FAKE ``cuda`` package (tests only): see ``cuda/bindings/driver.py``."""
