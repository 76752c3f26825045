#!/usr/bin/env bash
# The H200 runs behind docs/results.md's transformer, SAC and FSDP2/DDP tables: transformers against HF gradient
# checkpointing (per-block), torchtitan's op-level SAC (per-op) and torch.compile, our plan as a rewritten graph and
# as SAC, and FSDP2/DDP on 2 GPUs.
# Usage: PYTHONPATH=. benchmarks/h200_transformers.sh PART [OUT_DIR]
#   OUT_DIR: where results go, in results/'s layout (bench/<model>/...); default results/, the committed files.
#   PART (one H200 each): see `benchmarks/h200_transformers.sh list`; the fsdp-ddp* parts need nvidia-h200-x2.
# Each part stays under 9 minutes (`timeout` bounds it; a cut-off bench keeps the rows it measured in its
# bench.json, which is copied to OUT_DIR either way). Each configuration runs in a fresh process.
set -u
part=$1
out=${2:-results}
bench="python3 -m acstudio bench"
steps="--warmup 3 --iters 8"
export PYTHONUNBUFFERED=1
# A LLaMA-style decoder (RMSNorm, SwiGLU, rotary, no dropout): 8 layers of width 1024, 32k vocabulary, about
# 170M parameters; bf16 autocast, AdamW, seq 1024.
llama="llama --seq-len 1024 --precision bf16 --optimizer adamw --config hidden_size=1024 \
  --config intermediate_size=2816 --config num_hidden_layers=8 --config num_attention_heads=16 \
  --config num_key_value_heads=16 --config vocab_size=32000 --config max_position_embeddings=2048"
# The transformer table: every peer, our rewritten graph and our SAC form at the peers' measured peaks.
peers="eager,per-block,per-op,compile,compile+per-block,compile+per-op"
ours="rewritten@per-block,rewritten@per-block*1.15,rewritten@per-op,sac@per-block"
ours_compiled="sac+compile@compile+per-block,sac+compile@compile+per-op"

run() {  # run NAME TIMEOUT_S BENCH_ARGS...: one bench into /tmp/..., its bench.json to OUT_DIR/NAME.json
  name=$1
  limit=$2
  shift 2
  tmp="/tmp/${name//\//_}"
  mkdir -p "$(dirname "$out/$name")"
  timeout "$limit" $bench "$@" --out "$tmp"
  cp "$tmp/bench.json" "$out/$name.json"
  tar czf "$out/$name.workers.tgz" -C "$tmp" workers profiles 2>/dev/null  # logs and the GPU profile
}
# The SAC table: the eager and compiled peers, our plan as SAC eager at per-block's peak and compiled at the
# compiled peers' peaks.
sac_rows="eager,per-block,rewritten@per-block,sac@per-block,compile,compile+per-block,compile+per-op,\
sac+compile@compile+per-block,sac+compile@compile+per-op"
compiled_rows=compile,compile+per-block,compile+per-op,sac+compile@compile+per-block,sac+compile@compile+per-op
dist_rows() {  # the same under a parallelism: fsdp or ddp
  echo "$1,$1+per-block,$1+sac@$1+per-block,$1+compile,$1+compile+per-block,$1+sac+compile@$1+per-block"
}
# The eager table: the peers and our rewritten graph at their measured peaks, no compiled rows.
eager_rows="eager,per-block,per-op,rewritten@per-block,rewritten@per-block*1.15,rewritten@per-op"

case $part in
list)  # the parts, one a line
  grep -oE '^[a-z0-9.-]+\)' "$0" | tr -d ')' | grep -v '^list$'
  ;;
bert16-all-rows)  # about 7.5 min
  run bench/bert/bs16_all_rows 530 bert -b 16 --configs "$peers,$ours,$ours_compiled" $steps
  ;;
bert32-eager-rows-only)  # about 2 min: BERT at batch 32 against the eager peers only (no compiled rows)
  run bench/bert/bs32_rewritten_vs_eager_peers 400 bert -b 32 --configs "$eager_rows" $steps
  ;;
eager-rows-bert16-gpt2)  # about 5 min: the eager table's rows for BERT bs16 and GPT-2
  run bench/bert/bs16_rewritten_vs_eager_peers 270 bert -b 16 --configs "$eager_rows" $steps
  run bench/gpt2/bs16_rewritten_vs_eager_peers 270 gpt2 -b 16 --configs "$eager_rows" $steps
  ;;
eager-rows-llama-bert32)  # about 5 min: the eager table's rows for the bf16 decoder and BERT bs32
  run bench/llama/bs8_rewritten_vs_eager_peers 270 $llama -b 8 --configs "$eager_rows" $steps
  run bench/bert/bs32_rewritten_vs_eager_peers 270 bert -b 32 --configs "$eager_rows" $steps
  ;;
gpt2-all-rows)  # about 7.5 min
  run bench/gpt2/bs16_all_rows 530 gpt2 -b 16 --configs "$peers,$ours,$ours_compiled" $steps
  ;;
