"""What DistributedSampler promises, and every DDP step relies on: each rank gets its own share of the data,
together they cover all of it, and `set_epoch` reshuffles the same way on every rank."""
import pytest
from torch.utils.data.distributed import DistributedSampler

from utils import make_workload

DATASET = make_workload().train_set  # 2048 samples


def shards(world_size, epoch=0, dataset=DATASET):
    samplers = [DistributedSampler(dataset, num_replicas=world_size, rank=rank) for rank in range(world_size)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("world_size", [2, 3])
def test_shards_are_disjoint_and_cover_the_data(world_size):
    parts = shards(world_size)
    assert len({len(part) for part in parts}) == 1, "every rank gets the same number of samples"
    seen = [index for part in parts for index in part]
    assert set(seen) == set(range(len(DATASET))), "together the ranks see every sample"
    padding = len(seen) - len(DATASET)
    # 2048 = 2 x 1024 splits evenly; 2048 = 3 x 682 + 2, so the sampler repeats 1 sample to give 3 x 683.
    assert padding == (-len(DATASET)) % world_size
    assert len(seen) - len(set(seen)) == padding, "only the padding repeats, nothing else overlaps"


def test_padding_repeats_the_first_indices_of_the_shuffle():
    """With 3 ranks and 2048 samples, the shuffled list is extended by its own first index to 2049 so every rank
    gets 683: one sample is seen twice an epoch. (drop_last=True would drop the tail instead.)"""
    parts = shards(3)
    seen = [index for part in parts for index in part]
    repeated = [index for index in set(seen) if seen.count(index) > 1]
    assert len(repeated) == 1
    interleaved = [parts[i % 3][i // 3] for i in range(len(seen))]  # undo the rank::world_size striding
    assert interleaved[-1] == interleaved[0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_set_epoch_changes_the_order_and_the_same_epoch_repeats_it(world_size):
    assert shards(world_size, epoch=0) == shards(world_size, epoch=0)
    assert shards(world_size, epoch=0) != shards(world_size, epoch=1)


def test_without_set_epoch_every_epoch_has_the_same_order():
    """The classic bug: forget sampler.set_epoch(epoch) and each epoch replays epoch 0's order."""
    sampler = DistributedSampler(DATASET, num_replicas=2, rank=0)
    assert list(sampler) == list(sampler)
