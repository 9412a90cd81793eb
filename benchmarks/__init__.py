"""The libraries the benchmark and evaluation scripts under ``scripts/`` share, beside the
``stabilize`` package and not part of it (``pip install .`` installs none of this): the
training-benchmark harness (``lib.py``) and its statistics and tables (``stats.py``), the
monitors' cost clock, toggle and report (``monitor_*.py``), the forecast evaluation's run
set, scoring and tables (``forecast_set.py``, ``forecast_score.py``, ``forecast_tables.py``),
the spike forecast's set and scoring (``spike_eval.py``, ``spike_reach.py``), the soak's
jobs (``soak.py``), the fault drills' settings (``drills.py``) and the doc writers'
measured-block header (``docblock.py``). The harness never imports it. A script reaches it
through ``scripts/_repo.py`` (the repository root on ``sys.path``), the tests through
pytest's ``pythonpath``: scripts/README.md."""
