"""Runs one test of test_multihost.py or test_slurm.py for ctest: pytest's exit status, except 77
when the test was skipped (no network namespaces or no Slurm here), so that ctest reports it
skipped, never passed."""
import sys

import pytest


class Outcomes:
    def __init__(self):
        self.skipped = self.ran = 0

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.outcome != "skipped":
            self.ran += 1
        if report.skipped:
            self.skipped += 1


if __name__ == "__main__":
    outcomes = Outcomes()
    status = pytest.main(["-q", "-rs", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[outcomes])
    sys.exit(77 if status == 0 and outcomes.skipped and not outcomes.ran else int(status))
