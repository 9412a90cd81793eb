"""The fault drills' monitor settings, shared by ``scripts/drills.py`` (the drill table of
docs/rollback.md) and the fault tests (tests/test_stability.py, tests/test_replay.py)."""

# Snapshots every 2 steps and a grad-spike verdict that rolls back only on a 100x jump
# (never on the tiny model's ordinary steps).
DRILL_MONITORS = [
    "rollback.snapshot_every=2",
    "rollback.durable_every=0",
    "monitor.grad_spike.warmup=6",
    "monitor.grad_spike.window=20",
    "monitor.grad_spike.min_ratio=100",
    "monitor.grad_spike.action=rollback",
    "monitor.loss_spike.enabled=false",
]
