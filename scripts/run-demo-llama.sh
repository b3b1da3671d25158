#!/usr/bin/env bash
# run-demo-llama.sh — `bash scripts/run-demo.sh llama`: install, build, train a SentencePiece
# model on the GPL-3 text with Debian's spm_train (vocabulary 1024, unigram, one thread and a
# fixed seed, so the same model every time), tokenize the text with it, and train the Llama of
# configs/llama.yaml on those tokens on 2 ranks (configs/gpl3-spm.yaml trains the Transformer on
# the same tokens). The run logs the eval loss over the text's first windows every 100 steps and
# exports a Hugging Face directory (checkpoints/llama-spm/hf); its sample is decoded with the same
# SentencePiece model (data.tokenizer). Extra arguments go to fsdp-train, e.g.
#   bash scripts/run-demo.sh llama --training.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
FSDP_BUILD_TARGETS="fsdp-train fsdprun" bash scripts/build.sh -DFSDP_WERROR=ON  # as run-demo.sh builds
text=/usr/share/common-licenses/GPL-3
spm_train --input="$text" --model_prefix=build/gpl3-spm --vocab_size=1024 --model_type=unigram \
  --character_coverage=1.0 --byte_fallback=true --num_threads=1 --random_seed=0 --minloglevel=2
build/tools/fsdp-train/fsdp-train tokenize --tokenizer build/gpl3-spm.model "$text" build/gpl3-spm.tokens
# configs/llama.yaml's Llama with configs/llama-spm/config.json: the same shape with the
# SentencePiece model's vocabulary of 1024, and checkpoints of its own.
build/tools/fsdprun/fsdprun --standalone --nproc-per-node 2 \
  build/tools/fsdp-train/fsdp-train configs/llama.yaml --model.hf_config=configs/llama-spm/config.json \
  --data.path=build/gpl3-spm.tokens --data.tokenizer=build/gpl3-spm.model \
  --eval.path=build/gpl3-spm.tokens --eval.batches=2 --eval.interval=100 \
  --fsdp_config.checkpoint_dir=./checkpoints/llama-spm --logging.jsonl=./checkpoints/llama-spm/metrics_rank{rank}.jsonl \
  --sample.length=60 "$@"
