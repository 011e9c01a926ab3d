"""What it costs a rank of step 11 to start from one process's very weights without a seed checkpoint: GPT.init_weights
(seed) makes again, on the CPU, every draw one process makes when it builds the GPT (torch's own initialisation of
each layer, then GPT-2's), one weight at a time, and keeps its part of each. Every rank draws the whole model, whatever
it holds, so the cost grows with the model, not with the rank's share.

    python benchmarks/init_weights.py                     # the CPU and GPU sizes and the 1B width, 2 rounds each
    python benchmarks/init_weights.py --sizes gpu --rounds 5

For each size (tools/memory_plan.py's: "cpu", "gpu", and "1b", this GPT at Llama 3.2 1B's width), the GPT is built on
the meta device, cut to what a pipeline rank holds (its first block: the draws are the same whichever it holds), given
memory on the CPU and drawn, in one process on one CPU thread, as a rank of a CPU job runs (torchrun's
OMP_NUM_THREADS=1); the fastest of --rounds rounds (other work on the machine only ever slows a round down). Printed:
the whole model's weights, the seconds, the nanoseconds per weight of the whole model, and what that rate makes of
Llama 3 8B's width (tools/memory_plan.py's "8b"). Each rank draws on its own CPU thread, so the ranks of a node draw at
once; a seed checkpoint (--seed_checkpoint) reads each rank's shards instead, and draws nothing.
"""
import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/init_weights.py` from anywhere

from harness.jobs import machine_summary  # noqa: E402
from utils import positive_int  # noqa: E402

SIZES = ("cpu", "gpu", "1b")


def drawn_in(size, rounds):
    """(the whole model's weights, the fastest round's seconds) of init_weights(seed) on a one-block part of `size`."""
    import torch

    from tools.memory_plan import config_of
    from utils import SEED
    from utils.gpt import GPT

    with torch.device("meta"):
        model = GPT(config_of(size), vocab="")  # its vocabulary's size is the config's; the characters, not needed
    whole = sum(param.numel() for param in model.parameters())
    for name in [name for name, _ in model.named_children() if name != "block0"]:
        delattr(model, name)  # what one pipeline rank holds of it
    model.to_empty(device="cpu")
    fastest = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        model.init_weights(seed=SEED)
        fastest = min(fastest, time.perf_counter() - start)
    return whole, fastest


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    parser.add_argument("--rounds", type=positive_int, default=2, help="Rounds per size; the fastest is reported")
    args = parser.parse_args()

    import torch

    from tools.memory_plan import config_of

    torch.set_num_threads(1)
    print(f"init_weights(seed) on one rank, one CPU thread: {machine_summary()}")
    print(f"{'size':>5} {'weights':>14} {'seconds':>9} {'ns/weight':>10}")
    rate = None
    for size in args.sizes:
        weights, seconds = drawn_in(size, args.rounds)
        rate = seconds / weights
        print(f"{size:>5} {weights:>14,} {seconds:>9.3f} {rate * 1e9:>10.2f}")
    with torch.device("meta"):
        from utils.gpt import GPT

        big = sum(param.numel() for param in GPT(config_of("8b"), vocab="").parameters())
    print(f"at {rate * 1e9:.2f} ns a weight ({args.sizes[-1]}'s rate), the 8b width's {big:,} weights take "
          f"{rate * big:.0f} s on every rank; a seed checkpoint draws none")


if __name__ == "__main__":
    main()
