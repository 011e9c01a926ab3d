"""The workload every step trains: identical in every process, reproducible from its seed, and learnable."""
import hashlib
import time

import torch
from torch.utils.data import DataLoader

from support import PYTHON, REPO, job_env, run
from utils import evaluate, make_workload


def fingerprint(workload):
    digest = hashlib.sha256()
    for tensor in (*workload.train_set.tensors, *workload.eval_set.tensors, *workload.model.state_dict().values()):
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def test_every_process_builds_the_same_data_and_initial_weights(tmp_path):
    """Ranks never exchange the dataset: each builds it from the seed, so it must be bit-identical."""
    command = "from test_workload import fingerprint, make_workload; print(fingerprint(make_workload()))"
    env = job_env({"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    in_other_processes = {run([PYTHON, "-c", command], cwd=tmp_path, env=env).output.strip() for _ in range(2)}
    assert in_other_processes == {fingerprint(make_workload())}


def test_the_seed_decides_the_data():
    assert fingerprint(make_workload(seed=0)) == fingerprint(make_workload(seed=0))
    assert fingerprint(make_workload(seed=0)) != fingerprint(make_workload(seed=1))


def test_the_dataset_is_built_in_well_under_a_second():
    make_workload()  # the first call also pays for PyTorch's lazy imports
    start = time.perf_counter()
    make_workload()
    assert time.perf_counter() - start < 0.5


def test_an_unknown_workload_is_named_in_the_error():
    try:
        make_workload("imagenet-22k")
    except ValueError as error:
        assert "imagenet-22k" in str(error) and "synthetic" in str(error)
    else:
        raise AssertionError("no error for an unknown workload")


def test_the_model_learns_the_teacher():
    """Untrained, the model's loss is about the targets' variance (1.0); 5 epochs bring the held-out loss below
    a fifth of where it started (the noise floor is 0.01)."""
    torch.manual_seed(0)
    workload = make_workload()
    before = evaluate(workload.model, workload.eval_set, workload.loss_fn, "cpu")["loss"]
    for _ in range(5):
        for source, targets in DataLoader(workload.train_set, batch_size=32, shuffle=True):
            workload.optimizer.zero_grad()
            workload.loss_fn(workload.model(source), targets).backward()
            workload.optimizer.step()
    after = evaluate(workload.model, workload.eval_set, workload.loss_fn, "cpu")["loss"]
    assert 0.8 < before < 1.3
    assert after < 0.2 * before, (before, after)
