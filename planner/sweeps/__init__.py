"""Sweeps: plan many (model, cluster, global batch, sequence length) points into one results file.

- `spec`: the sweep file and flags -> validated points;
- `results`: the streamed, resumable results file (CSV or JSON lines);
- `executors`: planning points in this process, in local worker processes, or as Ray tasks;
- `runner`: `sweep()`, which ties them together with resume, signals and a progress bar.
"""
