"""Example: a small pipeline that exercises one op or one fusion, for the test matrices."""

from __future__ import annotations

import attrs


@attrs.frozen
class Example:
    """What an op's or a fusion's ``example()`` returns; ``fusible.testing`` runs it eagerly
    against the FP64 reference, compiled (bitwise against eager), through ``opcheck`` and
    under FP8.

    Attributes
    ----------
    ops : tuple
        The pipeline's operations (float32, on the CPU; the tests convert them).
    input_shape : tuple of int
        The input's shape (exactly representable values are drawn for it).
    extra_input_shapes : tuple of tuple
        Shapes of the extra inputs, in order.
    extra_input_values : tuple of Tensor
        Extra inputs given as they are, after those of ``extra_input_shapes`` (integer
        tensors such as GroupedLinear's split sizes; moved to the device, never
        converted or differentiated).
    input_requires_grad : bool
        Whether the input and extra inputs require grad.
    frozen : tuple of int
        Positions (in ``ops``) of operations whose parameters do not require grad.
    fp8 : bool
        Whether the example runs under an FP8 recipe (sizes divisible by 16) with the
        same stage chosen.
    fp8_recipes : tuple of str
        The names of the recipes under which the stage is chosen (its ``accepts`` refusing
        the others, the ops then running as their own stages); empty: every recipe.
    """

    ops: tuple
    input_shape: tuple
    extra_input_shapes: tuple = ()
    extra_input_values: tuple = ()
    input_requires_grad: bool = True
    frozen: tuple = ()
    fp8: bool = True
    fp8_recipes: tuple = ()
