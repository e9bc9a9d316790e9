"""CRIU as a tool: dump and restore a process tree, in namespaces of its own or nested, and rework its images (page fill, zero pages)."""
