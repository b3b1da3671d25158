"""Hosts of their own on one machine: network namespaces joined by a bridge, each with its own
address, for the multi-host tests (test_multihost.py).

    with Hosts(2) as hosts:
        p = hosts.start(0, ["fsdprun", "--nnodes", "2", "--master-addr", hosts.address(0), ...])
        hosts.link_down(1)          # host 1's cable pulled: its namespace stays, its link is down

    with Hosts(2, impaired={1: Impairment(delay_s=0.02, loss=0.01)}) as hosts:
        ...                         # host 1's cable holds each frame 20 ms and loses 1 %, each way

Each host is a network namespace `<tag>h<i>` with one interface, named `IFNAME` in every host (so one
FSDP_SOCKET_IFNAME fits all), at 10.<a>.<b>.<10 + i>/24 on the bridge `<tag>br`, where the tag
and the subnet come from this process's id: concurrent tests do not collide. Everything is
removed on exit, also when a test fails, and the processes started in the hosts are killed
first. Each process started in a host also gets a pid namespace of its own, so that hosts do not
see each other's processes, the host's own name (its namespace's), and a TMPDIR of its host's own, as separate machines do not share
/tmp (fsdprun's default flight-recorder folder is named by its pid, 1 in every host). Needs root (ip netns, ip link) and iproute2; `available()` says why not otherwise.

`mtu` sets every interface's and the bridge's MTU (default: the kernel's, 1500): a user-space
cable moves one frame per read, so big frames let it carry a faster link. `limit_rate(i, ...)`
puts the kernel's token-bucket filter (tc qdisc tbf) on host i's interface, which limits what the
host sends; `interface_counters(i)` reads that interface's byte counters.

Given `names`, host i is also called names[i]: what it starts sees that name as its host name
(instead of its namespace's), and every host's name resolves to its address inside the hosts
(an /etc/hosts of their own, /etc/netns/<namespace>/hosts, which `ip netns exec` mounts over
the machine's; the machine's own /etc/hosts is left alone).
"""
import fcntl
import heapq
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
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


TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def _open_tap(name):
    """A TAP device `name`, created in this namespace, and its descriptor (non-blocking): frames
    written to the descriptor come out of the device, and frames sent into it are read here. The
    descriptor stays bound to the device when the device moves to another namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def rate_bits(rate):
    """Bits per second of a rate in tc's spelling ("10gbit", "200mbit", "64kbit")."""
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"{rate!r} is not a rate in tc's spelling (NUMBER followed by gbit, mbit, kbit or bit)")


class Impairment:
    """What a host's cable does to every frame, each way: holds it `delay_s`, loses it with
    probability `loss` (in the manner of tc netem's delay and loss, done in user space because
    these machines' kernels have no netem)."""

    def __init__(self, delay_s=0.02, loss=0.01, seed=0):
        self.delay_s, self.loss, self.seed = delay_s, loss, seed


class _ImpairedCable(threading.Thread):
    """Carries frames between a host's interface and its port on the bridge (two TAP devices),
    as an Impairment says."""

    def __init__(self, host_fd, bridge_fd, impairment):
        super().__init__(daemon=True)
        self.fds, self.impairment = (host_fd, bridge_fd), impairment
        self.stopping = threading.Event()
        self.frames = 0
        self.lost = 0

    def run(self):
        rng = random.Random(self.impairment.seed)
        due = []  # (when, order, descriptor to write, frame)
        order = 0
        while not self.stopping.is_set():
            wait = min(0.05, max(0.0, due[0][0] - time.monotonic())) if due else 0.05
            readable, _, _ = select.select(self.fds, [], [], wait)
            now = time.monotonic()
            for fd in readable:
                other = self.fds[1] if fd == self.fds[0] else self.fds[0]
                while True:
                    try:
                        frame = os.read(fd, 65536)
                    except OSError:  # nothing more to read (EAGAIN), or the device is down
                        break
                    self.frames += 1
                    if rng.random() < self.impairment.loss:
                        self.lost += 1
                        continue
                    heapq.heappush(due, (now + self.impairment.delay_s, order, other, frame))
                    order += 1
            while due and due[0][0] <= now:
                _, _, fd, frame = heapq.heappop(due)
                try:
                    os.write(fd, frame)
                except OSError:  # the port is down (link_down): the frame is lost, as on a cable
                    pass

    def stop(self):
        self.stopping.set()
        self.join(timeout=5)
        for fd in self.fds:
            os.close(fd)


