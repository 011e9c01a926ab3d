"""Does the GPU-size GPT learn as well with 8 attention heads of 48 dimensions as with nanoGPT's 6 heads of 64? The
same weights and FLOPs (the heads cut the same width into parts), but 8 split over the tp groups of an 8-GPU node
(--tp 1, 2, 4, 8) and 6 only over 1 or 2; this measures what the change costs in learning, on this machine's CPU.

    python benchmarks/gpt_heads.py                        # 300 steps of 8 sequences each, both head counts
    python benchmarks/gpt_heads.py --steps 1000 --batch_size 16

Each head count trains its own GPT (utils/gpt.py's GPU size, dropout 0.2, AdamW at lr 1e-3, the gradient norm
clipped to 1) from the same seed, on the same batches of the help pages drawn at random, in one process on all of this
machine's cores. Every --every steps it prints the mean loss of the steps since the last line and the held-out loss on
the first --eval held-out sequences, and at the end the two held-out losses side by side. A GPU-scale run (5,000 steps
of 64 sequences) is far beyond a CPU; these are the first steps of the same curve.
"""
import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python benchmarks/gpt_heads.py` from anywhere

from harness.jobs import machine_summary  # noqa: E402
from utils import evaluate, positive_int  # noqa: E402

HEADS = (6, 8)  # nanoGPT's, the tutorial's


def train(heads, args):
    """{step: (mean training loss since the last report, held-out loss)} of the GPU size with `heads` heads."""
    import torch
    from torch.utils.data import Subset

    from utils import gpt

    workload = gpt.gpt_gpu(0)  # the help pages in blocks of 256, and the GPU size's model
    config = dataclasses.replace(workload.model.config, n_head=heads)
    torch.manual_seed(0)  # the same draws as the workload's model: the heads change no weight's shape
    model = gpt.GPT(config, workload.model.vocab, workload.model.text)
    optimizer = gpt.make_optimizer(model, config)
    train_set, eval_set = workload.train_set, workload.eval_set
    batches = torch.Generator().manual_seed(1)  # the same batches for both head counts
    held_out = Subset(eval_set, range(min(args.eval, len(eval_set))))
    curve, summed, began = {}, 0.0, time.perf_counter()
    for step in range(1, args.steps + 1):
        source, targets = train_set[torch.randint(len(train_set), (args.batch_size,), generator=batches)]
        loss = workload.loss_fn(model(source), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        summed += loss.item()
        if step % args.every == 0 or step == args.steps:
            scored = evaluate(model, held_out, workload.loss_fn, torch.device("cpu"))["loss"]
            curve[step] = (summed / (step - max([0, *curve])), scored)
            summed = 0.0
            print(f"{heads} heads of {config.n_embd // heads}: step {step} | training loss {curve[step][0]:.4f} | "
                  f"held-out {scored:.4f} | {time.perf_counter() - began:.0f} s", flush=True)
    return curve


def report(curves):
    """The last held-out loss of each head count, and their difference."""
    last = {heads: curve[max(curve)][1] for heads, curve in curves.items()}
    print(f"\nheld-out loss after {max(curves[HEADS[0]])} steps: " +
          ", ".join(f"{heads} heads {loss:.4f}" for heads, loss in last.items()) +
          f" (8 minus 6: {last[8] - last[6]:+.4f})")
    return last


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=300, help="Optimizer steps per head count")
    parser.add_argument("--batch_size", type=positive_int, default=8, help="Sequences of 256 characters per step")
    parser.add_argument("--every", type=positive_int, default=50, help="Steps between two reports")
    parser.add_argument("--eval", type=positive_int, default=64, help="Held-out sequences to score")
    args = parser.parse_args()
    print(machine_summary())
    curves = {heads: train(heads, args) for heads in HEADS}
    last = report(curves)
    print(machine_summary())
    return dict(curves=curves, last=last)


if __name__ == "__main__":
    main()
