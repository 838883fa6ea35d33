"""Carnator's ComfyUI nodes (V1 API) and the cache registry they share with the web routes."""
from .carnator_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
