#!/usr/bin/env bash
# `tandem plan` on DistServe's and Splitwise's published workloads, with the datasheet profiles of
# docs/plan/profiles (regenerate them with docs/plan/datasheet_profiles.py). Prints each plan's table;
# BENCHMARKS.md ("tandem plan against DistServe and Splitwise") has the comparison.
#   TANDEM=target/release/tandem MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf docs/plan/compare.sh
# The model only tokenizes the prompts (--foreign-model): the profiles describe OPT and Llama 2 models.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tandem=${TANDEM:-target/release/tandem}
model=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
n=${NUM_PROMPTS:-64}

plan() { # name profile transport in out ttft itl gpus
  echo "## $1"
  "$tandem" plan --profile "$here/profiles/$2" --model "$model" --foreign-model --transport "$3" \
    --workload random --num-prompts "$n" --input-len "$4" --output-len "$5" --range-ratio 0.8 \
    --ttft-p90-ms "$6" --itl-p90-ms "$7" --gpus "$8"
  echo
}

# DistServe (OSDI'24): SLOs as its repository's simdistserve/benchmarks/figure11-abalation/01-run_abalation.sh
# gives them ("See paper Table 1"), fleets of its ablation (4, 8, 32 GPUs) and a larger one.
plan "DistServe OPT-13B ShareGPT" distserve-opt-13b-a100.json nvlink 700 200 200 100 4,8,64
plan "DistServe OPT-66B ShareGPT" distserve-opt-66b-a100.json nvlink 700 200 400 100 8,64
plan "DistServe OPT-66B HumanEval" distserve-opt-66b-a100.json nvlink 170 100 125 200 8,64
plan "DistServe OPT-66B LongBench" distserve-opt-66b-a100.json nvlink 1700 90 1500 150 8,64
plan "DistServe OPT-175B ShareGPT" distserve-opt-175b-a100.json nvlink 700 200 4000 200 32,64
# Splitwise (ISCA'24): Llama 2 70B on DGX-H100, the Azure coding and conversation traces' mean lengths
# (its repository's generate_trace.py), 40 machines (320 GPUs) as its iso-power cluster.
plan "Splitwise Llama2-70B coding" splitwise-llama2-70b-h100.json ib 2048 28 1000 50 320
plan "Splitwise Llama2-70B conversation" splitwise-llama2-70b-h100.json ib 1155 211 1000 50 320
