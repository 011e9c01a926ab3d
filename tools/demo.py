"""`make demo`: every step of the tutorial, briefly, on whatever this machine has (GPUs, or the CPU).

Runs in runs/demo/ so checkpoints and snapshots land there, prints each command before running it and what it
printed, then a summary of the loss each step started and ended with.
"""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from tools.launch import PYTHON, REPO, epoch_losses, script, torchrun, torchrun_node  # noqa: E402
from utils import free_port  # noqa: E402

EPOCHS, SAVE_EVERY = 5, 2
RUN_DIR = REPO / "runs" / "demo"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def show(title, commands, envs=None, timeout=300):
    """Run the commands side by side (several nodes) or alone, echo them, and return everything they printed."""
    print(f"\n=== {title}", flush=True)
    envs = envs or [{}] * len(commands)
    procs, logs = [], []
    for number, (command, extra) in enumerate(zip(commands, envs)):
        command = [str(part) for part in command]
        shown = " ".join(f"{key}={value}" for key, value in extra.items())
        print("$", shown, " ".join(command).replace(PYTHON + " -m torch.distributed.run", "torchrun")
              .replace(PYTHON, "python").replace(str(REPO) + "/", ""), flush=True)
        name = next(Path(part).stem for part in command if part.endswith(".py"))
        logs.append(RUN_DIR / f"{name}-{number}.log")
        with open(logs[-1], "w") as log:  # a file, not a pipe: a full pipe would stall a process we are not reading
            procs.append(subprocess.Popen(command, cwd=RUN_DIR, env=dict(os.environ, **extra), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                os.killpg(other.pid, signal.SIGKILL)
    outputs = [log.read_text() for log in logs]
    for output in outputs:
        print("".join(line + "\n" for line in output.splitlines() if not line.startswith(("W1", "W0"))), end="")
    if any(proc.returncode for proc in procs):
        sys.exit(f"demo: '{title}' failed (exit codes {[proc.returncode for proc in procs]}; logs in {RUN_DIR})")
    return "".join(outputs)


def main():
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir(parents=True)
    print(f"PyTorch {torch.__version__}; " + (f"{GPUS} CUDA GPU(s)" if GPUS else f"no GPU: CPU only, "
                                              f"{os.cpu_count()} cores, gloo backend"))
    started, results = time.perf_counter(), {}
    results["single_gpu.py"] = show("Step 1: one device", [[PYTHON, script("single_gpu.py"), EPOCHS, SAVE_EVERY]])
    results["multigpu.py"] = show("Step 2: DDP with mp.spawn", [[PYTHON, script("multigpu.py"), EPOCHS, SAVE_EVERY]])
    results["multigpu_torchrun.py"] = show("Step 3: torchrun, with a snapshot", [
        torchrun("multigpu_torchrun.py", EPOCHS, SAVE_EVERY, nproc="gpu" if GPUS else 2)])
    # Two "nodes" on this machine: two torchrun agents meeting at one endpoint. With >= 2 GPUs each node gets its
    # own GPUs; otherwise both run on the CPU, one process each, one thread each (2 processes share the cores).
    endpoint = f"127.0.0.1:{free_port()}"
    if GPUS >= 2:
        envs = [{"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(n * GPUS // 2, (n + 1) * GPUS // 2)))}
                for n in range(2)]
    else:
        envs = [{"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}] * 2
    (RUN_DIR / "snapshot.pt").unlink(missing_ok=True)  # a fresh job: step 3 left its snapshot here
    results["multinode.py"] = show("Step 4: two nodes on localhost", [
        torchrun_node("multinode.py", EPOCHS, SAVE_EVERY, endpoint=endpoint, run_id="demo",
                      nproc="gpu" if GPUS >= 2 else 1) for _ in range(2)], envs)

    show("Step 3 under fire: a worker SIGKILLed, torchrun restarts the group, the job resumes",
         [[PYTHON, str(REPO / "tools" / "fault_demo.py")]])

    print(f"\n=== Summary ({time.perf_counter() - started:.0f} s; files in {RUN_DIR.relative_to(REPO)}/)")
    for step, output in results.items():
        losses = epoch_losses(output)
        print(f"{step:22} loss {losses[0]:.4f} (epoch 0) -> {losses[max(losses)]:.4f} (epoch {max(losses)})")


if __name__ == "__main__":
    main()
