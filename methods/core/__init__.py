"""The core every method and the connector compute with (floor 0 of `kvbench.methods`): the
segment store and its codecs, vLLM's paged cache layouts, the layer-by-layer partial forward,
RoPE re-rotation, LoRA value terms, attention influence, and the errors they raise. Torch only,
no vLLM; nothing here imports the floors above it (docs/architecture.md)."""
