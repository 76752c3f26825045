#!/usr/bin/env bash
# The H200 runs for issues 10 and 11: transformers against HF gradient checkpointing (per-block), torchtitan's
# op-level SAC (per-op) and torch.compile, our plan as a rewritten graph and as SAC, and FSDP2/DDP on 2 GPUs.
# Usage: PYTHONPATH=. benchmarks/h200_transformers.sh PART OUT_DIR
#   PART: bert | bert32 | gpt2 | llama | eager1 | eager2 | fits | resnet | resnet-eager | sacresnet | sacresnet-eager | sacresnet2 | sacresnet3 | sacresnet4 | sacresnet5 | sacresnet6 | sacresnet7 | sacbert | sacllama | compiled | compiled-llama | compiled-bert
#         | eager-apart | eager-apart-llama | compiled-apart | compiled-apart-op | verify (one H200 each)
#         | dist | dist-compiled | dist-eager (nvidia-h200-x2: 2 GPUs)
# Each part stays under 9 minutes (`timeout` bounds it; a cut-off bench keeps the rows it measured in its
# bench.json, which is copied to OUT_DIR either way). Each configuration runs in a fresh process.
set -u
part=$1
out=$2
mkdir -p "$out"
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

run() {  # run NAME TIMEOUT_S BENCH_ARGS...: one bench into /tmp/NAME, its bench.json to OUT_DIR
  name=$1
  limit=$2
  shift 2
  timeout "$limit" $bench "$@" --out "/tmp/$name"
  cp "/tmp/$name/bench.json" "$out/bench_h200_$name.json"
  tar czf "$out/workers_$name.tgz" -C "/tmp/$name" workers profiles 2>/dev/null  # logs and the GPU profile
}
# Issue 11's SAC table: the eager and compiled peers, our plan as SAC eager at per-block's peak and compiled at the
# compiled peers' peaks.
sac_rows="eager,per-block,rewritten@per-block,sac@per-block,compile,compile+per-block,compile+per-op,\
sac+compile@compile+per-block,sac+compile@compile+per-op"
compiled_rows=compile,compile+per-block,compile+per-op,sac+compile@compile+per-block,sac+compile@compile+per-op
dist_rows() {  # the same under a parallelism: fsdp or ddp
  echo "$1,$1+per-block,$1+sac@$1+per-block,$1+compile,$1+compile+per-block,$1+sac+compile@$1+per-block"
}
# Issue 10's eager table: the peers and our rewritten graph at their measured peaks, no compiled rows.
eager_rows="eager,per-block,per-op,rewritten@per-block,rewritten@per-block*1.15,rewritten@per-op"

case $part in
bert)  # about 7.5 min
  run bert_bs16_transformers 530 bert -b 16 --configs "$peers,$ours,$ours_compiled" $steps
  ;;
bert32)  # about 2 min: BERT at batch 32 against the eager peers only (no compiled rows)
  run bert_bs32_transformers 400 bert -b 32 --configs "$eager_rows" $steps
  ;;
eager1)  # about 5 min: issue 10's eager rows for BERT bs16 and GPT-2
  run bert_bs16_eager 270 bert -b 16 --configs "$eager_rows" $steps
  run gpt2_bs16_eager 270 gpt2 -b 16 --configs "$eager_rows" $steps
  ;;
eager2)  # about 5 min: issue 10's eager rows for the bf16 decoder and BERT bs32
  run llama_bs8_eager 270 $llama -b 8 --configs "$eager_rows" $steps
  run bert_bs32_eager 270 bert -b 32 --configs "$eager_rows" $steps
  ;;
gpt2)  # about 7.5 min
  run gpt2_bs16_transformers 530 gpt2 -b 16 --configs "$peers,$ours,$ours_compiled" $steps
  ;;
llama)  # about 7 min
  run llama_bs8_transformers 530 $llama -b 8 --configs "$peers,$ours,$ours_compiled" $steps
  ;;
resnet-eager)  # about 3 min: the ResNet-152 per-block row again (no regression of the rewritten step)
  run resnet152_bs64_eager 250 resnet152 -b 64 --configs eager,per-block,rewritten@per-block $steps
  ;;
