"""The pack's node list for ComfyUI's V3 node API (imported when ComfyUI calls comfy_entrypoint)."""

from comfy_api.latest import ComfyExtension, io

from .backend_node import XDiTBackend
from .control import XDiTControlNet, XDiTDiffSynthControlNet, XDiTZImageFunControlNet
from .loader import XDiTLoadDiffusionModel, XDiTLoraLoader, XDiTStandInConditioning
from .ltx2_guidance import XDiTLTX2Guidance
from .parallel_config import XDiTParallelConfig
from .remote_model import XDiTModelNode
from .sampler import XDiTSampler, XDiTSamplerAdvanced
from .step_cache import XDiTStepCache

NODES = [XDiTLoadDiffusionModel, XDiTLoraLoader, XDiTControlNet, XDiTDiffSynthControlNet, XDiTZImageFunControlNet,
         XDiTStepCache, XDiTLTX2Guidance,
         XDiTParallelConfig,
         XDiTSampler, XDiTSamplerAdvanced, XDiTModelNode, XDiTBackend, XDiTStandInConditioning]


class XDiTExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES
