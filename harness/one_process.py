"""What the GPT steps must compute, in one process on whole sequences: the reference that the tests, the workshop
checker and the notebooks hold a parallel job's losses and weights against.

    reference = train_gpt(text, batch_size=8, epochs=3, schedule_epochs=2)
    reference["losses"][epoch], reference["weights"][epochs_done], reference["norms"], reference["held_out"]

It trains as the steps' loop does at fp32 and dropout 0: AdamW, the gradient norm clipped to 1, the warm-up + cosine
schedule of `schedule_epochs` epochs stepped per batch (a job resumed with more epochs has no schedule left: it stays
at the floor), the batches in the order a 1-replica DistributedSampler deals them, which is the order every dp group
of a job splits between its ranks.
"""
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from utils import evaluate, make_workload
from utils.loop import WarmupCosine
from utils.moe import balance_loss


def tensors(state):
    """A state_dict's tensors, copied (a GPT's also holds the identity of its text, `_extra_state`)."""
    return {name: value.clone() for name, value in state.items() if isinstance(value, torch.Tensor)}


def train_gpt(text, batch_size, epochs, schedule_epochs=None, context=None, drop_last=False, workload="gpt-cpu",
              aux_weight=0.0, **options):
    """The CPU-size GPT learning `text` (a file) for `epochs`, batches of `batch_size` (`context`: instead of the size's
    context; `drop_last`: leave out a last batch that is not whole, as a pipeline must; `workload`: "gpt-moe-cpu" for
    the mixture of experts, its load-balancing loss weighted by `aux_weight`, `options` the builder's, e.g. top_k).
    {"losses": {epoch: mean loss of its batches}, "norms": each step's gradient norm before clipping, "weights":
    {epochs done: weights}, "held_out": the held-out loss after `schedule_epochs` (default: all of them)}."""
    schedule_epochs = schedule_epochs or epochs
    workload = make_workload(workload, text=str(text), dropout=0, context=context, **options)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the jobs run: 2 threads on a busy 2-core machine spin-wait, 10x slower
    loader = DataLoader(workload.train_set, batch_size=batch_size, drop_last=drop_last,
                        sampler=DistributedSampler(workload.train_set, num_replicas=1, rank=0))
    scheduler = LambdaLR(workload.optimizer, WarmupCosine(schedule_epochs * len(loader)))
    losses, norms, weights, held_out = {}, [], {}, None
    try:
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            summed = 0.0
            for source, targets in loader:
                loss = workload.loss_fn(workload.model(source), targets)
                (loss + aux_weight * balance_loss(workload.model) if aux_weight else loss).backward()
                summed += loss.item()
                norms.append(torch.nn.utils.clip_grad_norm_(workload.model.parameters(), 1.0).item())
                workload.optimizer.step()
                scheduler.step()
                workload.optimizer.zero_grad(set_to_none=True)
            losses[epoch] = summed / len(loader)
            weights[epoch + 1] = tensors(workload.model.state_dict())
            if epoch + 1 == schedule_epochs:
                held_out = evaluate(workload.model, workload.eval_set, workload.loss_fn, torch.device("cpu"))["loss"]
    finally:
        torch.set_num_threads(threads)
    return dict(losses=losses, norms=norms, weights=weights, held_out=held_out)
