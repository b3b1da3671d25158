"""A Slurm cluster of its own on one machine, for the Slurm tests (test_slurm.py): compute nodes
host0..host<n-1> and a login node, each a host of hosts.py (a network namespace with its own
address, host name and /etc/hosts), one slurmd per compute node and slurmctld on the login node,
all authenticated by a munged of their own.

    with SlurmCluster(2) as cluster:
        r = cluster.run(["srun", "-N", "2", "-n", "4", "hostname"])     # from the login node

Debian's slurmd is built for one daemon per machine; here each runs in its own namespaces, so
each is alone on its "machine", with `-N hostN`, its own spool directory and pid file (%n in
slurm.conf). No cgroups: processes are tracked by their parentage (proctrack/linuxproc) and not
confined (task/none). Every file (key, sockets, state, logs) lives in one temporary directory;
daemons and the processes of jobs are killed, and the namespaces removed, on exit, also when a
test fails (FSDP_KEEP_SLURM_DIR=1 keeps the directory, to read the daemons' logs). The clients
(srun, sbatch, scontrol) find the cluster through SLURM_CONF, which `env` holds. Needs root,
iproute2, munge and Slurm's daemons; `available()` says why not.
"""
import os
import shutil
import subprocess
import tempfile
import time

from hosts import Hosts
from hosts import available as hosts_available

PROGRAMS = ("munged", "slurmctld", "slurmd", "slurmstepd", "srun", "sbatch", "scontrol", "sinfo")


def available():
    """'' when a cluster can be made here, otherwise why not."""
    missing = [d for d in PROGRAMS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return (f"{', '.join(missing)} not installed (scripts/install-deps.sh installs Debian's slurmctld, slurmd, "
                "slurm-client and munge)")
    return hosts_available()


def _which(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, nodes, cpus=2, partition="debug"):
        # `cpus` per node, whatever the machine has (config_overrides): the nodes share its cores.
        self.nodes = nodes
        self.cpus = cpus
        self.partition = partition
        self.hosts = Hosts(nodes + 1, names=[f"host{i}" for i in range(nodes)] + ["login"])
        self.login = nodes  # the index of the login node among the hosts
        self.dir = None
        self.munged = None

    def node_name(self, i):
        return f"host{i}"

    def address(self, i):
        return self.hosts.address(i)

    @property
    def env(self):
        """What a client needs to find this cluster."""
        return {"SLURM_CONF": self.conf}

    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    def __enter__(self):
        self.dir = tempfile.mkdtemp(prefix="fsdp-slurm-")
        os.chmod(self.dir, 0o755)
        try:
            self.hosts.__enter__()
            self._start_munged()
            self._write_conf()
            self.hosts.start(self.login, [_which("slurmctld"), "-D", "-f", self.conf],
                             stdout=open(self.path("slurmctld.out"), "w"), stderr=subprocess.STDOUT)
            for i in range(self.nodes):
                self.hosts.start(i, [_which("slurmd"), "-D", "-f", self.conf, "-N", self.node_name(i)],
                                 stdout=open(self.path(f"slurmd-{i}.out"), "w"), stderr=subprocess.STDOUT)
            self._wait_until_idle(timeout=60)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _start_munged(self):
        key = self.path("munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.socket = self.path("munge.socket")
        self.munged = subprocess.Popen(
            [_which("munged"), "-F", f"--key-file={key}", f"--socket={self.socket}",
             f"--pid-file={self.path('munged.pid')}", f"--log-file={self.path('munged.log')}",
             f"--seed-file={self.path('munged.seed')}"],
            stdout=open(self.path("munged.out"), "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 10
        while not os.path.exists(self.socket):
            if self.munged.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.logs('munged.out', 'munged.log')}")
            time.sleep(0.05)

    def _write_conf(self):
        self.conf = self.path("slurm.conf")
        # Each node's spool and temporary directory of its own (PMIx's client directories are
        # named by the job alone, and would collide in one shared /tmp).
        os.makedirs(self.path("state"))
        for i in range(self.nodes):
            os.makedirs(self.path("spool", self.node_name(i)))
            os.makedirs(self.path("tmp", self.node_name(i)))
        # slurmd loads a cgroup plugin even when nothing uses it; named, it is not probed for
        # (`ip netns exec` gives the node a /sys of its own, without the machine's cgroup mounts).
        with open(self.path("cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\n")
        nodes = "\n".join(f"NodeName={self.node_name(i)} NodeAddr={self.address(i)} CPUs={self.cpus} State=UNKNOWN"
                          for i in range(self.nodes))
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=fsdp
SlurmctldHost=login({self.address(self.login)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool', '%n')}
SlurmctldPidFile={self.path('slurmctld.pid')}
SlurmdPidFile={self.path('spool', 'slurmd-%n.pid')}
SlurmctldLogFile={self.path('slurmctld.log')}
SlurmdLogFile={self.path('slurmd-%n.log')}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
TmpFS={self.path("tmp", "%n")}
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=300
{nodes}
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _wait_until_idle(self, timeout):
        deadline = time.time() + timeout
        while True:
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10, check=False)
            states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
            if len(states) == self.nodes and all(s == "idle" for s in states.values()):
                return
            if time.time() > deadline:
                raise RuntimeError(f"the Slurm nodes never became idle (sinfo: {r.stdout.strip() or r.stderr.strip()})"
                                   f":\n{self.logs()}")
            time.sleep(0.3)

    def run(self, argv, on=None, env=None, timeout=120, check=True):
        """Runs a client command (srun, sbatch, scontrol, ...) on the login node, or on host `on`,
        and waits for it; returns the CompletedProcess (stdout and stderr as text)."""
        p = self.hosts.start(self.login if on is None else on, argv, env={**self.env, **(env or {})},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            out, err = p.communicate()
            raise RuntimeError(f"{' '.join(argv)} did not finish within {timeout} s:\n{out}\n{err}\n{self.logs()}")
        r = subprocess.CompletedProcess(argv, p.returncode, out, err)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}):\n{out}\n{err}\n{self.logs()}")
        return r

    def wait_for_job(self, job_id, timeout):
        """Waits until the job has left the queue; returns its final state as scontrol says."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            r = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False, timeout=10)
            state = next((w.split("=", 1)[1] for w in r.stdout.split() if w.startswith("JobState=")), None)
            if state not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return state
            time.sleep(0.3)
        raise RuntimeError(f"job {job_id} still in the queue after {timeout} s:\n{self.logs()}")

    def logs(self, *names):
        """The tails of the daemons' logs, for a failure's message."""
        names = names or sorted(n for n in os.listdir(self.dir) if n.endswith((".log", ".out")))
        parts = []
        for n in names:
            try:
                with open(self.path(n), errors="replace") as f:
                    parts.append(f"--- {n}:\n" + "".join(f.readlines()[-20:]))
            except OSError:
                pass
        return "\n".join(parts)

    def close(self):
        self.hosts.close()  # slurmctld, the slurmds, their slurmstepds and the jobs' processes
        if self.munged is not None and self.munged.poll() is None:
            self.munged.kill()
            self.munged.wait()
        if self.dir and not os.environ.get("FSDP_KEEP_SLURM_DIR"):
            shutil.rmtree(self.dir, ignore_errors=True)
