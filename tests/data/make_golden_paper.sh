#!/usr/bin/env bash
# Rebuild tests/data/golden-paper/: `kvbench paper NAME --run` sweeps against kvbench's stub server
# (tests/helpers/kvbench_stub_server.py: every server kvbench starts is the stub, answering each
# method's worker RPCs), small grids, two trajectories per cell, the embedded model's tokenizer.
# Tables 6 and 8 replay tests/data/mmlu-sample.parquet's items (the stub never answers them).
# The figures are the stub's, never a method's: they exist so every `kvbench paper` renderer runs
# in the unit tier. Only what the renderers read is kept (config.json, summary.json, requests.parquet).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=tests/data/golden-paper
rm -rf "$out" && mkdir -p "$out"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
kvbench() {
  PYTHONPATH=tests/helpers STUB_TOKEN_DELAY=0 .venv/bin/python tests/helpers/kvbench_stub_server.py "$@" \
    >"$scratch/log" 2>&1 || { cat "$scratch/log"; exit 1; }
}
common=(--num-trajectories 2 --num-warmups 0)
kvbench paper table7 --run -o "$scratch/table7" "${common[@]}" --shared-tokens 2048,8192 --qps 0,8 \
  --methods nonshared,fullshared,cacheblend,kvcmas,kvcmas-nonchained
kvbench paper table10 --run -o "$scratch/table10" "${common[@]}" --qps 0,8 --methods nonshared,kvcmas --shared-tokens 2048
kvbench paper table12 --run -o "$scratch/table11" "${common[@]}" --shared-tokens 2048,8192 --methods nonshared,fullshared,kvcmas
kvbench paper table13 --run -o "$scratch/table13" "${common[@]}" --shared-tokens 2048
kvbench paper fig13 --run -o "$scratch/fig13" "${common[@]}" --shared-tokens 2048 --method-param kvcmas:r_c=16,32 \
  --method-param kvcmas:r_delta=16,32
kvbench paper table14 --run -o "$scratch/table14" "${common[@]}" --shared-tokens 2048 --agents 2,4 --methods nonshared,kvcmas
kvbench paper table15 --run -o "$scratch/table15" "${common[@]}" --shared-tokens 2048 --rounds 2,3 --methods nonshared,kvcmas
mmlu=(--data mmlu=tests/data/mmlu-sample.parquet --limit 2 --num-warmups 0)
kvbench paper table6 --run -o "$scratch/table6" "${mmlu[@]}" --method-param kvcmas:tau=0.1,0.3
kvbench paper table8 --run -o "$scratch/table8" "${mmlu[@]}"
for name in table7 table10 table11 table13 fig13 table14 table15 table6 table8; do
  mkdir -p "$out/$name"
  (cd "$scratch/$name" && find . -path '*/runs/*' \( -name config.json -o -name summary.json -o -name requests.parquet \) \
    -print0 | tar --null -cf - -T -) | tar -xf - -C "$out/$name"
done
# no machine's paths in tracked files: the checkout's and the scratch folder's become placeholders
.venv/bin/python - "$out" "$PWD" "$scratch" <<'PY'
import pathlib, sys
out, checkout, scratch = sys.argv[1:]
for path in [*pathlib.Path(out).rglob("config.json"), *pathlib.Path(out).rglob("summary.json")]:
    path.write_text(path.read_text().replace(scratch, "<scratch>").replace(checkout, "<checkout>"))
PY
du -sh "$out"
