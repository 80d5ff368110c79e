"""Exercise ``ddp_script``: a complete DistributedDataParallel training script, run by torchrun.

The other exercises are functions that dtlab launches; real jobs are scripts that
``torchrun`` (``python -m torch.distributed.run``) starts once per rank. Such a
script has five pieces, and each one, forgotten, fails quietly:

1. ``dist.init_process_group("gloo")``: torchrun puts RANK, WORLD_SIZE, MASTER_ADDR
   and MASTER_PORT in every process's environment, and init reads them.
2. ``DistributedSampler(dataset)``: each rank trains on its own 1/n of every epoch
   (without it, every rank trains on everything and the "global batch" is n copies).
3. ``sampler.set_epoch(epoch)`` at the start of every epoch: the sampler shuffles
   with seed + epoch, so without it every epoch repeats the first one's order.
4. ``DistributedDataParallel(model)``: it copies rank 0's parameters to every rank
   and averages the gradients in backward, so the replicas stay identical.
5. Rank 0 alone saves (``model.module.state_dict()``), then ``dist.barrier()``: no
   rank goes on, or reads the checkpoint, before it is written.

The check runs the script under torchrun through a small probe
(``_script_probe.py``) that notes the calls to init_process_group, the DDP
constructor, torch.save and barrier, and judges the files the script writes.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.exercises._check import CheckResult, ScriptExercise
from dtlab.exercises._values import max_abs
from dtlab.launch import lifeline
from dtlab.launch.torchrun import free_port, kill_session

NAME = "ddp_script"
HERE = Path(__file__).resolve().parent
PROBE, REFERENCE, STARTER = HERE / "_script_probe.py", HERE / "ddp_script_reference.py", HERE / "ddp_script_starter.py"
SAMPLES, FEATURES, WIDTH, CLASSES = 48, 8, 16, 4  # 48 samples: an equal share at 2, 3 and 4 ranks
BATCH = 4  # per rank
LR = 0.1
EPOCHS = 2
TOL = 1e-5
KEYS = ("0.weight", "0.bias", "2.weight", "2.bias")

DESCRIPTION = (
    "Write a torchrun script that trains a small MLP data-parallel, with DistributedDataParallel; check it with "
    "check('ddp_script', path), a path rather than a function (exercises.stub('ddp_script') is the path of a "
    "one-process starter to copy, exercises.solution('ddp_script') the reference's). The check writes the data to "
    "DIR/data.pt and runs python -m torch.distributed.run --nproc-per-node 2 path --out DIR --epochs "
    f"{EPOCHS}, which starts the script once per rank. The script parses --out and --epochs; loads data = "
    "torch.load(os.path.join(out, 'data.pt'), weights_only=True), a dict with 'x' (float32, "
    f"{SAMPLES} × {FEATURES}) and 'y' (int64, {SAMPLES} labels 0 to {CLASSES - 1}), as a TensorDataset; and trains "
    f"nn.Sequential(nn.Linear({FEATURES}, {WIDTH}), nn.Tanh(), nn.Linear({WIDTH}, {CLASSES})), built right after "
    f"torch.manual_seed(0), with torch.optim.SGD (lr={LR}) on F.cross_entropy, in batches of {BATCH} per rank: "
    "each rank on its own share of every epoch, in a new shuffled order each epoch, all ranks stepping together "
    "as one model. In every epoch it writes the indices this rank trains on, in the order it trains on them, as "
    "a JSON list to os.path.join(out, f'indices_rank{rank}_epoch{epoch}.json'). After training, rank 0 alone saves "
    f"the trained model's state_dict (the keys {', '.join(KEYS)}) to os.path.join(out, 'model.pt'), and no rank "
    "goes on before the file is written. Checked at world size 2 (a script running past 30 + 6 × timeout_s "
    "seconds is stopped): the script ends without error on every rank, which joined as ranks 0 and 1 of 2; "
    "each rank's model trained on exactly the samples it wrote, in that order (the check sees the rows of x that "
    f"reach its first layer); in each epoch the ranks' indices are disjoint and cover all {SAMPLES} samples, and "
    "each epoch's order differs from the one before; every rank built a DistributedDataParallel and trained "
    "through it; only rank 0 saved model.pt, and every rank "
    "waited at a barrier until it had; and the saved parameters match one process training the same model on the "
    f"same global batches (within {TOL:g})."
)

HINTS = (
    "A torchrun script is the one-process script plus five pieces: join the other processes in one process group; "
    "give each rank its own share of the data; reshuffle that share every epoch; wrap the model so that backward "
    "averages the gradients over the ranks; and save once, from rank 0, while the others wait for it.",

    "dist.init_process_group('gloo') reads torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); "
    "then rank = dist.get_rank(). sampler = DistributedSampler(dataset, shuffle=True, seed=0) and "
    f"DataLoader(dataset, batch_size={BATCH}, sampler=sampler) (no shuffle=True on the loader). At the start of "
    "each epoch sampler.set_epoch(epoch): the sampler shuffles with seed + epoch; list(sampler) is then this rank's "
    "indices, in order. model = DistributedDataParallel(model), and the optimizer takes the wrapper's parameters. "
    "At the end: if rank == 0: torch.save(model.module.state_dict(), path) (module: the model inside the "
    "wrapper); dist.barrier() on every rank; dist.destroy_process_group().",

    "dist.init_process_group('gloo');  rank = dist.get_rank()\n"
    "dataset = TensorDataset(data['x'], data['y'])\n"
    "sampler = DistributedSampler(dataset, shuffle=True, seed=0)\n"
    f"loader = DataLoader(dataset, batch_size={BATCH}, sampler=sampler)\n"
    "torch.manual_seed(0);  model = DistributedDataParallel(nn.Sequential(...))\n"
    f"optimizer = torch.optim.SGD(model.parameters(), lr={LR})\n"
    "for epoch in range(epochs):\n"
    "    sampler.set_epoch(epoch)\n"
    "    write list(sampler) to indices_rank{rank}_epoch{epoch}.json\n"
    "    for x, y in loader: zero_grad; cross_entropy(model(x), y).backward(); step\n"
    "if rank == 0: torch.save(model.module.state_dict(), os.path.join(out, 'model.pt'))\n"
    "dist.barrier()\n"
    "dist.destroy_process_group()",
)


# -- the data and the reference run ------------------------------------------------------------------------------
def _data() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4000)
    return {"x": torch.randn(SAMPLES, FEATURES, generator=gen),
            "y": torch.randint(0, CLASSES, (SAMPLES,), generator=gen)}


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES))


def reference(indices: dict[tuple[int, int], list[int]], n: int) -> dict[str, torch.Tensor]:
    """One process on the global batches the ranks reported: step k of an epoch averages every rank's k-th batch."""
    data, model = _data(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch in range(EPOCHS):
        shares = [indices[r, epoch] for r in range(n)]
        for k in range(math.ceil(len(shares[0]) / BATCH)):
            opt.zero_grad()
            batches = [share[k * BATCH:(k + 1) * BATCH] for share in shares]
            loss = sum(F.cross_entropy(model(data["x"][b]), data["y"][b]) for b in batches) / n
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- running the script ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ended:
    """How a torchrun run ended: its exit code, whether it was stopped at the deadline, and what it printed."""

    returncode: int
    timed_out: bool
    log: str


def run_script(script: Path, out: Path, n: int, deadline_s: float) -> Ended:
    """``script --out OUT --epochs 2`` under torchrun on n local ranks (through the probe), stopped at the deadline."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(n),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id",
               uuid.uuid4().hex[:12], "--local-addr", "127.0.0.1", "--max-restarts", "0", "--monitor-interval", "0.2",
               "--log-dir", str(out / "logs"), "--redirects", "3",  # each rank's stdout and stderr in a file
               str(PROBE), str(out), str(script), "--out", str(out), "--epochs", str(EPOCHS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    log_path = out / "torchrun.log"
    with open(log_path, "wb") as log:
        # The agent, and through the probe its ranks, die with this process however it ends.
        proc = subprocess.Popen(lifeline.dying_with_parent(command), stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=out, start_new_session=True)
    start = lifeline.watch_process(proc.pid)
    timed_out = False
    try:
        proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_session(proc)
    except BaseException:  # an interrupt in the notebook: take torchrun and its ranks down with it
        kill_session(proc)
        raise
    finally:
        lifeline.forget_process(proc.pid, start)
    return Ended(proc.returncode, timed_out, log_path.read_text(errors="replace"))


# -- judging -----------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _failed(ended: Ended, script: Path, out: Path, deadline_s: float) -> str | None:
    """Why the run did not end cleanly: the first error a rank raised, a hang, or torchrun's last lines."""
    errors = [(int(p.stem.removeprefix("error_rank")), _read_json(p)) for p in out.glob("error_rank*.json")]
    errors = sorted((e for e in errors if isinstance(e[1], dict)), key=lambda e: e[1].get("time", 0))
    if errors:
        rank, err = errors[0]
        where = f" at line {err['line']} of {script.name}" if err.get("line") else ""
        return f"rank {rank}'s script raised {err['type']}{where}: {err['message']}"
    if ended.timed_out:
        return (f"the script was still running after {deadline_s:g} s and was stopped. A rank that waits forever "
                "usually waits in a collective another rank never reaches: a dist.barrier() inside "
                "'if rank == 0:', say, or ranks with different numbers of batches.")
    if ended.returncode != 0:
        for rank, lines in _stderr(out):
            if lines:
                return f"rank {rank}'s script failed. The last lines it printed:\n" + "\n".join(lines[-8:])
        tail = [line for line in ended.log.splitlines() if line.strip()][-12:]
        return f"torchrun ended with exit code {ended.returncode}. The last lines it printed:\n" + "\n".join(tail)
    return None


def _stderr(out: Path) -> list[tuple[int, list[str]]]:
    """Each rank's stderr (torchrun's --redirects), as its non-empty lines, in rank order."""
    logs = sorted((int(p.parent.name), p) for p in out.glob("logs/*/attempt_*/*/stderr.log") if p.parent.name.isdigit())
    return [(rank, [line for line in p.read_text(errors="replace").splitlines() if line.strip()]) for rank, p in logs]


def _notes(out: Path, n: int) -> dict[int, list[dict[str, Any]]]:
    found = {r: _read_json(out / f"probe_rank{r}.json") for r in range(n)}
    return {r: notes if isinstance(notes, list) else [] for r, notes in found.items()}


def _joined(n: int, notes: dict[int, list[dict[str, Any]]]) -> str | None:
    inits = {r: [x for x in rank_notes if x.get("call") == "init"] for r, rank_notes in notes.items()}
    for r, calls in inits.items():
        if not calls:
            return (f"rank {r} never called dist.init_process_group: under torchrun every rank runs your whole "
                    "script as a process of its own, and dist.init_process_group('gloo') joins them into one world "
                    "(torchrun's environment, RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, tells it everything).")
    said = [(calls[0]["rank"], calls[0]["world"]) for calls in inits.values()]
    if sorted(said) != [(r, n) for r in range(n)]:
        return (f"the ranks joined as {', '.join(f'rank {r} of {w}' for r, w in said)}; under torchrun they are ranks "
                f"0 to {n - 1} of {n}: call dist.init_process_group('gloo') without rank or world_size and it reads "
                "them from torchrun's environment.")
    return None


def _indices(n: int, out: Path) -> tuple[str | None, dict[tuple[int, int], list[int]]]:
    """Every rank's indices in every epoch, or what is wrong with their files."""
    found: dict[tuple[int, int], list[int]] = {}
    for r in range(n):
        for e in range(EPOCHS):
            path = out / f"indices_rank{r}_epoch{e}.json"
            if not path.exists():
                return (f"there is no {path.name}: in every epoch, after sampler.set_epoch(epoch), each rank writes "
                        "the indices it trains on, json.dump(list(sampler), f), to os.path.join(out, "
                        "f'indices_rank{rank}_epoch{epoch}.json')."), found
            value = _read_json(path)
            if not isinstance(value, list) or not all(isinstance(i, int) and 0 <= i < SAMPLES for i in value):
                return (f"{path.name} should hold a JSON list of sample indices (0 to {SAMPLES - 1}), as "
                        "json.dump(list(sampler), f) writes it."), found
            found[r, e] = value
    return None, found


def _shares(n: int, indices: dict[tuple[int, int], list[int]]) -> str | None:
    """Disjoint shares that cover the data set each epoch, in a new order each epoch."""
    for e in range(EPOCHS):
        shares = [indices[r, e] for r in range(n)]
        if all(sorted(share) == list(range(SAMPLES)) for share in shares):
            return (f"in epoch {e} every rank trained on all {SAMPLES} samples: give the DataLoader a "
                    f"DistributedSampler(dataset), so that each rank trains on its own 1/{n} of them.")
        seen = [i for share in shares for i in share]
        if twice := sorted({i for i in seen if seen.count(i) > 1}):
            return (f"in epoch {e}, {len(twice)} samples were on more than one rank (sample {twice[0]}, say): "
                    "DistributedSampler gives the ranks disjoint shares.")
        if missing := sorted(set(range(SAMPLES)) - set(seen)):
            return (f"in epoch {e}, {len(missing)} of the {SAMPLES} samples were on no rank (sample {missing[0]}, "
                    "say): together the ranks' shares cover the data set.")
    for e in range(1, EPOCHS):
        for r in range(n):
            if indices[r, e] == indices[r, e - 1]:
                return (f"rank {r} trained on the same samples in the same order in epoch {e} as in epoch {e - 1}: "
                        "DistributedSampler shuffles with its seed plus the epoch number, so without "
                        "sampler.set_epoch(epoch) at the start of every epoch, every epoch repeats the first one's "
                        "order.")
    return None


def _trained(n: int, notes: dict[int, list[dict[str, Any]]], indices: dict[tuple[int, int], list[int]]) -> str | None:
    """The samples each rank's model trained on (seen by the probe at its first layer) against what it wrote."""
    for r in range(n):
        trained = [i for x in notes[r] if x.get("call") == "batch" for i in x.get("indices", [])]
        written = [i for e in range(EPOCHS) for i in indices[r, e]]
        if not trained:
            return (f"rank {r}'s model never trained on data.pt's samples: no row of its x reached the model's first "
                    "layer while gradients were on. Train on TensorDataset(data['x'], data['y']).")
        if -1 in trained:
            return (f"rank {r}'s model got inputs that are not rows of data.pt's x: train on the samples as they "
                    "are.")
        if n > 1 and sorted(trained) == sorted(list(range(SAMPLES)) * EPOCHS):
            wrote = f", although it wrote only {len(written)} indices" if len(written) < len(trained) else ""
            return (f"rank {r}'s model trained on all {SAMPLES} samples in every epoch{wrote}: give the DataLoader "
                    f"the DistributedSampler (DataLoader(dataset, batch_size={BATCH}, sampler=sampler)), so that "
                    f"each rank trains on its own 1/{n} of them.")
        if trained != written:
            k = next((k for k, (a, b) in enumerate(zip(trained, written)) if a != b), min(len(trained), len(written)))
            ends = list(itertools.accumulate(len(indices[r, e]) for e in range(EPOCHS)))
            epoch = next((e for e, end in enumerate(ends) if k < end), EPOCHS - 1)
            return (f"rank {r}'s model trained on other samples than it wrote to its indices files ({len(trained)} "
                    f"trained, {len(written)} written): at position {k} (epoch {epoch}) {_sample(trained, k)} went "
                    f"through the model where the file says {_sample(written, k)}. Write list(sampler) of the "
                    "sampler the DataLoader draws from, after sampler.set_epoch(epoch).")
    return None


def _sample(seq: list[int], k: int) -> str:
    return f"sample {seq[k]}" if k < len(seq) else "nothing"


def _ddp(notes: dict[int, list[dict[str, Any]]]) -> str | None:
    for r, rank_notes in notes.items():
        if not any(x.get("call") == "ddp" for x in rank_notes):
            return (f"rank {r} never built a DistributedDataParallel: wrap the model, model = "
                    "DistributedDataParallel(model), so that it starts from rank 0's parameters on every rank and "
                    "backward averages the gradients over the ranks.")
        if not any(x.get("call") == "ddp_forward" for x in rank_notes):
            return (f"rank {r} built a DistributedDataParallel but never ran a forward pass through it: train the "
                    "wrapper (model(x), with model the DistributedDataParallel), not the module inside it, or "
                    "backward does not average the gradients over the ranks.")
    return None


def _saved(n: int, notes: dict[int, list[dict[str, Any]]]) -> str | None:
    """Rank 0 alone saved model.pt, and every rank waited at a barrier until it had."""
    saves = {r: [x for x in rank_notes if x.get("call") == "save" and x.get("file") == "model.pt"]
             for r, rank_notes in notes.items()}
    if not saves[0]:
        return ("rank 0 did not save model.pt: after training, rank 0 saves the model's parameters, "
                "torch.save(model.module.state_dict(), os.path.join(out, 'model.pt')).")
    if others := [r for r in range(1, n) if saves[r]]:
        return (f"rank {others[0]} saved model.pt too: save on rank 0 only (if dist.get_rank() == 0). The replicas "
                "are identical, and several processes writing one file can leave it corrupt.")
    saved_at = saves[0][-1]["end"]
    for r, rank_notes in notes.items():
        if not any(x.get("call") == "barrier" and x["end"] >= saved_at for x in rank_notes):
            when = "after saving" if r == 0 else "until rank 0 had saved"
            return (f"rank {r} did not wait at a dist.barrier() {when} model.pt: call dist.barrier() on every rank "
                    "after the save, so that no rank goes on (or reads the checkpoint) before it is written.")
    return None


def _parity(out: Path, indices: dict[tuple[int, int], list[int]], n: int) -> tuple[str | None, float]:
    try:
        saved = torch.load(out / "model.pt", weights_only=True)
    except Exception as exc:
        return (f"model.pt could not be read with torch.load(path, weights_only=True) ({type(exc).__name__}): save "
                "a state_dict, a dict of tensors: torch.save(model.module.state_dict(), path)."), math.inf
    if not isinstance(saved, dict) or not all(isinstance(v, torch.Tensor) for v in saved.values()):
        return "model.pt should hold a state_dict, a dict of tensors: model.module.state_dict().", math.inf
    saved = {k.removeprefix("module."): v for k, v in saved.items()}  # the wrapper's own state_dict is fine too
    if sorted(saved) != sorted(KEYS):
        return (f"model.pt holds {', '.join(sorted(saved)) or 'nothing'}; the model's state_dict has "
                f"{', '.join(KEYS)}: save model.module.state_dict() of nn.Sequential(nn.Linear({FEATURES}, {WIDTH}), "
                f"nn.Tanh(), nn.Linear({WIDTH}, {CLASSES})).", math.inf)
    expected = reference(indices, n)
    diffs = {k: max_abs(saved[k], expected[k]) for k in KEYS}
    worst = max(diffs.values())
    if worst <= TOL:
        return None, worst
    name = max(diffs, key=diffs.__getitem__)
    if all(max_abs(saved[k], v) == 0 for k, v in _model().state_dict().items()):
        return "model.pt holds the untrained parameters: save after the training loop.", worst
    return (f"the saved parameters differ by {worst:.1e} ({name}) from one process training on the same global "
            f"batches: build the model right after torch.manual_seed(0), wrap it in DistributedDataParallel, train "
            f"with torch.optim.SGD(lr={LR}) and F.cross_entropy on DataLoader(dataset, batch_size={BATCH}, "
            "sampler=sampler), one step per batch, and save at the end."), worst


def check_at(script: Path, n: int, timeout_s: float) -> tuple[str | None, float]:
    """Run the script once at world size n and judge it: (what is wrong or None, the largest parameter difference)."""
    deadline_s = 30 + 6 * timeout_s
    with lifeline.folder("dtlab-ddp-script-") as out:
        torch.save(_data(), out / "data.pt")
        ended = run_script(script, out, n, deadline_s)
        if problem := _failed(ended, script, out, deadline_s):
            return problem, math.inf
        notes = _notes(out, n)
        if problem := _joined(n, notes):
            return problem, math.inf
        problem, indices = _indices(n, out)
        if problem := problem or _trained(n, notes, indices) or _shares(n, indices) or _ddp(notes) or _saved(n, notes):
            return problem, math.inf
        return _parity(out, indices, n)


def run(script: Path, world_sizes: Sequence[int], timeout_s: float) -> CheckResult:
    """Check the script at each world size; the first problem ends the check."""
    worst: dict[int, float] = {}
    for n in world_sizes:
        problem, worst[n] = check_at(script, n, timeout_s)
        if problem:
            return CheckResult(NAME, False, f"World size {n}: {problem}")
    sizes = f"world size{'s' * (len(world_sizes) > 1)} {', '.join(map(str, world_sizes))}"
    return CheckResult(NAME, True, (
        f"at {sizes} torchrun ran the script without error on every rank, and each rank joined with its "
        f"own rank. In each of the {EPOCHS} epochs the ranks trained on disjoint shares that covered the "
        f"{SAMPLES} samples, in a new order every epoch (set_epoch), and each rank's model trained on exactly the "
        "samples it wrote; every rank trained through DistributedDataParallel; rank 0 alone saved model.pt and "
        "every rank waited at a barrier until it had; the saved parameters matched one process training on the "
        f"same global batches (largest difference {max(worst.values()):.1g})."))


EXERCISE = ScriptExercise(NAME, DESCRIPTION, run, str(REFERENCE), str(STARTER), world_sizes=(2,),
                          allowed_world_sizes=(2, 3, 4), hints=HINTS)
