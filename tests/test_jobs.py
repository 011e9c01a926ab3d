"""harness/jobs, the one way the tests, the checker, the demo and the notebooks run jobs, in this process: a slow disk
that needs no recording, and the steps' own lines told apart from what the launchers print around them."""
import os
import runpy
import time

import pytest
import torch

from harness.jobs import PYTHON, REPO, RECORDER, SHARED_VARIABLE, Job, environment, output, run, shared_file


def test_slow_save_makes_every_save_slower_without_the_recorder_on(tmp_path, monkeypatch):
    """The job's processes load the recorder when slow_save alone is asked for, and the recorder then slows every
    torch.save to a file down, the file already written while it waits (what a kill or Ctrl-C in a slow save meets)."""
    env = environment(slow_save=0.3)
    assert str(RECORDER) in env["PYTHONPATH"].split(os.pathsep) and "JOB_RECORD_DIR" not in env
    monkeypatch.setenv("JOB_SLOW_SAVE", env["JOB_SLOW_SAVE"])
    monkeypatch.delenv("JOB_RECORD_DIR", raising=False)
    monkeypatch.setattr(torch, "save", torch.save)  # what the recorder replaces is put back after the test
    runpy.run_path(str(RECORDER / "sitecustomize.py"))
    path = tmp_path / "snapshot.pt.123.tmp"
    sizes = []
    monkeypatch.setattr(time, "sleep", lambda seconds: sizes.append((seconds, path.stat().st_size)))
    torch.save({"EPOCHS_RUN": 1}, path)
    assert len(sizes) == 1 and sizes[0][0] == 0.3 and sizes[0][1] > 0, sizes
    assert torch.load(path)["EPOCHS_RUN"] == 1


def test_own_lines_are_the_steps_lines_without_torchruns_report_or_gloos_errors():
    printed = """2 processes on gloo (no CUDA)
[rank 0/2 | cpu] epoch 0 | steps 32 | loss 0.9000 | 9,000 samples/s
[rank 0/2 | local 0 | cpu] sample after 8 optimizer steps:
  | def main():
W1123 08:53:25.374000 27389 torch/distributed/elastic/agent/server/api.py:753] Received 2 death signal
[rank1]: Traceback (most recent call last):
[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer
RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 4000ms for recv
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1142, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
error: stopped by SIGINT (Ctrl-C), with every worker of this node; the last snapshot saved is kept
"""
    assert output.own_lines(printed) == [
        "2 processes on gloo (no CUDA)", "[rank 0/2 | cpu] epoch 0 | steps 32 | loss 0.9000 | 9,000 samples/s",
        "[rank 0/2 | local 0 | cpu] sample after 8 optimizer steps:", "  | def main():",
        "error: stopped by SIGINT (Ctrl-C), with every worker of this node; the last snapshot saved is kept"]


@pytest.mark.slow
def test_a_shared_job_that_several_ask_for_at_once_runs_once_and_each_gets_its_result(tmp_path):
    """Two processes of one session ask for the same job together (as pytest-xdist's workers and the notebooks'
    kernels do): it runs once, and each gets its output, exit code and folder; a job with other options runs apart."""
    import subprocess
    import sys

    counter = tmp_path / "runs.txt"
    asker = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from harness.jobs import run, shared_file
text = shared_file("greeting.txt", "hello")
command = [sys.executable, "-c", "import sys, time; open(sys.argv[1], 'a').write('x'); time.sleep(1); "
           "print(open(sys.argv[2]).read())", {str(counter)!r}, str(text)]
