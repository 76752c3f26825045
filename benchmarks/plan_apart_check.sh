#!/usr/bin/env bash
# ResNet-152 bs64 on one H200: sac+compile@compile@0.2 planned by a worker of its own (task "plan"), then measured
# twice (cold, then warm Inductor cache), against compile@0.2 measured twice. The budget is compile@0.2's peak in
# h200_transformers.sh's resnet-sac-compiled-0.2-logged, the calibration its compile and compile+per-block rows.
# Results: results/bench/resnet152/bs64_plan_in_process_check.txt
# Usage: PYTHONPATH=. benchmarks/plan_apart_check.sh OUT_DIR
set -u
O=$1; W=/tmp/inproc; mkdir -p $W $O
export PYTHONUNBUFFERED=1
python3 - <<'PY'
import json
from acstudio.workload.spec import WorkloadSpec
spec = WorkloadSpec(model="resnet152", batch_size=64, optimizer="adam").to_dict()
base = {"spec": spec, "device": "cuda", "warmup": 5, "iters": 20, "compile_backend": "inductor", "nproc": 1,
        "profile_path": "/tmp/inproc/profile.json.gz"}
sac = base | {"config": "sac+compile@compile@0.2", "budget": "7218007040B",
              "compiled_per_block_peak": f"{4835 * 2**20}B", "compiled_step_ms": "49.3,60.5"}
json.dump(sac, open("/tmp/inproc/sac.json", "w"))
json.dump(base | {"config": "compile@0.2"}, open("/tmp/inproc/peer.json", "w"))
PY
summ() { python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print(sys.argv[2], r['status'], r.get('message','')[:200], r.get('setup_s'), round((r.get('peak_bytes') or 0)/2**20), 'MiB', round(r.get('time_ms_median') or 0,2), 'iqr', round(r.get('time_ms_iqr') or 0,2), [round(t,1) for t in r.get('times_ms') or []])" "$@"; }
t0=$(date +%s)
python3 - <<'PY'
import json; c = json.load(open("/tmp/inproc/sac.json")); c["task"] = "plan"; json.dump(c, open("/tmp/inproc/sac_plan.json", "w"))
PY
python3 -m acstudio.bench.worker $W/sac_plan.json > $O/P.json 2> $O/P.log; summ $O/P.json "P plan task"; echo "t=$(( $(date +%s)-t0 ))"
python3 -m acstudio.bench.worker $W/sac.json > $O/E.json 2> $O/E.log; summ $O/E.json "E sac cold cache, planned apart"; echo "t=$(( $(date +%s)-t0 ))"
python3 -m acstudio.bench.worker $W/sac.json > $O/E2.json 2> $O/E2.log; summ $O/E2.json "E2 sac warm cache, planned apart"; echo "t=$(( $(date +%s)-t0 ))"
python3 -m acstudio.bench.worker $W/peer.json > $O/C.json 2> $O/C.log; summ $O/C.json "C compile@0.2 cold cache"; echo "t=$(( $(date +%s)-t0 ))"
python3 -m acstudio.bench.worker $W/peer.json > $O/C2.json 2> $O/C2.log; summ $O/C2.json "C2 compile@0.2 warm cache"; echo "t=$(( $(date +%s)-t0 ))"