resnet)  # about 6 min: the per-block row again (no regression), compile@0.5 and our SAC form at its peak
  run resnet152_bs64_sac 530 resnet152 -b 64 \
    --configs eager,per-block,rewritten@per-block,compile,compile@0.5,sac+compile@compile@0.5 $steps
  ;;
sacresnet)  # about 9 min: ResNet-152's SAC rows: eager at per-block's peak, compiled at compile@0.5's peak (the
  # compiled row failed in this run: see sacresnet2)
  run resnet152_bs64_sac_compile 560 resnet152 -b 64 --configs "per-block,rewritten@per-block,sac@per-block,\
compile,compile+per-block,compile@0.5,sac+compile@compile@0.5" $steps
  ;;
sacresnet-eager)  # about 2 min: ResNet-152's eager SAC row at per-block's peak, beside per-block and rewritten
  run resnet152_bs64_sac_eager 200 resnet152 -b 64 --configs per-block,rewritten@per-block,sac@per-block $steps
  ;;
sacresnet2)  # about 9 min: ResNet-152's compiled SAC rows at compile@0.5's and compile+per-block's peaks
  run resnet152_bs64_sac_compile2 570 resnet152 -b 64 --configs \
    "compile@0.5,sac+compile@compile@0.5,compile+per-block,compile,sac+compile@compile+per-block" $steps
  ;;
sacresnet3)  # about 8 min: ResNet-152's compiled SAC row at compile@0.2's peak
  run resnet152_bs64_sac_compile3 570 resnet152 -b 64 --configs \
    "compile@0.2,compile+per-block,compile,sac+compile@compile@0.2" $steps
  ;;
sacresnet4)  # about 8 min: sacresnet3 again after the fill change, with more steps and recompilations logged
  TORCH_LOGS=graph_breaks,recompiles run resnet152_bs64_sac_compile4 570 resnet152 -b 64 --configs \
    "compile@0.2,compile+per-block,compile,sac+compile@compile@0.2" --warmup 5 --iters 20
  ;;
sacresnet5)  # about 9 min: sacresnet4 again with the sac row profiled and planned in a process of its own
  run resnet152_bs64_sac_compile5 585 resnet152 -b 64 --configs \
    "compile@0.2,compile+per-block,compile,sac+compile@compile@0.2" --warmup 5 --iters 20
  ;;
sacresnet6)  # ResNet-152 at compile+per-block's and compile@0.5's peaks with this code, planned apart (the 585 s cut off
  # its last row, sac+compile@compile@0.5: see sacresnet7)
  run resnet152_bs64_sac_compile6 585 resnet152 -b 64 --configs \
    "compile+per-block,compile,sac+compile@compile+per-block,compile@0.5,sac+compile@compile@0.5" --warmup 5 --iters 20
  ;;
sacresnet7)  # about 9.5 min: sacresnet6's last row, with compile@0.5 and the calibration rows it needs
  run resnet152_bs64_sac_compile7 590 resnet152 -b 64 --configs compile@0.5,sac+compile@compile@0.5 --warmup 5 --iters 20
  ;;
fits)  # about 3 min: the rows that had come out a fraction of a MiB over their budget, with the bench's headroom
  run gpt2_bs16_fits 200 gpt2 -b 16 --configs per-block,rewritten@per-block $steps
  run bert_bs32_fits 200 bert -b 32 --configs per-block,rewritten@per-block $steps
  ;;
sacbert)  # about 5 min: BERT's SAC rows, eager and compiled (sac+compile calibrated on compile+per-block)
  run bert_bs16_sac_compile 530 bert -b 16 --configs "$sac_rows" $steps
  ;;
compiled)  # about 8 min: the compiled rows of sacllama and sacbert only
  run llama_bs8_sac_compiled 250 $llama -b 8 --configs "$compiled_rows" $steps
  run bert_bs16_sac_compiled 330 bert -b 16 --configs "$compiled_rows" $steps
  ;;
compiled-llama)  # about 5 min: the compiled rows of sacllama only
  run llama_bs8_sac_compiled 290 $llama -b 8 --configs "$compiled_rows" $steps
  ;;
compiled-bert)  # about 5.5 min: the compiled rows of sacbert only
  run bert_bs16_sac_compiled 330 bert -b 16 --configs "$compiled_rows" $steps
  ;;
