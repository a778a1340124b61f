"""The built-in layer converters, one file each, registered in this order (see
:class:`fusible.models.layer_converter.LayerConverter`)."""

from fusible.models.layer_converter import register_layer_converter
from fusible.models.layer_converters.bert import BertLayers
from fusible.models.layer_converters.gemma import GemmaLayers
from fusible.models.layer_converters.gpt2 import GPT2Layers
from fusible.models.layer_converters.gpt_neox import GPTNeoXLayers
from fusible.models.layer_converters.llama import LlamaLayers
from fusible.models.layer_converters.nanogpt import NanoGPTLayers
from fusible.models.layer_converters.phi3 import Phi3Layers
from fusible.models.layer_converters.torchtitan import TorchTitanLayers

for _converter in (LlamaLayers(), GemmaLayers(), Phi3Layers(), GPTNeoXLayers(), GPT2Layers(),
                   BertLayers(), NanoGPTLayers(), TorchTitanLayers()):
    register_layer_converter(_converter)
