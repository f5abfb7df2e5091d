"""Machinery PReCache's two variants share (`precache-prelr`, `precache-rebase`): agents as V-only
LoRA adapters over one base cache (base.py) and the parameters both take (params.py)."""