llama-all-rows)  # about 7 min
  run bench/llama/bs8_all_rows 530 $llama -b 8 --configs "$peers,$ours,$ours_compiled" $steps
  ;;
resnet-rewritten-at-per-block)  # about 3 min: ResNet-152's per-block row again (no regression of the rewritten step)
  run bench/resnet152/bs64_rewritten_at_per_block 250 resnet152 -b 64 --configs eager,per-block,rewritten@per-block $steps
  ;;
resnet-sac-compiled-0.5-first)  # about 6 min: per-block again, compile@0.5 and our SAC form at its peak
  run bench/resnet152/bs64_sac_compiled_at_compile0.5_first 530 resnet152 -b 64 \
    --configs eager,per-block,rewritten@per-block,compile,compile@0.5,sac+compile@compile@0.5 $steps
  ;;
resnet-sac-eager-and-compiled-0.5)  # about 9 min: ResNet-152's SAC rows: eager at per-block's peak, compiled at
  # compile@0.5's peak (the compiled row failed in the committed run: see resnet-sac-compiled-0.5-and-per-block)
  run bench/resnet152/bs64_sac_eager_and_compiled_at_compile0.5 560 resnet152 -b 64 --configs "per-block,rewritten@per-block,sac@per-block,\
compile,compile+per-block,compile@0.5,sac+compile@compile@0.5" $steps
  ;;
resnet-sac-at-per-block-only)  # about 2 min: ResNet-152's eager SAC row at per-block's peak, beside per-block, rewritten
  run bench/resnet152/bs64_sac_at_per_block 200 resnet152 -b 64 --configs per-block,rewritten@per-block,sac@per-block $steps
  ;;
resnet-sac-compiled-0.5-and-per-block)  # about 9 min: compiled SAC rows at compile@0.5's and compile+per-block's peaks
  run bench/resnet152/bs64_sac_compiled_at_compile0.5_and_per_block 570 resnet152 -b 64 --configs \
    "compile@0.5,sac+compile@compile@0.5,compile+per-block,compile,sac+compile@compile+per-block" $steps
  ;;
resnet-sac-compiled-0.2-short)  # about 8 min: ResNet-152's compiled SAC row at compile@0.2's peak
  run bench/resnet152/bs64_sac_compiled_at_compile0.2_short 570 resnet152 -b 64 --configs \
    "compile@0.2,compile+per-block,compile,sac+compile@compile@0.2" $steps
  ;;
resnet-sac-compiled-0.2-logged)  # about 8 min: resnet-sac-compiled-0.2-short with 20 steps, recompilations logged
  TORCH_LOGS=graph_breaks,recompiles run bench/resnet152/bs64_sac_compiled_at_compile0.2_logged 570 resnet152 -b 64 --configs \
    "compile@0.2,compile+per-block,compile,sac+compile@compile@0.2" --warmup 5 --iters 20
  ;;
resnet-sac-compiled-0.2)  # about 9 min: the compiled SAC row at compile@0.2's peak, 20 steps
  run bench/resnet152/bs64_sac_compiled_at_compile0.2 585 resnet152 -b 64 --configs \
    "compile@0.2,compile+per-block,compile,sac+compile@compile@0.2" --warmup 5 --iters 20
  ;;
resnet-sac-compiled-per-block-and-0.5)  # compiled SAC at compile+per-block's and compile@0.5's peaks (the 585 s cut
  # off its last row, sac+compile@compile@0.5: see resnet-sac-compiled-0.5)
  run bench/resnet152/bs64_sac_compiled_at_compile_per_block 585 resnet152 -b 64 --configs \
    "compile+per-block,compile,sac+compile@compile+per-block,compile@0.5,sac+compile@compile@0.5" --warmup 5 --iters 20
  ;;
resnet-sac-compiled-0.5)  # about 9.5 min: the compiled SAC row at compile@0.5's peak, with the calibration rows it needs
  run bench/resnet152/bs64_sac_compiled_at_compile0.5 590 resnet152 -b 64 --configs compile@0.5,sac+compile@compile@0.5 --warmup 5 --iters 20
  ;;
rewritten-headroom-gpt2-bert32)  # about 3 min: rows once a fraction of a MiB over their budget, with bench's headroom
  run bench/gpt2/bs16_rewritten_at_per_block_headroom 200 gpt2 -b 16 --configs per-block,rewritten@per-block $steps
  run bench/bert/bs32_rewritten_at_per_block_headroom 200 bert -b 32 --configs per-block,rewritten@per-block $steps
  ;;
bert-sac-all-rows)  # about 5 min: BERT's SAC rows, eager and compiled (sac+compile calibrated on compile+per-block)
  run bench/bert/bs16_sac_all_rows 530 bert -b 16 --configs "$sac_rows" $steps
  ;;
sac-compiled-llama-bert-short)  # about 8 min: the compiled SAC rows of the decoder and BERT, shorter time limits
  run bench/llama/bs8_sac_compiled 250 $llama -b 8 --configs "$compiled_rows" $steps
  run bench/bert/bs16_sac_compiled 330 bert -b 16 --configs "$compiled_rows" $steps
  ;;
