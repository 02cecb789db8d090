#!/usr/bin/env bash
# Rerun every command whose output the README, docs/ and MODEL.md quote for the bundled model, one after another
# (nothing else running: the timed ones are the main job and the sweep), each output saved under OUT.
#
#     bash scripts/regenerate_readme.sh [OUT [STEP ...]]     (OUT default runs/readme; STEP default: all, in order)
#
# Steps: main_job three_bit two_bit sweep engines engines_test levels transform ablation_2bit ablation_2bit_2048
#        recall two_bit_cap engine_fp8 export_vllm int8_matmul rope_rotation guard guard_clip_all fast_path bf16
#        generate hf_cache lm_eval (two_bit_cap: the 2-bit config under --max-bits 2.3, which must fail in one line)
#
# The decode-speed benchmarks (`mlaquant bench decode ...`) are not here: they use random weights, not the
# bundled model, and want an idle machine of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/readme}
shift || true
STEPS=${*:-main_job three_bit two_bit sweep engines engines_test levels transform ablation_2bit ablation_2bit_2048 recall two_bit_cap engine_fp8 export_vllm int8_matmul rope_rotation guard guard_clip_all fast_path bf16 generate hf_cache lm_eval}
mkdir -p "$OUT"
run() {  # run NAME CMD...: stdout+stderr to OUT/NAME.txt, wall time appended; skipped unless NAME is in STEPS
    local name=$1; shift
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "== $name: $*" >&2
    local t0=$SECONDS
    "$@" > "$OUT/$name.txt" 2>&1
    echo "wall $(( SECONDS - t0 )) s: $*" >> "$OUT/$name.txt"
}
run main_job /usr/bin/time -v mlaquant calibrate --out plans/default
run three_bit /usr/bin/time -v mlaquant calibrate --config configs/calibrate-3bit.yaml --out plans/3bit
run two_bit /usr/bin/time -v mlaquant calibrate --config configs/calibrate-2bit.yaml --out plans/2bit
run sweep bash -c 'mlaquant sweep --out runs/sweep && mkdir -p docs/sweep && cp runs/sweep/{report.md,report.json,sweep.png,memory.png} docs/sweep/'
run engines mlaquant engines --plan plans/default --data third-party --codecs int4-g32/int4-g32,int4-row/int4-row
run engines_test mlaquant engines --plan plans/default --data test --codecs int4-g32/int4-g32,int4-row/int4-row
run levels python scripts/measure_levels.py
run transform python scripts/measure_transform.py --out "$OUT/transform.json"
run ablation_2bit python scripts/measure_2bit.py --out "$OUT/ablation-2bit.json"
run ablation_2bit_2048 python scripts/measure_2bit.py --seq-len 2048 --samples 8 \
    --rows "row-int 2.0 / int4-row,row-int 1.5 / int4-row,row-int 1.25 / int4-row,row-int 1.0 / int4-row,c_kv fp16,int8-row" \
    --out "$OUT/ablation-2bit-2048.json"
run recall mlaquant recall --plans plans/default,plans/3bit,plans/2bit
run two_bit_cap bash -c '! mlaquant calibrate --config configs/calibrate-2bit.yaml --max-bits 2.3 --out "$0/plan-2bit-cap"' "$OUT"
run engine_fp8 mlaquant calibrate --config configs/calibrate-engine-fp8.yaml --out plans/engine-fp8
run export_vllm mlaquant export --plan plans/engine-fp8 --engine vllm --out "$OUT/served-vllm"
run int8_matmul mlaquant calibrate --int8-matmul --out plans/int8mm
run rope_rotation python scripts/measure_rope_rotation.py
run guard python scripts/measure_recalibration.py --plan plans/default --out "$OUT/guard.json"
run guard_clip_all python scripts/measure_recalibration.py --plan plans/default --clip-all --out "$OUT/guard_clip_all.json"
run fast_path python scripts/measure_fast_path.py --plan plans/default --out "$OUT/fast_path.json"
run bf16 pytest -q -p no:cacheprovider tests/test_device.py -k bf16_weights -s
run generate mlaquant generate --plan plans/default --prompt "def fib(n):" --max-new-tokens 64
run hf_cache python - <<'PY'
import torch
from transformers import AutoModelForCausalLM
from mlaquant.integrations.hf import PlanCache
from mlaquant.modeling.loader import default_model_path, load_model

path = default_model_path()
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
tok = load_model(path).tokenizer
ids = torch.tensor([tok.encode("def fib(n):\n    if n < 2:").ids])
cache = PlanCache("int8", model)
out = model.generate(ids, cache=cache, max_new_tokens=32, do_sample=False)
print(tok.decode(out[0].tolist()))
print(cache.nbytes(), "bytes for", cache.get_seq_length(), "tokens")
PY
run lm_eval bash -c 'cd tests/lm_eval_tasks && HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 mlaquant-lm-eval --model mlaquant --model_args plan=int8,device=cpu --tasks mlaquant_code_choice,mlaquant_code_rolling --include_path .'
echo "outputs in $OUT" >&2
