"""Every built-in method's spec, one module each (`SPEC`: name, summary, flags, parameters, and the
dotted path of its implementation). Torch-free: the registry (kvbench.methods.registry) imports
them all to list the methods; only a worker imports an implementation."""
