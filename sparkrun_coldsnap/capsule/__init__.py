"""capsule."""
