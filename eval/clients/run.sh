#!/usr/bin/env bash
# Runs two real clients, unchanged, against a running `python -m sparkjax.serve` (the demo pair, default flags):
# guidellm (streaming, synthetic data, concurrency 1 / 4 / 16, 48 requests each, chat and completions) and
# lm-evaluation-harness `local-completions` on a generate task and a multiple-choice task (this folder's YAMLs
# over its JSONL files, 12 questions each). Neither client is a sparkjax dependency: install them in a venv of
# their own (pip install guidellm==0.8.1 "lm-eval[api]==0.4.13").
#
#   eval/clients/run.sh VENV OUT [URL]      VENV: that venv's folder; OUT: a new folder for the logs and results;
#                                           URL: the server (default http://127.0.0.1:8000)
# Then `grep http_responses OUT/metrics.txt` lists the server's responses by status.
set -euo pipefail
VENV=$1; OUT=$2; URL=${3:-http://127.0.0.1:8000}
cd "$(dirname "$0")/../.."
mkdir "$OUT"
TOK=sparkjax/assets/demo/target
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
for route in /v1/chat/completions /v1/completions; do
  name=${route#/v1/}; name=${name//\//-}
  "$VENV/bin/guidellm" run \
    --backend "{\"kind\":\"openai_http\",\"target\":\"$URL\",\"request_format\":\"$route\"}" \
    --profile '{"kind":"concurrent","streams":[1,4,16]}' \
    --data '{"kind":"synthetic_text","prompt_tokens":64,"output_tokens":32}' \
    --tokenizer "{\"kind\":\"huggingface_auto\",\"model\":\"$TOK\"}" \
    --constraint '{"kind":"max_requests","count":48}' --constraint '{"kind":"max_duration","seconds":120}' \
    --output "{\"kind\":\"json\",\"path\":\"$OUT/guidellm-$name.json\"}" --output '{"kind":"console"}' \
    --disable-progress > "$OUT/guidellm-$name.txt" 2>&1
  grep -E "completed \|" "$OUT/guidellm-$name.txt" | sed 's/.*Benchmark/guidellm '"$name"': Benchmark/'
done
for task in local_gen local_mc; do
  "$VENV/bin/lm-eval" run --model local-completions \
    --model_args "base_url=$URL/v1/completions,model=sparkjax-demo,tokenizer=$TOK,tokenizer_backend=huggingface" \
    --tasks $task --include_path eval/clients --limit 12 --output_path "$OUT/lmeval-$task" \
    > "$OUT/lmeval-$task.txt" 2>&1
  grep -E "^\|" "$OUT/lmeval-$task.txt" | sed "s/^/lm-eval $task: /"
done
curl -s "$URL/metrics" > "$OUT/metrics.txt"
grep http_responses "$OUT/metrics.txt"
