"""Testing helpers for fusible and for plugin authors.

* :func:`exact_tensor` draws values every float dtype represents exactly, so
  that an FP64 reference sees the very inputs the op under test saw.
* :func:`reference_forward` runs any Sequential with plain differentiable
  PyTorch in float64, op by op, from each op's ``reference()`` (or one registered
  with :func:`register_reference`).
* :func:`check_against_reference` compares outputs and every gradient with
  that reference; :func:`check_fusion` also asserts which fusions the plan chose,
  compiles the model (bitwise against eager) and opchecks its custom ops.
* ``fusible.testing.matrix`` enumerates every op's and fusion's ``example()``;
  ``fusible.testing.distributed.run_distributed`` runs a function on spawned ranks.
"""

from fusible.testing.checks import (TOLERANCE, assert_close, check_against_reference,
                                    check_compiled_matches_eager, check_fusion,
                                    check_split_matches_unsplit, opcheck,
                                    opcheck_stages, recorded_stage_calls, same_bits, stage_names)
from fusible.testing.fp8 import fp8_snr_floor, snr_db
from fusible.testing.reference import (FP8Emulation, Rounding, exact_parameters_, exact_tensor,
                                       reference_forward, register_reference)

__all__ = ["FP8Emulation", "Rounding", "TOLERANCE", "assert_close", "check_against_reference",
           "check_compiled_matches_eager", "check_fusion", "check_split_matches_unsplit",
           "exact_parameters_", "exact_tensor",
           "fp8_snr_floor", "opcheck", "opcheck_stages", "recorded_stage_calls",
           "reference_forward", "register_reference", "same_bits", "snr_db", "stage_names"]
