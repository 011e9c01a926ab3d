"""What each rank really trained on, recorded sample by sample from real runs of the steps: its own share of the
data, together all of it, a new order every epoch (the same one again after a resume), and DistributedSampler's
padding when the ranks cannot split the data evenly."""
from itertools import combinations

from tools.jobs import python, run

DATASET_SIZE = 2048  # the synthetic workload's training set


def by_epoch(samples):
    """{epoch: {rank: indices}} of a recorded job."""
    epochs = {}
    for row in samples:
        epochs.setdefault(row["epoch"], {})[row["rank"]] = row["indices"]
    return epochs


def test_two_ranks_train_on_disjoint_halves_that_cover_the_data_every_epoch(torchrun_jobs):
    epochs = by_epoch(torchrun_jobs["first"].samples + torchrun_jobs["resumed"].samples)
    assert sorted(epochs) == [0, 1, 2, 3]
    for epoch, shares in epochs.items():
        assert sorted(shares) == [0, 1]
        assert [len(indices) for indices in shares.values()] == [DATASET_SIZE // 2] * 2, epoch
        assert not set(shares[0]) & set(shares[1]), f"epoch {epoch}: a sample trained on by both ranks"
        assert set(shares[0]) | set(shares[1]) == set(range(DATASET_SIZE)), f"epoch {epoch}: samples left out"


def test_set_epoch_gives_every_epoch_a_new_order_also_after_a_resume(torchrun_jobs):
    """Epochs 2 and 3 ran in a new job that resumed from the snapshot: the order depends on the epoch alone."""
    epochs = by_epoch(torchrun_jobs["first"].samples + torchrun_jobs["resumed"].samples)
    for rank in (0, 1):
        orders = [tuple(epochs[epoch][rank]) for epoch in sorted(epochs)]
        assert len(set(orders)) == len(orders), f"rank {rank} repeated an epoch's order"


def test_three_ranks_split_2048_samples_with_one_padded_repeat(tmp_path):
    """2048 = 3 x 682 + 2: DistributedSampler pads the shuffled list with its first index to 2049, so each of the 3
    ranks gets 683 samples and one sample is trained on twice an epoch (drop_last=True would drop the tail)."""
    job = run(python("multigpu.py", 1, 1, "--world_size", 3), cwd=tmp_path, record=True)
    [shares] = by_epoch(job.samples).values()
    assert sorted(shares) == [0, 1, 2]
    assert [len(indices) for indices in shares.values()] == [683] * 3
    seen = [index for indices in shares.values() for index in indices]
    assert set(seen) == set(range(DATASET_SIZE))
    assert len(seen) - len(set(seen)) == 1, "only the padding repeats"
    assert sum(len(set(a) & set(b)) for a, b in combinations(shares.values(), 2)) == 1
