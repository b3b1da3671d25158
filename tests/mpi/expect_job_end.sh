#!/usr/bin/env bash
# expect_job_end.sh EXPECTED_TEXT [--within SECONDS] -- MPIRUN_COMMAND...
# Runs an MPI job that must END (not hang, not succeed): fails if the job runs past 120 s,
# exits 0, or its output lacks each |-separated piece of EXPECTED_TEXT. With --within, the job
# must also end within SECONDS of the last "job-clock-start: <epoch ms>" line a rank printed.
set -uo pipefail
expected=$1
shift
within=""
if [[ $1 == --within ]]; then
  within=$2
  shift 2
fi
[[ $1 == -- ]] && shift
start=$SECONDS
out=$(timeout --kill-after=10 120 "$@" 2>&1)
rc=$?
elapsed=$((SECONDS - start))
echo "$out" | tail -n 40
echo "expect_job_end: exit status $rc"
# mpirun passes a killed rank's status on (137 for SIGKILL), so a hang is told by the clock.
if ((elapsed >= 120)); then
  echo "expect_job_end: FAIL: the job was still running after 120 s (a hang)"
  exit 1
fi
if ((rc == 0)); then
  echo "expect_job_end: FAIL: the job succeeded; it should have ended with an error"
  exit 1
fi
IFS='|' read -r -a pieces <<<"$expected"
for piece in "${pieces[@]}"; do
  if ! grep -qF -- "$piece" <<<"$out"; then
    echo "expect_job_end: FAIL: the output does not contain: $piece"
    exit 1
  fi
done
if [[ -n $within ]]; then
  ended_ms=$(date +%s%3N)
  started_ms=$(grep -o 'job-clock-start: [0-9]*' <<<"$out" | tail -n 1 | awk '{print $2}')
  if [[ -z $started_ms ]]; then
    echo "expect_job_end: FAIL: no rank printed job-clock-start"
    exit 1
  fi
  took_ms=$((ended_ms - started_ms))
  echo "expect_job_end: the job ended ${took_ms} ms after job-clock-start (allowed: ${within} s)"
  if ((took_ms > within * 1000)); then
    echo "expect_job_end: FAIL: the job ended later than ${within} s after job-clock-start"
    exit 1
  fi
fi
echo "expect_job_end: ok"
