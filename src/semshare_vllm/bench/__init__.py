"""``semshare-bench``: time-to-first-token, hit rate, miss cost and answer fidelity of a vLLM
server with the SemShare connector, on workloads built from real text.

``workloads.py`` (what is sent: donors and targets per group), ``client.py`` (one OpenAI
endpoint: streaming completions, the connector's counters), ``measure.py`` (each target cold and
through the connector), ``report.py`` (summary, console table, JSON, plots), ``cli.py`` (the
command).
"""
