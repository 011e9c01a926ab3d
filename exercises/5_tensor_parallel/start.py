"""Exercise 5 - 2D parallelism (FSDP x TP): which ranks must train on the same data, and which on their own part of it.

Starting file: tensor_parallel.py (step 7) with the data split taken out of prepare_dataloader; the TODOs say what goes
back. Check it with `python exercises/check.py 5 my_2d.py`; hints in exercises/5_tensor_parallel/hints.md.

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
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from utils import (WORKLOADS, attempt_store, configure_cpu_threads, evaluate, exit_without_teardown, make_workload,
                   positive_int, log_memory, log_rank_metrics, reason, replacing, require_epochs_left,
                   require_same_arguments, require_torchrun, writable_path)
from utils import log_slices, mesh_with_timeout, require_tp_fits

# Megatron-style: q, k, v and the MLP's first matrix split by columns (a rank computes n_head/tp heads, 1/tp of the
# hidden units), the matrices after them by rows; the partial sums are all-reduced over tp (backward: at the inputs)
PLAN = {"attention": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate()),
        "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
        "attention.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}


def ddp_setup(timeout_s):  # torchrun has set LOCAL_RANK, RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before init: each process drives its own GPU
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo",  # meet in torchrun's store,
                            store=attempt_store(timeout_s), rank=int(os.environ["RANK"]),  # under this attempt's keys
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=timeout_s))


class Trainer:
    def __init__(self, model, train_data, make_optimizer, loss_fn, device, save_every, snapshot_path, mesh, fsdp,
                 verbose):
        self.local_rank = int(os.environ["LOCAL_RANK"])  # its number on this node: picks the GPU
        self.global_rank = int(os.environ["RANK"])  # its number in the whole job: logs, and the one writer
        self.device = device
        self.model = model.to(device)
        for block in list(model.children())[1:-1]:  # each transformer block: its matrices split over the tp ranks,
            parallelize_module(block, mesh["tp"], PLAN)  # which each hold 1/tp of them (DTensors), then FSDP over dp:
        for module in [*model.children(), model] if fsdp else []:  # each block, then the root: a block's full
            fully_shard(module, **fsdp)  # weights exist only while it runs; its parameters become 1/N shards
        optimizer = make_optimizer(model)  # after fully_shard: over the sharded parameters that replaced the full ones
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.save_every = save_every
        self.tag = f"[rank {self.global_rank}/{dist.get_world_size()} | local {self.local_rank} | {device}]"
        self.snapshot_path = snapshot_path
        self.mesh, self.verbose = mesh, verbose
        found = torch.tensor(os.path.exists(snapshot_path), device=device)  # DCP's load is a collective: if any
        dist.all_reduce(found, op=dist.ReduceOp.MAX)  # rank finds a snapshot, all load (one without one fails)
        self.epochs_run = self._load_snapshot() if found else 0  # epochs already done
        seen = torch.tensor([self.epochs_run, -self.epochs_run], device=device)  # every node reads its own disk:
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)  # do all ranks resume from the same epoch?
        if seen[0] != -seen[1]:
            raise SystemExit(f"error: ranks resume from different epochs ({-int(seen[1])} to {int(seen[0])}): put "
                             "--snapshot_path on storage that every node shares")

    def _load_snapshot(self):
        try:  # each rank reads only its own shards, into the (sharded) state it already has
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            snapshot = dict(MODEL_STATE=model_state, OPTIMIZER_STATE=optimizer_state, EPOCHS_RUN=0)
            dcp.load(snapshot, checkpoint_id=self.snapshot_path)  # fills the tensors above in place
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
            epochs_run = snapshot["EPOCHS_RUN"]
        except (Exception, dcp.CheckpointException) as error:  # garbage bytes, another model's snapshot, a missing key
            raise SystemExit(f"error: cannot resume from {self.snapshot_path} ({reason(error)}); it is left in place: "
                             "move it away to start anew")
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
        self.train_data.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one on every rank
        totals = torch.zeros(2, device=self.device)  # [summed loss, samples]: stays on the device, no per-step sync
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            totals[0] += self._run_batch(source, targets) * len(source)
            totals[1] += len(source)
        log_rank_metrics(epoch, len(self.train_data), totals, start)  # this rank's own totals, not summed over ranks
        dist.all_reduce(totals, group=self.mesh["dp"].get_group())  # over dp: a tp group trained on one batch
        mean_loss = (totals[0] / totals[1]).item()  # .item() waits for the device, so the clock below is honest
        samples_per_s = totals[1].item() / (time.perf_counter() - start)
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | steps {len(self.train_data)} | loss {mean_loss:.4f} | "
                  f"{samples_per_s:,.0f} samples/s")

    def _save_snapshot(self, epoch):
        snapshot = dict(zip(["MODEL_STATE", "OPTIMIZER_STATE"], get_state_dict(self.model, self.optimizer)),
                        EPOCHS_RUN=epoch + 1)  # all it takes to go on exactly (the data order is the sampler's)
        tmp = f"{self.snapshot_path}.{os.environ['TORCHELASTIC_RUN_ID']}.tmp"  # one name for every rank of the job
        with replacing(self.snapshot_path, tmp, rename=self.global_rank == 0):  # every rank writes its shards, then
            dcp.save(snapshot, checkpoint_id=tmp)  # rank 0 swaps the complete directory in for the last snapshot
        if self.global_rank == 0:
            print(f"{self.tag} epoch {epoch} | snapshot saved to {self.snapshot_path}")

    def train(self, max_epochs):
        require_epochs_left(self.epochs_run, max_epochs, self.snapshot_path)  # a finished job run again says so
        log_memory("start", self.model, self.optimizer, self.device, self.verbose)  # every rank's, in one table
        log_slices(self.model.block0, self.verbose)  # the part of each matrix of a block that each rank holds
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            log_memory(f"after epoch {epoch}", self.model, self.optimizer, self.device, self.verbose)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_snapshot(epoch)  # a sharded snapshot: every rank writes its part
                dist.barrier()  # no rank runs ahead of a snapshot that is not on disk yet
        log_memory("end", self.model, self.optimizer, self.device, self.verbose)


def load_train_objs(workload_name):
    return make_workload(workload_name)  # dataset, held-out split, model, optimizer, loss: one call, every step


def prepare_dataloader(dataset: Dataset, batch_size: int, dp_mesh):
    # TODO: which ranks must train on the same batches, which on parts of their own? dp_mesh is this rank's dp group.
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      sampler=DistributedSampler(dataset))  # TODO: every rank's own 1/world_size of the data?


def main(args):
    ddp_setup(args.timeout)
    require_same_arguments(args)  # every node started with the same command? Else all stop here, with one line
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    configure_cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"]))  # only the processes of this node share its cores
    workload = load_train_objs(args.workload)
    require_tp_fits(args.tp, dist.get_world_size(), workload.model.config.n_head)  # whole tp groups, whole heads
    # dp x tp ranks, named; a tp group is tp consecutive ranks (the GPUs of one node: TP communicates the most)
    mesh = init_device_mesh(device.type, (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    mesh_with_timeout(mesh, args.timeout)  # its process groups too give up after --timeout
    fsdp = dict(mesh=mesh["dp"],  # FSDP shards over dp; --precision bf16: computes in bfloat16, keeps fp32 shards
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.precision == "bf16" else None))
    train_data = prepare_dataloader(workload.train_set, args.batch_size, mesh["dp"])
    trainer = Trainer(workload.model, train_data, workload.make_optimizer, workload.loss_fn, device,
                      args.save_every, args.snapshot_path, mesh, fsdp, args.verbose)
    trainer.train(args.total_epochs)
    metrics = evaluate(trainer.model, workload.eval_set, workload.loss_fn, device, group=mesh["dp"].get_group())
    full_model = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank == 0:
        print(f"{trainer.tag} held-out {len(workload.eval_set)} samples | {metrics}")
        full_path = os.path.join(os.path.dirname(args.snapshot_path), "model_full.pt")  # beside the snapshot
        torch.save(full_model, full_path)  # the shards gathered into one plain state_dict: no torch.distributed
        print(f"{trainer.tag} full model saved to {full_path}")
    dist.destroy_process_group()
    exit_without_teardown()  # a gloo thread may still hold tensors: see utils


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("total_epochs", type=positive_int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=positive_int, help="How often to save (in epochs)")
    parser.add_argument("--batch_size", default=32, type=positive_int, help="Input batch size per dp rank")
    parser.add_argument("--workload", default="gpt", choices=[w for w in WORKLOADS if w.startswith("gpt")])
    parser.add_argument("--timeout", default=60, type=positive_int, help="Seconds before a stuck collective fails")
    parser.add_argument("--snapshot_path", default="snapshot", type=writable_path, help="Sharded snapshot folder")
    parser.add_argument("--tp", default=2, type=positive_int, help="Ranks that split each block (tensor parallel)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="Compute dtype (CPU, GPU)")
    parser.add_argument("--verbose", action="store_true", help="Print every rank's memory at each epoch")
    args = parser.parse_args()

    require_torchrun("torchrun --nnodes=2 --nproc_per_node=1 --rdzv_id=job1 --rdzv_backend=c10d "
                     "--rdzv_endpoint=HEAD:29500")  # a clear error for plain `python`, or more processes than GPUs
    main(args)
