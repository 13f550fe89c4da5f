"""The LoRA at a strength other than the trained one, for the duration of a block (``--sample_strengths``).

Strength ``s`` scales what the LoRA adds to each targeted layer's output by ``s``: 0 is the base model, 1 the LoRA
as trained, 0.5 half of it. For a plain LoRA that is ``W + s * scaling * B A`` (peft's ``scaling`` of each layer
times ``s``). For DoRA (``--lora_variant dora``) it is the same interpolation of the weight change,
``W + s * (W' - W)`` with ``W' = m * (W + scaling B A) / ||W + scaling B A||_row``: peft's DoRA layer adds
``W' x - W x`` to the base output, and that is what is scaled (the direction and the magnitude are not varied
apart). At 0 the layers add an exact zero, so the output is the base model's bit for bit.

Nothing of the module's parameters changes: each layer's ``scaling`` gets its exact value back and the hooks go,
even on error. Blocks compiled in place (``--compile``) run uncompiled inside the block, so no guard of a
compiled graph can keep the trained strength; their compiled forms are put back afterwards. torch and peft are
imported inside the function.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def lora_strength(model, strength: float):
    """``model``'s LoRA (or DoRA) layers at ``strength`` inside the block; exactly as they were after it."""
    if strength == 1:
        yield
        return
    from peft.tuners.lora.layer import LoraLayer

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    scalings = [(layer, dict(layer.scaling)) for layer in layers]
    compiled = [(module, module._compiled_call_impl) for module in model.modules()
                if getattr(module, "_compiled_call_impl", None) is not None]
    hooks = []

    def scaled(_module, _inputs, output):
        return output * strength

    try:
        for module, _ in compiled:
            module._compiled_call_impl = None
        for layer in layers:
            for name in layer.scaling:
                if name in layer.lora_magnitude_vector:   # DoRA: the weight change its layer adds, scaled
                    hooks.append(layer.lora_magnitude_vector[name].register_forward_hook(scaled))
                else:
                    layer.scaling[name] = layer.scaling[name] * strength
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for layer, saved in scalings:
            layer.scaling.update(saved)
        for module, call in compiled:
            module._compiled_call_impl = call
