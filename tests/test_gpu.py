"""The same steps on GPUs (CUDA, nccl), unchanged. Skipped cleanly on a machine without CUDA."""
import pytest
import torch

from support import PYTHON, epoch_losses, free_port, job_env, run, script, start, torchrun, torchrun_node

pytestmark = pytest.mark.gpu
EPOCHS = 3


def assert_learned_on_cuda(output):
    losses = epoch_losses(output)
    assert sorted(losses) == list(range(EPOCHS)) and losses[EPOCHS - 1] < 0.5 * losses[0], output
    assert "| cuda" in output and "| cpu]" not in output, output


def test_single_gpu_trains_on_cuda(tmp_path):
    proc = run([PYTHON, script("single_gpu.py"), EPOCHS, EPOCHS], cwd=tmp_path, env=job_env(gpu=True))
    assert "Training on cuda" in proc.output
    assert_learned_on_cuda(proc.output)


def test_multigpu_runs_one_nccl_process_per_gpu(tmp_path):
    proc = run([PYTHON, script("multigpu.py"), EPOCHS, EPOCHS], cwd=tmp_path, env=job_env(gpu=True))
    assert f"{torch.cuda.device_count()} processes on NCCL, one per GPU" in proc.output
    assert_learned_on_cuda(proc.output)


def test_torchrun_uses_every_gpu_and_resumes_on_cuda(tmp_path):
    env = job_env(gpu=True)
    run(torchrun("multigpu_torchrun.py", 1, 1, nproc="gpu"), cwd=tmp_path, env=env)
    proc = run(torchrun("multigpu_torchrun.py", EPOCHS, 1, nproc="gpu"), cwd=tmp_path, env=env)
    assert "resuming from epoch 1" in proc.output and "| cuda:0]" in proc.output


def test_torchrun_with_more_processes_than_gpus_is_refused(tmp_path):
    proc = run(torchrun("multigpu_torchrun.py", 1, 1, nproc=torch.cuda.device_count() + 1), cwd=tmp_path,
               env=job_env(gpu=True), check=False)
    assert proc.returncode != 0 and "GPU(s): one process per GPU" in proc.output


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two nodes on one machine need a GPU each")
def test_multinode_as_two_nodes_with_one_gpu_each(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start(torchrun_node("multinode.py", EPOCHS, EPOCHS, endpoint=endpoint), cwd=tmp_path,
                   env=job_env({"CUDA_VISIBLE_DEVICES": str(n)}, gpu=True), log=tmp_path / f"node{n}.log")
             for n in range(2)]
    assert [node.wait(timeout=180) for node in nodes] == [0, 0]
    assert_learned_on_cuda("".join((tmp_path / f"node{n}.log").read_text() for n in range(2)))
