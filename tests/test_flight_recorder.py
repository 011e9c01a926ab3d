"""The Flight Recorder on any step (docs/flight-recorder.md): with it on, the one line a torchrun worker stops with
when a collective gave up (or a peer vanished in one) ends with where this rank's dump is, written where torch's
variables say, in the form torch's analyzer reads; with it off, the line is what it always was."""
import pickle

import pytest
import torch

from utils.launch import known_cause

TIMED_OUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to "
                         "complete")
PEER_GONE = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")


@pytest.fixture
def recorder_on(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", f"{tmp_path}/fr_")
    return tmp_path


@pytest.mark.parametrize("error", [TIMED_OUT, PEER_GONE], ids=["timed out", "peer gone"])
def test_the_one_line_ends_with_where_the_dump_is_when_the_flight_recorder_is_on(recorder_on, error):
    line = known_cause(error, 5)
    assert line.startswith("error: rank 3: a "), line
    assert line.endswith(f"; the Flight Recorder's dump is {recorder_on}/fr_3 (every rank's: torchfrtrace "
                         f"{recorder_on} -p fr_)"), line
    assert "\n" not in line
    dump = pickle.loads((recorder_on / "fr_3").read_bytes())
    assert {"entries", "pg_config", "version"} <= set(dump), sorted(dump)


def test_the_older_variable_names_turn_it_on_too(recorder_on, monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f"{recorder_on}/trace_")
    assert known_cause(TIMED_OUT, 5).endswith(f"dump is {recorder_on}/trace_3 (every rank's: torchfrtrace "
                                              f"{recorder_on} -p trace_)")


@pytest.mark.parametrize("size", [None, "0", "lots"])
def test_the_line_is_unchanged_and_nothing_is_written_when_the_flight_recorder_is_off(recorder_on, monkeypatch,
                                                                                      size):
    if size is None:
        monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    else:
        monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", size)
    line = known_cause(TIMED_OUT, 5)
    assert line.endswith("a rank is stuck or gone; the last snapshot is kept, and the same command resumes from it"), \
        line
    assert not list(recorder_on.iterdir())


def test_a_torch_without_the_flight_recorder_for_gloo_says_so_in_the_same_line(recorder_on, monkeypatch):
    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace")
    line = known_cause(TIMED_OUT, 5)
    assert line.endswith(f"; torch {torch.__version__} has no Flight Recorder for gloo (torch 2.14 has)"), line
    assert not list(recorder_on.iterdir())
