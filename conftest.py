"""The test session's shared folder, for the tests and the notebooks alike (nbval runs them in kernels this process
starts): harness.jobs.run(..., shared=True) runs each job there once, however many tests ask for it. Made by the
process that starts the session, before any worker, so every pytest-xdist worker (and each notebook's kernel)
inherits the same one; removed when the session ends.

Every cell of a notebook is marked `slow`: its kernel is a process, and its cells run the steps as processes
(tests/conftest.py fails a test that starts processes without the marker, in whatever folder it was collected)."""
import os
import shutil
import tempfile

from harness.jobs import SHARED_VARIABLE


def pytest_configure(config):
    if not os.environ.get(SHARED_VARIABLE) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[SHARED_VARIABLE] = tempfile.mkdtemp(prefix="tutorial-session-")
        config._made_shared_folder = os.environ[SHARED_VARIABLE]


def pytest_unconfigure(config):
    folder = getattr(config, "_made_shared_folder", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(SHARED_VARIABLE, None)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker("slow")
