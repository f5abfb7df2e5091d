#!/usr/bin/env bash
# kvbench's tests, fastest first: lint and types, the unit tier (no vLLM engine, no model
# build; about 10 minutes on 2 cores), then the engine tier (real vLLM servers on the embedded model).
# Extra arguments go to both pytest runs (e.g. -x, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVBENCH_VENV:-.venv}
"$venv/bin/ruff" check .
"$venv/bin/mypy" --no-error-summary
"$venv/bin/python" -m pytest tests -m "not engine" "$@"
# Engine tests check behaviour, not speed: their servers run eager (no torch.compile warm-up),
# which starts each in about a quarter of the time (kvbench/server/config.py, ServerConfig.enforce_eager).
KVBENCH_ENFORCE_EAGER=${KVBENCH_ENFORCE_EAGER:-1} "$venv/bin/python" -m pytest tests -m engine "$@"
