"""A step's time, predicted: one rank's compute (timed, or predicted on a roofline) plus each tier's communication.

Compute is timed as the job's ranks would run it: in as many processes at once as the job has ranks
(they share this machine's cores and memory), each running dtlab's own loop, so the loop's own work
is in the prediction too (``probe.loop_phases``; the pipeline's stages are timed bare, per stage).
With ``compute="predicted"`` (or a ``roofline.cpu.Roofline``) nothing is timed for the single tier,
the DDP family and ``zero``: a rank's phases come from its ops on this machine's measured roofline
(``roofline.predict.predicted_phases``), DDP's gradient copies from its bandwidth.

The link is an alpha-beta ``LinkModel`` (``dtlab.cost.links``): calibrated
on a collectives sweep, or built from a bandwidth and latency for a what-if; or a
``LinkSet``, one link per collective, each calibrated on that collective's sweep. Its
``busy_s`` (``costmodel.with_busy``; 0 unless measured) is what a collective costs beyond its
price when the ranks compute between collectives, its slow wake-ups included (the sweep's fit prices
the fast mode; negative where the fit overprices): each one the training thread blocks on adds it.
Per tier:

* ``single``: data + forward + backward + optimizer, the single tier's loop timed.
* ``ddp``, ``multinode``, ``elastic``: the single tier at a rank's batch, timed, then DDP's
  buckets (torch's own assignment by size)
  all-reduced one after another as backward produces them (``predict_ddp_step``);
  what runs past backward is exposed, and the step blocks once on them (one ``busy_s``).
  On CPU, where the ranks' threads take every core (``costmodel.spare_cores``), no all-reduce
  overlaps backward: gloo's work would take its time from backward's.
  DDP's own work: copying each gradient into its bucket and back, and the division by n,
  three passes over the gradient bytes at this machine's copy speed (one with ``gradient_as_bucket_view``).
* ``zero``: DDP, plus one broadcast per parameter from the rank that updated it, all issued at
  once and waited for together (one ``busy_s``); the optimizer steps only the largest rank's share
  of the parameters.
* ``fsdp``, ``tp``, ``fsdp-tp``, ``cp``, at any world size: their own CPU work is large and tier-specific
  (FSDP2's copy-in and copy-out around every collective and its optimizer on DTensors;
  DTensor's dispatch on every op), so the job's ranks run dtlab's own loop on torch's fake
  backend (``probe``: every rank at once, collectives free, everything else as at world n),
  and every collective rank 0 called in a steady step is priced on the link and added, all of it
  exposed: on CPU these tiers run their collectives in the training thread. Each one also pays the
  busy excess for the work between them (``costmodel.busy_at`` of the step's work over its collectives:
  FSDP's many collectives, close together, each pay less than DDP's single wait), cp's ring hops
  too: each is waited on before the attention block it feeds.
* ``pipeline``: per stage and micro-batch, forward + backward + its transfers; GPipe
  and 1F1B take (M - 1) x the slowest stage + the sum of the stages (the bubble is the
  same for both), ``naive`` takes M x the sum.
"""

from __future__ import annotations

from torch import nn

