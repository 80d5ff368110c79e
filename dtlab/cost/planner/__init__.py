"""Plan a training run on a real cluster: which layouts fit, and how fast each would step (a projection).

    from dtlab.cost import planner
    plan = planner.search(planner.LLAMA2_7B, planner.H100_SXM, gpus=64, global_batch=1024)
    plan.table.head()          # ranked: feasible first, then by predicted step time
    plan.assumptions           # every figure and formula it rests on
    cfg = planner.scaled_down(plan.best())   # the same strategies, as a job this machine runs

Pure arithmetic on published figures (``clusters``, and the GPUs in
``dtlab.cost.roofline.devices``) and a model's shape (``transformer``):
``ops`` lists a step's operations, ``step`` times them on the GPU's roofline with
each strategy's communication and bubble (``overlap``, ``network``), ``memory``
counts the bytes, ``search`` enumerates the layouts. ``validate`` holds the whole
model against published runs (``python -m dtlab.cost.planner.validate``): ``runs`` reads
them, ``prediction`` predicts one as the planner would advise where the source left a
choice open, ``fit`` fits the constants and predicts each source with them refitted
without it.
Nothing here starts a process: the app layer (``dtlab.widgets.planner``) runs the
scaled-down job.
"""

from __future__ import annotations

from dtlab.cost.planner.clusters import A100_80GB, CLUSTERS, H100_SXM, H200_SXM, Cluster
from dtlab.cost.planner.layout import SCHEDULES, Layout
from dtlab.cost.planner.scaled import scaled_down, scaled_tier
from dtlab.cost.planner.search import KINDS, Plan, assumptions, evaluate, layouts, search
from dtlab.cost.planner.transformer import LLAMA2_7B, LLAMA2_70B, MIXTRAL_8X7B, MODELS, TransformerSpec, from_charformer

__all__ = ["A100_80GB", "CLUSTERS", "H100_SXM", "H200_SXM", "KINDS", "LLAMA2_70B", "LLAMA2_7B", "MIXTRAL_8X7B",
           "MODELS", "SCHEDULES",
           "Cluster", "Layout", "Plan", "TransformerSpec", "assumptions", "evaluate", "from_charformer", "layouts",
           "scaled_down", "scaled_tier", "search"]
