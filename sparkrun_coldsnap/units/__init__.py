"""A workload's launch units as the coordinator reaches them: typed steps (``steps``), their
wire (``framing``), the steps on this host (``local``), the host's server (``agent``) and the
coordinator's end (``remote``)."""
