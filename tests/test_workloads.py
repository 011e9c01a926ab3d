"""The workloads every step trains: built identically in every process from the seed, learnable; MNIST read by
torchvision's own loader from the files it downloads, with a clear stop when they are missing and cannot be fetched;
FakeData trained under DDP; and held-out metrics that, across ranks, count every sample exactly once and score the
same model (rank 0's) everywhere."""
import hashlib
import re
import struct
import urllib.error

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from expect import assert_bitwise_equal
from harness.jobs import PYTHON, REPO, free_port, run, script, torchrun
from utils import WORKLOADS, evaluate, exit_without_teardown, make_workload
from utils.vision import FAKEDATA_SIZES

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def fingerprint(workload):
    digest = hashlib.sha256()
    for tensor in (*workload.train_set.tensors, *workload.eval_set.tensors, *workload.model.state_dict().values()):
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
def test_every_process_builds_the_same_data_and_initial_weights(tmp_path):
    """Ranks never exchange the dataset: each builds it from the seed, so it must be bit-identical."""
    names = ["synthetic", "wide"]
    command = ("from test_workloads import fingerprint, make_workload; "
               f"print(*(fingerprint(make_workload(name)) for name in {names!r}))")
    job = run([PYTHON, "-c", command], cwd=tmp_path, env={"PYTHONPATH": REPO / "tests"})
    assert job.output.split() == [fingerprint(make_workload(name)) for name in names]


def test_the_seed_decides_the_data():
    assert fingerprint(make_workload(seed=0)) == fingerprint(make_workload(seed=0))
    assert fingerprint(make_workload(seed=0)) != fingerprint(make_workload(seed=1))


def test_an_unknown_workload_is_named_in_the_error():
    with pytest.raises(ValueError) as error:
        make_workload("imagenet-22k")
    assert "imagenet-22k" in str(error.value) and "synthetic" in str(error.value)


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


def write_idx(path, array):
    """A uint8 array in the idx format MNIST ships in: magic (0, 0, type 0x08 = ubyte, rank), sizes, bytes."""
    header = struct.pack(">I", 0x0800 | array.dim()) + struct.pack(f">{array.dim()}I", *array.shape)
    path.write_bytes(header + array.numpy().tobytes())


