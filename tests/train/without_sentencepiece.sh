#!/usr/bin/env bash
# fsdp-train built without SentencePiece (FSDP_WITH_SENTENCEPIECE=OFF): `tokenize --tokenizer` and
# data.tokenizer stop before any work, naming the key, the model file and the build option.
#   without_sentencepiece.sh FSDP_TRAIN CONFIGS_DIR
set -uo pipefail
train=$1 configs=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "some text to tokenize" > "$tmp/in.txt"
failed=0
expect() {  # expect WHAT CONDITION-RESULT OUTPUT
  if [[ $2 != 0 ]]; then echo "FAILED: $1"; echo "$3" | sed 's/^/  | /'; failed=1; else echo "ok: $1"; fi
}
has() { grep -qF -- "$2" <<< "$1"; echo $?; }

said=$("$train" tokenize --tokenizer "$tmp/m.model" "$tmp/in.txt" "$tmp/out.tokens" 2>&1)
rc=$?
expect "tokenize --tokenizer exits non-zero (got $rc)" "$(( rc == 0 ))" "$said"
expect "it names the key and the model" "$(has "$said" "--tokenizer: $tmp/m.model needs SentencePiece")" "$said"
expect "it names the build option" "$(has "$said" "-DFSDP_WITH_SENTENCEPIECE=ON")" "$said"
expect "it wrote no token file" "$( [[ -e $tmp/out.tokens ]]; echo $(( $? == 0 )) )" "$(ls -l "$tmp")"

said=$("$train" "$configs/tiny.yaml" "--data.tokenizer=$tmp/m.model" --training.steps=1 --logging.progress=off \
       "--fsdp_config.checkpoint_dir=$tmp/ckpt" "--logging.jsonl=$tmp/m.jsonl" --training.export=none 2>&1)
rc=$?
expect "data.tokenizer is a configuration error, exit 2 (got $rc)" "$(( rc != 2 ))" "$said"
expect "it names the key and the model" "$(has "$said" "data.tokenizer: $tmp/m.model needs SentencePiece")" "$said"
expect "it names the build option" "$(has "$said" "-DFSDP_WITH_SENTENCEPIECE=ON")" "$said"
expect "nothing was started: no checkpoint folder, no metrics" \
  "$( [[ -e $tmp/ckpt || -e $tmp/m.jsonl ]]; echo $(( $? == 0 )) )" "$(ls -l "$tmp")"
exit $failed
