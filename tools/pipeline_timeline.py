"""A pipeline schedule as it ran: the recorder's pipeline.jsonl (one line per micro-batch's forward or backward on a
stage, with its start and end), read step by step, measured, and drawn.

    steps = by_step(job.records("pipeline.jsonl"))     # {step: [event, ...]} of the first attempt
    order(steps[1], stage=0)                           # ['F0', 'F1', 'B0', 'F2', 'B1', 'F3', 'B2', 'B3'] (1F1B)
    idle(steps[1])                                     # (span in s, {stage: the fraction of it the stage idled})
    held(steps[1], stage=0)                            # (most micro-batches held at once, their saved bytes)
    bubble(stages=2, microbatches=4)                   # 0.2: the schedule's idle fraction, in theory
    bubble(stages=2, microbatches=4, per_rank=2)       # 0.11: interleaved, two stages on each of the 2 ranks

A step's span runs from its first forward's start to its last backward's end, over all stages; a stage is busy while
it computes a forward or a backward, idle otherwise (waiting for an activation or a gradient, or sending one).
"""


def by_step(records, restart=0):
    """{step: [event, ...]} of one attempt, each step's events in the order they began."""
    steps = {}
    for event in sorted((r for r in records if r["restart"] == restart), key=lambda r: r["began"]):
        steps.setdefault(event["step"], []).append(event)
    return steps


def stages_of(events):
    return sorted({event["stage"] for event in events})


def order(events, stage):
    """The passes one stage ran, in order: 'F3' is micro-batch 3's forward, 'B3' its backward."""
    return [event["pass"][0].upper() + str(event["microbatch"]) for event in events if event["stage"] == stage]


def idle(events):
    """(the step's span in seconds, {stage: the fraction of the span it spent not computing})."""
    span = max(event["ended"] for event in events) - min(event["began"] for event in events)
    busy = {stage: sum(e["ended"] - e["began"] for e in events if e["stage"] == stage) for stage in stages_of(events)}
    return span, {stage: 1 - seconds / span for stage, seconds in busy.items()}


def held(events, stage):
    """(the most micro-batches whose activations the stage held at once, the bytes autograd kept for them): a
    micro-batch is held from the end of its forward to the end of its backward."""
    saved, now, most, peak = {}, 0, 0, 0
    for event in sorted((e for e in events if e["stage"] == stage), key=lambda e: e["ended"]):
        if event["pass"] == "forward":
            saved[event["microbatch"]] = event.get("saved", 0)
            now += saved[event["microbatch"]]
            most = max(most, len(saved))
        else:
            now -= saved.pop(event["microbatch"], 0)
        peak = max(peak, now)
    return most, peak


def bubble(stages, microbatches, per_rank=1):
    """The idle fraction of a GPipe or 1F1B step when every forward and every backward takes the same time on every
    stage: (stages - 1) / (microbatches + stages - 1). With `per_rank` stages on each of `stages` ranks (an
    interleaved 1F1B), each 1/per_rank of the model: (stages - 1) / (per_rank x microbatches + stages - 1)."""
    return (stages - 1) / (per_rank * microbatches + stages - 1)


def draw(axes, events, title):
    """One step on `axes`: a row per stage, a box per forward (light) and backward (dark), micro-batch numbers in
    them; milliseconds from the step's start."""
    start = min(event["began"] for event in events)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
    for event in events:
        left, width = (event["began"] - start) * 1e3, (event["ended"] - event["began"]) * 1e3
        forward = event["pass"] == "forward"
        axes.barh(event["stage"], width, left=left, height=0.8, color=colors[event["microbatch"] % len(colors)],
                  alpha=0.45 if forward else 0.95, edgecolor="black", linewidth=0.5)
        axes.text(left + width / 2, event["stage"], ("F" if forward else "B") + str(event["microbatch"]),
                  ha="center", va="center", fontsize=8)
    span, idles = idle(events)
    axes.set_yticks(stages_of(events), [f"stage {s}\nidle {idles[s]:.0%}" for s in stages_of(events)])
    axes.set_ylim(max(stages_of(events)) + 0.6, -0.6)
    axes.set(xlabel="milliseconds since the step's first forward", xlim=(0, span * 1e3 * 1.01), title=title)
    axes.grid(axis="x", alpha=0.3)


def plot(steps, out_path=None, suptitle=None):
    """Several steps ({title: events}) one above the other; to `out_path` (PNG) or, without one, shown."""
    import matplotlib

    if out_path:
        matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(steps), 1, figsize=(11, 1.1 + 1.6 * len(steps)), squeeze=False)
    for row, (title, events) in zip(axes[:, 0], steps.items()):
        draw(row, events, title)
    if suptitle:
        figure.suptitle(suptitle)
    figure.tight_layout()
    if out_path:
        figure.savefig(out_path, dpi=100)
        plt.close(figure)
    else:
        plt.show()