def tiny_mnist(root, train_size=12, test_size=5):
    """root/MNIST/raw/ with the four files torchvision looks for; images and labels the test can recognize."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    splits = {}
    for prefix, size in (("train", train_size), ("t10k", test_size)):
        images = torch.randint(0, 256, (size, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
        labels = torch.arange(size, dtype=torch.uint8) % 10
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
        splits[prefix] = images, labels
    return splits


def test_every_workload_the_steps_take_is_in_the_docs_table_and_every_one_it_lists_is_taken():
    """`--workload` accepts the names of utils.WORKLOADS; docs/measure.md's table says what each is. A workload added
    without a row, or a row left for one that is gone, fails here."""
    table = (REPO / "docs" / "measure.md").read_text().split("| `--workload` |", 1)[1].split("\n\n", 1)[0]
    listed = {name for cell in re.findall(r"^\| ([^|]+) \|", table, re.M) for name in re.findall(r"`([\w-]+)`", cell)}
    assert listed == set(WORKLOADS), (sorted(listed), sorted(WORKLOADS))


def test_mnist_is_read_from_the_data_dir_in_its_on_disk_format(tmp_path, monkeypatch):
    splits = tiny_mnist(tmp_path)
    monkeypatch.setenv("TUTORIAL_DATA_DIR", str(tmp_path))
    workload = make_workload("mnist")

    for dataset, (images, labels) in ((workload.train_set, splits["train"]), (workload.eval_set, splits["t10k"])):
        pixels, targets = dataset[:]
        assert pixels.shape == (len(images), 1, 28, 28) and pixels.dtype == torch.float32
        assert torch.equal(targets, labels.long())
        restored = (pixels[:, 0] * MNIST_STD + MNIST_MEAN) * 255  # undo the normalization: the file's bytes again
        assert torch.allclose(restored, images.float(), atol=1e-3)
    assert workload.classification
    assert workload.model(workload.train_set[:3][0]).shape == (3, 10)  # one score per digit


def test_missing_dataset_that_cannot_be_downloaded_stops_with_one_clear_line(tmp_path, monkeypatch):
    import torchvision

    def offline(self):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", offline)
    monkeypatch.setenv("TUTORIAL_DATA_DIR", str(tmp_path / "empty"))
    with pytest.raises(SystemExit) as stop:
        make_workload("mnist")
    message = str(stop.value)
    assert message.startswith("error: MNIST is not in") and "\n" not in message
    assert "download=True" in message and "TUTORIAL_DATA_DIR" in message and "URLError" in message


@pytest.mark.slow
def test_fakedata_trains_under_ddp_and_held_out_accuracy_counts_each_sample_once(tmp_path):
    job = run(torchrun("multigpu_torchrun.py", 1, 1, "--workload", "fakedata"), cwd=tmp_path)
    held_out = re.search(r"\[rank 0/2 [^\]]*\] held-out (\d+) samples \| loss ([\d.]+) \| accuracy ([\d.]+)",
                         job.output)
    assert held_out, job.output
    assert int(held_out[1]) == FAKEDATA_SIZES[1]  # 499: prime, so the 2 ranks cannot split it evenly

    # The same weights scored in this one process, over every held-out sample once, must give the same numbers:
    # a sample counted twice (as DistributedSampler's padding would) moves the accuracy by >= 1/500 x accuracy.
    workload = make_workload("fakedata")
    workload.model.load_state_dict(torch.load(tmp_path / "snapshot.pt", weights_only=True)["MODEL_STATE"])
    expected = evaluate(workload.model, workload.eval_set, workload.loss_fn, torch.device("cpu"), True)
    assert float(held_out[2]) == pytest.approx(expected["loss"], abs=1e-4)
    assert float(held_out[3]) == pytest.approx(expected["accuracy"], abs=1e-4)


def score_on_two_ranks(rank, port, result_path):
    """One of two gloo processes: a BatchNorm model whose running statistics differ by rank, as DDP leaves them
    after its last step (each rank updates them on its own batch), scored on 7 samples (2 does not divide 7)."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, dataset = batchnorm_model_and_data()
    model[1].running_mean += 3.0 * rank
    metrics = evaluate(model, dataset, torch.nn.CrossEntropyLoss(), torch.device("cpu"), classification=True)
    if rank == 0:
        torch.save(dict(metrics), result_path)
    dist.destroy_process_group()
    exit_without_teardown()  # as the step scripts do (utils.exit_without_teardown says why)


def batchnorm_model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    return model, TensorDataset(torch.randn(7, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0]))


