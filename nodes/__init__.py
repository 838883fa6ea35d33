"""Carnator's ComfyUI nodes (carnator_nodes, on ComfyUI's V3 node API), the cache registry they share with the web
routes (stores) and those routes (routes). Nothing is imported here: the routes and the stores import without
ComfyUI's node API, the nodes only inside ComfyUI (the plugin's comfy_entrypoint)."""
