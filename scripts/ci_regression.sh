#!/usr/bin/env bash
# kvbench's CI regression check (docs/ci.md): replay a small role-recall trace on a constructed
# role-family model (where reuse without correction answers the wrong question) with the method
# under development, compare it with a stored baseline, exit 1 on a latency, accuracy or output
# regression, and leave the markdown comparison for the CI to publish.
#
# The baseline directory ($KVBENCH_BASELINE) holds `trace.jsonl` (the trace both sides replay),
# `reference/` (a NonShared run: the outputs quality is measured against, and the latency the
# speed-up is measured against) and `$METHOD/`. A first run without it makes it (commit it) and
# exits 0.
set -euo pipefail

METHOD=${KVBENCH_METHOD:-kvcmas}
BASELINE=${KVBENCH_BASELINE:-ci-baseline}
OUT=${KVBENCH_OUT:-ci-candidate}
read -r -a KVBENCH <<< "${KVBENCH:-kvbench}"
# `kvbench gen-trace` arguments of the baseline's trace, and `kvbench replay` arguments of every run
# (3 warm-ups fill the method's state; 4 trajectories are measured).
read -r -a TRACE <<< "${KVBENCH_TRACE_ARGS:---task role-recall --model kvbench:roles-transferable --qps 0 --num-trajectories 7 --shared-tokens 1024}"
read -r -a REPLAY <<< "${KVBENCH_REPLAY_ARGS:---qps 0 --num-warmups 3 --prime-method-state}"
# Gates: the speed-up over NonShared measured inside each side (robust to a slower runner), the
# answers on reuse turns, and what the outputs lost against the reference.
read -r -a GATES <<< "${KVBENCH_GATES:---gate p50_ttft_ms:nonshared/$METHOD=-25% --gate task_accuracy_reuse=-0.1 --gate exact_match_rate=-0.1 --gate mean_token_f1=-0.05}"
# Running servers to use instead of starting them (e.g. one per method on a GPU box).
REFERENCE_URL=(); METHOD_URL=()
if [[ -n ${KVBENCH_REFERENCE_URL:-} ]]; then REFERENCE_URL=(--base-url "$KVBENCH_REFERENCE_URL"); fi
if [[ -n ${KVBENCH_METHOD_URL:-} ]]; then METHOD_URL=(--base-url "$KVBENCH_METHOD_URL"); fi

replay() {  # replay METHOD RESULT_DIR [ARGS...]: NonShared for `nonshared`, the method's server otherwise
  local method=$1 dir=$2; shift 2
  local urls=("${METHOD_URL[@]}")
  if [[ $method == nonshared ]]; then urls=("${REFERENCE_URL[@]}"); fi
  "${KVBENCH[@]}" replay --method "$method" --trace "$BASELINE/trace.jsonl" "${REPLAY[@]}" --result-dir "$dir" \
    "${urls[@]}" "$@"
}

if [[ ! -f $BASELINE/trace.jsonl || ! -d $BASELINE/reference || ! -d $BASELINE/$METHOD ]]; then
  rm -rf "$BASELINE/reference" "$BASELINE/$METHOD"
  mkdir -p "$BASELINE"
  "${KVBENCH[@]}" gen-trace -o "$BASELINE/trace.jsonl" "${TRACE[@]}"
  replay nonshared "$BASELINE/reference" --logprobs 20 --label nonshared
  replay "$METHOD" "$BASELINE/$METHOD" --reference "$BASELINE/reference"
  echo "kvbench: baseline made in $BASELINE (commit it); later runs compare against it"
  exit 0
fi
rm -rf "$OUT"
replay nonshared "$OUT/nonshared" --logprobs 20
replay "$METHOD" "$OUT/$METHOD" --reference "$BASELINE/reference"
# A failure whose bootstrap interval holds "no change" is within a noisy runner's noise: reported as
# such, not failed (KVBENCH_NOISE=fail fails it too).
"${KVBENCH[@]}" compare "$BASELINE" "$OUT" "${GATES[@]}" --noise "${KVBENCH_NOISE:-pass}" --markdown "$OUT/comparison.md"
