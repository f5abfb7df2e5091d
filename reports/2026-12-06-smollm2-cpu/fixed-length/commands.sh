# The paper's fixed output lengths on role-lookup (every turn 32 tokens, past end of sequence),
# NonShared against FullShared, reference-anchored. From the repository root, eager servers:
set -e
export KVBENCH_ENFORCE_EAGER=1
kvbench gen-trace -o trace.jsonl --model kvbench:smollm2-135m --task role-lookup --num-trajectories 8 --shared-tokens 2048 --qps 0 --seed 11 --ignore-eos
kvbench replay --trace trace.jsonl --model kvbench:smollm2-135m --method nonshared --qps 0 --result-dir nonshared --logprobs 20
kvbench replay --trace trace.jsonl --model kvbench:smollm2-135m --method fullshared --qps 0 --result-dir fullshared --reference nonshared
kvbench report nonshared fullshared -o report
