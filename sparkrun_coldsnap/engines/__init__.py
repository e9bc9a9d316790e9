"""Engine adapters: how to launch, validate, release and hydrate each inference engine."""
