"""Set-up of the embedded default: CRIU, engine environments, the tiny model."""