sacllama)  # about 5 min: the decoder's SAC rows, with torch.compile's graph breaks and recompilations logged
  TORCH_LOGS=graph_breaks,recompiles run llama_bs8_sac 530 $llama -b 8 --configs "$sac_rows" $steps
  ;;
eager-apart)  # about 7 min: the eager SAC rows again, each sac row planned in a process of its own (Kind.planner)
  run llama_bs8_sac_eager2 200 $llama -b 8 --configs eager,per-block,rewritten@per-block,sac@per-block $steps
  run bert_bs16_sac_eager2 180 bert -b 16 --configs eager,per-block,rewritten@per-block,sac@per-block $steps
  run resnet152_bs64_sac_eager2 150 resnet152 -b 64 --configs per-block,rewritten@per-block,sac@per-block $steps
  ;;
eager-apart-llama)  # about 4 min: eager-apart's decoder rows again with 20 timed steps (its sac row had an IQR of 8 ms)
  run llama_bs8_sac_eager3 280 $llama -b 8 --configs per-block,rewritten@per-block,sac@per-block --warmup 5 --iters 20
  ;;
compiled-apart)  # about 9 min: the compiled rows of compiled again, each sac row planned in a process of its own
  run llama_bs8_sac_compiled2 250 $llama -b 8 --configs "$compiled_rows" $steps
  run bert_bs16_sac_compiled2 330 bert -b 16 --configs "$compiled_rows" $steps
  ;;
compiled-apart-op)  # about 4 min: the decoder's per-op rows, which compiled-apart's 250 s had cut off
  run llama_bs8_sac_compiled2_op 300 $llama -b 8 --configs compile,compile+per-op,sac+compile@compile+per-op $steps
  ;;
dist)  # about 8 min on nvidia-h200-x2: FSDP2 and DDP on 2 GPUs, 8 sequences per rank, eager and compiled per
  # block; and 1 GPU on all 16
  run llama_bs8x2_dist 480 $llama -b 8 --nproc 2 --configs "$(dist_rows fsdp),$(dist_rows ddp)" $steps
  run llama_bs16_single 80 $llama -b 16 --configs eager $steps
  ;;
dist-compiled)  # about 5 min on nvidia-h200-x2: the compiled rows of dist, beside HF GC (their budget) and no AC
  run llama_bs8x2_dist_compiled 330 $llama -b 8 --nproc 2 --configs \
    fsdp,fsdp+per-block,fsdp+compile,fsdp+compile+per-block,fsdp+sac+compile@fsdp+per-block,\
ddp,ddp+per-block,ddp+compile,ddp+compile+per-block,ddp+sac+compile@ddp+per-block $steps
  ;;
dist-eager)  # about 3 min on nvidia-h200-x2: the eager rows of dist only
  run llama_bs8x2_dist_eager 300 $llama -b 8 --nproc 2 --configs \
    fsdp,fsdp+per-block,fsdp+sac@fsdp+per-block,ddp,ddp+per-block,ddp+sac@ddp+per-block $steps
  ;;
verify)  # about 3 min: the plans benchmarked at per-block's and 1.15x per-block's peaks, checked on the GPU
  for spec in bert_bs16_adam:4603MiB:5293MiB gpt2_bs16_adam:6553MiB:7536MiB llama_bs8_bf16_adamw:5424MiB:6238MiB; do
    IFS=: read -r name b1 b2 <<<"$spec"
    for b in $b1 $b2; do
      python3 -m acstudio plan "sample_profiles/h200_$name.json.gz" --budget "$b" --out "/tmp/plan_${name}_$b.json"
      timeout 120 python3 -m acstudio verify "sample_profiles/h200_$name.json.gz" --plan "/tmp/plan_${name}_$b.json" \
        --device cuda --json "/tmp/verify_${name}_$b.json"
    done
  done
  python3 -c 'import json, sys; json.dump({p: json.load(open(p)) for p in sys.argv[2:]}, open(sys.argv[1], "w"), indent=1)' \
    "$out/verify_h200_transformers.json" /tmp/verify_*.json
  ;;
*)
  echo "unknown part $part (see the usage line)" >&2
  exit 2
  ;;
esac
