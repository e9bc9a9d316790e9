"""The one worker extension the plugin gives vLLM (``--worker-extension-cls
coldsnap_worker.ColdsnapWorker``; vLLM takes a single class): the native weight payload and
the communicators around the CUDA checkpoint, each in its own module."""

from __future__ import annotations

from coldsnap_communicators import Communicators
from coldsnap_native_weights import NativeWeights


class ColdsnapWorker(NativeWeights, Communicators):
    """Mixed into vLLM's worker class."""
