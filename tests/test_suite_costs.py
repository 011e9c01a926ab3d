"""The suite's own accounting (the root conftest.py): each test's CPU seconds, those of the processes it started
included, and the summary of the costliest at the session's end."""
import importlib.util
import subprocess

from harness.jobs import REPO


def root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", REPO / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tests_cpu_seconds_count_the_processes_it_started():
    counted = root_conftest().cpu_seconds
    before = counted()
    subprocess.run(["sh", "-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"], check=True)  # busy, no Python
    assert counted() - before > 0.2


def test_the_summary_names_the_costliest_files_and_tests_first():
    root, lines = root_conftest(), []
    root.spent.update({"tests/a.py::cheap": 1.0, "tests/a.py::dear": 30.0, "tests/b.py::middle": 20.0})

    class Reporter:
        def section(self, title):
            lines.append(f"== {title}")

        def write_line(self, line):
            lines.append(line)

    root.pytest_terminal_summary(Reporter())
    assert lines == ["== CPU seconds, the tests' own and their processes'",
                     "51 s of CPU in 3 tests; the files that cost the most:",
                     "    31.0 s  tests/a.py", "    20.0 s  tests/b.py",
                     "the tests that cost the most:",
                     "    30.0 s  tests/a.py::dear", "    20.0 s  tests/b.py::middle", "     1.0 s  tests/a.py::cheap"]
