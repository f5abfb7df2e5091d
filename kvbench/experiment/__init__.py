"""Experiments: the one place that composes a server, a trace, the replayer and the summary.

`run.replay_and_summarize` is one replay with its summary; `sweep.run_sweep` a grid of them (what
`kvbench sweep`, `kvbench paper --run` and the benchmark scripts use); `calibrate` finds a
method's threshold by replays. Lower layers never import this package.
"""
