"""The test session's shared folder, for the tests and the notebooks alike (nbval runs them in kernels this process
starts): tools.jobs.run(..., shared=True) runs each job there once, however many tests ask for it. Made by the
process that starts the session, before any worker, so every pytest-xdist worker (and each notebook's kernel)
inherits the same one; removed when the session ends."""
import os
import shutil
import tempfile

from tools.jobs import SHARED_VARIABLE


def pytest_configure(config):
    if not os.environ.get(SHARED_VARIABLE) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[SHARED_VARIABLE] = tempfile.mkdtemp(prefix="tutorial-session-")
        config._made_shared_folder = os.environ[SHARED_VARIABLE]


def pytest_unconfigure(config):
    folder = getattr(config, "_made_shared_folder", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(SHARED_VARIABLE, None)
