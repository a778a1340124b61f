"""The Float8Tensor: the class (``float8_tensor.py``), its op table (``ops.py``), the
functions that quantize into it (``quantize.py``), ``fusible.quantize`` (``autograd.py``)
and how it crosses custom-op boundaries (``boundary.py``).

The op table and the quantize functions build Float8Tensors, so they import the class;
the class calls them through the hooks set here, which every import of a module of this
package runs first.
"""

from fusible.quantization.tensor import ops, quantize
from fusible.quantization.tensor.float8_tensor import Float8Tensor, Hooks

Float8Tensor._hooks = Hooks(ops.dispatch, quantize.requantize, quantize.quantize_raw)
