"""Processes of a running job, read from Linux's /proc: the tree under a launcher, a process's environment, and a
kill that reaches every process of a tree (torchrun starts each worker in a session of its own)."""
import contextlib
import os
import signal
import time
from pathlib import Path


def child_pids(pid):
    """Pids of the live (not zombie) processes whose parent is `pid`."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited while we looked
            continue
        state, parent = stat[stat.rindex(")") + 2:].split()[:2]  # the name in (...) may hold spaces
        if int(parent) == pid and state != "Z":
            children.append(int(entry.name))
    return children


def descendant_pids(pid):
    """Pids of the live children of `pid`, their children, and so on."""
    found, todo = [], [pid]
    while todo:
        children = child_pids(todo.pop())
        found += children
        todo += children
    return found


def alive(pid):
    """Whether the process `pid` still runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def process_env(pid):
    """The environment a process was started with, as a dict ({} once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def torchrun_workers(agent_pid, nproc, restart=0, timeout=60):
    """{global rank: pid} of the `nproc` workers a torchrun agent started for attempt `restart` (their
    TORCHELASTIC_RESTART_COUNT), waiting until all of them are up. `agent_pid` is the torchrun process itself."""
    deadline = time.monotonic() + timeout
    while True:
        workers = {}
        for pid in child_pids(agent_pid):
            env = process_env(pid)
            if env.get("TORCHELASTIC_RESTART_COUNT") == str(restart) and "RANK" in env:
                workers[int(env["RANK"])] = pid
        if len(workers) == nproc:
            return workers
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchrun (pid {agent_pid}) has {len(workers)} of {nproc} workers of restart "
                               f"{restart} after {timeout} s")
        time.sleep(0.02)


def kill_tree(pid, sig=signal.SIGKILL):
    """Send `sig` to the process `pid` started in a session of its own, and to everything it started. The session's
    process group is frozen first, so nothing new is started while the tree is read; its stragglers in other
    sessions (torchrun's workers) are signalled one by one."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGSTOP)
    for member in [*descendant_pids(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, sig)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
        os.killpg(pid, signal.SIGCONT)  # a stopped process acts on a SIGTERM only once it runs again


def listening(pid):
    """{(address, port)} of the TCP sockets the process `pid` listens on, from /proc: "0.0.0.0" or "::" for every
    interface, "127.0.0.1" or "::1" for loopback alone."""
    import ipaddress

    try:
        inodes = {os.readlink(link)[8:-1] for link in Path(f"/proc/{pid}/fd").iterdir()
                  if os.readlink(link).startswith("socket:[")}
    except OSError:  # it exited while we looked
        return set()
    found = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # /proc writes each 32-bit word of the address in the host's byte order (little-endian here)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
                found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found
