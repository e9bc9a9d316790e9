"""Moving a workload between active, sleeping, warm and hibernated.

``states`` is the state machine (the moves allowed), ``records`` the per-workload record on
disk and its lock, ``settle`` runs a transition and settles one a crash interrupted,
``hibernate`` captures a live workload, ``warm`` prepares a restore ahead, ``verbs`` tells each
verb's story, ``status`` reports, ``run_hooks`` is what ``sparkrun run`` asks of it.
"""
