"""Capsules: OCI artifacts in a local OCI image layout, packed and verified."""
