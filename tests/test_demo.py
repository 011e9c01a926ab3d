"""`make demo` stops with one line naming a step that fails or runs past its time, instead of counting it as done.
(The whole demo, every step and the fault demo, runs in tests/test_steps.py, whose step tests read its jobs.)"""
import re
from types import SimpleNamespace

import pytest

import tools.demo as demo
from harness.jobs import python


@pytest.fixture
def demo_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "RUN_DIR", tmp_path / "demo")
    (tmp_path / "demo").mkdir()


@pytest.mark.slow
def test_a_step_that_fails_stops_the_demo_with_one_line_naming_it(demo_dir):
    with pytest.raises(SystemExit) as stop:
        demo.show("Step 2: DDP with mp.spawn", python("multigpu.py", 0, 1), timeout=60)  # epochs must be >= 1
    assert re.fullmatch(r"demo: 'Step 2: DDP with mp.spawn' failed \(exit codes \[2\]; its log: .*/multigpu/\)",
                        str(stop.value)), stop.value


@pytest.mark.slow
def test_a_step_that_runs_past_its_time_stops_the_demo_instead_of_counting_as_done(demo_dir):
    with pytest.raises(SystemExit) as stop:
        demo.show("a slow step", python("multigpu.py", 500, 500), timeout=3)
    assert "demo: 'a slow step' failed (still running after 3 s; its log:" in str(stop.value)


def test_a_step_whose_loss_did_not_fall_stops_the_demo_with_one_line_naming_it():
    def job(losses):
        return SimpleNamespace(losses=losses, logs_dir=demo.RUN_DIR / "gpt", output="")

    demo.require_learning({"single_gpu.py": job({0: 2.31, 4: 1.87}), "gpt.py": job({0: 3.5, 1: 3.6, 3: 2.9})})
    with pytest.raises(SystemExit) as stop:
        demo.require_learning({"single_gpu.py": job({0: 2.31, 4: 1.87}), "gpt.py": job({0: 3.5, 1: 2.9, 3: 3.5})})
    assert str(stop.value) == "demo: gpt.py did not learn (its loss went from 3.5000 to 3.5000; its log: runs/demo/gpt/)"
