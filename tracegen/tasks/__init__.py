"""Tasks: workloads whose answers are known, one module each (`TASK`: its data, its prompts, how
an answer is read and how it is graded). `gen-trace --task NAME`, `kvbench score` and the paper
tables look tasks up by name in `registry.py`; a new task is one module here and its test
(docs/running.md, "Adding a task")."""
