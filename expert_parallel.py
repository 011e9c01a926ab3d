"""Step 10 - expert parallelism: a mixture-of-experts GPT whose experts are split over ep ranks, tokens sent to them.

    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job1 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \
        expert_parallel.py 50 10 --ep 8 --precision bf16      # the same command on every node; HEAD: the first node
"""
import argparse
import contextlib
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from utils import (WORKLOADS, attempt_store, configure_cpu_threads, errors_said_once, evaluate, exists_on_any_rank,
                   exit_without_teardown, log_rank_metrics, make_workload, mesh_with_timeout, non_negative_number,
                   positive_int, replacing, require_epochs_left, require_same_arguments, require_same_start,
                   require_torchrun, require_written_by, said_once_per_node, size_of, stop_if_unloadable,
                   watch_this_worker, writable_path)
from utils.loop import (WarmupCosine, add_gpt_arguments, check_options, every_rank_rng_state, generate, mfu,
                        set_rng_state)
from utils.moe import balance_loss, describe, moe_layers, require_ep_fits, routing_stats, split_experts, whole_grad_norm
from utils.snapshot_reader import SnapshotReader

# The optimizer's state saved weight by weight, under the weights' names (block0.mlp.experts.3.fc.weight's): the ranks
# hold different experts, whose lists would collide in the one snapshot of the model.
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


def ddp_setup(timeout_s):
    # torchrun has set LOCAL_RANK, RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each process it started.
    if torch.cuda.is_available():
        # Before the process group forms: each process its own GPU.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # The processes meet in torchrun's store, under keys of this attempt's own: after a restart the keys of the
    # workers that died are still there (docs/steps.md explains). A collective stuck past the timeout fails.
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", store=attempt_store(timeout_s),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=timeout_s))


