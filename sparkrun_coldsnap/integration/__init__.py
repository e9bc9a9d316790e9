"""Everything that touches sparkrun (pinned at 0.4.2)."""