from dtlab.core.compat import ddp_bucket_assignment
from dtlab.core.config import RunConfig
from dtlab.core.env import resolve_backend
from dtlab.cost.estimate import compute, probe
from dtlab.cost.estimate.memory import nbytes, zero_partition
from dtlab.cost.links.alpha_beta import LinkModel
from dtlab.cost.links.buckets import predict_ddp_step, spare_cores
from dtlab.cost.links.busy import busy_at
from dtlab.cost.links.linkset import LinkSet
from dtlab.cost.roofline.cpu import Roofline
from dtlab.cost.roofline.predict import predicted_phases
from dtlab.tiers.parts.pipeline_stages import MULTI_STAGE

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket is capped at 1 MiB (torch.distributed's default)
PROBED_TIERS = ("fsdp", "tp", "fsdp-tp", "cp")
STEP_TIERS = ("single", "ddp", "multinode", "elastic", "zero", "pipeline", *PROBED_TIERS)
# the tiers whose compute is the single tier's at a rank's batch: what compute="predicted" covers
PREDICTED_TIERS = ("single", "ddp", "multinode", "elastic", "zero")
COMPUTE = ("timed", "predicted")


def ddp_buckets(model: nn.Module, cap_mb: float) -> list[int]:
    """Bucket sizes in gradient-ready order, from torch's own assignment over the parameters in reverse."""
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    groups = ddp_bucket_assignment(params, [FIRST_BUCKET_BYTES, int(cap_mb * 2**20)])
    return [sum(nbytes(params[i]) for i in g) for g in groups]


def roofline_of(compute: str | Roofline) -> Roofline | None:
    """The roofline ``compute`` names (None: compute is timed); ValueError naming ``compute`` otherwise."""
    if isinstance(compute, Roofline):
        return compute
    if compute == "timed":
        return None
    if compute == "predicted":
        return Roofline.load()  # the saved measurement (python -m dtlab.cost.roofline)
    raise ValueError(f"estimate: compute={compute!r} is invalid: choose {' or '.join(map(repr, COMPUTE))}, "
                     "or give a Roofline")


def _compute_note(cfg: RunConfig, roof: Roofline | None, n: int) -> str:
    if roof is None:
        return (f"compute timed with {cfg.resolved_threads} thread(s), as one rank of the job gets, in {n} "
                "process(es) at once, as the job's ranks share this machine, each running dtlab's loop (the "
                "single tier at a rank's batch, or the tier itself on the fake backend)")
    return (f"compute predicted, not timed: the ops of a step at a rank's batch (counted on fake tensors) on this "
            f"machine's roofline at {cfg.resolved_threads} thread(s) x {n} copies (measured "
            f"{roof.machine.get('measured', '?')}), plus eager PyTorch's measured cost per op and per step")


def predict(cfg: RunConfig, model: nn.Module, link: LinkModel | LinkSet,
            compute_from: str | Roofline = "timed") -> tuple[float, list[str]]:
    """Seconds per step and the assumptions behind them; ValueError naming a tier without a rule.
    ``compute_from``: ``"timed"`` (a rank's compute run here), ``"predicted"`` (on the saved roofline) or a
    ``Roofline``."""
    if cfg.tier not in STEP_TIERS:
        raise ValueError(f"estimate: no step-time rule for tier {cfg.tier!r} yet (rules: {', '.join(STEP_TIERS)})")
    roof = roofline_of(compute_from)
    if roof is not None and cfg.tier not in PREDICTED_TIERS:
        raise ValueError(f"estimate: compute='predicted' covers tiers {', '.join(PREDICTED_TIERS)} (a rank's "
                         f"compute is the single tier's); tier {cfg.tier!r} needs compute='timed'")
    n = cfg.world_size
    notes = [f"{_compute_note(cfg, roof, n)}; link: {link.label}"]
    if link.busy_s and n > 1:
        notes.append(f"each collective the training thread blocks on: its price {link.busy_s * 1e3:+.3g} ms (busy_s, "
                     "measured between compute on this machine, slow wake-ups included)")
    if cfg.tier == "pipeline":
        return pipelined(cfg, link, notes)
    # world 1 too: FSDP2 at world 1 measured twice the single loop on the mlp (13.4 against 6.7 ms, estimate_error)
    if cfg.tier in PROBED_TIERS:
        return probed(cfg, link, notes)
    acc = int(getattr(cfg.tier_options, "accumulation_steps", 1) or 1)
    # one rank's batch (one micro-batch of it) in dtlab's own loop, as the single tier runs it
    solo = cfg.replace(tier="single", world_size=1, global_batch_size=cfg.per_rank_batch // acc,
                       threads_per_rank=cfg.resolved_threads)
    ph = probe.loop_phases(solo, copies=n) if roof is None else predicted_phases(solo, roof, copies=n)
    ph = {k: v * acc if k in ("forward", "backward") else v for k, v in ph.items()}
    if cfg.tier == "single":
        return sum(ph.values()), notes
    grad_bytes = sum(nbytes(p) for p in model.parameters())
    passes = 1 if getattr(cfg.tier_options, "gradient_as_bucket_view", False) else 3
    # a copy reads and writes each byte: at the roofline's bandwidth when predicted, else timed here
    per_byte = (2 / roof.placement(cfg.resolved_threads, n)[0].device.memory_bandwidth if roof is not None
                else compute.copy_seconds_per_byte())
    overhead = passes * grad_bytes * per_byte
    buckets = ddp_buckets(model, cfg.tier_options.bucket_cap_mb)
    notes.append(f"{len(buckets)} DDP bucket(s); DDP's own copies: {passes} pass(es) over the gradients")
    # gloo's all-reduce is CPU work: beside backward only on a core the ranks leave free (a GPU's runs on the device)
    overlap = resolve_backend(cfg.backend, cfg.device)[1] == "cuda" or spare_cores(n, cfg.resolved_threads)
    if not overlap:
        notes.append(f"no all-reduce overlaps backward: {n} rank(s) x {cfg.resolved_threads} thread(s) use every "
                     "core, and gloo's collectives need the same cores")
    step = predict_ddp_step(ph, buckets, link, n, overhead_s=overhead, overlap=overlap).step_s  # busy_s once
    if cfg.tier == "zero":
        params = list(model.parameters())
        share = max(sum(p.numel() for p in part) for part in zero_partition(params, n)) / sum(p.numel() for p in params)
        step -= ph["optimizer"] * (1 - share)
        # ZeroRedundancyOptimizer issues every broadcast at once and then waits for them all: one more wait
        step += sum(link.predict("broadcast", nbytes(p), n) for p in params)
        step += link.busy_s if n > 1 else 0.0  # one rank waits for no one
        notes.append(f"ZeRO: the optimizer steps {share:.0%} of the parameters; one broadcast per parameter")
    return step, notes


def probed(cfg: RunConfig, link: LinkModel | LinkSet, notes: list[str]) -> tuple[float, list[str]]:
    """Rank 0 on the fake backend (``probe``): its step with free collectives, plus each collective it called,
    priced on the link; all exposed (on CPU, FSDP2's and DTensor's collectives run in the training thread)."""
    measured = probe.probe(cfg)
    # a group of one moves nothing and waits for no one
    collectives = [c for c in measured.collectives if c[2] > 1]
    # every priced exchange is waited on, cp's ring hops too (``_InFlight.wait``): on CPU the transfer takes
    # the cores the next block would need, so it hides neither its price nor the meeting (five runs priced cp
    # 16-26 % low when its hops paid no busy excess, 2026-12-04)
    waits = [c for c in collectives if probe.link_op(c[0]) is not None]
    # the ranks meet at each wait, so each one's lead grows only over the work since the last
    busy = busy_at(link, measured.step_s / len(waits)) if waits else 0.0
    comm, unpriced = 0.0, set()
    for op, size, group in collectives:
        name = probe.link_op(op)
        if name is None:
            unpriced.add(op)
            continue
        comm += link.predict(name, size, group)
    comm += busy * len(waits)
    notes.append(f"{cfg.tier}: rank 0's step on torch's fake backend (compute and the tier's own CPU work, "
                 f"collectives free): {measured.step_s * 1e3:.3g} ms, timed in a child process; plus its "
                 f"{len(collectives)} collectives per step priced on the link ({comm * 1e3:.3g} ms), "
                 "all exposed")
    if busy:
        notes.append(f"{len(waits)} waits, {measured.step_s / len(waits) * 1e3:.3g} ms of work apart: "
                     f"{busy * 1e3:+.3g} ms each on the price (costmodel.busy_at)")
    if unpriced:
        notes.append(f"not priced (no link rule): {', '.join(sorted(unpriced))}")
    return measured.step_s + comm, notes


def pipelined(cfg: RunConfig, link: LinkModel | LinkSet, notes: list[str]) -> tuple[float, list[str]]:
    m = cfg.tier_options.microbatches
    stages = compute.stage_phases(cfg, ranks=cfg.world_size)
    costs = []
    for s, st in enumerate(stages):
        sends = st["out_bytes"]  # forward: the activation out; backward: its gradient back in
        received = stages[s - 1]["out_bytes"] if s else 0.0
        p2p = sum(2 * link.predict("send_recv", b, 2) for b in (sends, received) if b)
        costs.append(st["forward"] + st["backward"] + p2p)
    notes.append(f"pipeline: {len(stages)} stages, {m} micro-batches, {cfg.tier_options.schedule}")
    if cfg.tier_options.schedule in MULTI_STAGE:
        notes.append(f"{cfg.tier_options.schedule}: priced as 1F1B over world_size stages; its smaller bubble and "
                     "its transfers per stage (more stages, more hops) are not modelled")
    return schedule_seconds(costs, m, cfg.tier_options.schedule) + max(st["optimizer"] for st in stages), notes


def schedule_seconds(costs: list[float], microbatches: int, schedule: str) -> float:
    """A pipeline's forward and backward, from each stage's seconds per micro-batch: ``naive`` runs one
    stage at a time (M x the sum); GPipe and 1F1B overlap stages and pay the same bubble
    ((M - 1) x the slowest stage + the sum)."""
    if schedule == "naive":
        return microbatches * sum(costs)
    return (microbatches - 1) * max(costs) + sum(costs)