class Trainer:
    def __init__(self, model, train_data, optimizer, loss_fn, device, save_every, snapshot_path, args, mesh):
        # LOCAL_RANK numbers the processes of this node (it picks the GPU); RANK numbers those of the whole job.
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.args = args
        self.steps_per_epoch = math.ceil(len(train_data) / args.grad_accum)  # K micro-batches a step
        self.schedule = WarmupCosine(args.total_epochs * self.steps_per_epoch)  # warm-up, then a cosine
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule)
        self.dtype = {"bf16": torch.bfloat16}.get(args.precision)  # None: fp32
        # The weights are built: each rank its own dropout masks.
        torch.manual_seed(1 + self.global_rank)
        self.tag = f"[rank {self.global_rank}/{dist.get_world_size()} | local {self.local_rank} | {device}]"
        self.snapshot_path = snapshot_path
        # The ranks that split the experts: the gradient norm adds up over them.
        self.ep = mesh["ep"].get_group()
        # DCP's load is a collective: if any rank finds a snapshot, all of them load it.
        self.epochs_run = self._load_snapshot() if exists_on_any_rank(snapshot_path, device) else 0
        # Each node read the snapshot from its own disk.
        require_same_start(self.epochs_run, device)
        # An expert's gradient sums the losses of every ep rank whose tokens it took: a DDP of its own averages it
        # over its dp copies, and / ep makes it, like every other gradient, the mean over all ranks.
        ids = [device.index] if device.type == "cuda" else None
        # Every DDP of this rank: a micro-batch that must not all-reduce runs inside the no_sync() of each.
        self.syncs = []
        for layer in moe_layers(model):
            layer.experts = DDP(layer.experts, device_ids=ids, process_group=mesh["dp"].get_group())
            for weight in layer.experts.parameters():
                weight.register_hook(lambda grad: grad / mesh["ep"].size())
            self.syncs.append(layer.experts)
        # DDP broadcasts rank 0's weights, then averages the gradients of the rest (attention, routers...) over all.
        experts = [name for name, _ in model.named_parameters() if ".experts." in name]
        DDP._set_params_and_buffers_to_ignore_for_model(model, experts)
        self.model = DDP(self.model, device_ids=ids)
        self.syncs.append(self.model)

    def _load_snapshot(self):
        with stop_if_unloadable(self.snapshot_path):
            # Read once, as data only: a planted folder runs no code.
            reader = SnapshotReader(self.snapshot_path)
            require_written_by("expert_parallel.py", self.snapshot_path, reader)
            # Each rank reads its own experts and the rest, by their names, from a snapshot of any --ep: DCP fills
            # the tensors of the dict below in place.
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=BY_NAME)
            snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state,
                            SCHEDULER_STATE=self.scheduler.state_dict(), RNG_STATES=(), EPOCHS_RUN=0)
            dcp.load(snapshot, storage_reader=reader)
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                           options=BY_NAME)
            self.scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
            # This rank's dropout, where it left off.
            set_rng_state(snapshot["RNG_STATES"], self.global_rank)
            epochs_run = snapshot["EPOCHS_RUN"]
        self.schedule.resume(self.scheduler.last_epoch, (self.args.total_epochs - epochs_run) * self.steps_per_epoch)
        print(f"{self.tag} resuming from epoch {epochs_run}, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        return epochs_run

    def _run_batch(self, source, targets, micro_batches, last):
        # All but the last micro-batch of a step run inside every DDP's no_sync(), the forward too (DDP arms its
        # all-reduce there): their gradients add up locally and backward all-reduces once per optimizer step.
        with contextlib.ExitStack() as unsynced:
            if not last:
                for ddp in self.syncs:
                    unsynced.enter_context(ddp.no_sync())
            with torch.autocast(self.device.type, self.dtype, enabled=self.dtype is not None):  # weights stay fp32
                loss = self.loss_fn(self.model(source), targets)
            # The routers' load-balancing loss, smallest when they spread the batch's tokens evenly over the experts.
            ((loss + self.args.aux_weight * balance_loss(self.model)) / micro_batches).backward()
        if last:
            # Clip by the whole model's gradient norm: the ranks of an ep group hold different experts.
            norm = whole_grad_norm(self.model, self.ep)
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.args.grad_clip, norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        # A new shuffle each epoch, the same on every rank.
        self.train_data.sampler.set_epoch(epoch)
        # [summed loss, samples], kept on the device.
        totals = torch.zeros(2, device=self.device)
        batches = len(self.train_data)
        K = self.args.grad_accum
        for i, (source, targets) in enumerate(self.train_data):
            source, targets = source.to(self.device), targets.to(self.device)
            # K, or what is left for the epoch's last step.
            micro_batches = min(K, batches - i // K * K)
            totals[0] += self._run_batch(source, targets, micro_batches, i % K + 1 == micro_batches) * len(source)
            totals[1] += len(source)
        # What the routers did this epoch: the tokens each expert got, the aux loss, the bytes the all-to-alls moved.
        routing = routing_stats(self.model)
        log_rank_metrics(epoch, self.steps_per_epoch, totals, start, **routing)
        # Summed over the ranks: the loss below is their mean.
        dist.all_reduce(totals)
        # Waits for the device: the clock below is honest.
        mean_loss = (totals[0] / totals[1]).item()
        samples_per_s = totals[1].item() / (time.perf_counter() - start)
        tokens_per_s = samples_per_s * source.shape[1]  # the whole job's
        utilisation = mfu(self.model, tokens_per_s, self.device, self.args.peak_tflops)
        # The MFU where the device's peak is known (a GPU's, or --peak_tflops).
        mfu_text = f" | MFU {utilisation:.1%}" if utilisation else ""
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | steps {self.steps_per_epoch} | loss {mean_loss:.4f} | "
                  f"{tokens_per_s:,.0f} tokens/s{mfu_text} | {describe(routing, self.steps_per_epoch)}")

    def _save_snapshot(self, epoch, rng_states):
        # All it takes to go on exactly: the data order comes from the sampler's seed and the epoch.
        # Each rank saves its experts and the rest under the whole model's names: DCP writes a replicated weight once.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=BY_NAME)
        snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state,
                        SCHEDULER_STATE=self.scheduler.state_dict(), RNG_STATES=tuple(rng_states),
                        EPOCHS_RUN=epoch + 1, STEP="expert_parallel.py")
        # Every rank writes its part into one folder of the job's; rank 0 then swaps it in for the last snapshot.
        tmp = f"{self.snapshot_path}.{os.environ['TORCHELASTIC_RUN_ID']}.tmp"
        with replacing(self.snapshot_path, tmp, rename=self.global_rank == 0):
            dcp.save(snapshot, checkpoint_id=tmp)
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | snapshot saved to {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                # Every rank's dropout generators, as bytes: no pickle.
                rng_states = every_rank_rng_state()
                self._save_snapshot(epoch, rng_states)  # sharded: every rank writes its part
                # No rank runs ahead of a snapshot not on disk yet.
                dist.barrier()


def load_train_objs(args):
    # Data, model, optimizer and loss: the GPT whose blocks' MLPs are experts, each token sent to --top_k of them.
    return make_workload(args.workload, text=args.text, dropout=args.dropout, top_k=args.top_k,
                         capacity_factor=args.capacity_factor)


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(),
                      shuffle=False, sampler=DistributedSampler(dataset))  # each rank its own 1/world_size


