#!/usr/bin/env bash
# tensorboard_screenshot.sh — a manual check that TensorBoard shows fsdp-train's event files: trains
# a short demo run with logging.tensorboard_dir (or takes a folder of event files), serves
# TensorBoard on loopback, opens its Scalars dashboard in headless Chromium and saves a PNG. Look
# at the pictures: the train/loss chart should show a falling curve, the Text tab the config
# (FILE_text.png).
#   bash tools/tensorboard_screenshot.sh [--logdir DIR] [--steps N] [--out FILE.png]
# Defaults: a fresh 100-step run of configs/gpl3.yaml on 2 ranks, out/tensorboard.png. Needs the
# build (scripts/build.sh), tensorboard in the project's venv and Debian's chromium
# (FSDP_SCREENSHOT_TOOLS=1 bash scripts/install-deps.sh installs both).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch-env.sh

logdir="" steps=100 out=out/tensorboard.png
while (($#)); do
  case "$1" in
    --logdir) logdir="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "tensorboard_screenshot.sh: unknown argument '$1' (takes --logdir DIR, --steps N, --out FILE.png)" >&2; exit 2 ;;
  esac
done
browser="$(command -v chromium || true)"
if [[ -z "$browser" ]]; then
  echo "tensorboard_screenshot.sh: no chromium: FSDP_SCREENSHOT_TOOLS=1 bash scripts/install-deps.sh" >&2; exit 1
fi
if ! "$FSDP_PYTHON" -c "import tensorboard" 2>/dev/null; then
  echo "tensorboard_screenshot.sh: $FSDP_PYTHON has no tensorboard: bash scripts/install-deps.sh" >&2; exit 1
fi

work="$(mktemp -d)"
tb_pid=""
cleanup() {
  if [[ -n "$tb_pid" ]]; then kill "$tb_pid" 2>/dev/null || true; wait "$tb_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

if [[ -z "$logdir" ]]; then
  build/tools/fsdp-train/fsdp-train tokenize /usr/share/common-licenses/GPL-3 "$work/gpl3.tokens"
  logdir="$work/tb"
  build/tools/fsdprun/fsdprun --standalone --nproc-per-node 2 build/tools/fsdp-train/fsdp-train configs/gpl3.yaml \
    --data.path="$work/gpl3.tokens" --training.steps="$steps" --fsdp_config.checkpoint_dir="$work/ckpt" \
    --fsdp_config.checkpoint_interval=0 --training.export=none --sample.length=0 --logging.jsonl= \
    --logging.progress=off --logging.log_interval="$steps" --logging.tensorboard_dir="$logdir"
fi

# A free port on loopback, then TensorBoard on it; ready once its HTTP answers (polled, up to 60 s).
port="$("$FSDP_PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")"
"$FSDP_PYTHON" -m tensorboard.main --logdir "$logdir" --host 127.0.0.1 --port "$port" >"$work/tensorboard.log" 2>&1 &
tb_pid=$!
url="http://127.0.0.1:${port}"
"$FSDP_PYTHON" - "$url" "$tb_pid" <<'PY' || { cat "$work/tensorboard.log" >&2; exit 1; }
import os, sys, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 60
while True:
    try:
        # The scalars' data route: TensorBoard answers it once the event files are loaded.
        with urllib.request.urlopen(url + "/data/plugin/scalars/tags", timeout=5) as r:
            if b"train/loss" in r.read():
                break
    except OSError:
        pass
    os.kill(pid, 0)  # TensorBoard died: raises, and the log is shown
    if time.monotonic() > deadline:
        sys.exit(f"tensorboard at {url} did not list train/loss within 60 s")
    time.sleep(0.5)
PY

mkdir -p "$(dirname "$out")"
# The Scalars dashboard draws with SVG, which a headless browser without a GPU renders; the
# virtual-time budget lets its scripts fetch and draw before the picture is taken. The tag filter
# keeps the train/ group (loss first) at the top; the Text tab's picture shows the config.
shoot() {
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1000 \
    --virtual-time-budget=20000 --screenshot="$1" "$2" 2>"$work/chromium.log" || { cat "$work/chromium.log" >&2; exit 1; }
}
shoot "$out" "${url}/#scalars&tagFilter=train%2F&_smoothingWeight=0"
text_out="${out%.png}_text.png"
shoot "$text_out" "${url}/#text"
echo "tensorboard_screenshot.sh: $out and $text_out (TensorBoard over $logdir); look at them: the" \
     "train/loss chart should show a falling curve, the Text tab the run's config"
