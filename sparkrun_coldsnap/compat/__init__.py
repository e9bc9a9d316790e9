"""Compatibility: the fingerprint a capsule records, and admission before a restore."""
