"""kvbench.methods: cross-agent KV sharing methods running inside vLLM workers."""
