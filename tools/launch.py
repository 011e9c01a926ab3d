"""How the step scripts are launched and how their output is read: shared by `make demo` and the tests."""
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]  # the `torchrun` command, from this interpreter

EPOCH_LINE = re.compile(r"\[(?:rank \d+/\d+[^\]]*|cpu|cuda[:\d]*)\] epoch (\d+) \| steps \d+ \| loss ([\d.]+)")


def script(name):
    return str(REPO / name)


def torchrun(name, *args, nproc=2, launcher_args=()):
    """`torchrun --standalone --nproc_per_node=N name args...` as a command list."""
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *launcher_args, script(name), *map(str, args)]


def torchrun_node(name, *args, nnodes=2, nproc=1, endpoint, run_id="test", launcher_args=()):
    """One node's torchrun of a multi-node job with c10d rendezvous at `endpoint` (host:port)."""
    return [*TORCHRUN, f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", f"--rdzv_id={run_id}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", *launcher_args, script(name), *map(str, args)]


def epoch_losses(output):
    """{epoch: loss} from the per-epoch lines a step prints (each epoch's last report wins)."""
    return {int(epoch): float(loss) for epoch, loss in EPOCH_LINE.findall(output)}