def main(args):
    # Before the process group forms, a mistake that every rank finds alike: one line, said once on each node.
    with said_once_per_node(args.timeout):
        # An option that cannot run here: one line, before anything.
        check_options(args)
        # Whole ep groups, each rank as many experts as the others: else one line, before anything starts.
        require_ep_fits(args.ep, args.top_k, size_of(args.workload).experts, int(os.environ["WORLD_SIZE"]))
        # Its data read: missing data stops it here, too.
        workload = load_train_objs(args)
    # From here on this worker stops with one line, never a hang or a traceback: the group must form within --timeout,
    # torchrun must stay alive, and Ctrl-C or a collective that gave up ends it (utils/launch.py).
    watch_this_worker(args.timeout)
    ddp_setup(args.timeout)
    # Every node started with the same command?
    require_same_arguments(args)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    # Only this node's processes share its cores.
    configure_cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
    # dp x ep, rank = d * ep + e: an ep group's ranks are neighbours, on one node, whose links the all-to-alls need.
    mesh = init_device_mesh(device.type, (dist.get_world_size() // args.ep, args.ep), mesh_dim_names=("dp", "ep"))
    # The groups it made give up after --timeout too.
    mesh_with_timeout(mesh, args.timeout)
    # Each rank keeps 1/ep of every layer's experts; the tokens of the others travel to them and back (utils/moe.py).
    # So the ranks of an ep group read different data, like any two ranks: the sampler splits it over all of them.
    split_experts(workload.model, mesh["ep"].get_group())
    train_data = prepare_dataloader(workload.train_set, args.batch_size)
    # A snapshot that every rank finds unusable, or finished already: one line on each node too.
    with said_once_per_node(args.timeout):
        trainer = Trainer(workload.model, train_data, workload.make_optimizer(workload.model), workload.loss_fn, device,
                          args.save_every, args.snapshot_path, args, mesh)
        require_epochs_left(trainer.epochs_run, args.total_epochs, args.snapshot_path)  # a finished job run again
    trainer.train(args.total_epochs)
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, workload.classification)
    # Every rank samples, the same characters: each forward sends the tokens to the experts on the other ranks.
    sample = generate(trainer.model, seed=0).strip("\n").splitlines()  # the same seed every run
    if trainer.global_rank == 0:
        print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")
        print(f"{trainer.tag} sample after {trainer.scheduler.last_epoch} optimizer steps:")
        for line in sample:
            print(f"  | {line}")
    dist.destroy_process_group()
    # Python's teardown can abort under gloo: see utils.
    exit_without_teardown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per process")
    parser.add_argument("--workload", default="gpt-moe", choices=[w for w in WORKLOADS if w.startswith("gpt-moe")])
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--snapshot_path", default="ep_snapshot", type=writable_path, help="Sharded snapshot folder")
    parser.add_argument("--ep", default=2, type=positive_int, help="Ranks that split the experts; dp: processes / ep")
    parser.add_argument("--top_k", default=2, type=positive_int, help="Experts each token goes to")
    parser.add_argument("--aux_weight", default=0.01, type=non_negative_number,
                        help="Weight of the load-balancing loss (0: off)")
    parser.add_argument("--capacity_factor", default=0, type=non_negative_number,
                        help="Drop tokens past this x an expert's even share (0: never)")
    parser.add_argument("--grad_accum", default=1, type=positive_int, help="Micro-batches per optimizer step (K)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: weights stay fp32")
    parser.add_argument("--grad_clip", default=1.0, type=float, help="Largest gradient norm of a step (inf: no clip)")
    add_gpt_arguments(parser)  # --text, --dropout, --peak_tflops
    # Torchrun gives every rank the same arguments: a mistake in them is said once.
    errors_said_once(parser)
    args = parser.parse_args()

    require_torchrun()
    main(args)
