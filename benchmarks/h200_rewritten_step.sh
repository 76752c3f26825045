#!/usr/bin/env bash
# The H200 runs behind docs/results.md's first rewritten-step tables, in parts that each fit one 10-minute call.
# Usage: PYTHONPATH=. benchmarks/h200_rewritten_step.sh PART [OUT_DIR]
#   PART: resnet-batches | verify-resnet-plans | resnet-vs-compile | resnet-compile-30-steps | bert-batches
#         | verify-bert-plans | bert-vs-compile
#   OUT_DIR: where results go, in results/'s layout; default results/, the committed files.
# Each bench writes its whole folder under /tmp (worker logs, cached profiles) and copies bench.json to OUT_DIR;
# `timeout` bounds every part, and a cut-off bench still leaves the rows it measured in its bench.json.
set -u
part=$1
out=${2:-results}
mkdir -p "$out/bench/resnet152" "$out/bench/bert" "$out/verify"
bench="python3 -m acstudio bench"
export PYTHONUNBUFFERED=1
case $part in
resnet-batches)  # eager, per-block, captured and rewritten at 32, 64, 128; the largest batch in 6249 MiB
  timeout 420 $bench resnet152 -b 32,64,128 --configs eager,per-block,captured,rewritten@per-block \
    --fit-budget 6249MiB --max-batch 256 --warmup 5 --iters 10 --out /tmp/rn
  cp /tmp/rn/bench.json "$out/bench/resnet152/batches_32_64_128.json"
  ;;
verify-resnet-plans)  # five ResNet-152 plans verified against the captured step on the GPU
  timeout 140 python3 benchmarks/verify_plans.py "$out/verify/verify_h200_resnet152_bs64.json" \
    sample_profiles/h200_resnet152_bs64_adam.json.gz --budgets 90%,70%,50%,41%,floor
  ;;
resnet-vs-compile)  # the rewritten step across the memory range and at torch.compile's peaks
  timeout 560 $bench resnet152 -b 64 \
    --configs eager,captured,rewritten,compile,compile@0.5,rewritten@compile@0.5,compile@0.2,rewritten@compile@0.2 \
    --budgets 90%,75%,60%,30% --warmup 5 --iters 10 --out /tmp/rnc
  cp /tmp/rnc/bench.json "$out/bench/resnet152/bs64_vs_compile.json"
  ;;
resnet-compile-30-steps)  # plain torch.compile again, 30 timed steps
  timeout 110 $bench resnet152 -b 64 --configs compile --warmup 10 --iters 30 --out /tmp/rc2
  cp /tmp/rc2/bench.json "$out/bench/resnet152/bs64_compile_30_steps.json"
  ;;
bert-batches)  # eager, per-block, captured and rewritten at batch 8, 16, 32
  timeout 420 $bench bert -b 8,16,32 --configs eager,per-block,captured,rewritten@per-block \
    --warmup 5 --iters 10 --out /tmp/bt
  cp /tmp/bt/bench.json "$out/bench/bert/batches.json"
  ;;
verify-bert-plans)  # five BERT plans verified against the captured step on the GPU
  timeout 150 python3 benchmarks/verify_plans.py "$out/verify/verify_h200_bert_bs16.json" \
    sample_profiles/h200_bert_bs16_adam.json.gz --budgets 90%,70%,60%,52%,floor
  ;;
bert-vs-compile)  # the rewritten step at torch.compile@0.5's peak
  timeout 200 $bench bert -b 16 --configs eager,captured,compile,compile@0.5,rewritten@compile@0.5 \
    --warmup 5 --iters 10 --out /tmp/btc
  cp /tmp/btc/bench.json "$out/bench/bert/bs16_vs_compile.json"
  ;;
*)
  echo "unknown part $part" >&2
  exit 2
  ;;
esac
