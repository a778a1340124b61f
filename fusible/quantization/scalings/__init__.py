"""Scalings, the plugin point behind a format's granularity: the base and its registry
(``base.py``), and a file per built-in family: one scale per tensor (``tensor.py``), per
row (``row.py``), per block or MX tile (``block.py``), per tensor from an amax history
(``delayed.py``, registered per configuration when a recipe first asks for it).

Importing the package registers the built-in scalings, in this order: ``scaling_of``
takes the first that describes a tensor's scales, and a row's scale is also a 1x128
tile's where a row holds at most 128 values.
"""

from fusible.quantization.scalings.base import register_scaling
from fusible.quantization.scalings.block import (Block128x128Scaling, MX1x32Scaling,
                                                 Tile1x128Scaling)
from fusible.quantization.scalings.row import RowScaling
from fusible.quantization.scalings.tensor import TensorScaling

for _scaling in (TensorScaling(), RowScaling(), Tile1x128Scaling(), Block128x128Scaling(),
                 MX1x32Scaling()):
    register_scaling(_scaling)
