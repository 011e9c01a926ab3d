"""A step's process itself: its share of the CPU's cores, its exit without interpreter teardown, and torchft's noise
silenced at its cause (step 13)."""
import os
import sys

import torch
import torch.distributed as dist


def configure_cpu_threads(processes_on_this_machine):
    """Give each CPU process its share of the cores, so N processes do not fight over them.

    PyTorch starts one compute thread per core in *every* process; two processes on a 2-core laptop
    would then run 4 busy threads on 2 cores and both slow down. An OMP_NUM_THREADS set by the user
    (torchrun sets it to 1 when it starts several processes) wins.
    """
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
    if threads < 1:
        threads = max(1, (os.cpu_count() or 1) // processes_on_this_machine)
    torch.set_num_threads(threads)
    return threads


def exit_without_teardown():
    """End this process at once, skipping Python's interpreter teardown; call it after destroy_process_group().

    With gloo, a thread of the process group can still be releasing the last collective's tensors when Python
    shuts down. It then needs the interpreter lock that the shutdown holds, and the process aborts with
    "terminate called without an active exception" (SIGABRT) although the job finished well: with torch 2.14 in
    about 1 run in 10 on a busy 2-core machine. Nothing is lost by skipping the teardown: output is flushed here
    and the scripts' files are closed by then.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def quiet_torchft():
    """Silence what torchft makes torch and Python print that a learner cannot act on, each at its cause: torchft's
    gloo group calls a method of torch's that is now a no-op and warns in C++ (replaced here by a silent no-op),
    torch warns once that a checkpoint received from a peer sits in a read-only buffer (torchft loads it and copies
    nothing back), the checkpoint server (Python's http.server) logs every request a healing group makes, and torchft's
    Python side logs every failed step with a traceback (the step prints one line). torchft's Rust side logs as RUST_LOG
    says (step 13 sets it before torchft loads)."""
    import http.server
    import logging
    import warnings

    backend = dist.ProcessGroupGloo
    if hasattr(backend, "_set_sequence_number_for_group"):
        backend._set_sequence_number_for_group = lambda self: None
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    http.server.BaseHTTPRequestHandler.log_message = lambda self, *args: None
    # torchft's Python side logs a failed collective with its traceback, and goes on: the step says it in one line.
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
