"""Exercise 1's checker: one process -> DDP with mp.spawn. It runs the learner's script as a learner would, on CPU
processes, and judges what they did (exercises/judging.py's training_problems): that 2 processes trained, as the ranks
of one process group, each a model wrapped in DDP, on disjoint shards that cover the data and are reshuffled every
epoch; that their parameters stayed equal; that rank 0 alone saved a model a fresh one loads; that the printed loss is
the mean over the ranks; that each process closed its process group.
"""
from exercises.judging import COLLECTIVE_TIMEOUT_S, WORLD_SIZE, training_problems
from harness.jobs import PYTHON, run, shown


def check(script, workdir, say):
    """Exercise 1: `python SCRIPT 3 1 --world_size 2` trains 2 DDP ranks on disjoint, reshuffled shards."""
    epochs = 3
    cmd = [PYTHON, script, epochs, 1, "--world_size", WORLD_SIZE, "--timeout", COLLECTIVE_TIMEOUT_S]
    say(f"running: {shown(cmd)}")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record=True, timeout=90, check=False)
    return training_problems(job, workdir, epochs, script)
