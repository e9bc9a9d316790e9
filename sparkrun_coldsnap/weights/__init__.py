"""Model weights: which files, their digests, the native payload, the page cache, engine-side readers."""
