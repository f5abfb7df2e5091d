"""kvbench.tracegen: controlled multi-agent workflow traces (the kvbench-trace format)."""
