"""The flags a job is given by, and how an error about a field names the flag that sets it.

Torch-free, like the parser that uses it: the command line checks every flag that
needs no tier before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from dtlab.core import options, registry
from dtlab.core.config import RunConfig

# RunConfig's defaults, read off the dataclass: making one would validate it, and that imports its tier.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}


def add_job_args(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    p.add_argument("--model", default=d["model"], help="mlp, cnn, cnn-bn, charformer, moe or package.module:factory")
    p.add_argument("--model-size", type=int, default=d["model_size"], help="width of the built-in model")
    p.add_argument("--model-depth", type=int, default=d["model_depth"], help="mlp hidden layers / charformer blocks")
    p.add_argument("--heads", type=int, default=d["model_heads"], help="charformer / moe attention heads")
    p.add_argument("--dataset", default=d["dataset"], help="digits, synthetic, text or package.module:factory")
    p.add_argument("--dataset-size", type=int, default=d["dataset_size"], help="samples (synthetic only)")
    p.add_argument("--batch-size", type=int, default=d["global_batch_size"], help="global batch size")
    p.add_argument("--steps", type=int, default=d["steps"])
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--optimizer", default=d["optimizer"], help="sgd, adam or muon")
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--backend", default=d["backend"], help="auto, gloo or nccl")
    p.add_argument("--device", default=d["device"], help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=d["threads_per_rank"], help="threads per rank (0: cores / ranks)")
    p.add_argument("--timeout", type=float, default=d["timeout_s"], help="seconds a collective may wait")
    p.add_argument("--slow-rank", default=d["slow_rank"], metavar="RANK:DELAY",
                   help="make one rank a straggler, e.g. 1:5ms (it computes that much longer every step)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's forward in backward (less activation memory, more compute)")
    p.add_argument("--precision", default=d["precision"], help="fp32 or bf16 (autocast of the forward and loss)")
    p.add_argument("--dtype", default=d["dtype"], help="float32 or float64: the parameters' and inputs' dtype")
    p.add_argument("--experts", type=int, default=d["experts"], help="--model moe: experts per layer")
    p.add_argument("--top-k", type=int, default=d["top_k"], help="--model moe: experts each token is sent to")
    p.add_argument("--capacity-factor", type=float, default=d["capacity_factor"],
                   help="--model moe: tokens an expert takes, as a multiple of an even share (0: dropless)")
    p.add_argument("--aux-loss-coef", type=float, default=d["aux_loss_coef"],
                   help="--model moe: weight of the load-balancing loss in the loss (0: none)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a tier option, e.g. --opt bucket_cap_mb=1 (repeatable); booleans true/false, "
                   "lists comma-separated: --opt faults=sigkill:7:1,exception:12:0")


def job_fields(args: argparse.Namespace, tier: str, world_size: int) -> dict[str, Any]:
    """The RunConfig fields the flags give (all but ``tier_options``, which needs the tier's module)."""
    return dict(
        tier=tier, world_size=world_size, model=args.model, model_size=args.model_size, model_depth=args.model_depth,
        model_heads=args.heads, dataset=args.dataset,
        dataset_size=args.dataset_size, global_batch_size=args.batch_size, steps=args.steps, lr=args.lr,
        optimizer=args.optimizer, seed=args.seed, backend=args.backend, device=args.device,
        threads_per_rank=args.threads, timeout_s=args.timeout, slow_rank=args.slow_rank,
        activation_checkpointing=args.activation_checkpointing, precision=args.precision, dtype=args.dtype,
        experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor,
        aux_loss_coef=args.aux_loss_coef, flight_recorder=getattr(args, "flight_recorder", False),
    )


def tier_options(tier: str, pairs: list[str]) -> Any:
    """Build the tier's Options from ``--opt KEY=VALUE`` strings (converted by ``dtlab.core.options``).

    A tuple option takes comma-separated values (``--opt faults=sigkill:7:1,exception:12:0``); given
    twice, its values add up. Anything that does not fit is one line naming ``--opt`` and the field.
    """
    spec = registry.get(tier)  # imports the tier's module (and torch)
    known = options.fields(spec.options)
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known:
            what = "is not KEY=VALUE" if not sep else f"tier {tier!r} has no option {key!r}"
            raise ValueError(f"--opt {pair}: {what}; it takes: {', '.join(known) or 'no options'}")
        try:
            value = options.parse(known[key], raw, key)
        except options.OptionError as exc:
            raise ValueError(f"--opt {exc}") from None
        values[key] = values.get(key, ()) + value if known[key] == "tuple" else value
    return spec.options(**values)


def split(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{flag} {text!r}: give one or more comma-separated values")
    return items


def tier_names(text: str) -> list[str]:
    """``--tiers a,b``: the names, each a tier (ValueError naming the flag otherwise)."""
    names = split(text, "--tiers")
    for name in names:
        if name not in registry.names():
            raise ValueError(f"--tiers {text}: unknown tier {name!r}: choose from {', '.join(registry.names())}")
    return names


def world_sizes(text: str) -> list[int]:
    sizes = []
    for item in split(text, "--world-sizes"):
        try:
            sizes.append(int(item))
        except ValueError:
            raise ValueError(f"--world-sizes {text}: {item!r} is not an integer (write e.g. 1,2,4)") from None
    return sizes


# The flag that sets each RunConfig field, to name it in an error about that field.
FLAGS = {"tier": "--tier", "world_size": "--world-size", "model": "--model", "model_size": "--model-size",
         "model_depth": "--model-depth", "model_heads": "--heads", "dataset": "--dataset",
         "dataset_size": "--dataset-size",
         "global_batch_size": "--batch-size", "steps": "--steps", "lr": "--lr", "optimizer": "--optimizer",
         "seed": "--seed", "backend": "--backend", "device": "--device", "threads_per_rank": "--threads",
         "timeout_s": "--timeout", "slow_rank": "--slow-rank",
         "activation_checkpointing": "--activation-checkpointing", "precision": "--precision", "dtype": "--dtype",
         "experts": "--experts", "top_k": "--top-k", "capacity_factor": "--capacity-factor",
         "aux_loss_coef": "--aux-loss-coef", "flight_recorder": "--flight-recorder"}
COMMAND_FLAGS = {"compare": {"world_size": "--world-sizes", "tier": "--tiers"},
                 "cluster": {"world_size": "--nnodes x --nproc-per-node"}}


def name_flag(message: str, args: argparse.Namespace) -> str:
    """Prefix an error about a RunConfig field or a tier option with the flag that sets it."""
    found = re.search(r"(RunConfig|tier_options)\.(\w+)", message)
    if message.startswith("--") or not found:
        return message
    where, name = found.groups()
    if where == "tier_options":
        given = [p for p in getattr(args, "opt", []) if p.partition("=")[0].strip().replace("-", "_") == name]
        return f"--opt {given[-1] if given else name}: {message}"
    flag = COMMAND_FLAGS.get(args.command, {}).get(name) or FLAGS.get(name)
    return f"{flag}: {message}" if flag else message
