"""The host a unit runs on: facts, paths, disk room, processes, the subprocess runner."""
