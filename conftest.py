"""The test session's shared folder, for the tests and the notebooks alike (nbval runs them in kernels this process
starts): harness.jobs.run(..., shared=True) runs each job there once, however many tests ask for it. Made by the
process that starts the session, before any worker, so every pytest-xdist worker (and each notebook's kernel)
inherits the same one; removed when the session ends.

The suite's budget is CPU on 2 cores, so each test's CPU seconds are counted: its own and those of the processes it
started (a job's ranks and launchers: each waits for its children). The session ends with the costliest tests and
files: unlike seconds of wall time, these do not grow with the machine's load. A module's shared job counts for the
test that asks for it first; a notebook's kernel, for the cell in which it ends.

Every cell of a notebook is marked `slow`: its kernel is a process, and its cells run the steps as processes
(tests/conftest.py fails a test that starts processes without the marker, in whatever folder it was collected)."""
import collections
import os
import resource
import shutil
import tempfile

import pytest

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


def cpu_seconds():
    """The CPU seconds of this process and of its children that ended and were waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


began = {}  # {test: CPU seconds when its setup began}, in the process that runs it
spent = {}  # {test: CPU seconds from its setup to its teardown}, in the process that prints the summary


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    began[item.nodeid] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # The teardown's report is a test's last: it carries the test's CPU seconds (pytest-xdist sends a worker's reports,
    # with their user_properties, to the process that prints the summary).
    outcome = yield
    if call.when == "teardown" and item.nodeid in began:
        outcome.get_result().user_properties.append(("cpu_seconds", cpu_seconds() - began.pop(item.nodeid)))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        spent.update((report.nodeid, value) for name, value in report.user_properties if name == "cpu_seconds")


def pytest_terminal_summary(terminalreporter):
    if not spent:
        return
    by_file = collections.Counter()
    for test, seconds in spent.items():
        by_file[test.split("::")[0]] += seconds
    write = terminalreporter.write_line
    terminalreporter.section("CPU seconds, the tests' own and their processes'")
    write(f"{sum(spent.values()):.0f} s of CPU in {len(spent)} tests; the files that cost the most:")
    for file, seconds in by_file.most_common(12):
        write(f"{seconds:8.1f} s  {file}")
    write("the tests that cost the most:")
    for test, seconds in sorted(spent.items(), key=lambda pair: -pair[1])[:12]:
        write(f"{seconds:8.1f} s  {test}")
