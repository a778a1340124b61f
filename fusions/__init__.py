"""Built-in fusions, one per file, each registered exactly as a plugin would.

Import order is registration order, the planner's tie-break among matches of
equal length.
"""

from fusions.forward_linear_bias import ForwardLinearBias
from fusions.forward_linear_bias_activation import ForwardLinearBiasActivation
from fusions.forward_linear_bias_add import ForwardLinearBiasAdd
from fusions.backward_activation_bias import BackwardActivationBias
from fusions.backward_linear_add import BackwardLinearAdd
from fusions.backward_linear_bias import BackwardLinearBias

__all__ = ["BackwardActivationBias", "BackwardLinearAdd", "BackwardLinearBias", "ForwardLinearBias",
           "ForwardLinearBiasActivation", "ForwardLinearBiasAdd"]
