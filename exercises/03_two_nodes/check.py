"""Exercise 3's checker: two nodes. Two torchrun "nodes" on this machine train first in one shared directory (one
writer in the whole job: global rank 0, not each node's local rank 0; every save slower, as a slow disk), then each in a
directory of its own with the snapshot on node 0's only: the nodes must not train out of step.
"""
import shutil

from exercises.judging import (COLLECTIVE_TIMEOUT_S, SLOW_SAVE_S, exit_problems, last_saved, ranks_of,
                               training_problems)
from harness.jobs import free_port, run, shown, torchrun_node


def check(script, workdir, say):
    """Exercise 3: two torchrun "nodes" on this machine. Sharing one directory they train with one writer;
    each in its own directory (a disk of its own) with the snapshot on node 0's only, they must not train
    out of step: stop with an error, or resume every rank from the same epoch."""
    epochs, endpoint = 3, f"127.0.0.1:{free_port()}"
    cmd = [*torchrun_node(script, epochs, 1, endpoint=endpoint, run_id="check"), "--timeout", COLLECTIVE_TIMEOUT_S]
    shared = workdir / "shared"
    shared.mkdir()
    say(f"running: {shown(cmd)}   (twice: 2 nodes sharing one directory; every save takes {SLOW_SAVE_S} s longer)")
    job = run(cmd, cmd, cwd=[shared, shared], logs=workdir / "records-shared", record=True, slow_save=SLOW_SAVE_S,
              timeout=120, check=False)
    problems = training_problems(job, shared, epochs, script, multinode=True, snapshots=True)
    snapshot = last_saved(job.writes, shared)
    if problems or snapshot is None:
        return problems
    nodes = [workdir / "node0", workdir / "node1"]
    for node in nodes:
        node.mkdir()
    shutil.copy(snapshot, nodes[0] / snapshot.name)
    more_epochs, endpoint = epochs + 2, f"127.0.0.1:{free_port()}"
    cmd = [*torchrun_node(script, more_epochs, 1, endpoint=endpoint, run_id="check"), "--timeout", 30]
    say(f"running it again for {more_epochs} epochs, each node in its own directory; only node 0's has "
        f"{snapshot.name}")
    job = run(cmd, cmd, cwd=nodes, logs=workdir / "records-apart", record=True, timeout=90, check=False)
    first_epoch = {rank: min(row["number"] if row["epoch"] is None else row["epoch"]
                             for row in job.samples if row["rank"] == rank) for rank in ranks_of(job.samples)}
    if len(set(first_epoch.values())) > 1:
        starts = "; ".join(f"rank {rank} began at epoch {epoch}" for rank, epoch in first_epoch.items())
        ended = ("it hung until stopped" if job.timed_out else "it finished as if all was well" if job.codes == [0, 0]
                 else "it crashed once their collectives no longer matched")
        return [f"the nodes trained out of step: {starts} (each node read its own disk), and {ended}. Before "
                "training, check that every rank resumes from the same epoch (all_reduce it) and stop with an "
                "error that says to put --snapshot_path on storage every node shares"]
    if first_epoch:
        return exit_problems(job, script)  # every rank resumed from the same epoch (e.g. rank 0's snapshot was shared)
    if job.timed_out:
        return [f"it hung for {job.limit} s instead of stopping with an error when the nodes' snapshots differ"]
    if job.codes == [0, 0]:
        return ["it exited 0 without training when the nodes' snapshots differ: stop with an error instead"]
    errors = [line for line in job.output.splitlines() if line.startswith("error")]
    if not errors:  # it stopped, but not on purpose: a crash is no refusal
        return exit_problems(job, script)
    say(f"it refused to train out of step, with: {errors[0]}")
    return []
