"""The same steps on GPUs (CUDA, nccl), unchanged. Skipped cleanly on a machine without CUDA."""
import re

import pytest
import torch

from harness.jobs import free_port, python, run, torchrun, torchrun_node

pytestmark = pytest.mark.gpu
EPOCHS = 3


def assert_learned_on_cuda(text):
    from harness.jobs.output import epoch_losses

    losses = epoch_losses(text)
    assert sorted(losses) == list(range(EPOCHS)) and losses[EPOCHS - 1] < 0.5 * losses[0], text
    # Step 1 tags its lines [cuda], the others [rank 0/2 | cuda:0] or [rank 0/2 | local 0 | cuda:0].
    assert re.search(r"^\[(?:rank [^\]]*\| )?cuda(?::\d+)?\]", text, re.M) and "cpu]" not in text, text


def test_single_gpu_trains_on_cuda(tmp_path):
    job = run(python("single_gpu.py", EPOCHS, EPOCHS), cwd=tmp_path, gpu=True)
    assert job.output.startswith("Training on cuda\n"), job.output
    assert_learned_on_cuda(job.output)


def test_multigpu_runs_one_nccl_process_per_gpu(tmp_path):
    job = run(python("multigpu.py", EPOCHS, EPOCHS), cwd=tmp_path, gpu=True)
    assert f"{torch.cuda.device_count()} processes on NCCL, one per GPU" in job.output
    assert_learned_on_cuda(job.output)


def test_torchrun_uses_every_gpu_and_resumes_on_cuda(tmp_path):
    run(torchrun("multigpu_torchrun.py", 1, 1, nproc="gpu"), cwd=tmp_path, gpu=True)
    job = run(torchrun("multigpu_torchrun.py", EPOCHS, 1, nproc="gpu"), cwd=tmp_path, gpu=True)
    assert "resuming from epoch 1" in job.output and "| cuda:0]" in job.output


def test_torchrun_with_more_processes_than_gpus_is_refused(tmp_path):
    job = run(torchrun("multigpu_torchrun.py", 1, 1, nproc=torch.cuda.device_count() + 1), cwd=tmp_path, gpu=True,
              check=False)
    assert job.returncode != 0 and "GPU(s): one process per GPU" in job.output


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two nodes on one machine need a GPU each")
def test_multinode_as_two_nodes_with_one_gpu_each(tmp_path):
    node = torchrun_node("multinode.py", EPOCHS, EPOCHS, endpoint=f"127.0.0.1:{free_port()}")
    job = run(node, node, cwd=tmp_path, gpu=True, node_env=[{"CUDA_VISIBLE_DEVICES": str(n)} for n in range(2)],
              timeout=180)
    assert_learned_on_cuda(job.output)
