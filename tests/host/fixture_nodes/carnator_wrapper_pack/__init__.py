"""A test-only custom-node pack: wrappers on the diffusion model, as a third-party pack writes them. The model-key
tests install it at several paths with ComfyUI's own custom-node loader and call its nodes directly."""
from .wrappers import ScaleOutput, ShiftOutput

NODE_CLASS_MAPPINGS = {}    # nothing registered with the host: the tests call the classes
__all__ = ["NODE_CLASS_MAPPINGS", "ScaleOutput", "ShiftOutput"]
