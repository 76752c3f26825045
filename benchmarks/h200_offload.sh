#!/usr/bin/env bash
# H200 runs for offload and for the bench's loss parity: each part one device call (10 minutes at most).
# Usage: PYTHONPATH=. benchmarks/h200_offload.sh PART [OUT_DIR]
#   gpu-tests        the CUDA tests of the offload runtime (side streams, pinned pool, bitwise, 50 steps flat)
#   parity-resnet152 captured, rewritten and sac rows against eager's losses, ResNet-152 bs64
#   parity-bert      the same, BERT-base MLM bs16
#   offload-bert     our plans (offload allowed) at HF GC's and the offload peers' peaks, BERT-base bs16
#   offload-gpt2     the same, GPT-2 seq 1024 bs16
#   offload-resnet152 the same, ResNet-152 bs64 (host-bound: the planner prices each offload's host calls)
#   offload-llama    the same, the bundled sample's bf16 LLaMA-style decoder (168M), seq 1024 bs8
#   samples          the bundled H200 sample profiles measured again (host link included), as OUT_DIR/samples.tgz
# OUT_DIR defaults to results/; parts write OUT_DIR/offload/ and OUT_DIR/parity/, and beside each bench file the
# profile its plans were made from (FOLDER/profiles/), to check the predictions against on a CPU.
set -u
part=${1:-list}
out=${2:-results}
export PYTHONUNBUFFERED=1
steps="--warmup 3 --iters 8"
parity_rows="eager,per-block,captured,rewritten@per-block,sac@per-block"
# HF GC (per-block) and the two offload peers, and our rewritten step at their measured peaks and at 1.15x HF GC's;
# captured (the captured step run as is) is what the rewritten rows' predicted time is over (rows before 2026-11-27
# lack it).
offload_rows="eager,captured,per-block,per-block+offload,offload,rewritten@per-block,rewritten@per-block*1.15,\
rewritten@per-block+offload"

bench() {  # bench FOLDER NAME BENCH_ARGS...: one bench into /tmp/NAME, its bench.json to OUT_DIR/FOLDER/NAME.json
  folder=$1
  name=$2
  shift 2
  mkdir -p "$out/$folder"
  timeout "${PART_TIMEOUT_S:-560}" python3 -m acstudio bench "$@" $steps --out "/tmp/$name"
  cp "/tmp/$name/bench.json" "$out/$folder/$name.json"
  if [ -d "/tmp/$name/profiles" ]; then
    mkdir -p "$out/$folder/profiles"
    cp /tmp/"$name"/profiles/*.json.gz "$out/$folder/profiles/"
  fi
}
# The bundled decoder sample's model: 8 layers of width 1024, 32k vocabulary, bf16 autocast, AdamW.
llama="llama --seq-len 1024 --precision bf16 --optimizer adamw --config hidden_size=1024 \
  --config intermediate_size=2816 --config num_hidden_layers=8 --config num_attention_heads=16 \
  --config num_key_value_heads=16 --config vocab_size=32000 --config max_position_embeddings=2048"

case $part in
list)
  sed -n 's/^#   \([a-z0-9-]*\) .*/\1/p' "$0"
  ;;
gpu-tests)
  python3 -m pytest -q -x -p no:cacheprovider tests/test_offload.py tests/test_offload_bench.py tests/test_offload_runtime.py \
    tests/test_offload_health.py
  ;;
parity-resnet152)
  bench parity resnet152_bs64 resnet152 -b 64 --configs "$parity_rows"
  ;;
parity-bert)
  bench parity bert_bs16 bert -b 16 --configs "$parity_rows"
  ;;
offload-bert)
  bench offload bert_bs16 bert -b 16 --configs "$offload_rows"
  ;;
offload-gpt2)
  bench offload gpt2_s1024_bs16 gpt2 --seq-len 1024 -b 16 --configs "$offload_rows"
  ;;
offload-resnet152)
  bench offload resnet152_bs64_offload_rows resnet152 -b 64 --optimizer adam --configs "$offload_rows"
  ;;
offload-llama)
  # shellcheck disable=SC2086  # the model arguments are words
  bench offload llama_bs8_bf16 $llama -b 8 --configs "$offload_rows"
  ;;
samples)
  mkdir -p /tmp/samples
  while read -r name args; do
    # shellcheck disable=SC2086  # the model arguments are words
    python3 -m acstudio profile $args --device cuda --out "/tmp/samples/$name.json.gz" </dev/null
  done <<EOF2
h200_resnet152_bs32_adam resnet152 -b 32 --optimizer adam
h200_resnet152_bs64_adam resnet152 -b 64 --optimizer adam
h200_resnet152_bs128_adam resnet152 -b 128 --optimizer adam
h200_bert_bs8_adam bert -b 8 --optimizer adam
h200_bert_bs16_adam bert -b 16 --optimizer adam
h200_bert_bs32_adam bert -b 32 --optimizer adam
h200_gpt2_bs16_adam gpt2 -b 16 --optimizer adam
h200_llama_bs8_bf16_adamw $llama -b 8
EOF2
  tar czf "$out/samples.tgz" -C /tmp/samples .
  ;;
*)
  echo "unknown part $part; the parts:" >&2
  sed -n 's/^#   \([a-z0-9-]*\) .*/\1/p' "$0" >&2
  exit 2
  ;;
esac
