"""fsdp-train under Slurm, for real: a cluster of its own (slurm.py: slurmctld on a login node and a
slurmd on each of two compute nodes, network namespaces with their own addresses and names, one
munged). The job's four ranks, two per node, train exactly as the same ranks on one host do under
`fsdprun --standalone`, started three ways:
  - `srun -N 2 -n 4 fsdp-train` from the login node: each rank reads its place from SLURM_*, and
    rank 0 hosts the store on the step's first node;
  - `sbatch examples/slurm/train.sbatch`: one fsdprun per node, meeting at the first node's
    address (NodeAddr);
  - the mpi backend under `srun --mpi=pmix` (OpenMPI's PMIx, Slurm's mpi/pmix plugin).
`srun --mpi=pmi2` is not a case: Debian 12's OpenMPI 4.1 is built without Slurm's PMI-2 library,
and its ranks stop in MPI_Init_thread ("OMPI was not built with SLURM's PMI support").
Run by ctest (label multihost) with FSDP_BUILD_DIR set; skipped, with the reason, where Slurm is
not installed or its daemons cannot start."""
import contextlib
import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hosts import IFNAME  # noqa: E402
from slurm import SlurmCluster, available  # noqa: E402
from test_multihost import BUILD, REPO, TRAINER, losses, one_host, trainer_args  # noqa: E402

SBATCH = os.path.join(REPO, "examples", "slurm", "train.sbatch")
STEPS = 6

why_not = available()
pytestmark = pytest.mark.skipif(bool(why_not), reason=f"no Slurm cluster here: {why_not}")


def rank_env(backend):
    return {"FSDP_BACKEND": backend, "FSDP_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1"}


@contextlib.contextmanager
def two_node_cluster():
    """A cluster of two nodes, or the test skipped saying why the daemons did not start."""
    cluster = SlurmCluster(2)
    try:
        cluster.__enter__()  # closes what it started when it fails
    except RuntimeError as e:
        pytest.skip(f"the Slurm daemons did not start here: {e}")
    try:
        yield cluster
    finally:
        cluster.close()


def ranks_out(r):
    return f"exit status {r.returncode}\n--- stdout:\n{r.stdout}\n--- stderr:\n{r.stderr}"


def test_srun_from_the_login_node_trains_as_one_host_does():
    with tempfile.TemporaryDirectory() as tmp:
        want = one_host(os.path.join(tmp, "one"), STEPS)
        with two_node_cluster() as cluster:
            out = os.path.join(tmp, "srun")
            r = cluster.run(["srun", "-N", "2", "-n", "4", "--kill-on-bad-exit=1", *trainer_args(out, STEPS)],
                            env=rank_env("gloo"), timeout=240, check=False)
            assert r.returncode == 0, ranks_out(r) + cluster.logs()
            assert "collectives on gloo" in r.stdout, ranks_out(r)
            assert losses(out) == want


def test_sbatch_starts_one_fsdprun_per_node_and_trains_as_one_host_does():
    with tempfile.TemporaryDirectory() as tmp:
        want = one_host(os.path.join(tmp, "one"), STEPS)
        with two_node_cluster() as cluster:
            out, log = os.path.join(tmp, "sbatch"), os.path.join(tmp, "job.out")
            env = {**rank_env("gloo"), "FSDP_BUILD_DIR": BUILD, "FSDP_NPROC_PER_NODE": "2"}
            r = cluster.run(["sbatch", "--parsable", f"--chdir={REPO}", f"--output={log}", SBATCH,
                             *trainer_args(out, STEPS)[1:]], env=env, timeout=30)
            job = r.stdout.strip().split(";")[0]
            state = cluster.wait_for_job(job, timeout=240)
            with open(log) as f:
                text = f.read()
            assert state == "COMPLETED", f"job {job}: {state}\n{text}\n{cluster.logs()}"
            first = cluster.address(0)
            assert f"train.sbatch: 2 nodes x 2 ranks, store on host0 ({first}:" in text, text
            assert "collectives on gloo" in text, text
            assert losses(out) == want


def test_mpi_backend_under_srun_pmix_trains_as_one_host_does():
    with tempfile.TemporaryDirectory() as tmp:
        want = one_host(os.path.join(tmp, "one"), STEPS)
        with two_node_cluster() as cluster:
            plugins = cluster.run(["srun", "--mpi=list"], check=False, timeout=30)
            if "pmix" not in plugins.stdout + plugins.stderr:
                pytest.skip(f"this Slurm has no mpi/pmix plugin (srun --mpi=list: {plugins.stdout + plugins.stderr})")
            out = os.path.join(tmp, "mpi")
            r = cluster.run(["srun", "--mpi=pmix", "-N", "2", "-n", "4", "--kill-on-bad-exit=1",
                             *trainer_args(out, STEPS)], env=rank_env("mpi"), timeout=240, check=False)
            if "has no MPI backend" in r.stdout + r.stderr:
                pytest.skip("this build of fsdp-cpp has no MPI backend (CMake found no MPI)")
            assert r.returncode == 0, ranks_out(r) + cluster.logs()
            assert "collectives on mpi" in r.stdout, ranks_out(r)
            got = losses(out)
            # MPI's reductions add in an order of their own: equal to rounding, not bitwise.
            assert got == pytest.approx(want, rel=1e-5), (got, want)
