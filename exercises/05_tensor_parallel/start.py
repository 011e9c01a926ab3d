"""Exercise 5 - 2D parallelism (FSDP x TP): which ranks must train on the same data, and which on their own part of it.

Starting file: tensor_parallel.py (step 7) with the data split taken out of prepare_dataloader; the TODOs say what goes
back. Check it with `python exercises/check.py 5 my_2d.py`; hints in exercises/05_tensor_parallel/hints.md.

    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job1 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \
        tensor_parallel.py 50 10 --tp 8 --verbose   # the same command on every node; HEAD: the first node
"""
import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from utils import (SEED, WORKLOADS, attempt_store, configure_cpu_threads, errors_said_once, evaluate,
                   exists_on_any_rank, exit_without_teardown, log_memory, log_rank_metrics, log_slices, make_workload,
                   mesh_with_timeout, positive_int, replacing, require_epochs_left, require_same_arguments,
                   require_same_start, require_torch_for_fsdp, require_torchrun, require_tp_fits, require_written_by,
                   said_once_per_node, stop_if_unloadable, watch_this_worker, writable_path)
from utils.snapshot_reader import SnapshotReader

# Megatron-style: q, k, v and the MLP's first matrix split by rows (a rank computes n_head/tp heads), the matrices
# after them by columns, their partial sums all-reduced over tp; backward all-reduces once at each input.
PLAN = {"attention": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate()),
        "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
        "attention.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}


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
    def __init__(self, model, train_data, make_optimizer, loss_fn, device, save_every, snapshot_path, fsdp, verbose):
        # LOCAL_RANK numbers the processes of this node (it picks the GPU); RANK numbers those of the whole job.
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        # Each block, then the root: one block's full weights exist at a time; each parameter becomes a 1/N shard.
        if fsdp:
            for module in [*model.children(), model]:
                fully_shard(module, **fsdp)
        # After fully_shard: it steps the shards.
        self.optimizer = make_optimizer(model)
        self.train_data = train_data
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.tag = f"[rank {self.global_rank}/{dist.get_world_size()} | local {self.local_rank} | {device}]"
        self.snapshot_path = snapshot_path
        self.verbose = verbose
        # dp: the ranks that split the data.
        self.dp = fsdp["mesh"]
        # Each rank draws the dropout masks of its own heads' attention weights from a generator of its own.
        self.heads = torch.Generator(device)
        for block in list(model.children())[1:-1]:
            block.attention.generator = self.heads
        # DCP's load is a collective: if any rank finds a snapshot, all of them load it.
        self.epochs_run = self._load_snapshot() if exists_on_any_rank(snapshot_path, device) else 0
        # Each node read the snapshot from its own disk.
        require_same_start(self.epochs_run, device)

    def _load_snapshot(self):
        with stop_if_unloadable(self.snapshot_path):
            # Read once, as data only: a planted folder runs no code.
            reader = SnapshotReader(self.snapshot_path)
            require_written_by("tensor_parallel.py", self.snapshot_path, reader)
            # Each rank reads only its own shards, into the (sharded) state it already has.
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state, EPOCHS_RUN=0)
            dcp.load(snapshot, storage_reader=reader)  # fills the tensors above in place
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
            epochs_run = snapshot["EPOCHS_RUN"]
        print(f"{self.tag} resuming from epoch {epochs_run}, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        return epochs_run

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        # A new shuffle each epoch, the same on every rank.
        self.train_data.sampler.set_epoch(epoch)
        # Dropout, seeded anew each epoch by the epoch and the rank's place in the mesh. The ranks of a tp group hold
        # the activations between the split matrices whole and must drop the same elements of them, else their copies
        # drift apart: one seed per dp rank. Their own heads draw from seeds of their own. No random state needs to
        # be saved: a resumed epoch draws what it drew the first time, on any layout.
        torch.manual_seed(hash((SEED, epoch, self.dp.get_local_rank())))
        self.heads.manual_seed(hash((SEED, epoch, self.dp.size() + self.global_rank)))
        # [summed loss, samples], kept on the device.
        totals = torch.zeros(2, device=self.device)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            totals[0] += self._run_batch(source, targets) * len(source)
            totals[1] += len(source)
        log_rank_metrics(epoch, len(self.train_data), totals, start)
        # Summed over dp only: the ranks of a tp group trained on the same samples, which count once.
        dist.all_reduce(totals, group=self.dp.get_group())
        # Waits for the device: the clock below is honest.
        mean_loss = (totals[0] / totals[1]).item()
        samples_per_s = totals[1].item() / (time.perf_counter() - start)
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | steps {len(self.train_data)} | loss {mean_loss:.4f} | "
                  f"{samples_per_s:,.0f} samples/s")

    def _save_snapshot(self, epoch):
        # All it takes to go on exactly: the data order comes from the sampler's seed and the epoch.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state, EPOCHS_RUN=epoch + 1,
                        STEP="tensor_parallel.py")
        # Every rank writes its shards into one folder of the job's; rank 0 then swaps it in for the last snapshot.
        tmp = f"{self.snapshot_path}.{os.environ['TORCHELASTIC_RUN_ID']}.tmp"
        with replacing(self.snapshot_path, tmp, rename=self.global_rank == 0):
            dcp.save(snapshot, checkpoint_id=tmp)
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | snapshot saved to {self.snapshot_path}")

    def train(self, max_epochs):
        log_memory("start", self.model, self.optimizer, self.device, self.verbose)  # every rank's, in one table
        # Each rank's part of a block's matrices, in one table.
        log_slices(self.model.block0, self.verbose)
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            log_memory(f"after epoch {epoch}", self.model, self.optimizer, self.device, self.verbose)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_snapshot(epoch)  # sharded: every rank writes its part
                # No rank runs ahead of a snapshot not on disk yet.
                dist.barrier()
        log_memory("end", self.model, self.optimizer, self.device, self.verbose)


