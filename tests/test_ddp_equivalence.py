"""What DDP's gradient averaging means: 2 processes with batch b take exactly the steps that 1 process takes
with batch 2b over the same samples. multigpu.py is run for real (mp.spawn, 2 gloo ranks); the reference is
single_gpu.py's Trainer fed the same samples in batches twice as large."""
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import single_gpu
from tools.jobs import python, run
from utils import make_workload

BATCH, EPOCHS = 16, 2


def train_in_one_process(batch_size):
    """single_gpu.py's Trainer, fed in the order a 2-rank DistributedSampler deals the samples out: rank r gets
    shuffled positions r, r+2, r+4..., so one 2b batch holds exactly the two ranks' b batches."""
    workload = make_workload()
    loader = DataLoader(workload.train_set, batch_size=batch_size,
                        sampler=DistributedSampler(workload.train_set, num_replicas=1, rank=0))
    trainer = single_gpu.Trainer(workload.model, loader, workload.optimizer, workload.loss_fn,
                                 torch.device("cpu"), save_every=EPOCHS)
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)  # the same shuffle the 2 ranks share in this epoch
        trainer._run_epoch(epoch)
    return trainer.model.state_dict()


@pytest.fixture(scope="module")
def two_rank_weights(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ddp")
    run(python("multigpu.py", EPOCHS, EPOCHS, "--world_size", 2, "--batch_size", BATCH), cwd=workdir)
    return torch.load(workdir / "checkpoint.pt", weights_only=True)


def test_two_ranks_with_batch_b_equal_one_process_with_batch_2b(two_rank_weights):
    reference = train_in_one_process(2 * BATCH)
    assert two_rank_weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(two_rank_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_one_process_with_batch_b_ends_somewhere_else(two_rank_weights):
    """The equivalence above is not a coincidence of training long enough: batch b alone differs."""
    reference = train_in_one_process(BATCH)
    largest_gap = max((two_rank_weights[name] - tensor).abs().max().item() for name, tensor in reference.items())
    assert largest_gap > 1e-2
