#!/usr/bin/env bash
# expect_job_end.sh EXPECTED_TEXT -- MPIRUN_COMMAND...
# Runs an MPI job that must END (not hang, not succeed): fails if the job runs past 120 s,
# exits 0, or its output lacks each |-separated piece of EXPECTED_TEXT.
set -uo pipefail
expected=$1
shift
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
echo "expect_job_end: ok"
