"""Exercise 5's checker: 2D parallelism. The learner's script runs under torchrun (4 ranks, dp 2 x tp 2, dropout 0) on
a short text with the samples each rank trained on and its losses recorded: the ranks of a tp group must train on the
same batches, the dp groups on disjoint parts that cover the data, and each epoch's loss must be one process's.
"""
import itertools

from exercises.judging import COLLECTIVE_TIMEOUT_S, epochs_of, exit_problems, mean_loss_problems
from harness.jobs import run, shown, torchrun
from utils import make_workload

TP_NPROC, TP_SIZE, TP_BATCH, TP_EPOCHS = 4, 2, 4, 2  # processes, --tp, batch per dp rank, epochs
TP_TEXT_CHARS = 4600  # a short excerpt of the help pages: 64 training blocks, 8 optimizer steps an epoch


def two_d_reference(text):
    """{epoch: mean loss} of one process training the GPT (dropout 0) as tensor_parallel.py's loop does (AdamW, no
    schedule) with the global batch of the 2 dp ranks, over the samples in their order: what a correct run computes."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    workload = make_workload("gpt-cpu", text=str(text), dropout=0)
    sampler = DistributedSampler(workload.train_set, num_replicas=1, rank=0)
    loader = DataLoader(workload.train_set, batch_size=TP_BATCH * TP_NPROC // TP_SIZE, sampler=sampler)
    losses = {}
    for epoch in range(TP_EPOCHS):
        sampler.set_epoch(epoch)
        summed = 0.0
        for source, targets in loader:
            workload.optimizer.zero_grad(set_to_none=True)
            loss = workload.loss_fn(workload.model(source), targets)
            loss.backward()
            workload.optimizer.step()
            summed += loss.item() * len(source)
        losses[epoch] = summed / len(sampler)
    return losses, len(workload.train_set)


def two_d_problems(samples, reference):
    """The ranks of a tp group (the same "dp" coordinate of the mesh) must train on the same batches, the dp groups on
    disjoint parts that cover the data; then each epoch's loss must be what one process computes."""
    losses, dataset_size = reference
    if not samples:
        return ["it never trained: no process iterated over a DataLoader"]
    if any(row.get("mesh") is None for row in samples):
        return ['no rank made a named device mesh: init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", '
                '"tp")) gives every rank its place in the dp x tp grid']
    for (restart, number), rows in sorted(epochs_of(samples).items()):
        epoch = f"epoch {number}" + (f" after restart {restart}" if restart else "")
        groups = {}
        for rank, row in sorted(rows.items()):
            groups.setdefault(row["mesh"]["dp"], []).append(row)
        for dp, (first, *others) in sorted(groups.items()):
            for other in (other for other in others if other["indices"] != first["indices"]):
                share = len(first["indices"])
                split = (f"each rank trained on its own 1/{TP_NPROC} of the data ({share} of {dataset_size} "
                         f"samples), as a DistributedSampler over all {TP_NPROC} ranks (the global rank) deals it. "
                         if share * TP_NPROC <= dataset_size + TP_NPROC else "")
                return [f"ranks {first['rank']} and {other['rank']} form a tp group (dp {dp}: they compute one model "
                        f"together, each with 1/{len(others) + 1} of every block's heads) but trained on different "
                        f"samples in {epoch}, so every step added up two batches' activations: {split}Give the "
                        "sampler the dp group's size and rank: DistributedSampler(dataset, "
                        "num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank()), so the ranks of a tp group "
                        "get the same batches"]
        shares = {dp: set(members[0]["indices"]) for dp, members in groups.items()}
        for (dp_a, a), (dp_b, b) in itertools.combinations(sorted(shares.items()), 2):
            if len(a & b) > len(shares):  # DistributedSampler pads by < dp samples to even out the shards
                return [f"the dp groups {dp_a} and {dp_b} trained on the same samples in {epoch} ({len(a & b)} of "
                        f"{len(a)}): each dp rank must get its own 1/{len(shares)} of the data: "
                        "DistributedSampler(dataset, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank())"]
        unseen = dataset_size - len(set().union(*shares.values()))
        if unseen > 0:
            return [f"no rank trained on {unseen} of the {dataset_size} samples in {epoch}: together the dp groups "
                    "must cover the whole dataset"]
    return mean_loss_problems(samples, losses, "on the same samples",
                              " (the tensor-parallel plan, or the way the data reaches the ranks)")


def check(script, workdir, say):
    """Exercise 5: 4 ranks, --tp 2 (dp 2 x tp 2), dropout 0, on a short text; the samples each rank trained on and
    their losses recorded."""
    from utils.gpt import DROPOUT_VARIABLE, TEXT_VARIABLE, help_pages

    text = workdir / "text.txt"
    text.write_text(help_pages()[:TP_TEXT_CHARS])
    cmd = [*torchrun(script, TP_EPOCHS, TP_EPOCHS, nproc=TP_NPROC), "--tp", TP_SIZE, "--workload", "gpt-cpu",
           "--batch_size", TP_BATCH, "--timeout", COLLECTIVE_TIMEOUT_S]
    say(f"running: {shown(cmd)}   (dp 2 x tp 2, dropout 0, on {TP_TEXT_CHARS:,} characters of Python's help pages)")
    job = run(cmd, cwd=workdir, logs=workdir / "records", record=True, timeout=180, check=False,
              env={TEXT_VARIABLE: text, DROPOUT_VARIABLE: 0})
    problems = two_d_problems(job.samples, two_d_reference(text)) if job.samples else []
    return problems or exit_problems(job, script)