llama-sac-compiled-short)  # about 5 min: the decoder's compiled SAC rows only
  run bench/llama/bs8_sac_compiled 290 $llama -b 8 --configs "$compiled_rows" $steps
  ;;
bert-sac-compiled-short)  # about 5.5 min: BERT's compiled SAC rows only
  run bench/bert/bs16_sac_compiled 330 bert -b 16 --configs "$compiled_rows" $steps
  ;;
llama-sac-all-rows-logged)  # about 5 min: the decoder's SAC rows, torch.compile's graph breaks and recompilations logged
  TORCH_LOGS=graph_breaks,recompiles run bench/llama/bs8_sac_all_rows 530 $llama -b 8 --configs "$sac_rows" $steps
  ;;
sac-at-per-block)  # about 7 min: the eager SAC rows at per-block's peak: decoder, BERT, ResNet-152
  run bench/llama/bs8_sac_at_per_block 200 $llama -b 8 --configs eager,per-block,rewritten@per-block,sac@per-block $steps
  run bench/bert/bs16_sac_at_per_block 180 bert -b 16 --configs eager,per-block,rewritten@per-block,sac@per-block $steps
  run bench/resnet152/bs64_sac_at_per_block 150 resnet152 -b 64 --configs per-block,rewritten@per-block,sac@per-block $steps
  ;;
llama-sac-at-per-block-20-steps)  # about 4 min: sac-at-per-block's decoder rows with 20 timed steps
  run bench/llama/bs8_sac_at_per_block_20_steps 280 $llama -b 8 --configs per-block,rewritten@per-block,sac@per-block --warmup 5 --iters 20
  ;;
sac-compiled-llama-bert)  # about 9 min: the compiled SAC rows of the decoder and BERT
  run bench/llama/bs8_sac_compiled 250 $llama -b 8 --configs "$compiled_rows" $steps
  run bench/bert/bs16_sac_compiled 330 bert -b 16 --configs "$compiled_rows" $steps
  ;;
llama-sac-compiled-at-per-op)  # about 4 min: the decoder's per-op rows, which sac-compiled-llama-bert's 250 s cut off
  run bench/llama/bs8_sac_compiled_at_compile_per_op 300 $llama -b 8 --configs compile,compile+per-op,sac+compile@compile+per-op $steps
  ;;
fsdp-ddp)  # about 8 min on nvidia-h200-x2: FSDP2 and DDP on 2 GPUs, 8 sequences per rank, eager and compiled per
  # block; and 1 GPU on all 16
  run bench/llama/bs8x2_fsdp_ddp 480 $llama -b 8 --nproc 2 --configs "$(dist_rows fsdp),$(dist_rows ddp)" $steps
  run bench/llama/bs16_one_gpu 80 $llama -b 16 --configs eager $steps
  ;;
fsdp-ddp-compiled)  # about 5 min on nvidia-h200-x2: the compiled rows of fsdp-ddp, beside HF GC (their budget), no AC
  run bench/llama/bs8x2_fsdp_ddp_compiled 330 $llama -b 8 --nproc 2 --configs \
    fsdp,fsdp+per-block,fsdp+compile,fsdp+compile+per-block,fsdp+sac+compile@fsdp+per-block,\
ddp,ddp+per-block,ddp+compile,ddp+compile+per-block,ddp+sac+compile@ddp+per-block $steps
  ;;
fsdp-ddp-eager)  # about 3 min on nvidia-h200-x2: the eager rows of fsdp-ddp only
  run bench/llama/bs8x2_fsdp_ddp_eager 300 $llama -b 8 --nproc 2 --configs \
    fsdp,fsdp+per-block,fsdp+sac@fsdp+per-block,ddp,ddp+per-block,ddp+sac@ddp+per-block $steps
  ;;
verify-transformer-plans)  # about 3 min: the plans at per-block's and 1.15x per-block's peaks, verified on the GPU
  for spec in bert_bs16_adam:4603MiB:5293MiB gpt2_bs16_adam:6553MiB:7536MiB llama_bs8_bf16_adamw:5424MiB:6238MiB; do
    IFS=: read -r name b1 b2 <<<"$spec"
    for b in $b1 $b2; do
      python3 -m acstudio plan "sample_profiles/h200_$name.json.gz" --budget "$b" --out "/tmp/plan_${name}_$b.json"
      timeout 120 python3 -m acstudio verify "sample_profiles/h200_$name.json.gz" --plan "/tmp/plan_${name}_$b.json" \
        --device cuda --json "/tmp/verify_${name}_$b.json"
    done
  done
  mkdir -p "$out/verify"
  python3 -c 'import json, sys; json.dump({p: json.load(open(p)) for p in sys.argv[2:]}, open(sys.argv[1], "w"), indent=1)' \
    "$out/verify/verify_h200_transformers.json" /tmp/verify_*.json
  ;;
*)
  echo "unknown part $part; the parts: $("$0" list | tr '\n' ' ')" >&2
  exit 2
  ;;
esac
