"""The sandbox scoring runs model-written code in (HumanEval's grader): `code_execution.py` on the
host (consent, bubblewrap, limits, seccomp), `sandboxed_check.py` inside it (standard library
only). It lives beside the tasks because grading is each task's own (`TaskDefinition.grade`); a
task that needs it says so (`TaskDefinition.runs_model_code`)."""
