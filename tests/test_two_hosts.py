"""Two real hosts: multinode.py on two network namespaces with their own IP addresses, joined by a bridge.

No loopback is shared between the nodes, so every byte of the rendezvous and of the all-reduces crosses the
link, as on a cluster. The commands are the ones `make two-hosts` prints (tools/two_hosts.py).
"""
import pytest

from expect import assert_learned, assert_one_writer
from harness.jobs import run
from tools.netns import namespaces_unavailable, network_namespaces
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


def run_nodes(hosts, tmp_path, *script_args, limit, **options):
    """One node per host (host 0 is the head), in one folder, bounded; the finished job."""
    return run(*[node_command(host, hosts[0], *script_args, **options) for host in hosts], cwd=tmp_path,
               timeout=limit, check=False, record=True)


def test_two_hosts_train_over_their_own_addresses_with_one_writer(hosts, tmp_path):
    job = run_nodes(hosts, tmp_path, EPOCHS, 2, "--timeout", 20, limit=120)
    assert job.codes == [0, 0], job.output
    reporting = [node for node in range(2) if "epoch" in job.node_output(node)]
    assert len(reporting) == 1 and "[rank 0/2 |" in job.node_output(reporting[0]), "only global rank 0 reports"
    assert_learned(job.node_output(reporting[0]), EPOCHS)
    assert_one_writer(job.writes, tmp_path / "snapshot.pt")  # the folder both hosts use plays the shared file system


def test_without_gloo_socket_ifname_the_job_fails_fast_and_says_why(hosts, tmp_path):
    # Without the interface, gloo binds to the address the hostname resolves to (127.0.0.1 here) and tells the
    # other node to connect there: on another host that is its own loopback, so "Connection refused".
    job = run_nodes(hosts, tmp_path, EPOCHS, 2, "--timeout", 4, limit=60, set_ifname=False)
    assert None not in job.codes, f"a node was still running after 60 s:\n{job.output[-3000:]}"
    assert all(code != 0 for code in job.codes), job.output[-3000:]
    assert "Connection refused" in job.output and "remote=[127.0.0.1]" in job.output, job.output[-3000:]
