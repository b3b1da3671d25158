"""Hosts of their own on one machine: network namespaces joined by a bridge, each with its own
address, for the multi-host tests (test_multihost.py).

    with Hosts(2) as hosts:
        p = hosts.start(0, ["fsdprun", "--nnodes", "2", "--master-addr", hosts.address(0), ...])
        hosts.link_down(1)          # host 1's cable pulled: its namespace stays, its link is down

Each host is a network namespace `<tag>h<i>` with one interface, named `IFNAME` in every host (so one
FSDP_SOCKET_IFNAME fits all), at 10.<a>.<b>.<10 + i>/24 on the bridge `<tag>br`, where the tag
and the subnet come from this process's id: concurrent tests do not collide. Everything is
removed on exit, also when a test fails, and the processes started in the hosts are killed
first. Each process started in a host also gets a pid namespace of its own, so that hosts do not
see each other's processes, and a TMPDIR of its host's own, as separate machines do not share
/tmp (fsdprun's default flight-recorder folder is named by its pid, 1 in every host). Needs root (ip netns, ip link) and iproute2; `available()` says why not otherwise.
"""
import os
import shutil
import signal
import subprocess
import tempfile
import time

IFNAME = "fsdp0"


def _ip(*args, netns=None, check=True):
    cmd = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def available():
    """'' when namespaces with veth pairs and a bridge can be made here, otherwise why not."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"fsdpprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


class Hosts:
    def __init__(self, count):
        if not 1 <= count <= 8:
            raise ValueError(f"Hosts: 1 to 8 hosts, got {count}")
        pid = os.getpid()
        self.count = count
        self.tag = f"fm{pid % 100000}"
        self.subnet = f"10.{100 + pid % 100}.{(pid // 100) % 250}"
        self.bridge = f"{self.tag}br"
        self.processes = []
        self.tmpdirs = []

    def netns(self, i):
        return f"{self.tag}h{i}"

    def _veth(self, i):  # the bridge's end of host i's cable
        return f"{self.tag}v{i}"

    def address(self, i):
        return f"{self.subnet}.{10 + i}"

    def __enter__(self):
        self.tmpdirs = [tempfile.mkdtemp(prefix=f"{self.netns(i)}-") for i in range(self.count)]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                ns, veth, inner = self.netns(i), self._veth(i), f"{self.tag}p{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", inner, "name", IFNAME, netns=ns)
                _ip("addr", "add", f"{self.address(i)}/24", "dev", IFNAME, netns=ns)
                _ip("link", "set", IFNAME, "up", netns=ns)
                _ip("link", "set", "lo", "up", netns=ns)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self, i, argv, env=None, **popen):
        """Starts argv inside host i, in a process group and a pid namespace of its own (its
        processes die with it); returns the Popen."""
        full_env = dict(os.environ)
        full_env["TMPDIR"] = self.tmpdirs[i]
        full_env.update(env or {})
        p = subprocess.Popen(["ip", "netns", "exec", self.netns(i), "unshare", "--pid", "--fork", "--kill-child",
                              *argv], env=full_env, start_new_session=True, **popen)
        self.processes.append(p)
        return p

    def link_down(self, i):
        _ip("link", "set", self._veth(i), "down")

    def link_up(self, i):
        _ip("link", "set", self._veth(i), "up")

    def kill_host(self, i):
        """Every process of host i, killed at once: each started process group, and whatever else
        runs inside its namespace (workers in process groups of their own)."""
        for p in self.processes:
            if p.args[3] == self.netns(i) and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        r = subprocess.run(["ip", "netns", "pids", self.netns(i)], capture_output=True, text=True)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self):
        for p in self.processes:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # ip netns pids lists what is still inside (a grandchild that left the process group).
        for i in range(self.count):
            r = subprocess.run(["ip", "netns", "pids", self.netns(i)], capture_output=True, text=True)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        time.sleep(0.1)
        for i in range(self.count):
            subprocess.run(["ip", "netns", "del", self.netns(i)], capture_output=True)
            subprocess.run(["ip", "link", "del", self._veth(i)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        for d in self.tmpdirs:
            shutil.rmtree(d, ignore_errors=True)
