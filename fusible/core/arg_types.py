"""Type aliases of the public constructors' arguments (fusible ships ``py.typed``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

#: Where parameters are created, as ``torch.nn`` layers take it.
DeviceArg = Optional[Union[torch.device, str, int]]
#: The parameters' dtype (None: the default dtype).
DTypeArg = Optional[torch.dtype]
#: A process group, or a one-dimensional DeviceMesh (``mesh["tp"]``); None: the default group.
GroupArg = Optional[Union["ProcessGroup", "DeviceMesh"]]
#: A tensor-parallel split: ``"column"``, ``"row"``, or None (not split).
ParallelModeArg = Optional[str]
#: A norm's ``normalized_shape``, as ``torch.nn.LayerNorm`` takes it.
ShapeArg = Union[int, Sequence[int]]
