"""Small helpers used by every step: argument checks, CPU threads, a free port, a clean exit."""
import argparse
import os
import socket
import sys

import torch


def positive_int(text):
    """argparse type: a whole number >= 1 (epochs, save interval, batch size, processes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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


def free_port(host="127.0.0.1"):
    """A TCP port nobody listens on right now (the OS picks it), for a rendezvous on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def require_torchrun(example="torchrun --standalone --nproc_per_node=2"):
    """Stop with one clear line when a torchrun script is started wrongly.

    Started with plain `python`, the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE...) are missing;
    started with more processes per machine than it has GPUs, two processes would share one GPU.
    """
    script = " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] or ["50", "10"]))
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(f"error: start this script with torchrun, which starts and numbers the processes: "
                         f"{example} {script}")
    require_a_gpu_each(int(os.environ["LOCAL_WORLD_SIZE"]), "--nproc_per_node=gpu")


def require_a_gpu_each(processes, hint):
    """`processes`, after checking this machine has a GPU for each (DDP and FSDP run one process per GPU; two on one
    GPU would fight over it): else one clear line and exit 1, where the official tutorial silently exits 0.
    Without CUDA, any number of CPU processes."""
    if torch.cuda.is_available() and processes > torch.cuda.device_count():
        raise SystemExit(f"error: {processes} processes on this machine but {torch.cuda.device_count()} GPU(s): "
                         f"one process per GPU ({hint})")
    return processes


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

