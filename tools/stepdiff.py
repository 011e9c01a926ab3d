"""The diffs between consecutive step scripts, generated from the files, and the doc blocks that show them.

    python tools/stepdiff.py            # check: exit 1 if a diff in README.md or docs/ is stale
    python tools/stepdiff.py --write    # regenerate every diff block of README.md and docs/ from the scripts

The full diffs live on the steps' reference pages (docs/reference/*.md). A page marks each generated block with
`<!-- diff OLD NEW -->` ... `<!-- end diff -->`; everything between the two markers is replaced by a ```diff fence
holding `diff -u`-style output of OLD -> NEW. Any page may hold any pair's block; the tests want every step shown
against the one it builds on (`pairs()`).
"""
import argparse
import difflib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHAIN = ["single_gpu.py", "multigpu.py", "multigpu_torchrun.py", "multinode.py", "fsdp.py", "gpt.py",
         "tensor_parallel.py", "pipeline_parallel.py", "context_parallel.py", "expert_parallel.py", "one_mesh.py",
         "long_run.py", "fault_tolerant.py"]
# The step each script is a diff of, where it is not the one before it in CHAIN: gpt.py trains with DDP, so it builds
# on multinode.py, not on fsdp.py; tensor_parallel.py adds TP to FSDP's sharding, so it builds on fsdp.py;
# pipeline_parallel.py, context_parallel.py and expert_parallel.py are diffs of gpt.py (the same GPT and loop, in
# stages; on parts of each sequence; with its MLPs as experts spread over the ranks); one_mesh.py is a diff of
# pipeline_parallel.py (its pipeline, with two stages a rank, each stage split over tp and sharded over dp);
# fault_tolerant.py is a diff of fsdp.py (its FSDP inside each replica group, its small workloads: a kill and a heal
# take seconds on a CPU, and the proofs compare it with fsdp.py itself).
PREVIOUS = {"gpt.py": "multinode.py", "tensor_parallel.py": "fsdp.py", "pipeline_parallel.py": "gpt.py",
            "context_parallel.py": "gpt.py", "expert_parallel.py": "gpt.py", "one_mesh.py": "pipeline_parallel.py",
            "fault_tolerant.py": "fsdp.py"}
