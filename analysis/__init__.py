"""kvbench.analysis: tables, plots and run comparison from recorded results."""
