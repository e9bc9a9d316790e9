"""The CUDA checkpoint API as a tool: the helper process that calls it, its order over ranks and units, and the GPUs it sees."""
