"""The documents the plugin reads and writes: requests, the recipe block, receipts, settings, schemas."""
