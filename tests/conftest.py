import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

@pytest.fixture(scope="session")
def torchrun_jobs(tmp_path_factory):
    """multigpu_torchrun.py as a learner runs it, twice in one folder: 2 epochs (a snapshot after each), then the
    same command for 4 epochs, which resumes. Per-rank metrics on (runs/), every torch.save recorded. Several test
    files read these two runs; each starts once per test process."""
    from tools.jobs import run, torchrun

    workdir = tmp_path_factory.mktemp("torchrun")
    env = {"TUTORIAL_RUN_DIR": workdir / "runs"}
    first = run(torchrun("multigpu_torchrun.py", 2, 1), cwd=workdir, env=env, record=True, logs=workdir / "first")
    snapshot_after_first = (workdir / "snapshot.pt").read_bytes()
    resumed = run(torchrun("multigpu_torchrun.py", 4, 1), cwd=workdir, env=env, record=True,
                  logs=workdir / "resumed")
    return dict(workdir=workdir, first=first, resumed=resumed, snapshot_after_first=snapshot_after_first)
