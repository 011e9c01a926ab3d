"""Run multinode.py as two real nodes: two network namespaces with their own IP addresses on one machine.

    sudo python tools/two_hosts.py            # make two-hosts; prints every command it runs
    sudo python tools/two_hosts.py 20 5 --no-ifname   # see the classic failure when GLOO_SOCKET_IFNAME is unset

Each "host" reaches the other only over its eth0 (no shared loopback), so this shows what a real cluster needs:
--local_addr (the address other nodes reach this one on), --rdzv_conf is_host=1 on the head node (its hostname
does not resolve to the endpoint address, so nobody would host the rendezvous store), and GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME (otherwise the backend binds to whatever the hostname resolves to, often 127.0.0.1).
Both nodes run in one folder, which plays the shared file system that holds the snapshot. Needs root.
"""
import argparse
import shlex
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository
from harness.jobs import TORCHRUN, script, start  # noqa: E402
from tools.netns import namespaces_unavailable, network_namespaces  # noqa: E402

PORT = 29500


def node_command(host, head, *script_args, nnodes=2, set_ifname=True, launcher_args=(), step="multinode.py"):
    """One node's command line: torchrun inside `host`'s namespace, meeting at `head`'s c10d rendezvous store."""
    env = [f"GLOO_SOCKET_IFNAME={host.ifname}", f"NCCL_SOCKET_IFNAME={host.ifname}"] if set_ifname else []
    hosting = ["--rdzv_conf", "is_host=1"] if host is head else []  # its hostname does not resolve to head.ip
    return host.cmd("env", *env, *TORCHRUN, f"--nnodes={nnodes}",
                    "--nproc_per_node=1", "--rdzv_id=two-hosts", "--rdzv_backend=c10d",
                    f"--rdzv_endpoint={head.ip}:{PORT}", f"--local_addr={host.ip}", *hosting, *launcher_args,
                    script(step), *map(str, script_args))


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM): cleaning up"))  # run the finally blocks
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", nargs="?", default=4, type=int)
    parser.add_argument("save_every", nargs="?", default=2, type=int)
    parser.add_argument("--no-ifname", action="store_true", help="leave GLOO_SOCKET_IFNAME unset (fails)")
    parser.add_argument("--timeout", default=10, type=int, help="multinode.py --timeout, seconds")
    parser.add_argument("--limit", default=180, type=int, help="stop everything after this many seconds")
    args = parser.parse_args()
    reason = namespaces_unavailable()
    if reason:
        sys.exit(f"error: {reason}")
    with tempfile.TemporaryDirectory(prefix="two-hosts-") as shared, \
            network_namespaces(2, echo=lambda line: print(f"$ {line}", flush=True)) as (_, hosts):
        commands = [node_command(host, hosts[0], args.total_epochs, args.save_every, "--timeout", args.timeout,
                                 set_ifname=not args.no_ifname) for host in hosts]
        for command in commands:
            print(f"$ cd {shared} && {shlex.join(command)} &", flush=True)
        with start(*commands, cwd=shared) as job:  # the one folder plays the shared file system
            codes = job.wait(args.limit, echo=lambda line, node: print(f"[{hosts[node].name} {hosts[node].ip}] "
                                                                       f"{line}", flush=True))
    print(f"exit codes: {[f'still running after {args.limit} s: stopped' if code is None else code for code in codes]}")
    sys.exit(0 if codes == [0, 0] else 1)


if __name__ == "__main__":
    main()
