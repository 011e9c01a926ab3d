"""One process's initial weights, written as a sharded (DCP) snapshot that `one_mesh.py --seed_checkpoint` loads:
every rank of any mesh reads its own shards of them, so a job of 8 ranks starts from the very weights one process
starts from, although no rank ever builds the whole model. This one process does, once: the seed checkpoint is made
where the whole model fits (torchtitan makes its own the same way).

    python tools/seed_checkpoint.py seed --workload gpt-cpu --text FILE --dropout 0
    torchrun --standalone --nproc_per_node=8 one_mesh.py 2 1 --workload gpt-cpu --seed_checkpoint seed ...
"""
import argparse
import os
import shutil
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from utils import WORKLOADS, make_workload  # noqa: E402


def save_seed_checkpoint(path, workload="gpt-cpu", **options):
    """The initial weights of `workload` (the builder's options: text, dropout...) as a DCP folder at `path`, under
    the key one_mesh.py reads (MODEL_STATE), each weight under its name in the whole model."""
    model = make_workload(workload, **options).model
    dcp.save({"MODEL_STATE": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    return path


def seed_checkpoint_beside(text, workload="gpt-cpu"):
    """The seed checkpoint of `workload` learning the text file `text` at dropout 0, in a folder beside the file
    (written once: a file named by its content, as harness.jobs.shared_file makes, names one seed): for the jobs that
    tests and notebooks share, which must find it outside their own folders."""
    path = Path(f"{text}.{workload}-seed")
    if not path.exists():
        partial = Path(f"{path}.{os.getpid()}.tmp")
        save_seed_checkpoint(partial, workload, text=str(text), dropout=0)
        try:
            os.rename(partial, path)
        except OSError:  # another process wrote the same seed first
            shutil.rmtree(partial, ignore_errors=True)
            if not path.exists():
                raise
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="The folder to write")
    parser.add_argument("--workload", default="gpt", choices=[w for w in WORKLOADS if w.startswith("gpt")])
    parser.add_argument("--text", help="The text the step will learn (its vocabulary sizes the model)")
    parser.add_argument("--dropout", type=float, help="As the step's --dropout")
    args = parser.parse_args()
    print(f"seed checkpoint of {args.workload} written to "
          f"{save_seed_checkpoint(args.path, args.workload, text=args.text, dropout=args.dropout)}")
