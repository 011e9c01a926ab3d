"""Two real hosts: multinode.py on two network namespaces with their own IP addresses, joined by a bridge.

No loopback is shared between the nodes, so every byte of the rendezvous and of the all-reduces crosses the
link, as on a cluster. The commands are the ones `make two-hosts` prints (tools/two_hosts.py).
"""
import pytest

from support import finish, job_env, namespaces_unavailable, network_namespaces, read_log, recorded_writes, start
from test_steps import assert_learned, assert_one_writer
from tools.two_hosts import node_command

pytestmark = pytest.mark.slow
EPOCHS = 4


@pytest.fixture(scope="module")
def hosts():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    with network_namespaces(2) as (_, hosts):
        yield hosts


def run_nodes(hosts, tmp_path, *script_args, limit, audit=None, **options):
    """Start one node per host (host 0 is the head), wait for all (bounded); return exit codes and the logs."""
    nodes = [start(node_command(host, hosts[0], *script_args, **options), cwd=tmp_path,
                   env=job_env(audit_file=audit), log=tmp_path / f"{host.name}.log") for host in hosts]
    codes = finish(nodes, timeout=limit)
    return codes, [read_log(tmp_path / f"{host.name}.log") for host in hosts]


def test_two_hosts_train_over_their_own_addresses_with_one_writer(hosts, tmp_path):
    audit = tmp_path / "writes.tsv"
    codes, logs = run_nodes(hosts, tmp_path, EPOCHS, 2, "--timeout", 20, limit=120, audit=audit)
    assert codes == [0, 0], "\n".join(logs)
    reporting = [log for log in logs if "epoch" in log]
    assert len(reporting) == 1 and "[rank 0/2 |" in reporting[0], "only global rank 0, on one of the hosts, reports"
    assert_learned(reporting[0])
    assert_one_writer(audit, tmp_path / "snapshot.pt")  # the folder both hosts use plays the shared file system
    assert {rank for _, rank, _ in recorded_writes(audit)} == {0}


def test_without_gloo_socket_ifname_the_job_fails_fast_and_says_why(hosts, tmp_path):
    # Without the interface, gloo binds to the address the hostname resolves to (127.0.0.1 here) and tells the
    # other node to connect there: on another host that is its own loopback, so "Connection refused".
    timeout = 4
    codes, logs = run_nodes(hosts, tmp_path, EPOCHS, 2, "--timeout", timeout, limit=60, set_ifname=False)
    output = "\n".join(logs)
    assert None not in codes, f"a node was still running after 60 s:\n{output[-3000:]}"
    assert all(code != 0 for code in codes), output[-3000:]
    assert "Connection refused" in output and "remote=[127.0.0.1]" in output, output[-3000:]
