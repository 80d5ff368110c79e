"""Communication cost model: alpha-beta links, a DDP step predictor and what-if projections.

A link is described by two numbers, fitted on a message-size sweep of the
instrumented collectives (``dtlab.cost.links.sweep.sweep``): a latency ``alpha``
(seconds per message step) and an inverse bandwidth ``beta`` (seconds per
byte). A collective of ``S`` bytes on ``n`` ranks then costs
``a(n) * alpha + b(n) * S * beta``, where ``a`` and ``b`` depend on the
algorithm. ``S`` follows the nccl-tests convention, as the sweep does:
all_gather counts the gathered output, reduce_scatter the full input.

Which algorithm runs, by backend (``ALGORITHMS``):

``"ring"`` -- the textbook ring algorithms (NCCL's ring, large messages):

* all_reduce: reduce-scatter then all-gather, ``2(n-1) alpha + 2(n-1)/n S beta``
* all_gather, reduce_scatter: ``(n-1) alpha + (n-1)/n S beta``
* broadcast: a pipelined chain, ``(n-1) alpha + S beta``
* send_recv (every rank sends S to its neighbour at once): ``alpha + S beta``

``"gloo"`` -- what torch 2.13's ProcessGroupGloo runs on CPU tensors, read
from its sources (``ProcessGroupGlooDetail.hpp``, ``ProcessGroupGloo.cpp``)
and gloo's (``gloo/allreduce.cc``, ``allgather.cc``, ``broadcast.cc``):

* all_reduce: ``AsyncAllreduceWork`` calls ``gloo::allreduce`` without
  choosing an algorithm, which selects the **ring** (reduce-scatter, then
  all-gather) at every message size: gloo's halving-doubling and bcube
  exist but ProcessGroupGloo never selects them, and there is no small-message
  tree as in NCCL. What differs from the textbook ring is segmentation: each
  rank's chunk is cut into at least 2 segments of at most 1 MiB, two in
  flight, so even a small all-reduce makes 2(n-1) ring steps of two segment
  messages each, and a large one pays a little per-segment cost that the
  fit folds into ``beta``. Formula: ``2(n-1) alpha + 2(n-1)/n S beta``.
* all_gather: ``gloo::allgather``, a ring passing each chunk in two halves:
  ``(n-1) alpha + (n-1)/n S beta``.
* reduce_scatter: gloo has no reduce-scatter; ProcessGroupGloo clones the
  input, **all-reduces it whole** and copies out its chunk, so it costs an
  all-reduce, ``2(n-1) alpha + 2(n-1)/n S beta``, twice the textbook bytes.
* broadcast: ``gloo::broadcast`` is a **binomial tree** sending the whole
  message at each level: ``ceil(log2 n) (alpha + S beta)``.
* send_recv: ``alpha + S beta``.

At ``n = 1`` every collective costs 0. At ``n = 2`` the ring and the tree
coincide, so a calibration at world size 2 cannot tell them apart: the
formulas above are what carries it to other ``n``.

Calibration (``calibrate``) has to hold from run to run on a shared machine,
so every step of it is robust and says how sure it is:

* each rank of the sweep runs torch on its share of the cores, as a training rank
  does (more threads leave OpenMP workers spinning on the cores gloo needs: at
  world 2 on 2 cores, 512 KiB took 4.6-7.3 ms on 2 threads per rank against
  1.0-3.0 ms on one, 8 MiB 14.4-14.7 against 8.6-9.4 ms);
* the sweep interleaves its repeats (each round runs every size once, in a
  shuffled order), so a burst of load slows one round, not every repeat of
  one size; a repeat's time is its slowest rank's;
* per message size, repeats more than 3 scaled MADs (at least 2 % of the
  median) slower than the size's median are dropped (``collectives.outliers``;
  interference only adds time) and the size's time is the median of the rest;
* the line is a Huber-weighted least-squares fit of relative residuals over
  the sizes, which need to reach both below the latency-bandwidth crossover
  (alpha) and well above it (beta): ``collectives.CALIBRATION_SIZES``, 1 KiB
  to 16 MiB a factor of 2 apart;
* the spread: a 90 % bootstrap interval for alpha and for beta (200 refits
  on sizes drawn with replacement and, within each, its repeats), kept on
  the ``LinkModel`` beside the RMS residual and shown by ``describe()``.

``predict_ddp_step`` turns a single-rank compute timeline and DDP's bucket
sizes into a step time (plus the link's ``busy_s``, once); ``measure`` and ``validate`` check it against real
DDP runs; ``project`` extrapolates to world sizes and links this machine
does not have (a simulation, with its ``assumptions``).

The modules, one job each (every public name is re-exported here, so
``from dtlab.read import costmodel; costmodel.X`` reaches them all):

* ``links``: the formulas above, ``LinkModel``, ``capped`` and fitting a link on a sweep (``calibrate``);
* ``linkset``: one link per collective (``LinkSet``, fitted by ``calibrate_ops``);
* ``busy``: what a collective costs beyond its price between a step's compute (``calibrate_busy``), after
  5 ms and after 0.5 ms of it (``with_busy``), and in between (``busy_at``);
* ``step``: one DDP step from compute phases and bucket sizes (``predict_ddp_step``, ``timeline_frame``),
  and whether a core is left for communication to overlap (``spare_cores``);
* ``measure``: the code that starts runs (``measure``, ``measure_links``; the compute of n ranks timed
  in n copies at once, ``compute_together``) and checks the step model against them (``validate``,
  ``validate_links``, round by round ``validate_rounds``, ``summary``);
* ``projection``: what-if world sizes and links (``project``, ``assumptions``).
"""

