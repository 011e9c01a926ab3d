"""What every test file shares: GPU tests skip cleanly without CUDA, and the `slow` marker is kept true.

`slow` marks every test that starts processes of its own (a job of the steps, mp.spawn's workers, a script run as a
user runs it): each costs seconds of CPU to import torch. `make test-fast` (pytest -m "not slow") leaves those out and
runs in a minute or less; a test that starts processes without the marker fails here, naming the marker, so the fast
set cannot grow slow unnoticed (a module's shared fixture counts for the first test that asks for it)."""
import multiprocessing.process
import os
import subprocess
import sys

import pytest
import torch

from expect import help_excerpt


@pytest.fixture(scope="session")
def text():
    """The help pages' excerpt that the GPT steps' exact jobs learn (expect.help_excerpt), as a file."""
    return help_excerpt()


@pytest.hookimpl(tryfirst=True)  # before -m selects: `make test-fast` leaves the GPU tests out on a GPU machine too
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA: no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker("slow")  # every GPU test runs the steps as processes
            if not torch.cuda.is_available():
                item.add_marker(skip)


def starts_python(command):
    """Whether a subprocess command runs Python (a step, torchrun, the checker): what makes a test slow. make, git
    and mount are quick."""
    program = os.path.basename(str(command[0] if isinstance(command, (list, tuple)) else str(command).split()[0]))
    return program.startswith("python") or program == "torchrun" or str(command[0]) == sys.executable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if "slow" in item.keywords:
        yield
        return
    message = f"{item.nodeid} starts processes: mark it @pytest.mark.slow (make test-fast leaves those out)"
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def popen_guarded(self, args, *rest, **options):
        if starts_python(args):
            raise AssertionError(message)
        popen_init(self, args, *rest, **options)

    def start_guarded(self):
        raise AssertionError(message)

    subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = popen_guarded, start_guarded
    try:
        yield
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = popen_init, process_start