# Budgets: a step script reads in one sitting (lines), and each is a small diff of the one before (changed lines:
# removed + added, as `diff OLD NEW | grep -c '^[<>]'` counts them).
BUDGET = (150, 60)
# The exceptions, each with its reason: every other step meets BUDGET.
LARGER_BUDGETS = {
    # Teaches two things at once, torchrun (its environment, the process group in torchrun's store under the keys of
    # its attempt) and fault-tolerant snapshots (save, load, resume at the next epoch, a barrier): 66 changed lines,
    # one of them the import of step 2's Ctrl-C handler, which torchrun's workers do not need (they have their own).
    # Then the snapshot names the step that wrote it and a resume refuses another step's, as the sharded steps' do
    # (STEP, one call and its import): 136 lines, 68 changed.
    # Then a mistake that every rank meets alike said once (utils.launch): the arguments' errors (one call), the checks
    # and the data read before the process group in a block, and the snapshot's resume with the check of epochs left
    # in another (4 changed lines and the lines they hold, indented): 141 lines, 77 changed.
    "multigpu_torchrun.py": (150, 77),
    # Sharding, sharded (collective) snapshots with their swap and step 4's checks around a collective load, the full
    # model exported at the end, the memory tables, and FSDP's precision and offload policies, which are the API the
    # step teaches: 170 lines, 66 changed. Then 3 lines and 7 changed lines more: the gradients reduced in fp32 under
    # bf16 (a policy argument and why, in the comment), the refusal of another step's snapshot (one call), and one
    # line where the torch at hand trains FSDP on CPU processes wrong (2.6 to 2.8).
    # The import of require_written_by on a line of its own, as every step from step 3 on has it, and step 4's
    # call of it for its single file, which this step does not have: 174 lines, 74 changed.
    # Then the snapshot read through the steps' own reader, once, as data only (utils/snapshot_reader.py: its
    # import, and the reader both loads use): 176 lines, 76 changed.
    # Then a mistake that every rank meets alike said once (utils.launch): the arguments' errors (one call), the checks
    # and the data read before the process group in a block, and the snapshot's resume with the check of epochs left
    # in another (4 changed lines and the lines they hold, indented): 181 lines, 76 changed.
    "fsdp.py": (181, 76),
    # The loop a real model is trained with, each piece a few lines: accumulation with no_sync, mixed precision with a
    # gradient scaler, clipping, a schedule that resumes, torch.compile, a snapshot of all the loop depends on, and a
    # sample of what the model writes: 180 lines, 80 changed (the limit its issue set).
    # Then step 3's naming of the step in the snapshot, with its own name (two lines that differ from step 4's),
    # and its import: 182 lines, 82 changed.
    # Then a mistake that every rank meets alike said once (utils.launch): the arguments' errors (one call), the checks
    # and the data read before the process group in a block, and the snapshot's resume with the check of epochs left
    # in another (4 changed lines and the lines they hold, indented): 187 lines, 82 changed.
    "gpt.py": (187, 82),
    # fsdp.py with the device mesh, the tensor-parallel plan applied before FSDP, and the data split over dp (182
    # lines, 60 changed, when TP was all it added), then what running it with dropout and on GPUs took: dropout seeded
    # per epoch by the rank's place in the mesh, with a generator of its own for each rank's heads (9 lines), the
    # whole model gathered without torch's warning (3), its own snapshot's name and the refusal of another step's,
    # step 5's check of the torch at hand, and comments as sentences above the code instead of trailing fragments.
    # Against its issue's (170, 60).
    # The import of require_written_by on a line of its own, as in step 5: 201 lines.
    # Then the snapshot read through the steps' own reader, once, as data only (utils/snapshot_reader.py: its
    # import, and the reader both loads use): 203 lines, 91 changed.
    # Then a mistake that every rank meets alike said once (utils.launch): the arguments' errors (one call), the checks
    # and the data read before the process group in a block, and the snapshot's resume with the check of epochs left
    # in another (4 changed lines and the lines they hold, indented): 208 lines, 91 changed.
    "tensor_parallel.py": (208, 91),
    # gpt.py with the loop's forward and backward replaced by a pipeline schedule: the stage and the shapes it sends,
    # the cut of the GPT into stages (in the script: it is the lesson), the (pp, dp) mesh and its timeouts, DDP over
    # dp, each micro-batch's loss / M whatever the torch version, clipping by the whole model's norm, and gpt.py's
    # snapshot turned into a sharded one keyed by the whole model's names (it resumes on any cut and any dp, which a
    # file per stage cannot), less accumulation, the fp16 scaler and compile, whose removed lines count too; comments
    # as sentences above the code. Against its issue's (180, 80); (192, 106) before the sharded snapshot and the cut.
    # The import of require_written_by on a line of its own, as in step 6, and step 6's call of it for its single
    # file, which this step does not have: 232 lines, 166 changed.
    # Then the snapshot read through the steps' own reader, once, as data only (utils/snapshot_reader.py: its
    # import, and the reader both loads use): 234 lines, 168 changed.
    # Then a mistake that every rank meets alike said once (utils.launch): the arguments' errors (one call), the checks
    # and the data read before the process group in a block, and the snapshot's resume with the check of epochs left
    # in another (4 changed lines and the lines they hold, indented): 239 lines, 170 changed.
    "pipeline_parallel.py": (239, 170),
    # gpt.py (180 lines) with the (dp, cp) mesh and its timeouts, the sampler over dp, the chunks each rank holds and
    # why, the model switched to a rank's chunks around the training loop, the batch cut to those chunks, DDP's
    # average over dp x cp explained, one check, three options and two imports, each comment a sentence above its
    # code: 201 lines, 65 changed, against its issue's (190, 80). Its loop is all of gpt.py's (accumulation, fp16's
    # scaler, compile, the sample), which the issue keeps; the exchange of keys and values lives in utils/context.py.
    # Then its own name in the snapshot and the refusal of another step's (as gpt.py's, with this step's name:
    # four changed lines), and the random states gathered as bytes in one line as gpt.py's: 203 lines, 67 changed.
    # Then a mistake that every rank meets alike said once (utils.launch): the arguments' errors (one call), the checks
    # and the data read before the process group in a block, and the snapshot's resume with the check of epochs left
    # in another (4 changed lines and the lines they hold, indented): 208 lines, 67 changed.
    "context_parallel.py": (208, 67),
    # gpt.py (180 lines) with the (dp, ep) mesh and its timeouts, the experts split (one call: the dispatch lives in
    # utils/moe.py), the two gradient averages the lesson is about (each layer's experts a DDP of its own over dp, with
    # the / ep that makes their gradient the mean over all ranks; the rest a DDP over all ranks that ignores the
    # experts; no_sync on both), the aux loss added to the loss, clipping by the whole model's norm, the routers' load
    # in the epoch line and the metrics, a sample every rank computes, four options, and gpt.py's one-file snapshot
    # turned into a sharded one keyed by the whole model's names, as pipeline_parallel.py's (it resumes on any --ep;
    # 12 lines and 30 changed). Less fp16's scaler (an overflow in one rank's experts would skip the step there
    # alone) and --compile (the all-to-alls' splits are data), whose removed lines count too; each comment a sentence
    # above its code, and the two options that take a number refusing a negative one: 226 lines, 136 changed, against
    # its issue's (190, 80).
    # The import of require_written_by on a line of its own, as in step 6, and step 6's call of it for its single
    # file, which this step does not have: 227 lines, 137 changed.
    # Then the snapshot read through the steps' own reader, once, as data only (utils/snapshot_reader.py: its
    # import, and the reader both loads use): 229 lines, 139 changed.
    # Then a mistake that every rank meets alike said once (utils.launch): the arguments' errors (one call), the checks
    # and the data read before the process group in a block, and the snapshot's resume with the check of epochs left
    # in another (4 changed lines and the lines they hold, indented): 234 lines, 139 changed.
    "expert_parallel.py": (234, 139),
    # pipeline_parallel.py (231 lines) with every dimension on one (pp, dp, tp) mesh: the TP plan with sequence
    # parallelism and the embeddings' and head's plan for loss parallelism (20 lines, the lesson's core), the cut into
    # two stages a rank with each stage and layer sharded by FSDP over dp in bf16 with fp32 reduction (a function of 25
    # lines, replacing step 8's cut and DDP), the model built on the meta device and given memory shard by shard with
    # its own draws or a seed checkpoint, activation checkpointing, asynchronous snapshots that become the last one only
    # once whole (a method of 10 lines), the loss under loss_parallel and clipped by a norm over DTensors and
    # stages, the
    # per-rank memory the plan is checked against (4 lines), the export to one plain file, and five options. Less step
    # 8's random-state snapshot (dropout is seeded by epoch and rank) and its GPipe/1F1B choice, whose removed lines
    # count too. Each comment a sentence above its code: 297 lines, 230 changed, against its issue's (220, -).
    # Then the export written by rank 0 weight by weight, each weight as it arrives (no rank holds the whole
    # model), and rank 0 alone with the file for the held-out loss and the sample, instead of step 8's whole GPT
    # on every rank; every rank's part of one process's very weights drawn with one call; the temporary of an
    # asynchronous save that a Ctrl-C removes too; the import of require_written_by on a line of its own: 300
    # lines, 238 changed.
    # Then the snapshot read through the steps' own reader, once, as data only (utils/snapshot_reader.py: its
    # import, and the reader both loads use): 302 lines, 240 changed.
    # Then a mistake that every rank meets alike said once (utils.launch): the arguments' errors (one call), the checks
    # and the data read before the process group in a block, and the snapshot's resume with the check of epochs left
    # in another (4 changed lines and the lines they hold, indented), and the seed checkpoint's load in a third:
    # 308 lines, 241 changed.
    "one_mesh.py": (308, 241),
    # one_mesh.py trained for a number of optimizer steps on token files: its epoch becomes a window of --log_every
    # steps (a line with the tokens seen and the time left, and TensorBoard's scalars), the sampler a list of global
    # batch numbers from the cursor on (--skip's left out) read through a DataLoader of this dp rank's shares, the
    # snapshot one of a folder of them every SAVE_EVERY steps (the last --keep kept) that holds the cursor and what it
    # skipped, and refuses another global batch; the loss summed over the tokens that count and scaled by the global
    # batch's count; a held-out loss every --eval_every steps on every rank (utils/pipeline.held_out_loss); six
    # options, --workers checked as a whole number of 0 or more. Against its issue's (-, 110): what reads the data
    # lives in utils/data.py (160 lines), the rest is the lesson itself, each piece in the script, and the loop's lines
    # that changed count twice: 358 lines, 238 changed. Then what a learner meets when a run goes wrong: the checks of
    # the options, the token files and the snapshot folder before the process group forms, said once (a `with` that
    # indents step 11's two checks), --resume_from for a rewind (the snapshot to go on from passed to the Trainer),
    # the tokens of a global batch added over dp (each rank reads its share alone), the held-out loss before its
    # step's snapshot and the board flushed there (a resume writes no step twice), the synchronous save inside
    # replacing() (a full disk: one line): 375 lines, 267 changed. Then the snapshot read through the steps' own
    # reader, once, as data only (utils/snapshot_reader.py: its import, and the reader both loads use): 377 lines,
    # 267 changed.
    # Then a mistake that every rank meets alike said once (utils.launch): the arguments' errors (one call), the checks
    # and the data read before the process group in a block, and the snapshot's resume with the check of epochs left
    # in another (4 changed lines and the lines they hold, indented), and the seed checkpoint's load in a third, as
    # step 11's: 381 lines, 263 changed.
    "long_run.py": (381, 263),
    # fsdp.py as a replica group of a job whose groups meet at torchft's lighthouse: the Manager (made by rank 0 first,
    # so a restarted group's other ranks never read a dead rank 0's address) with a synchronous quorum (a healthy
    # group's state read beside FSDP's forward crashed it), the all-reduce hook across groups, the state a healthy
    # group sends and its check of the arguments, torchft's step in the snapshot; the loop counted in the job's steps
    # instead of epochs (a group that heals takes the step count over, so the loop cannot be its own), the quorum at
    # its head, each step's batch read by its number from the group's share of the epoch (listed once an epoch), a line
    # per step with the participants and a digest of the weights (the proof a learner sees), a step that did not
    # commit said in one line; --group, --groups, --lighthouse; fsdp.py's --strategy ddp taken out. Against its issue's
    # (-, 80): the epoch loop that is replaced counts twice, once removed and once as the step loop; its comments stand
    # above the code they explain: 233 lines, 171 changed. Then what outside runs found (issues 45 and 47): every rank
    # first reaches the lighthouse (one line if it cannot) and binds torchft's Manager and the step's checkpoint server
    # to that interface (3 lines in main, 2 in the Manager), the checkpoint transport that unpickles nothing (4 lines,
    # the transport itself in utils/replicas.py), a group that torchrun restarted may not lead a quorum without a
    # group that holds the job's steps (an all-reduce of one flag and a bounded, loud wait: 26 lines with their
    # comments), a group back after the job's end stops and the export never replaces a result of more batches (17
    # lines), mistakes said once across torchrun's attempts (4), the epoch's short last batch trained (2): 300 lines,
    # 242 changed.
    # Then the snapshot read through the steps' own reader, once, as data only (utils/snapshot_reader.py: its
    # import, and the reader both loads use): 302 lines, 242 changed.
    # fsdp.py's blocks that say a mistake once on each node (its checks and data before the process group, its
    # snapshot's resume) are not carried here: a replica group meets the lighthouse before anything and resumes
    # under torchft's Manager, whose own stops say once what they must (stop_once): 302 lines, 251 changed.
    "fault_tolerant.py": (302, 251),
}
BLOCK = re.compile(r"(<!-- diff (\S+) (\S+) -->\n)(.*?)(<!-- end diff -->)", re.S)


