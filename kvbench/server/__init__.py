"""vLLM's process lifecycle, for every layer that starts or talks to a server: what a server is
started with (`config.py`), starting, health-checking and stopping it (`lifecycle.py`), the typed
client of kvbench's worker RPCs (`worker_rpc.py`) and the errors they raise (`errors.py`)."""
