"""What a correct run of a step shows: assertions that several test files make about a finished job, the sharded
snapshots of steps 5, 7 and 8 read back whole, and a step's checks before its process group, run in the test's
process."""
import runpy
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tools.jobs import output, saved_name, script
from utils import make_workload


def assert_learned(text, epochs):
    """Every epoch reported once, and the loss of the last below half the first's."""
    losses = output.epoch_losses(text)
    assert sorted(losses) == list(range(epochs)), text
    assert losses[epochs - 1] < 0.5 * losses[0], f"the loss did not fall: {losses}"


def assert_one_writer(writes, expected_path):
    """Exactly one process wrote files, it was rank 0 (or the only process), and it wrote `expected_path` (through
    its own .tmp file, `NAME.PID.tmp`, renamed when complete)."""
    assert writes, "nothing was saved"
    writers = {(pid, rank) for pid, rank, _ in writes}
    assert len(writers) == 1, f"more than one process wrote: {writers}"
    assert {rank for _, rank in writers} <= {0, None}, f"the writer is not rank 0: {writers}"
    assert {str(Path(path).with_name(saved_name(path))) for _, _, path in writes} == {str(expected_path)}, writes


def assert_loads_into_fresh_model(path, key=None, workload="synthetic"):
    """The file holds a plain model's state_dict (under `key` in a snapshot) that loads into a new model."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    make_workload(workload).model.load_state_dict(state[key] if key else state)  # raises on a wrong tensor


def assert_bitwise_equal(actual, expected, where="snapshot"):
    """Every tensor equal bit for bit (torch.equal, same dtype), every other value equal, at any depth."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_bitwise_equal(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for index, (item, expected_item) in enumerate(zip(actual, expected)):
            assert_bitwise_equal(item, expected_item, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def sharded_snapshot(folder):
    """A sharded snapshot (torch.distributed.checkpoint's folder) as one dict, every rank's parts put together, read
    without a process group: {"MODEL_STATE": {...}, "EPOCHS_RUN": ..., ...}."""
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(folder, Path(scratch) / "whole.pt")
        return torch.load(Path(scratch) / "whole.pt", map_location="cpu", weights_only=False)


def stopped_as_rank_0(monkeypatch, step, world_size, *args):
    """`step`'s __main__ run in this process as torchrun starts rank 0 of `world_size` processes, with TOTAL_EPOCHS 2,
    SAVE_EVERY 1 and `args`: the SystemExit it stops with (its checks of the options come before init_process_group,
    which a test's process must never reach)."""
    monkeypatch.setattr(sys, "argv", [step, "2", "1", *map(str, args)])
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "LOCAL_WORLD_SIZE": world_size,
                        "WORLD_SIZE": world_size}.items():
        monkeypatch.setenv(name, str(value))
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(script(step), run_name="__main__")
    return stop.value