@pytest.mark.slow
def test_held_out_metrics_on_two_ranks_are_rank_0s_model_on_every_sample_once(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(score_on_two_ranks, args=(free_port(), tmp_path / "metrics.pt"), nprocs=2)
    model, dataset = batchnorm_model_and_data()
    expected = evaluate(model, dataset, torch.nn.CrossEntropyLoss(), torch.device("cpu"), classification=True)
    assert torch.load(tmp_path / "metrics.pt") == pytest.approx(dict(expected), abs=1e-6)


# --- the GPT (step 6) -----------------------------------------------------------------------------------------------

def gpt_workload(monkeypatch, text=None):
    from utils.gpt import TEXT_VARIABLE

    if text is not None:
        monkeypatch.setenv(TEXT_VARIABLE, str(text))
    return make_workload("gpt-cpu")


def test_the_gpt_is_built_the_same_in_every_process_and_starts_near_uniform(monkeypatch):
    """Python's help pages: the same tokens and weights every time; an untrained model scores ~ln(vocabulary)."""
    import math

    from utils.gpt import decode, help_pages

    first, second = gpt_workload(monkeypatch), gpt_workload(monkeypatch)
    assert torch.equal(first.train_set.tensors[0], second.train_set.tensors[0])
    assert_bitwise_equal(first.model.state_dict(), second.model.state_dict(), "state_dict")
    source, targets = first.train_set[0]
    assert torch.equal(source[1:], targets[:-1])  # the target is the next character
    assert decode(first.train_set.tensors[0][0], first.model.vocab) == help_pages()[:64]
    subset = torch.utils.data.Subset(first.eval_set, range(64))
    held_out = evaluate(first.model, subset, first.loss_fn, torch.device("cpu"))["loss"]
    assert abs(held_out - math.log(len(first.model.vocab))) < 0.2, held_out


def test_a_gpt_sample_depends_on_its_seed_only_and_leaves_the_global_random_state_alone(monkeypatch):
    from utils.loop import generate

    model = gpt_workload(monkeypatch).model
    state = torch.get_rng_state()
    sample = generate(model, new_tokens=20, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert sample == generate(model, new_tokens=20, seed=3) != generate(model, new_tokens=20, seed=4)
    assert sample.startswith("\n") and len(sample) == 21


@pytest.mark.parametrize("content, message", [
    (None, r"error: cannot read TUTORIAL_GPT_TEXT=\S+ \(No such file or directory\); point it at a UTF-8 text "
           r"file or leave it out to train on Python's help pages"),
    (b"caf\xe9 " * 1000, r"error: TUTORIAL_GPT_TEXT=\S+ is not UTF-8 text \(byte 3: invalid continuation byte\); "
                         r"save it as UTF-8 or leave it out to train on Python's help pages"),
    (b"too short", r"error: TUTORIAL_GPT_TEXT=\S+ has 9 characters; this model size needs at least 2,600 \(.*\)"),
], ids=["missing", "latin-1", "too short"])
def test_a_gpt_text_that_cannot_be_used_stops_with_one_line(tmp_path, monkeypatch, content, message):
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as stop:
        gpt_workload(monkeypatch, path)
    assert re.fullmatch(message, str(stop.value)), stop.value


def test_a_text_given_as_an_option_is_named_as_the_option_and_wins_over_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("TUTORIAL_GPT_TEXT", str(tmp_path / "not-this.txt"))
    with pytest.raises(SystemExit) as stop:
        make_workload("gpt-cpu", text=str(tmp_path / "missing.txt"))
    assert re.fullmatch(r"error: cannot read --text \S+missing\.txt \(No such file or directory\); .*", str(stop.value))


@pytest.mark.parametrize("workload", ["gpt-cpu", "gpt-gpu", "gpt-moe-cpu"])
def test_a_part_of_the_gpt_built_on_meta_draws_one_process_s_weights_for_what_it_holds(tmp_path, workload):
    """one_mesh.py's model: built on the meta device (no draws), cut to a pipeline stage (the other layers deleted),
    a block in checkpoint_wrapper, given memory that holds garbage. init_weights(seed) makes again the draws of one
    process that builds the GPT with that seed, and keeps its part: the weights it holds are that process's, bit for
    bit, whatever the generator held before. (8 ranks of DTensor shards: tests/test_one_mesh.py.)"""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from utils import SEED
    from utils.gpt import help_pages

    text = tmp_path / "text.txt"
    text.write_text(help_pages()[:12_000])  # long enough for the GPU size's context
    whole = make_workload(workload, text=str(text)).model.state_dict()
    part = make_workload(workload, text=str(text), device="meta").model
    for name in [name for name, _ in part.named_children() if name not in ("block1", "head")]:
        delattr(part, name)  # the layers of the other pipeline stages
    part.register_module("block1", checkpoint_wrapper(part.block1))
    part.to_empty(device="cpu")
    with torch.no_grad():
        for param in part.parameters():
            param.fill_(float("nan"))
    torch.manual_seed(1234)
    part.init_weights(seed=SEED)
    held = {name.replace("_checkpoint_wrapped_module.", ""): value for name, value in part.state_dict().items()
            if isinstance(value, torch.Tensor)}
    assert held.keys() == {name for name in whole if name.startswith(("block1.", "head."))} and \
        all(torch.equal(value, whole[name]) for name, value in held.items())
    part.register_module("head", torch.nn.Sequential(part.head))
    with pytest.raises(RuntimeError, match=r"^init_weights draws no weight named head\.0\.linear\.weight: a wrapper "
                                           r"renamed it$"):
        part.init_weights(seed=SEED)


@pytest.mark.slow
def test_single_gpu_trains_the_gpt_too(tmp_path):
    """--workload gpt works in every step (fsdp.py's sharding of it: tests/test_gpt.py)."""
    from utils.gpt import TEXT_VARIABLE, help_pages

    (tmp_path / "text.txt").write_text(help_pages()[:8000])
    job = run([PYTHON, script("single_gpu.py"), 2, 2, "--workload", "gpt-cpu"], cwd=tmp_path,
              env={TEXT_VARIABLE: tmp_path / "text.txt"})
    assert job.losses[1] < job.losses[0] < 4.8, job.output
