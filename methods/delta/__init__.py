"""Machinery the delta-correction methods share (GraphFlow, KVComm, KVCMAS): the correction
base class, anchor pools and their stored factors, the distance memo and its GPU kernel, and the
parameters they take (params.py, torch-free)."""
