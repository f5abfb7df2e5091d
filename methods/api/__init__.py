"""The method API (floor 1 of `kvbench.methods`): what a method declares (`spec.py`: its name,
flags, parameters and where its implementation lives, importable without torch or vLLM), its
parameters (`params.py`), and the class an implementation subclasses (`base.py`: the hooks the
connector calls inside vLLM's workers)."""
