#!/usr/bin/env bash
# run-demo-llama.sh — `bash scripts/run-demo.sh llama`: install, build, train a SentencePiece
# model on the GPL-3 text with Debian's spm_train (vocabulary 1024, unigram, one thread and a
# fixed seed, so the same model every time), tokenize the text with it, and train on 2 ranks:
# configs/llama.yaml once the Llama model is in fsdp-train, until then the Transformer of
# configs/gpl3-spm.yaml on the same tokens (it says which). The run logs the eval loss, and its
# sample is decoded with the same SentencePiece model (data.tokenizer). Extra arguments go to
# fsdp-train, e.g.
#   bash scripts/run-demo.sh llama --training.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
text=/usr/share/common-licenses/GPL-3
spm_train --input="$text" --model_prefix=build/gpl3-spm --vocab_size=1024 --model_type=unigram \
  --character_coverage=1.0 --byte_fallback=true --num_threads=1 --random_seed=0 --minloglevel=2
build/tools/fsdp-train/fsdp-train tokenize --tokenizer build/gpl3-spm.model "$text" build/gpl3-spm.tokens
config=configs/llama.yaml
if [[ ! -f "$config" ]]; then
  echo "run-demo-llama: configs/llama.yaml is not there yet (no Llama model in fsdp-train):" \
       "training the Transformer of configs/gpl3-spm.yaml on the SentencePiece tokens instead"
  config=configs/gpl3-spm.yaml
fi
build/tools/fsdprun/fsdprun --standalone --nproc-per-node 2 \
  build/tools/fsdp-train/fsdp-train "$config" --data.path=build/gpl3-spm.tokens \
  --data.tokenizer=build/gpl3-spm.model --eval.path=build/gpl3-spm.tokens "$@"
