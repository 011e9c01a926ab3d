"""Writes notebooks/13_fault_tolerant.ipynb (cells only; `python notebooks/execute.py notebooks/13_fault_tolerant.ipynb`
runs it and stores its outputs). Edit the cells here, not in the notebook, then run both."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Step 13 — replica groups that train on when one dies (torchft)

Step 3 survives a failure by **restarting the world**: when one worker dies, torchrun stops every other worker,
starts them all again, and they resume from the last snapshot on disk. Every rank stands still for the restart, and
the steps since the snapshot are trained again. On a few machines that is cheap; on thousands, where some machine
fails every few hours, the whole job pays for each failure of any one of them.

`fault_tolerant.py` splits the job into **replica groups** that go on without the one that failed:

* each group is one `torchrun` of its own (a machine, or a few), with FSDP sharding the model over its ranks as in
  step 5; the groups hold the same weights and split the data between them;
* the gradient shards FSDP reduce-scatters inside a group are then averaged across the groups by torchft's `Manager`
  (HSDP: each replica a group of ranks);
* a **lighthouse** (`torchft_lighthouse`, one small process) tells the groups at every step who is in that step's
  **quorum**; a group whose heartbeat stops is left out of the next one, and the others train on without it: only
  its share of the data goes untrained while it is away;
* a group that dies is restarted by its own torchrun (`--max_restarts`), alone: the other groups never stop;
* a group that comes back (restarted, or new) is behind: at its first quorum it **heals**, taking a healthy group's
  weights and optimizer state over HTTP (as raw tensors and JSON, checked before it loads them), not from disk, and
  trains on from the step the job is at;
* a group's step commits only if all its ranks did all their all-reduces (a vote inside the group, not across the
  groups); a failure that interrupts a step fails it in every group of the quorum, and the groups left do it again.

This notebook runs a lighthouse and two groups of one rank each on this machine, `SIGKILL`s group 1's worker in the
middle of the run, lets group 1's torchrun start it again, and draws from the lines each group printed what happened:
the steps each group committed against time, the groups that took part in each step, and the returned group's
weights against the survivor's."""),
    new_code_cell("""import re

import matplotlib.pyplot as plt

from nbhelpers import scratch, show_diff
from harness.jobs import free_port, lighthouse, machine_summary, output, replica_groups, shown, start

print(machine_summary())"""),
    new_markdown_cell("""## The diff from step 5

Generated from the two files in the repository. `fault_tolerant.py` builds on `fsdp.py`: the same model sharded
inside the group, the same sharded snapshots. What is new: a `Manager` per group that meets the others at the
lighthouse, torchft's `Optimizer` around the optimizer (its `zero_grad()` starts a step's quorum, its `step()` steps
only if the step can commit), an all-reduce hook on every FSDP module that averages the group's gradient shards over
the quorum, and the two functions a heal calls: `_state` (what a healthy group sends) and `_heal` (what a returning
group loads). The loop counts the job's steps instead of epochs, reading each step's batch by its number, so that a
group that heals takes the job's count over and reads the batches the others read; torchft's `DistributedSampler`
gives each group, then each of its ranks, its share of the data."""),
    new_code_cell("""show_diff("fsdp.py", "fault_tolerant.py")"""),
    new_markdown_cell("""## A lighthouse, two groups, and a kill

Three commands, as one would type them on three machines (here, three processes of this one):

* the lighthouse, on a port of its own, which forms a quorum as soon as one group asks (`--min_replicas 1`: a group
  alone may train), waits up to 1 s for a group that heartbeats but has not asked yet, and takes a group whose
  heartbeat stopped 2 s ago for dead;
* group 0 and group 1, each `torchrun --nproc_per_node=1 --max_restarts=1 fault_tolerant.py 100 2 ...`: the default
  synthetic workload (a small MLP; 32 steps an epoch, each step 32 samples per group), a snapshot every 2 epochs
  (each group its own folder), `--timeout 20` for the quorums and the collectives.

Once group 1 has committed 100 steps together with group 0, its worker gets a `SIGKILL` (no cleanup, no goodbye, as
the kernel's out-of-memory killer would send it), wherever it is in its step. Its torchrun starts it again as in step 3,
but nobody else stops. Once group 1 is back and has trained 100 steps with group 0 again, the notebook stops the job:
the rest of its 100 epochs would look the same.

Why 100 epochs, and a stop: the restart is a new Python process that imports torch and torchft again, which takes
from 2 s to more than 10 s on a busy machine of 2 cores, while group 0 alone trains a step in a few milliseconds.
Group 0 must still be training when group 1 is back, or there is nobody to heal from: group 1, started again by its
torchrun, would wait for a group that holds the job's steps and then stop (a restarted group may not lead: it would
train the job again alone, from its own old snapshot). A run far longer than the notebook needs leaves group 0
training whatever the restart takes."""),
    new_code_cell("""EPOCHS, SAVE_EVERY, TIMEOUT = 100, 2, 20
KILL_AFTER, STOP_AFTER = 100, 100  # steps group 1 trains with group 0 before the kill, and after its heal
port = free_port()
commands = [lighthouse(port), *replica_groups("fault_tolerant.py", EPOCHS, SAVE_EVERY, "--timeout", TIMEOUT, port=port,
                                              launcher_args=["--max_restarts=1"])]
for node, command in enumerate(commands):
    print(f"node {node} $", shown(command))

with start(*commands, cwd=scratch("groups"), services=1) as job:  # the lighthouse serves: it does not end by itself
    together = 0  # the steps group 1 has committed with group 0 (2 participants), as its lines come
    while together < KILL_AFTER:
        line = job.wait_for(output.GROUP_STEP, timeout=120)
        together += line["group"] == "1" and line["participants"] == "2"
    job.kill_worker(rank=0, node=2)  # node 2 is group 1's torchrun; rank 0 its only worker
    healed = int(job.wait_for(r"\\[group 1 .*\\] healed at step (\\d+)", timeout=120)[1])  # back: the job's step
    printed = {"0": -1, "1": -1}  # the last step each group printed, until both are STOP_AFTER steps past the heal
    while min(printed.values()) < healed + STOP_AFTER:
        line = job.wait_for(output.GROUP_STEP, timeout=120)
        printed[line["group"]] = int(line["step"])
    job.note(f"stops the job, {STOP_AFTER} steps after group 1's heal")
print(f"the job ran {job.seconds():.0f} s")"""),
    new_markdown_cell("""## What the groups printed

Each group's rank 0 prints a line for every step it committed: the step, how many groups took part in it, the
step's loss (averaged over those groups), and a digest of the weights after it. Below, in the order the lines came,
each run of one group's consecutive steps with the same participants is one row; the other lines are shown as they
are (the snapshots, one every 2 epochs per group, are left out)."""),
    new_code_cell("""RECORD = re.compile(r"^[WEI]\\d{4} [\\d:.]+ \\d+ \\S+\\] (.*)")  # torchrun's log records
WHO = {None: "the notebook", 0: "lighthouse", 1: "group 0", 2: "group 1"}  # node g + 1 runs group g


def story(job):
    \"\"\"The job's lines in the order they came as rows (seconds, node, text), each group's run of consecutive
    committed steps with the same participants as one row (a dict, completed as the run goes on); and how many lines
    were left out (the snapshots saved, and the launchers' logging but for torchrun's records).\"\"\"
    rows, runs, left_out = [], {}, 0
    for seconds, node, line in job.timeline:
        step, record = output.GROUP_STEP.search(line), RECORD.match(line)
        if step:
            number, participants = int(step["step"]), int(step["participants"])
            run = runs.get(node)
            if not run or run["participants"] != participants or number != run["last"] + 1:
                run = runs[node] = dict(first=number, participants=participants, first_loss=step["loss"])
                rows.append((seconds, node, run))
            run.update(last=number, until=seconds, last_loss=step["loss"])
        elif record or node is None or not (output.noise(line) or output.SAVED.search(line)):
            runs.pop(node, None)  # a step after this line starts a new row
            rows.append((seconds, node, f"torchrun: {shown([record[1]])}" if record else line))
        else:
            left_out += 1
    return rows, left_out


rows, left_out = story(job)
for seconds, node, row in rows:
    if isinstance(row, dict):
        steps = f"step {row['first']}" if row["first"] == row["last"] else f"steps {row['first']}-{row['last']}"
        row = (f"{steps}: {row['participants']} participant"
               + "s" * (row["participants"] > 1) + f", loss {row['first_loss']} -> {row['last_loss']} "
               f"(until {row['until']:.2f} s)")
    print(f"{seconds:6.2f} s  {WHO[node]:12}  {row}")
print(f"({left_out} lines of snapshots saved and of launcher logging left out)")"""),
    new_markdown_cell("""Read it top to bottom. At the start, the group whose process came up first may train a few
steps alone (`--min_replicas 1`: one group makes a quorum), and the other heals as it joins, as a returning group
does. Then both groups train together (2 participants); the notebook kills group 1's worker and its torchrun reports
the exit code -9 (`SIGKILL`); group 0 stands still for about 2 s, the lighthouse's heartbeat timeout, then trains on
alone (1 participant; a step the kill interrupted, if any, is reported as not committed and done again). Group 1's new
worker finds its own snapshot on disk and loads it, as step 3 would, but that snapshot is older than the job: at its
first quorum it learns that group 0 is further on, and heals from it. From there both train together again, until
the notebook stops the job.

## The steps against time, and the groups in each step

Each group's committed steps, by the second its line came (top), and the participants of each step (bottom):"""),
    new_code_cell("""def steps_of(job, node):
    \"\"\"[(seconds, step, participants, weights)] of one group's committed steps, in the order it printed them.\"\"\"
    return [(seconds, int(match["step"]), int(match["participants"]), match["weights"])
            for seconds, where, line in job.timeline if where == node
            for match in [output.GROUP_STEP.search(line)] if match]


survivor, returned = steps_of(job, 1), steps_of(job, 2)
last = max(step for _, step, _, _ in survivor + returned)  # the last step read before the notebook stopped the job
killed_at = next(seconds for seconds, node, line in job.timeline if node is None and line.startswith("SIGKILL"))
before = [row for row in returned if row[0] < killed_at]  # group 1's first worker
after = [row for row in returned if row[0] > killed_at]  # the one its torchrun started again
# When group 1's new worker loaded its snapshot on disk, and the step that snapshot ends at (none: step 0).
resumed_at, on_disk = next(((seconds, int(match["epoch"]) * 32) for seconds, node, line in job.timeline if node == 2
                            for match in [output.RESUMED.search(line)] if match), (None, 0))
healed_at, healed = next(((seconds, int(match["step"])) for seconds, node, line in job.timeline
                          if node == 2 and seconds > killed_at for match in [output.HEALED.search(line)] if match),
                         (None, None))
assert healed is not None, "group 0 ended before group 1 was back (a very busy machine): nobody to heal from"

# Group 0's longest wait between two committed steps: (seconds, step) of the two ends.
waited = max(zip(survivor, survivor[1:]), key=lambda pair: pair[1][0] - pair[0][0])
(wait_from, wait_step, *_), (wait_to, *_) = waited

figure, (steps_ax, quorum_ax) = plt.subplots(2, 1, figsize=(11, 7), gridspec_kw=dict(height_ratios=[3, 2]))
# Group 1 in broad pale dots under group 0's small ones: where both trained together, both show.
for points, label in ((before, "group 1 (its first worker, then the one its torchrun restarted)"), (after, None)):
    steps_ax.plot([p[0] for p in points], [p[1] for p in points], ".", ms=7, alpha=0.35, color="tab:orange",
                  label=label)
steps_ax.plot([r[0] for r in survivor], [r[1] for r in survivor], ".", ms=2, color="tab:blue", label="group 0")
steps_ax.axvline(killed_at, color="red", lw=1.5)
steps_ax.annotate(" SIGKILL to group 1's worker", (killed_at, last * 0.7), color="red", fontsize=9)
steps_ax.axvspan(killed_at, healed_at, color="0.92")
steps_ax.annotate("", (wait_to, wait_step), (wait_from, wait_step), arrowprops=dict(arrowstyle="<->", color="black"))
steps_ax.annotate(f"group 0 waits {wait_to - wait_from:.1f} s\\n(the lighthouse's heartbeat timeout)",
                  ((wait_from + wait_to) / 2, wait_step), xytext=(0, 12), textcoords="offset points", ha="center",
                  fontsize=8)
if resumed_at is not None:
    steps_ax.plot(resumed_at, on_disk, "v", color="tab:orange", ms=9)
    steps_ax.annotate(f"group 1 loads its snapshot on disk: step {on_disk}", (resumed_at, on_disk), va="center",
                      fontsize=8, xytext=(8, 0), textcoords="offset points")
    steps_ax.annotate("", (healed_at, healed), (resumed_at, on_disk),
                      arrowprops=dict(arrowstyle="->", color="tab:orange", lw=1.5))
steps_ax.plot(healed_at, healed, "*", color="tab:orange", ms=14, mec="black")
steps_ax.annotate(f"healed at step {healed} from group 0, not from disk", (healed_at, healed), fontsize=8,
                  ha="right", va="bottom", xytext=(-10, 6), textcoords="offset points")
began, ended = min(survivor[0][0], returned[0][0]), max(survivor[-1][0], returned[-1][0])
steps_ax.set(xlabel="seconds since the job started", ylabel="step committed", ylim=(0, last * 1.1),
             xlim=(began - 0.05 * (ended - began), ended + 0.3 * (ended - began)),  # room for the labels on the right
             title="Group 0 never stops; group 1 comes back at the step the job is at")
steps_ax.legend(loc="upper left", fontsize=8, markerscale=2)
steps_ax.grid(alpha=0.3)

for points, color, offset, label in ((survivor, "tab:blue", 0.04, "group 0"),
                                     (before, "tab:orange", -0.04, "group 1"), (after, "tab:orange", -0.04, None)):
    quorum_ax.plot([p[1] for p in points], [p[2] + offset for p in points], ".", ms=2, color=color, label=label)
quorum_ax.axvspan(before[-1][1] + 0.5, healed + 0.5, color="0.92")
quorum_ax.annotate("group 1 away: group 0 trains alone", ((before[-1][1] + healed) / 2, 1.5), ha="center",
                   fontsize=8)
quorum_ax.set(xlabel="step", ylabel="participants", yticks=[1, 2], ylim=(0.6, 2.4), xlim=(0, last),
              title="The groups that took part in each step (what each group printed)")
quorum_ax.legend(loc="lower right", fontsize=8, markerscale=5)
quorum_ax.grid(alpha=0.3)
figure.tight_layout()
plt.show()"""),
    new_code_cell("""alone = [step for _, step, participants, _ in survivor
         if participants == 1 and step > before[-1][1]]  # group 0's steps without group 1, after the kill
print(f"group 1's first worker committed steps {before[0][1]} to {before[-1][1]}; the kill came at "
      f"{killed_at:.2f} s")
print(f"group 0's longest wait: {wait_to - wait_from:.2f} s, after step {wait_step} ({wait_from:.2f} s to "
      f"{wait_to:.2f} s)")
print(f"group 0 trained steps {alone[0]} to {alone[-1]} alone: {len(alone)} steps, {len(alone) * 32:,} samples of "
      "group 1's share not trained")
print(f"group 1 was back {healed_at - killed_at:.1f} s after the kill: "
      + (f"it loaded its snapshot of step {on_disk} from disk at {resumed_at:.2f} s, then " if resumed_at else "")
      + f"healed at step {healed} at {healed_at:.2f} s")
print("steps not committed (a kill inside a step's all-reduces):",
      [int(match["step"]) for match in output.NOT_COMMITTED.finditer(job.output)])"""),
    new_markdown_cell("""## The returned group holds the survivor's weights

Every step line ends with a digest of the group's weights after the step (`utils.weights_digest`, the same bytes,
the same digest). From the step it healed at on, group 1's digest must equal group 0's at every step: it took group
0's weights and Adam's state, and from there both applied the same averaged gradients."""),
    new_code_cell("""# NBVAL_CHECK_OUTPUT
numbers = [step for _, step, _, _ in survivor]
print("group 0 committed every step from its first to the last, once and in order:",
      numbers == list(range(numbers[0], numbers[-1] + 1)))
print(f"its longest wait began with the kill and was shorter than --timeout {TIMEOUT} s:",
      abs(wait_from - killed_at) < 1 and wait_to - wait_from < TIMEOUT)
print("it trained alone (1 participant) from group 1's kill to group 1's heal:",
      all(participants == 1 for _, step, participants, _ in survivor if before[-1][1] + 1 < step < healed))
print("group 1 came back behind the job (its snapshot on disk is older), and healed from group 0:", on_disk < healed)
digests = {step: weights for _, step, _, weights in survivor}
print("from the heal on, group 1 committed every step until the job was stopped:",
      [step for _, step, _, _ in after if step >= healed] == list(range(healed, after[-1][1] + 1)))
print("with 2 participants from the heal step on:",
      all(participants == 2 for _, step, participants, _ in survivor + after if step >= healed))
# The last step one group printed before the stop may be missing from the other's lines: the steps both printed.
both = [(step, weights) for _, step, _, weights in after if step >= healed and step in digests]
print(f"and the same weights as group 0 at every step from the heal on (at least {STOP_AFTER} steps):",
      len(both) >= STOP_AFTER and all(weights == digests[step] for step, weights in both))"""),
    new_code_cell("""for step, weights in both[:3] + both[-1:]:
    print(f"step {step}: group 0 {digests[step]} | group 1 {weights}")"""),
    new_markdown_cell("""## What the failure cost

Restarting the world (step 3), the same kill stops every rank for the restart, and every rank trains again the steps
since the last snapshot. Here group 0 stood still once, for the lighthouse's heartbeat timeout, and no step was
trained twice (at most the one the kill interrupted, which did not commit). The price is the data of group 1's share
for the steps it was away: while it was gone each step trained on half the samples a step of both groups trains on.
`benchmarks/fault_tolerance_at_scale.py` measures both strategies on the same kill, side by side.

What is left to the disk: each group still writes its own snapshot every `save_every` epochs, for the day every group
is gone at once: started again together, the groups go on from the newest snapshot, and a group with an older one
heals. The lighthouse itself is the one process every group needs: if it dies, each group stops after `--timeout` with
one line saying so, and keeps its snapshot for when the lighthouse runs again. The tests
(`tests/test_fault_tolerant.py`) check both, and that the groups train exactly as plain data parallelism does on the
same samples while all of them are there.

[The step's page](../docs/fault-tolerance-at-scale.md) walks through a step's quorum, what a healing group receives,
the data and the average with fewer groups, every fault and the line it prints, and when to prefer which strategy."""),
]


def main():
    notebook = new_notebook(cells=CELLS, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.write(notebook, Path(__file__).resolve().parent / "13_fault_tolerant.ipynb")


if __name__ == "__main__":
    main()
