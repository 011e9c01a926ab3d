"""Elastic training: a node is lost for good mid-training, the survivor re-forms the job alone and finishes it.

`--nnodes 1:2` lets the job run on one or two nodes; `--max_restarts` lets each agent restart its workers; the
snapshot (in a folder both nodes read, as on a shared file system) lets the restarted workers resume. The two nodes
run on this machine (loopback), which is enough: the lost node is a whole torchrun agent killed with SIGKILL.
"""
import re

import pytest
import torch

from harness.jobs import free_port, output, start, torchrun_node

pytestmark = pytest.mark.slow
EPOCHS, SAVE_EVERY = 12, 2
# How fast the survivor re-forms the job (the README's elastic section explains the trade-offs): a node whose agent
# missed keep_alive_max_attempt heartbeats, one every keep_alive_interval s, is dead (default 3 x 5 s); once the
# minimum number of nodes is there, the rendezvous still waits last_call_timeout s for latecomers (default 30).
RDZV_CONF = "join_timeout=60,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def test_surviving_node_reforms_the_job_resumes_and_finishes_on_the_resharded_data(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    launcher = ["--max_restarts=2", "--monitor_interval=0.2"]
    nodes = [torchrun_node("multinode.py", EPOCHS, SAVE_EVERY, "--timeout", 20, nnodes="1:2", endpoint=endpoint,
                           run_id="elastic", launcher_args=[*launcher, "--rdzv_conf", f"{RDZV_CONF},is_host={host}"])
             for host in (1, 0)]  # node 0 hosts the rendezvous store; node 1 is the one lost
    with start(*nodes, cwd=tmp_path) as job:
        # the global rank 0 (on either node) reports the first snapshot: both nodes trained together until then
        job.wait_for(output.SAVED, timeout=90)
        job.kill_node(1)  # node 1's agent and its worker, at once: the machine is gone
        job.wait_for(output.RESUMED, timeout=90)
        codes = job.wait(timeout=90)
    survivor = job.node_output(0)
    before = job.output.split("resuming from")[0]
    assert codes[0] == 0, f"the surviving node did not finish:\n{survivor[-4000:]}"
    assert re.search(r"\[rank 0/2 [^\]]*\] epoch \d+ \| steps 32 \|", before), "both nodes trained at first"
    resumed = re.search(r"\[rank 0/1 [^\]]*\] resuming from epoch (\d+), restart ([1-9])", survivor)
    assert resumed, f"the survivor did not resume from the snapshot:\n{survivor[-4000:]}"
    first = int(resumed[1])
    assert 0 < first < EPOCHS, f"resumed from epoch {first}: the node was not lost mid-training"
    alone = {int(match["epoch"]): int(match["steps"]) for match in output.EPOCH.finditer(survivor)
             if match["world_size"] == "1"}
    assert sorted(alone) == list(range(first, EPOCHS)), f"epochs after the restart: {sorted(alone)}"
    assert set(alone.values()) == {64}, "one rank alone now takes all the data: twice the steps per epoch"
    assert "[rank 0/1 | local 0 | cpu] held-out 512 samples" in survivor
    snapshot = torch.load(tmp_path / "snapshot.pt", map_location="cpu", weights_only=True)
    assert snapshot["EPOCHS_RUN"] == EPOCHS