from dtlab.cost.links.alpha_beta import (
    ALGORITHM_NAMES,
    ALGORITHMS,
    BACKENDS,
    BOOTSTRAP_DRAWS,
    INTERVAL,
    OPS,
    SWEEP_COLUMNS,
    Coefficients,
    LinkModel,
    bootstrap,
    calibrate,
    capped,
    coefficients,
    fit_alpha_beta,
    fit_frame,
)
from dtlab.cost.links.buckets import (
    COMPUTE_PHASES,
    BucketTiming,
    StepPrediction,
    bucket_schedule,
    predict_ddp_step,
    spare_cores,
    timeline_frame,
)
from dtlab.cost.links.busy import (
    BUSY_COMPUTE_S,
    BUSY_NBYTES,
    BUSY_ROUNDS,
    BUSY_SHORT_COMPUTE_S,
    busy_at,
    busy_excess,
    calibrate_busy,
    with_busy,
)
from dtlab.cost.links.linkset import LinkSet, calibrate_ops
from dtlab.cost.links.projection import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_WORLD_SIZES,
    MIB,
    assumptions,
    project,
    split_buckets,
)

__all__ = [
    "ALGORITHMS", "ALGORITHM_NAMES", "BACKENDS", "BOOTSTRAP_DRAWS", "BUSY_COMPUTE_S", "BUSY_NBYTES", "BUSY_ROUNDS",
    "BUSY_SHORT_COMPUTE_S", "BucketTiming", "COMPUTE_PHASES", "Coefficients", "DEFAULT_BUCKET_BYTES",
    "DEFAULT_WORLD_SIZES", "INTERVAL", "LinkModel", "LinkSet", "MIB", "OPS", "SWEEP_COLUMNS", "StepPrediction",
    "assumptions", "bootstrap", "bucket_schedule", "busy_at", "busy_excess", "calibrate", "calibrate_busy",
    "calibrate_ops", "capped", "coefficients", "fit_alpha_beta", "fit_frame", "predict_ddp_step", "project",
    "spare_cores", "split_buckets", "timeline_frame", "with_busy",
]
