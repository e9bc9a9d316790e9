"""Launch units: engine process trees on a host, their environments and ports."""
