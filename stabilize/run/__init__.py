"""A run without Lightning: its typed config (``config.py``), the checks before anything is
written (``preflight.py``), where the process sits in a launch (``env.py``), the run dir's
claim, lock and resume (``rundir.py``), the final summary (``summary.py``) and the console's
quieting of third-party noise (``quiet.py``). ``stabilize-plan`` and ``stabilize-train``'s
config errors need none of Lightning, so none of it is imported here."""
