"""kvbench.replay: fire traces at vLLM servers and record every request."""
