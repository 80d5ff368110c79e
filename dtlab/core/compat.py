"""Every private torch API dtlab touches, in one place, each with what happens where it is missing.

These names are not part of torch's public API and can change in any release.
dtlab is tested on the torch version pinned in the Makefile (``TESTED_TORCH``).
A helper that makes a figure nicer (a tag, a timing) degrades quietly where the
API is missing; one that dtlab cannot work without raises ``TorchCompatError``
naming the torch version it was written for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

TESTED_TORCH = "2.13"


class TorchCompatError(RuntimeError):
    """A private torch API dtlab relies on is missing from this torch."""


def _missing(what: str, exc: BaseException | None = None) -> TorchCompatError:
    detail = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    return TorchCompatError(f"{what} is not available in torch {torch.__version__}{detail}; dtlab uses it as in "
                            f"torch {TESTED_TORCH}, the version its tests run on")


# -- c10d ------------------------------------------------------------------------------------
def default_group() -> Any:
    """The default process group (``distributed_c10d._get_default_group``)."""
    import torch.distributed.distributed_c10d as c10d

    try:
        return c10d._get_default_group()
    except AttributeError as exc:
        raise _missing("torch.distributed.distributed_c10d._get_default_group", exc) from None


def default_store() -> Any:
    """The default process group's store (``distributed_c10d._get_default_store``): the ranks' key-value store, for
    agreeing on something without a collective of their own."""
    import torch.distributed.distributed_c10d as c10d

    try:
        return c10d._get_default_store()
    except AttributeError as exc:
        raise _missing("torch.distributed.distributed_c10d._get_default_store", exc) from None


def backend_class() -> type:
    """The C++ base class of every c10d backend (``torch._C._distributed_c10d.Backend``; the public
    ``torch.distributed.Backend`` is the class of backend names)."""
    try:
        from torch._C._distributed_c10d import Backend
    except ImportError as exc:
        raise _missing("torch._C._distributed_c10d.Backend", exc) from None
    return Backend


def unregister_library(library: Any) -> None:
    """Undo a ``torch.library.Library``'s registrations (``Library._destroy``: torch's own scoped libraries
    use it; there is no public counterpart)."""
    try:
        destroy = library._destroy
    except AttributeError as exc:
        raise _missing("torch.library.Library._destroy", exc) from None
    destroy()


def register_fake_backend() -> None:
    """Make ``init_process_group("fake")`` available: torch registers its fake process group (collectives
    return at once, no data moves) only when ``torch.testing._internal.distributed.fake_pg`` is imported."""
    try:
        from torch.testing._internal.distributed import fake_pg  # noqa: F401 - registers on import
    except ImportError as exc:
        raise _missing("torch.testing._internal.distributed.fake_pg (the fake process group)", exc) from None


# -- DDP -------------------------------------------------------------------------------------
def ddp_bucket_assignment(params: list[Any], caps_bytes: list[int]) -> list[list[int]]:
    """Indices of ``params`` per bucket, as DDP assigns them by size (``dist._compute_bucket_assignment_by_size``):
    the first bucket capped at ``caps_bytes[0]``, the rest at ``caps_bytes[-1]``."""
    import torch.distributed as dist

    try:
        groups, _ = dist._compute_bucket_assignment_by_size(params, caps_bytes, [False] * len(params),
                                                            list(range(len(params))))
    except AttributeError as exc:
        raise _missing("torch.distributed._compute_bucket_assignment_by_size", exc) from None
    return [list(g) for g in groups]


def ddp_bucket_sizes(model: Any) -> list[int]:
    """Bytes of each of DDP's current gradient buckets, in the reducer's order.

    DDP's logging data keeps the first layout only; after the first step DDP
    rebuilds buckets in gradient-ready order, so ask the reducer.
    """
    try:
        buckets = model.reducer._get_zeros_like_grad_buckets()
    except AttributeError as exc:
        raise _missing("DistributedDataParallel.reducer._get_zeros_like_grad_buckets", exc) from None
    return [int(b.buffer().numel() * b.buffer().element_size()) for b in buckets]


# -- DataParallel ----------------------------------------------------------------------------
def replicate_for_data_parallel(module: Any) -> Any:
    """A shallow replica of one module, as ``nn.parallel.replicate`` makes them
    (``Module._replicate_for_data_parallel``); the caller fills in children and parameters."""
    try:
        return module._replicate_for_data_parallel()
    except AttributeError as exc:
        raise _missing("torch.nn.Module._replicate_for_data_parallel", exc) from None


# -- FSDP2 -----------------------------------------------------------------------------------
def fsdp_default_comms() -> tuple[type, type] | None:
    """FSDP2's default all-gather and reduce-scatter classes, to subclass for recording; None where absent
    (older FSDP2 calls ``all_gather_into_tensor`` itself, which the recorder sees as is)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:
        return None
    return DefaultAllGather, DefaultReduceScatter