class Hosts:
    def __init__(self, count, impaired=None, names=None, mtu=None):
        """`impaired`: {host index: Impairment} for hosts whose cable delays and loses frames;
        `names`: the hosts' names (default: their namespaces'); `mtu`: the links' MTU (default
        the kernel's)."""
        if not 1 <= count <= 8:
            raise ValueError(f"Hosts: 1 to 8 hosts, got {count}")
        if names is not None and len(names) != count:
            raise ValueError(f"Hosts: {count} hosts, but {len(names)} names")
        self.names = names
        self.mtu = mtu
        pid = os.getpid()
        self.count = count
        self.impaired = dict(impaired or {})
        self.cables = []
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
                if i in self.impaired:  # two TAP devices and a user-space cable between them
                    cable = _ImpairedCable(_open_tap(inner), _open_tap(veth), self.impaired[i])
                    self.cables.append(cable)
                    cable.start()
                else:
                    _ip("link", "add", veth, "type", "veth", "peer", "name", inner)
                if self.mtu:
                    _ip("link", "set", veth, "mtu", str(self.mtu))
                    _ip("link", "set", inner, "mtu", str(self.mtu))
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", inner, "name", IFNAME, netns=ns)
                _ip("addr", "add", f"{self.address(i)}/24", "dev", IFNAME, netns=ns)
                _ip("link", "set", IFNAME, "up", netns=ns)
                _ip("link", "set", "lo", "up", netns=ns)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
            if self.names:
                self._write_etc_hosts()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _etc(self, i):
        return os.path.join("/etc/netns", self.netns(i))

    def _write_etc_hosts(self):
        lines = ["127.0.0.1 localhost"] + [f"{self.address(i)} {n}" for i, n in enumerate(self.names)]
        for i in range(self.count):
            os.makedirs(self._etc(i), exist_ok=True)
            with open(os.path.join(self._etc(i), "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")

    def start(self, i, argv, env=None, **popen):
        """Starts argv inside host i, in a process group and a pid namespace of its own (its
        processes die with it), with the host's name (`hostname()`); returns the Popen."""
        full_env = dict(os.environ)
        full_env["TMPDIR"] = self.tmpdirs[i]
        full_env.update(env or {})
        p = subprocess.Popen(["ip", "netns", "exec", self.netns(i), *self.enter(i), *argv], env=full_env,
                             start_new_session=True, **popen)
        self.processes.append(p)
        return p

    def limit_rate(self, i, rate, burst=None, latency="100ms"):
        """Limits what host i sends to `rate` (tc's spelling: "1gbit", "200mbit") with the kernel's
        token-bucket filter on its interface; None removes the limit. The bucket (`burst`, bytes;
        default 4 ms at the rate, at least 256 KiB and two frames) must outlast the kernel's timer
        tick at the rate, or tbf lets less through than it is set to."""
        if rate is None:
            subprocess.run(["ip", "netns", "exec", self.netns(i), "tc", "qdisc", "del", "dev", IFNAME, "root"],
                           capture_output=True)
            return
        if burst is None:
            burst = max(256 << 10, 2 * (self.mtu or 1500), int(rate_bits(rate) / 8 * 0.004))
        cmd = ["ip", "netns", "exec", self.netns(i), "tc", "qdisc", "replace", "dev", IFNAME, "root", "tbf",
               "rate", rate, "burst", str(burst), "latency", latency]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")

    def interface_counters(self, i):
        """Host i's interface's counters since it was made: {"tx_bytes", "rx_bytes", "tx_packets",
        "rx_packets"} (what the kernel counts, headers included)."""
        names = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        r = subprocess.run(["ip", "netns", "exec", self.netns(i), "cat",
                            *[f"/sys/class/net/{IFNAME}/statistics/{n}" for n in names]],
                           capture_output=True, text=True, check=True)
        return dict(zip(names, (int(v) for v in r.stdout.split())))

    def hostname(self, i):
        return self.names[i] if self.names else self.netns(i)

    def enter(self, i):
        """The command prefix that, run inside host i's network namespace, gives a command the
        host's own pid and host-name namespaces (the name set to hostname(i))."""
        return ["unshare", "--pid", "--uts", "--fork", "--kill-child", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.hostname(i)]

    def link_down(self, i):
        _ip("link", "set", self._veth(i), "down")

    def link_up(self, i):
        _ip("link", "set", self._veth(i), "up")

    def signal(self, i, name, signo):
        """Sends signo to every process of host i whose program is `name` (its comm, e.g.
        "fsdp-train"); returns how many there were."""
        r = subprocess.run(["ip", "netns", "pids", self.netns(i)], capture_output=True, text=True)
        sent = 0
        for pid in r.stdout.split():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() != name:
                        continue
                os.kill(int(pid), signo)
                sent += 1
            except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
                pass
        return sent

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
        for cable in self.cables:
            cable.stop()
        self.cables = []
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
            if self.names:
                shutil.rmtree(self._etc(i), ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        for d in self.tmpdirs:
            shutil.rmtree(d, ignore_errors=True)
