"""The libraries the benchmark and evaluation scripts under ``scripts/`` share, importable
without any ``sys.path`` edit: the training-benchmark harness (``lib.py``) and its
statistics and tables (``stats.py``), the monitors' cost clock, toggle and report
(``monitor_*.py``), the forecast evaluation's run set and tables (``forecast_set.py``,
``forecast_tables.py``), the fault drills' settings (``drills.py``) and the doc writers'
measured-block header (``docblock.py``). Not imported by the harness itself."""
