# Shim (burn-tp) of nanotron/distributed.py: its wrappers of all_gather_into_tensor /
# reduce_scatter_tensor / get_rank forward to torch.distributed unchanged on torch >= 1.13.
#
# One difference from NCCL: gloo's flat collectives require `input.shape[0] * world ==
# output.shape[0]`, where NCCL only checks the element counts, and nanotron's sync column
# backward passes a 2-D [b*s, h] input with a 3-D [b/n, s, h] output. Both are contiguous, so
# viewing one as the other's shape (no copy) gives gloo the call NCCL would have run.
import torch.distributed as _dist
from torch.distributed import *  # noqa: F401,F403
from torch.distributed import Work  # noqa: F401
from torch.distributed.distributed_c10d import ProcessGroup  # noqa: F401
import torch.distributed.distributed_c10d as distributed_c10d  # noqa: F401


def _world(group):
    return (group or distributed_c10d._get_default_group()).size()


def reduce_scatter_tensor(output, input, op=_dist.ReduceOp.SUM, group=None, async_op=False):
    if input.shape[0] != output.shape[0] * _world(group):
        input = input.view(output.shape[0] * _world(group), *output.shape[1:])
    return _dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    if output_tensor.shape[0] != input_tensor.shape[0] * _world(group):
        output_tensor = output_tensor.view(input_tensor.shape[0] * _world(group), *input_tensor.shape[1:])
    return _dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
