"""slurm/multinode.sbatch under a real two-node Slurm on this machine (tools/minislurm.py): submitted with sbatch,
it trains multinode.py with one torchrun per node, and exactly one process in the whole job writes the snapshot."""
import os
import re
import sys
from pathlib import Path

import pytest

from expect import assert_learned, assert_one_writer
from harness.jobs import REPO, environment, recorded_writes
from tools.minislurm import slurm_cluster, slurm_unavailable

pytestmark = pytest.mark.slow
EPOCHS = 4


@pytest.fixture(scope="module")
def cluster():
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    with slurm_cluster(nodes=2) as cluster:
        yield cluster


def test_sbatch_script_trains_on_two_slurm_nodes_with_one_writer(cluster, tmp_path):
    # sbatch passes its environment on to the job (--export=ALL): the recorder of harness/jobs goes with it
    env = environment({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "NPROC_PER_NODE": "1",
                       **cluster.env_overrides}, record_dir=tmp_path)
    submitted = cluster.command("sbatch", "--parsable", f"--chdir={tmp_path}", REPO / "slurm/multinode.sbatch",
                                EPOCHS, 2, "--timeout", 20, cwd=REPO, env=env)
    job_id = submitted.strip().split(";")[0]
    state = cluster.wait_job(job_id, timeout=180)
    output = "".join(out.read_text() for out in tmp_path.glob("multinode-*.out"))
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{output[-4000:]}\n{cluster.logs()}"
    nodes = re.search(r"job \d+: 2 nodes \((\S+)\) x 1 processes, rendezvous at (\S+):", output)
    assert nodes, output
    assert nodes[2] == cluster.hosts[0].name, "the head node is the allocation's first node (scontrol show hostnames)"
    assert_learned(output, EPOCHS)
    assert "[rank 0/2 |" in output and "[rank 1/2 |" not in output
    assert_one_writer(recorded_writes(tmp_path), tmp_path / "snapshot.pt")
