"""Reading runs of the ``moe`` model: where the tokens went, what the all-to-alls moved, who was slow.

Every tier that runs the model adds each step's routing to its steps (``tokens_e{i}``: the
assignments this rank's tokens made to expert i, over all MoE layers; ``dropped_tokens``;
``balance_loss``); the ``ep`` tier adds per rank what its own experts ran
(``RankResult.strategy``: ``expert_tokens``, ``expert_forward_s``) and records every
all-to-all with its split sizes.
"""

from __future__ import annotations

import pandas as pd
import torch

from dtlab.core import data as datasets
from dtlab.core.config import RunConfig
from dtlab.core.job import build_job
from dtlab.core.moe import routing_of
from dtlab.core.results import RunResult
from dtlab.read.stragglers import arrivals

__all__ = ["all_to_all_bytes", "dispatch_bytes", "expert_load", "imbalance", "rank_load", "router_choices",
           "stragglers", "vocabulary"]

FP32 = 4


def expert_load(result: RunResult) -> pd.DataFrame:
    """Tokens per expert per step, all ranks and layers together: a table step x expert."""
    df = result.steps_frame()
    cols = sorted((c for c in df if c.startswith("tokens_e")), key=lambda c: int(c.removeprefix("tokens_e")))
    if not cols:
        raise ValueError(f"expert_load: the run's model ({result.config.model!r}) has no experts: use model='moe'")
    table = df.groupby("step")[cols].sum()
    table.columns = [int(c.removeprefix("tokens_e")) for c in cols]
    table.columns.name = "expert"
    return table


def imbalance(result: RunResult) -> pd.Series:
    """Per step, the busiest expert's tokens over the mean expert's: 1 when the load is even."""
    load = expert_load(result)
    return (load.max(axis=1) / load.mean(axis=1)).rename("imbalance")


def rank_load(result: RunResult) -> pd.DataFrame:
    """ep: per step and rank, the rows its experts ran on, their forward seconds, the seconds the rank spent in
    all-to-alls and whether it was the step's straggler (``stragglers``: the rank the others waited for longest)."""
    rows = [{"step": step, "rank": r.rank, "tokens": sum(tokens), "expert_forward_s": seconds}
            for r in result.ranks if "expert_tokens" in r.strategy
            for step, (tokens, seconds) in enumerate(zip(r.strategy["expert_tokens"], r.strategy["expert_forward_s"]))]
    if not rows:
        raise ValueError(f"rank_load: tier {result.config.tier!r} does not share out experts: use tier='ep'")
    df = pd.DataFrame(rows)
    ev = result.events_frame()
    ev = ev[ev["op"] == "all_to_all_single"]
    spent = ev.groupby(["step", "rank"])["duration_s"].sum().rename("all_to_all_s")
    df = df.join(spent, on=["step", "rank"]).fillna({"all_to_all_s": 0.0})
    df["straggler"] = df["rank"] == df["step"].map(stragglers(result))
    return df


def stragglers(result: RunResult) -> pd.Series:
    """Per step, the rank that made the others wait longest: at each collective the last rank to arrive
    keeps the others waiting for the longest wait there; these waits are added up per rank and step."""
    df = arrivals(result)
    df = df[df["step"] < result.config.steps]  # not the final gather of the experts
    if df.empty:
        return pd.Series(dtype=int, name="rank")
    caused = df.groupby(["step", "index"]).agg(wait_s=("wait_s", "max"))
    caused["rank"] = df[df["last"]].groupby(["step", "index"])["rank"].first()
    per_rank = caused.groupby(["step", "rank"])["wait_s"].sum()
    return per_rank.groupby("step").idxmax().map(lambda key: key[1]).rename("rank")


def dispatch_bytes(cfg: RunConfig) -> int:
    """Bytes of one dispatch all-to-all on one rank, dropless: its tokens x top_k rows of model_size fp32 values
    (the rows it keeps for its own experts included; ``(n - 1) / n`` of them leave it when the load is even)."""
    tokens = cfg.per_rank_batch * datasets.SEQ_LEN
    return tokens * cfg.top_k * cfg.model_size * FP32


def all_to_all_bytes(result: RunResult, rank: int = 0) -> pd.DataFrame:
    """One rank's all-to-alls per step: ``kind`` (counts, dispatch, combine; ``(backward)`` for the gradients'),
    ``bytes`` (the rows it sends, its own share included, as the recorder counts them) and ``sent_bytes``
    (the rows that leave it: its split sizes without its own), summed over the layers."""
    ev = result.events_frame()
    ev = ev[(ev["op"] == "all_to_all_single") & (ev["rank"] == rank) & (ev["step"] >= 0)
            & (ev["step"] < result.config.steps)].copy()
    row_bytes = ev["bytes"] / ev["input_splits"].map(lambda s: max(sum(s), 1))
    ev["sent_bytes"] = row_bytes * ev["input_splits"].map(lambda s: sum(s) - s[rank])
    ev["kind"] = ev["tag"].str.replace(r"^ep:(\w+):[\w.]+", r"\1", regex=True)
    return ev.groupby(["step", "kind"], as_index=False)[["bytes", "sent_bytes"]].sum()


def vocabulary() -> list[str]:
    """The text data set's characters, in the order of their ids (as ``dtlab.core.data.text`` numbers them)."""
    return sorted(set((datasets.DATA_DIR / datasets.TEXT_FILE).read_text(encoding="utf-8")))


@torch.no_grad()
def router_choices(result: RunResult, layer: int = 0, top: int = 20, samples: int = 256) -> pd.DataFrame:
    """For the ``top`` most frequent characters of the held-out text, the share of their tokens whose first
    choice is each expert, in MoE layer ``layer`` of the trained model (rank 0's parameters)."""
    model, data = build_job(result.config, torch.device("cpu"))
    model.load_state_dict(result.params())
    model.eval()
    layers = routing_of(model)
    if not layers:
        raise ValueError(f"router_choices: the run's model ({result.config.model!r}) has no router: use model='moe'")
    seen: list[torch.Tensor] = []
    hook = layers[layer].router.register_forward_hook(lambda _m, _a, logits: seen.append(logits.argmax(-1)))
    x = data.test_x[:samples]
    model(x)
    hook.remove()
    chars = vocabulary()
    frame = pd.DataFrame({"char": [chars[int(i)] for i in x.reshape(-1)], "expert": seen[0].reshape(-1).numpy()})
    share = pd.crosstab(frame["char"], frame["expert"], normalize="index")
    share = share.reindex(columns=range(len(layers[layer].router.weight)), fill_value=0.0)
    common = frame["char"].value_counts().index[:top]
    share = share.loc[common]
    share.index = [{" ": "space", "\n": "newline"}.get(c, c) for c in share.index]
    return share
