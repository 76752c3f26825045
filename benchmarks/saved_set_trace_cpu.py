"""Time the saved-set trace (acstudio.export.compiled.compiled_saved_bytes) of the H200 decoder, per-block
checkpointed, at batch 1 on the CPU: the cost per plan of the compiled-peak method that was tried and dropped.

Usage: python benchmarks/saved_set_trace_cpu.py  (from the repository root)
"""

import time

from acstudio.bench.steps import enable_per_block
from acstudio.export.compiled import compiled_saved_bytes
from acstudio.workload import WorkloadSpec, build_workload

# benchmarks/h200_transformers.sh's decoder, at batch 1
CONFIG = (("hidden_size", "1024"), ("intermediate_size", "2816"), ("num_hidden_layers", "8"),
          ("num_attention_heads", "16"), ("num_key_value_heads", "16"), ("vocab_size", "32000"),
          ("max_position_embeddings", "2048"))

workload = build_workload(WorkloadSpec("llama", batch_size=1, seq_len=1024, config=CONFIG, optimizer="adamw"))
enable_per_block(workload)
start = time.perf_counter()
saved = compiled_saved_bytes(workload.model, workload.loss_fn, workload.batch)
print(f"saved for backward: {[round(b / 2**20, 1) for b in saved]} MiB per compiled graph; "
      f"trace {time.perf_counter() - start:.1f} s")
