#!/usr/bin/env bash
# The transformer grid: BERT (MLM), GPT-2 and a LLaMA-style decoder at sequence 512, 1024 and 2048, each shape one
# `acstudio bench` call on one H200, our plans against the strongest peers at those peers' measured peaks.
# Usage: PYTHONPATH=. benchmarks/grid.sh SHAPE|all|list [OUT_DIR] [eager|compiled]
#   SHAPE: one of `benchmarks/grid.sh list`, so that one device call (10 minutes at most) runs one shape;
#   all: every shape in turn. OUT_DIR defaults to results/; each shape writes OUT_DIR/grid/SHAPE.json, and the
#   profile its plans came from as OUT_DIR/grid/profiles/SHAPE.json.gz.
#   eager|compiled: only the eager rows or only the compiled ones, into OUT_DIR/grid/SHAPE.eager.json or
#   SHAPE.compiled.json, for a shape too slow for one device call (each part profiles the shape on its own).
# Rerun it whenever the planner, the simulator or the compiled model changes.
#
# Batch sizes aim eager at 15-60 GB on an H200 (about 25-33 GiB, the middle). They are estimated from the committed
# H200 eager peaks, which grow linearly in the batch (BERT seq 512: 9259 MiB at bs16, 17208 at bs32; the decoder
# below at seq 1024: 9124 MiB at bs8, 15878 at bs16), assuming memory linear in tokens (SDPA's memory-efficient
# attention keeps no seq x seq matrix):
#   BERT-base:    1.3 GiB + 0.97 MiB per token  -> 32768 tokens, about 32 GiB
#   GPT-2 (124M): 1.9 GiB + 1.56 MiB per token (its 50257-word vocabulary's logits) -> 16384 tokens, about 27 GiB
#   decoder (953M): the 168M decoder's 2.3 GiB + 0.82 MiB per token, scaled: its state by parameters (x5.7), its
#                 layers' activations by layers x width (x4; the loss head's, about half, unchanged)
#                 -> 13.5 GiB + 2.1 MiB per token -> 8192 tokens, about 30 GiB. No 1B run is committed yet, so
#                 this one is an extrapolation: check the eager row of the first run.
set -u
shape=${1:-list}
out=${2:-results}
export PYTHONUNBUFFERED=1
# The rows: the peers (HF gradient checkpointing, torchtitan's op-level SAC, both compiled or not) and our plans at
# their measured peaks. eager is measured too, to check the batch's memory, and captured (the captured step run
# as is), which the rewritten rows' predicted time is over; bench adds the calibration rows (compile,
# compile+per-block, compile+per-op+regions) that sac+compile needs.
eager_rows="eager,captured,per-block,per-op,rewritten@per-block,rewritten@per-block*1.15,rewritten@per-op"
compiled_rows="compile+per-op,sac+compile@compile+per-op"
part=${3:-}
case $part in
"") rows="$eager_rows,$compiled_rows" suffix="" ;;
eager) rows=$eager_rows suffix=".eager" ;;
compiled) rows=$compiled_rows suffix=".compiled" ;;
*) echo "unknown part $part: give eager or compiled, or nothing for both" >&2; exit 2 ;;
esac
steps="--warmup 3 --iters 8"
# BERT-base and GPT-2 from their default configs; past their 512 / 1024 positions, the position table grows.
bert="bert --optimizer adam"
gpt2="gpt2 --optimizer adam"
# A LLaMA-style decoder of 953M parameters (RMSNorm, SwiGLU, rotary, no dropout): 16 layers of width 2048,
# 32k vocabulary; bf16 autocast, AdamW.
decoder="llama --precision bf16 --optimizer adamw --config hidden_size=2048 --config intermediate_size=5632 \
  --config num_hidden_layers=16 --config num_attention_heads=16 --config num_key_value_heads=16 \
  --config vocab_size=32000 --config max_position_embeddings=2048"

# SHAPE  MODEL_ARGS  (one line each; the model arguments end with --seq-len and -b)
shapes() {
  cat <<EOF
bert-s512 $bert --seq-len 512 -b 64
bert-s1024 $bert --seq-len 1024 -b 32 --config max_position_embeddings=1024
bert-s2048 $bert --seq-len 2048 -b 16 --config max_position_embeddings=2048
gpt2-s512 $gpt2 --seq-len 512 -b 32
gpt2-s1024 $gpt2 --seq-len 1024 -b 16
gpt2-s2048 $gpt2 --seq-len 2048 -b 8 --config n_positions=2048
decoder1b-s512 $decoder --seq-len 512 -b 16
decoder1b-s1024 $decoder --seq-len 1024 -b 8
decoder1b-s2048 $decoder --seq-len 2048 -b 4
EOF
}

run_shape() {  # run_shape NAME MODEL_ARGS...: one bench, bounded (GRID_TIMEOUT_S) to fit a 10-minute device call
  name=$1
  shift
  mkdir -p "$out/grid"
  # stopped by the timeout, bench keeps the rows it measured
  timeout "${GRID_TIMEOUT_S:-560}" python3 -m acstudio bench "$@" --configs "$rows" $steps --out "/tmp/grid_$name$suffix"
  cp "/tmp/grid_$name$suffix/bench.json" "$out/grid/$name$suffix.json"
  # the profile the shape's plans were made from, to check their predictions against on a CPU
  if [ -d "/tmp/grid_$name$suffix/profiles" ]; then
    mkdir -p "$out/grid/profiles"
    cp /tmp/grid_"$name$suffix"/profiles/*.json.gz "$out/grid/profiles/$name$suffix.json.gz"  # one: one batch size
  fi
}

case $shape in
list)
  shapes | cut -d' ' -f1
  ;;
all)
  shapes | while read -r name args; do
    run_shape "$name" $args </dev/null
  done
  ;;
*)
  line=$(shapes | grep "^$shape ")
  if [ -z "$line" ]; then
    echo "unknown shape $shape; the shapes:" >&2
    shapes | cut -d' ' -f1 >&2
    exit 2
  fi
  # shellcheck disable=SC2086  # the model arguments are words
  run_shape $line
  ;;
esac