job = run(command, cwd={str(tmp_path)!r}, shared=True, env=dict(GREETING=sys.argv[1]))
print(job.output.strip(), job.codes, job.cwd)
"""
    env = dict(os.environ, **{SHARED_VARIABLE: str(tmp_path / "session")})
    askers = [subprocess.Popen([sys.executable, "-c", asker, greeting], env=env, stdout=subprocess.PIPE, text=True)
              for greeting in ("same", "same", "other")]
    answers = [asker.communicate(timeout=60)[0].split() for asker in askers]
    assert counter.read_text() == "xx", "the same job ran once, the one with another environment once more"
    assert [answer[:2] for answer in answers] == [["hello", "[0]"]] * 3, answers
    assert answers[0][2] == answers[1][2] != answers[2][2], "the same job: the same folder"


@pytest.mark.slow
def test_outside_a_session_a_shared_job_is_an_ordinary_one(tmp_path, monkeypatch):
    import sys

    monkeypatch.delenv(SHARED_VARIABLE, raising=False)
    job = run([sys.executable, "-c", "print('here')"], cwd=tmp_path, shared=True)
    assert job.output == "here\n" and job.cwd == tmp_path and type(job) is Job
    assert shared_file("a.txt", "one") != shared_file("a.txt", "two")


@pytest.mark.slow
def test_a_shared_job_asked_for_with_an_option_at_its_default_is_the_same_job(tmp_path, monkeypatch):
    """gpu=False is what a job gets without it (a notebook passes gpu=<has GPUs>, a test nothing): one job, run once."""
    import sys

    monkeypatch.setenv(SHARED_VARIABLE, str(tmp_path / "session"))
    counter = tmp_path / "runs.txt"
    command = [sys.executable, "-c", "import sys; open(sys.argv[1], 'a').write('x')", str(counter)]
    plain, on_cpu = run(command, cwd=tmp_path, shared=True), run(command, cwd=tmp_path, shared=True, gpu=False)
    assert counter.read_text() == "x" and plain.cwd == on_cpu.cwd
    assert run(command, cwd=tmp_path, shared=True, gpu=True).cwd != plain.cwd and counter.read_text() == "xx"


def test_a_test_not_marked_slow_cannot_start_python_processes_but_may_run_quick_tools():
    """tests/conftest.py keeps `make test-fast` fast: this test is not marked slow, so a Python process (a step, a
    torchrun, mp.spawn's workers) fails it with the line that says to mark it; make, git and mount run."""
    import multiprocessing
    import subprocess
    import sys

    with pytest.raises(AssertionError, match=r"starts processes: mark it @pytest\.mark\.slow"):
        subprocess.Popen([sys.executable, "-c", "pass"])
    with pytest.raises(AssertionError, match=r"starts processes: mark it @pytest\.mark\.slow"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    assert subprocess.run(["git", "--version"], capture_output=True, check=True).stdout.startswith(b"git version")


def test_a_run_cut_short_stops_its_job_which_no_signal_to_this_process_reaches(tmp_path):
    """Ctrl-C (or pytest's timeout) in the middle of run(): the job's processes live in sessions of their own, so
    run() itself must stop them before the interrupt goes on."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(["sh", "-c", f"echo $$ > {tmp_path / 'pid'}; exec sleep 30"], cwd=tmp_path, timeout=10)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# A plugin named by its path (as an exercise's recorder.py is): it wraps all_reduce over the recorder's own wrapper and
# notes the stack from a helper of its own, as the exercises' plugins do.
PLUGIN = """import json

import sitecustomize
import torch.distributed as dist

_all_reduce = dist.all_reduce


def _stack_here():
    return sitecustomize._stack()


def _noting_all_reduce(*args, **kwargs):
    sitecustomize._append("plugin.jsonl", json.dumps(dict(stack=_stack_here())))
    return _all_reduce(*args, **kwargs)


dist.all_reduce = _noting_all_reduce
"""
PROGRAM = """import torch
import torch.distributed as dist

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.ones(3))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_plugin_named_by_its_path_runs_and_its_frames_are_the_recorders_not_the_programs(tmp_path):
    """JOB_RECORD_PLUGINS names a plugin by its path: the recorder runs it, and a line it records names the program's
    own line, never the plugin's (the collective's caller, and the stack the plugin notes)."""
    plugin, program = tmp_path / "recorder.py", tmp_path / "program.py"
    plugin.write_text(PLUGIN)
    program.write_text(PROGRAM)
    job = run([PYTHON, program], cwd=tmp_path, record_collectives=True, env={"JOB_RECORD_PLUGINS": plugin}, timeout=60)
    [noted] = job.records("plugin.jsonl")
    assert noted["stack"] == [[str(program), 5, "<module>"]], noted
    [call] = [row for row in job.records("collectives.jsonl") if row["event"] == "call" and row["op"] == "all_reduce"]
    assert call["caller"] == [str(program), 5, "<module>"], call
