"""Two wrappers on the diffusion model: one scales its output, the other shifts it."""


def _wrapped(model, wrapper):
    from comfy.patcher_extension import WrappersMP
    model = model.clone()
    model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "carnator_wrapper_pack", wrapper)
    return (model,)


class ScaleOutput:
    def patch(self, model, strength: float):
        def scaled(executor, *args, **kwargs):
            return executor(*args, **kwargs) * strength
        return _wrapped(model, scaled)


class ShiftOutput:
    def patch(self, model, strength: float):
        def shifted(executor, *args, **kwargs):
            return executor(*args, **kwargs) + strength
        return _wrapped(model, shifted)
