#!/usr/bin/env bash
# The H200 runs behind README's "Rewritten step on the H200" tables, in parts that each fit one 10-minute call.
# Usage: PYTHONPATH=. benchmarks/h200_issue4.sh PART OUT_DIR
#   PART: resnet | verify | resnet-compile | compile-again | bert | verify-bert | bert-compile
# Each bench writes its whole folder under /tmp (worker logs, cached profiles) and copies bench.json to OUT_DIR;
# `timeout` bounds every part, and a cut-off bench still leaves the rows it measured in its bench.json.
set -u
part=$1
out=$2
mkdir -p "$out"
bench="python3 -m acstudio bench"
export PYTHONUNBUFFERED=1
case $part in
resnet)
  timeout 420 $bench resnet152 -b 32,64,128 --configs eager,per-block,captured,rewritten@per-block \
    --fit-budget 6249MiB --max-batch 256 --warmup 5 --iters 10 --out /tmp/rn
  cp /tmp/rn/bench.json "$out/bench_h200_resnet152.json"
  ;;
verify)
  timeout 140 python3 benchmarks/verify_plans.py "$out/verify_h200_resnet152_bs64.json" \
    sample_profiles/h200_resnet152_bs64_adam.json.gz --budgets 90%,70%,50%,41%,floor
  ;;
resnet-compile)
  timeout 560 $bench resnet152 -b 64 \
    --configs eager,captured,rewritten,compile,compile@0.5,rewritten@compile@0.5,compile@0.2,rewritten@compile@0.2 \
    --budgets 90%,75%,60%,30% --warmup 5 --iters 10 --out /tmp/rnc
  cp /tmp/rnc/bench.json "$out/bench_h200_resnet152_bs64_compile.json"
  ;;
compile-again)
  timeout 110 $bench resnet152 -b 64 --configs compile --warmup 10 --iters 30 --out /tmp/rc2
  cp /tmp/rc2/bench.json "$out/bench_h200_resnet152_bs64_compile_default.json"
  ;;
bert)
  timeout 420 $bench bert -b 8,16,32 --configs eager,per-block,captured,rewritten@per-block \
    --warmup 5 --iters 10 --out /tmp/bt
  cp /tmp/bt/bench.json "$out/bench_h200_bert.json"
  ;;
verify-bert)
  timeout 150 python3 benchmarks/verify_plans.py "$out/verify_h200_bert_bs16.json" \
    sample_profiles/h200_bert_bs16_adam.json.gz --budgets 90%,70%,60%,52%,floor
  ;;
bert-compile)
  timeout 200 $bench bert -b 16 --configs eager,captured,compile,compile@0.5,rewritten@compile@0.5 \
    --warmup 5 --iters 10 --out /tmp/btc
  cp /tmp/btc/bench.json "$out/bench_h200_bert_bs16_compile.json"
  ;;
*)
  echo "unknown part $part" >&2
  exit 2
  ;;
esac
