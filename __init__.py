"""Carnator: cross-request trajectory reuse for text-to-video models, as ComfyUI custom nodes.

ComfyUI imports this file as a package named after the plugin's folder. The nodes and the web routes
import the engine as the top-level package `carnator_engine` (one module identity for both), so the
plugin folder goes on sys.path; it is appended, so ComfyUI's own top-level modules (its `nodes.py`)
always win over this plugin's `nodes/` package, which is only ever imported relatively.
"""
import logging
import os
import sys

_PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))
if _PLUGIN_DIR not in sys.path:
    sys.path.append(_PLUGIN_DIR)

WEB_DIRECTORY = "./web"

# pytest imports this file as a plain top-level module (no parent package) when the checkout's folder
# name is not a Python identifier; there is no plugin to register then.
if __package__:
    try:
        from .nodes import routes  # noqa: F401,E402  (the cache browser's HTTP routes)
    except Exception as error:  # the nodes work without the browser: never block them on it
        logging.getLogger("carnator").warning("carnator: web routes not loaded: %s", error)


def comfy_entrypoint():
    """ComfyUI's entry point for nodes on its versioned (V3) API: the loader asks the extension for its nodes.
    The node module is imported here, not at import time, so that the package imports without ComfyUI's API."""
    from .nodes.carnator_nodes import CarnatorExtension
    return CarnatorExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
