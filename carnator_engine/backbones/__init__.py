"""Backbone layouts of the supported video DiTs, and the project's own tiny reference DiT."""
from .base import BackboneLayout

# Patch sizes from the published architectures (ComfyUI's comfy/ldm/* model classes agree).
WAN21 = BackboneLayout("wan2.1", latent_channels=16, patch_size=(1, 2, 2))
WAN22_5B = BackboneLayout("wan2.2-ti2v-5b", latent_channels=48, patch_size=(1, 2, 2))
HUNYUAN_VIDEO = BackboneLayout("hunyuan-video", latent_channels=16, patch_size=(1, 2, 2))
LTX_VIDEO = BackboneLayout("ltx-video", latent_channels=128, patch_size=(1, 1, 1))

__all__ = ["BackboneLayout", "WAN21", "WAN22_5B", "HUNYUAN_VIDEO", "LTX_VIDEO"]
