"""The demos a learner runs first: `make demo` runs every step briefly, the fault demo narrates a worker killed and
the job resuming, and the summary shows every step's loss falling. A step that fails or runs past its time stops the
demo with one line naming it, instead of counting as done."""
import re

import pytest

import tools.demo as demo
from tools.jobs import python

EPOCHS = 2


@pytest.fixture
def quick_demo(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "RUN_DIR", tmp_path / "demo")
    monkeypatch.setattr(demo, "EPOCHS", EPOCHS)
    monkeypatch.setattr(demo, "SAVE_EVERY", 1)
    (tmp_path / "demo").mkdir()
    return demo


@pytest.mark.slow
def test_make_demo_runs_every_step_the_fault_demo_and_sums_up_the_losses(quick_demo, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["demo.py", "--timeout", "120"])
    quick_demo.main()
    text = capsys.readouterr().out
    for step in ("single_gpu.py", "multigpu.py", "multigpu_torchrun.py", "multinode.py", "fsdp.py"):
        falls = re.search(rf"^{re.escape(step)} +loss ([\d.]+) \(epoch 0\) -> ([\d.]+) \(epoch 1\)$", text, re.M)
        assert falls and float(falls[2]) < 0.5 * float(falls[1]), text
    fault = text.split("=== Step 3 under fire")[1]
    assert re.search(r">>> SIGKILL -> rank 1 \(pid \d+\), from outside, after epoch 4", fault), fault
    assert "torchrun: failed (exitcode: -9) local_rank: 1" in fault
    assert re.search(r">>> rank \d reloaded the snapshot: resuming from epoch 4 \(restart 1\)", fault), fault
    assert ">>> the job finished (exit 0): 8 epochs in all, one worker killed on the way" in fault


def test_a_step_that_fails_stops_the_demo_with_one_line_naming_it(quick_demo):
    with pytest.raises(SystemExit) as stop:
        quick_demo.show("Step 2: DDP with mp.spawn", python("multigpu.py", 0, 1), timeout=60)  # epochs must be >= 1
    assert re.fullmatch(r"demo: 'Step 2: DDP with mp.spawn' failed \(exit codes \[2\]; its log: .*/multigpu/\)",
                        str(stop.value)), stop.value


def test_a_step_that_runs_past_its_time_stops_the_demo_instead_of_counting_as_done(quick_demo):
    with pytest.raises(SystemExit) as stop:
        quick_demo.show("a slow step", python("multigpu.py", 500, 500), timeout=3)
    assert "demo: 'a slow step' failed (still running after 3 s; its log:" in str(stop.value)