# -- pipelining ------------------------------------------------------------------------------
def wrap_pipeline_stage_init(schedule: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace the schedule's first-step stage initialisation (a shape exchange) by ``wrap(init)``.

    Returns False, changing nothing, where the schedule has no ``_initialize_stage`` (one stage per rank)
    or ``_initialize_stages`` (several): tagging is a nicety.
    """
    for name in ("_initialize_stage", "_initialize_stages"):
        init = getattr(schedule, name, None)
        if init is not None:
            setattr(schedule, name, wrap(init))
            return True
    return False


def pipeline_actions(schedule_cls: type, world: int, placement: list[list[int]], microbatches: int,
                     transfers: bool = False) -> dict[int, list[tuple[int, str, int]]]:
    """Each rank's compute actions, (stage, "F" | "B" | "I" | "W", micro-batch), in the order a multi-stage
    ``schedule_cls`` (``ScheduleInterleaved1F1B``, ...) runs them, without a process group: these build every
    rank's order (``pipeline_order``, of private ``_Action``s, the list their runtime executes) from the
    stages' indices and counts alone, so stand-ins holding those serve. ``placement[r]``: the stage indices
    rank r holds. Overlapped F+B actions are split into their parts (on a CPU they run one after the other).
    With ``transfers``: the transfers instead ("SEND_F" | "RECV_F" | "SEND_B" | "RECV_B", from the lowered
    ``pipeline_order_with_comms``), one per point-to-point op the rank posts, in its order.
    Not for the one-stage schedules: their ``pipeline_order`` is a drawing aid, not what they run."""
    from types import SimpleNamespace

    total = sum(len(p) for p in placement)

    def stand_in(index: int) -> SimpleNamespace:
        return SimpleNamespace(group_size=world, group_rank=0, num_stages=total, stage_index=index, submod=None,
                               is_first=index == 0, is_last=index == total - 1)

    kinds = ("SEND_F", "RECV_F", "SEND_B", "RECV_B") if transfers else ("F", "B", "I", "W")
    try:
        schedule = schedule_cls([stand_in(i) for i in placement[0]], n_microbatches=microbatches)
        order = schedule.pipeline_order_with_comms if transfers else schedule.pipeline_order
        out: dict[int, list[tuple[int, str, int]]] = {}
        for rank in range(world):
            parts = [sub for a in order[rank] if a is not None for sub in (a.sub_actions or (a,))]
            out[rank] = [(p.stage_index, p.computation_type.value, p.microbatch_index) for p in parts
                         if p.computation_type.value in kinds]
    except (AttributeError, KeyError, TypeError) as exc:
        raise _missing(f"{schedule_cls.__name__}.pipeline_order built from stage stand-ins", exc) from None
    return out


# -- RPC -------------------------------------------------------------------------------------
def is_rref(obj: Any) -> bool:
    """True for an RRef, local or received (``rpc.RRef`` subclasses the private ``PyRRef``)."""
    rref_type = getattr(getattr(torch._C, "_distributed_rpc", None), "PyRRef", None)
    return rref_type is not None and isinstance(obj, rref_type)


def on_rref_created(rref: Any, callback: Callable[[Any], None]) -> None:
    """Call ``callback`` once the owner confirms the RRef (``RRef._get_future``); nothing where absent."""
    with contextlib.suppress(Exception):
        rref._get_future().add_done_callback(callback)


def set_rpc_timeout(seconds: float) -> None:
    """The default timeout of every later RPC in this process (``rpc._set_rpc_timeout``)."""
    from torch.distributed import rpc

    try:
        rpc._set_rpc_timeout(seconds)
    except AttributeError as exc:
        raise _missing("torch.distributed.rpc._set_rpc_timeout", exc) from None


def tensorpipe_options(init_method: str, rpc_timeout_s: float) -> Any:
    """TensorPipe options with the ``uv`` transport and ``basic`` channel only (private keyword arguments):
    one listening socket per worker and no multiplexed lanes."""
    from torch.distributed import rpc

    try:
        return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=rpc_timeout_s,
                                               _transports=["uv"], _channels=["basic"])
    except TypeError as exc:
        raise _missing("TensorPipeRpcBackendOptions(_transports=, _channels=)", exc) from None


# -- functional collectives (DTensor) ---------------------------------------------------------
def process_group_size(group_name: str) -> int:
    """World size of the process group a functional collective names (``_resolve_process_group``); 0 if unknown."""
    import torch.distributed.distributed_c10d as c10d

    try:
        return int(c10d._resolve_process_group(group_name).size())
    except (AttributeError, RuntimeError, ValueError):
        return 0


def module_tracker() -> Any:
    """torch's ``ModTracker`` (``torch.distributed._tools``, what ``CommDebugMode`` uses): which modules
    are running, in forward and in backward. None where it is missing: events then name no module."""
    try:
        from torch.distributed._tools.mod_tracker import ModTracker
    except ImportError:
        return None
    return ModTracker()


# -- autograd --------------------------------------------------------------------------------
def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (``_current_graph_task_id``)."""
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError as exc:
        raise _missing("torch._C._current_graph_task_id", exc) from None


# -- Flight Recorder -------------------------------------------------------------------------
# torch reads the buffer size from the environment when a process group starts (0: Flight Recorder off).
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"


def flight_recorder_dump() -> dict[str, Any]:
    """This process's Flight Recorder buffer (``_dump_fr_trace``: the pickle torch's ``fr_trace`` reads):
    ``entries`` (one per collective, with its Python stack ``frames``), ``pg_config``, ``pg_status``, ``version``."""
    import pickle

    try:
        raw = torch._C._distributed_c10d._dump_fr_trace()
    except AttributeError as exc:
        raise _missing("torch._C._distributed_c10d._dump_fr_trace (Flight Recorder)", exc) from None
    return pickle.loads(raw)


def flight_recorder_json() -> dict[str, Any]:
    """The same buffer as JSON (``_dump_fr_trace_json``): no stack frames."""
    import json

    try:
        raw = torch._C._distributed_c10d._dump_fr_trace_json()
    except AttributeError as exc:
        raise _missing("torch._C._distributed_c10d._dump_fr_trace_json (Flight Recorder)", exc) from None
    return json.loads(raw)


def process_groups() -> dict[str, dict[str, str]]:
    """Every process group of this process as Flight Recorder's ``pg_config`` lists them: {name: {"name", "desc",
    "ranks"}}, ranks global, as text (``_world.pg_names``, ``pg_group_ranks``). gloo's own dump leaves
    ``pg_config`` empty in torch 2.13; torch's analyser needs it."""
    import torch.distributed.distributed_c10d as c10d

    try:
        world = c10d._world
        # A copy first: a dump on request runs in its own thread while the main thread may be making groups.
        return {str(name): {"name": str(name), "desc": str(getattr(pg, "group_desc", "") or ""),
                            "ranks": str(sorted(world.pg_group_ranks.get(pg, {})))}
                for pg, name in list(world.pg_names.items())}
    except (AttributeError, KeyError) as exc:
        raise _missing("torch.distributed.distributed_c10d._world (pg_names, pg_group_ranks)", exc) from None


def fr_trace_database(trace_dir: str) -> tuple[Any, list[str]]:
    """torch's Flight Recorder analyser (``torch.distributed.flight_recorder``, the ``fr_trace`` tool) on a folder
    of dumps named ``<prefix><rank>``: its database (``collectives``, each with ``pass_check``, ``missing_ranks``,
    ``type_of_mismatch``) and what it logged, line by line. Its errors propagate: they are its verdict."""
    import gc
    import logging

    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.extend(record.getMessage().splitlines())

    # Its logger prints to stderr (a handler its first import adds): its report is kept here instead.
    logger, keep = logging.getLogger("Flight Recorder"), _Keep()
    before, propagate, collecting = logger.handlers[:], logger.propagate, gc.isenabled()
    logger.handlers, logger.propagate, added = [keep], False, []
    try:
        from torch.distributed.flight_recorder.components import fr_logger

        fr_logger.FlightRecorderLogger()  # creates the logger's handler on first use
        added = [h for h in logger.handlers if h is not keep]
        logger.handlers = [keep]
        from torch.distributed.flight_recorder.components.builder import build_db
        from torch.distributed.flight_recorder.components.config_manager import JobConfig
        from torch.distributed.flight_recorder.components.loader import read_dir

        args = JobConfig().parse_args([trace_dir])
        details, version = read_dir(args)
        return build_db(details, args, version), lines
    except ImportError as exc:
        raise _missing("torch.distributed.flight_recorder (the fr_trace analyser)", exc) from None
    finally:
        logger.handlers, logger.propagate = before + added, propagate
        if collecting:  # its loader switches the garbage collector off (for speed) and leaves it off
            gc.enable()


def group_timeout(group: Any = None) -> Any:
    """The collective timeout of ``group`` (default: the default group) as a timedelta, from its backend's options
    (``ProcessGroup._get_backend(device).options._timeout``). ``new_group`` does not inherit it: without a
    ``timeout`` a new group waits torch's own default (30 minutes for gloo)."""
    import torch.distributed as dist

    pg = group if group is not None else default_group()
    device = torch.device("cuda" if dist.get_backend(pg) == "nccl" else "cpu")
    try:
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError) as exc:
        raise _missing("ProcessGroup._get_backend(device).options._timeout", exc) from None
