"""Several "hosts" on one machine: network namespaces on a bridge, each with its own IP address.

A network namespace has its own interfaces, addresses, routes and loopback, so a process in one cannot reach a
process in another over 127.0.0.1: exactly like two machines on a LAN. Used by `make two-hosts`
(tools/two_hosts.py) and by the multi-node tests. Needs root.
"""
import contextlib
import os
import shlex
import signal
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass

# Every namespace and link this project creates starts with it (TUTORIAL_NETNS_PREFIX gives another: several people
# testing on one machine then tell theirs apart).
PREFIX = os.environ.get("TUTORIAL_NETNS_PREFIX", "ddpt")


@dataclass
class Host:
    name: str  # also its network namespace's name
    ip: str
    ifname: str = "eth0"  # inside its namespace, like a real machine's first interface

    def cmd(self, *argv):
        """`argv` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.name, *map(str, argv)]


def namespaces_unavailable():
    """Why this machine cannot create network namespaces (a reason to skip), or None when it can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run as root, e.g. in a container)"
    if not shutil.which("ip"):
        return "needs the `ip` command (apt-get install iproute2)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@contextmanager
def network_namespaces(count, tag="h", echo=None):
    """`count` hosts, each a network namespace with its own 10.213.X.(10+n)/24 address on a bridge whose address
    is 10.213.X.1; yields (bridge_ip, hosts). X comes from this process's id, so two runs on one machine do not
    collide. Everything is deleted on the way out, also when the body fails. `echo(line)` sees every command."""
    pid = os.getpid()
    subnet = f"10.213.{20 + pid % 200}"
    bridge = f"{PREFIX}{pid}br"[:15]
    hosts = [Host(f"{PREFIX}{pid}{tag}{n}", f"{subnet}.{10 + n}") for n in range(count)]

    def ip(*argv, check=True):
        if echo:
            echo(shlex.join(["ip", *argv]))
        done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise RuntimeError(f"ip {shlex.join(argv)}: {done.stderr.strip()}")

    try:
        ip("link", "add", bridge, "type", "bridge")
        ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for n, host in enumerate(hosts):
            outside, inside = f"{PREFIX}{pid}{tag}v{n}"[:14], f"{PREFIX}{pid}{tag}p{n}"[:14]
            ip("netns", "add", host.name)
            ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", host.name)
            ip("link", "set", outside, "master", bridge, "up")
            ip("-n", host.name, "link", "set", inside, "name", host.ifname)
            ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", host.ifname)
            ip("-n", host.name, "link", "set", host.ifname, "up")
            ip("-n", host.name, "link", "set", "lo", "up")
        yield f"{subnet}.1", hosts
    finally:
        for host in hosts:  # switch the "machine" off: whatever still runs in it, then the namespace itself
            pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True, timeout=30)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", host.name, check=False)  # takes its veth end, and with it the peer on the bridge
        ip("link", "del", bridge, check=False)