def load_train_objs(args):
    # Data, model, optimizer and loss, as in every step.
    return make_workload(args.workload)


def prepare_dataloader(dataset: Dataset, batch_size: int, dp_mesh):
    # TODO: which ranks must train on the same batches, which on parts of their own? dp_mesh is this rank's dp group.
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      sampler=DistributedSampler(dataset))  # TODO: every rank its own 1/world_size of the data?


def main(args):
    # Before the process group forms, a mistake that every rank finds alike: one line, said once on each node.
    with said_once_per_node(args.timeout):
        # Whole tp groups, and whole heads on every rank of one: else one line, before anything starts.
        require_tp_fits(args, int(os.environ["WORLD_SIZE"]))
        # FSDP on CPU processes needs torch 2.9: else one line.
        require_torch_for_fsdp()
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
    # A grid of dp x tp ranks, named; a tp group is tp consecutive ranks (the GPUs of one node).
    mesh = init_device_mesh(device.type, (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    # The groups it made give up after --timeout too.
    mesh_with_timeout(mesh, args.timeout)
    # bf16 compute; the gradients reduce-scattered in fp32 (a bf16 sum of many ranks' gradients loses their low bits);
    # fp32 outputs for the loss; FSDP over dp only.
    bf16 = torch.bfloat16 if args.precision == "bf16" else None
    fsdp = dict(mp_policy=MixedPrecisionPolicy(bf16, reduce_dtype=torch.float32, output_dtype=torch.float32),
                mesh=mesh["dp"])
    # Each transformer block split over its tp group, before FSDP shards what each rank holds of it.
    for block in list(workload.model.children())[1:-1]:
        parallelize_module(block, mesh["tp"], PLAN)
    train_data = prepare_dataloader(workload.train_set, args.batch_size, mesh["dp"])
    # A snapshot that every rank finds unusable, or finished already: one line on each node too.
    with said_once_per_node(args.timeout):
        trainer = Trainer(workload.model, train_data, workload.make_optimizer, workload.loss_fn, device,
                          args.save_every, args.snapshot_path, fsdp, args.verbose)
        require_epochs_left(trainer.epochs_run, args.total_epochs, args.snapshot_path)  # a finished job run again
    trainer.train(args.total_epochs)
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, group=mesh["dp"].get_group())
    # Every weight gathered whole, in the order it was split: over dp (FSDP's shards), then over tp (the slices). In
    # one go, torch would warn that it cannot merge the two all-gathers of a weight split twice along one dimension.
    full_model = {}
    for name, value in trainer.model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.redistribute(placements=[Replicate(), *value.placements[1:]]).full_tensor().cpu()
        full_model[name] = value
    if trainer.global_rank == 0:
        print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")
        full_path = os.path.join(os.path.dirname(args.snapshot_path), "tp_model_full.pt")  # beside the snapshot
        # One plain state_dict: it loads without torch.distributed.
        torch.save(full_model, full_path)
        print(f"{trainer.tag} full model saved to {full_path}")
    dist.destroy_process_group()
    # Python's teardown can abort under gloo: see utils.
    exit_without_teardown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per dp rank")
    parser.add_argument("--workload", default="gpt", choices=[w for w in WORKLOADS if w.startswith("gpt")])
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--snapshot_path", default="tp_snapshot", type=writable_path, help="Sharded snapshot folder")
    parser.add_argument("--tp", default=2, type=positive_int, help="Ranks that split each block (tensor parallel)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="Compute dtype")
    parser.add_argument("--verbose", action="store_true", help="Print every rank's memory at each epoch")
    # Torchrun gives every rank the same arguments: a mistake in them is said once.
    errors_said_once(parser)
    args = parser.parse_args()

    require_torchrun()
    main(args)