def steps():
    """The step scripts that exist, in teaching order."""
    return [name for name in CHAIN if (REPO / name).exists()]


def pairs():
    """(the step a script builds on, the script) for every step script but the first."""
    chain = steps()
    return [(PREVIOUS.get(new, old), new) for old, new in zip(chain, chain[1:])]


def budget(name):
    """(most lines, most changed lines against the step before) for a step script."""
    return LARGER_BUDGETS.get(name, BUDGET)


def lines_of(name):
    return (REPO / name).read_text().splitlines()


def step_diff(old, new, context=2):
    """Unified diff of two step scripts, as text."""
    return "\n".join(difflib.unified_diff(lines_of(old), lines_of(new), old, new, n=context, lineterm=""))


def changed_lines(old, new):
    """Removed plus added lines between two scripts (a modified line counts twice)."""
    ops = difflib.SequenceMatcher(None, lines_of(old), lines_of(new), autojunk=False).get_opcodes()
    return sum((i2 - i1) + (j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def render(text):
    """A page's text with every diff block regenerated from the files."""
    return BLOCK.sub(lambda m: f"{m[1]}```diff\n{step_diff(m[2], m[3])}\n```\n{m[5]}", text)


def pages():
    """The pages that may hold diff blocks: README.md, docs/*.md, then the steps' reference pages (docs/reference/)."""
    docs = REPO / "docs"
    return [REPO / "README.md", *sorted(docs.glob("*.md")), *sorted((docs / "reference").glob("*.md"))]


def shown_pairs():
    """{(OLD, NEW): [page, ...]}: the diff blocks of every page, by the pair of scripts they show."""
    pairs = {}
    for page in pages():
        for match in BLOCK.finditer(page.read_text()):
            pairs.setdefault((match[2], match[3]), []).append(page)
    return pairs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the pages instead of checking them")
    args = parser.parse_args()
    stale = []
    for page in pages():
        current = page.read_text()
        fresh = render(current)
        if current != fresh:
            stale.append(str(page.relative_to(REPO)))
            if args.write:
                page.write_text(fresh)
    if stale and not args.write:
        sys.exit(f"stale step diffs in {', '.join(stale)}: run `python tools/stepdiff.py --write`")
    shown = shown_pairs()
    for old, new in pairs():
        where = ", ".join(str(page.relative_to(REPO)) for page in shown.get((old, new), [])) or "no page"
        print(f"{old} -> {new}: {changed_lines(old, new)} changed lines, shown in {where}")
    if args.write and stale:
        print(f"rewrote {', '.join(stale)}")


if __name__ == "__main__":
    main()
