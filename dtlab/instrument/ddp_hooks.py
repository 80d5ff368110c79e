"""DDP comm hooks that record each bucket's reduction.

What never passes through Python -- DDP's reducer -- is seen through a comm
hook: ``allreduce_hook`` is DDP's default reduction, recorded; ``recording_hook``
wraps a library hook (fp16, PowerSGD) so that its buckets are recorded too.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d

from dtlab.core.comm import END, TAG
from dtlab.core.compat import default_group
from dtlab.instrument.calls import dtype_name, tensor_nbytes
from dtlab.instrument.recorder import active, group_size


# -- DDP ---------------------------------------------------------------------------
def recording_hook(inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wrap a DDP comm hook so that each bucket's reduction is recorded.

    The collectives the inner hook issues are recorded by the wrappers above and
    tagged with the bucket index; a hook that issues none through Python still
    leaves one event per bucket.
    """

    @functools.wraps(inner)
    def hook(state: Any, bucket: Any) -> Any:
        rec = active()
        if rec is None:
            return inner(state, bucket)
        before = len(rec.events)
        start = rec.now()
        previous, rec.tag = rec.tag, f"ddp_bucket:{bucket.index()}"
        try:
            fut = inner(state, bucket)
        finally:
            rec.tag = previous
        if len(rec.events) == before:
            buf = bucket.buffer()
            size = group_size(getattr(state, "process_group", state))
            ev = rec.add("all_reduce", tensor_nbytes(buf), dtype_name(buf), size, None, start, None, True)
            ev[TAG] = f"ddp_bucket:{bucket.index()}"

            def done(_fut: Any) -> None:
                ev[END] = time.perf_counter()

            fut.add_done_callback(done)
        return fut

    return hook


def allreduce_hook(process_group, bucket):  # noqa: ANN001, ANN201 - DDP rejects string annotations here
    """DDP's default reduction (divide by the world size, all-reduce), recorded cheaply.

    Same arithmetic as ``default_hooks.allreduce_hook``, but the one Python
    callback on the future both unwraps the result and stamps the bucket's end
    time, where wrapping the default hook would add a second callback per bucket.
    """
    rec = active()
    buf = bucket.buffer()
    group = process_group if process_group is not None else default_group()
    buf.div_(group.size())
    all_reduce = getattr(c10d.all_reduce, "__dtlab_original__", c10d.all_reduce)  # recorded here, not twice
    start = rec.now() if rec is not None else 0.0
    work = all_reduce(buf, group=group, async_op=True)
    if rec is None:
        return work.get_future().then(lambda fut: fut.value()[0])
    ev = rec.add("all_reduce", tensor_nbytes(buf), dtype_name(buf), group.size(), None, start, None, True)
    ev[TAG] = f"ddp_bucket:{bucket.index()}"

    def done(fut: Any) -> torch.Tensor:
        ev[END] = time.perf_counter()
        return fut.value()[0]

    return work.get_future().then(done)
