"""Whether ``--compile auto|on|off`` compiles the DiT blocks on this machine. Pure: no torch import.

``auto`` compiles on a CUDA GPU that torch's own Triton check accepts (compute capability 7.0 or newer with a
Triton build for NVIDIA), and never on the CPU, where compiling costs the demo and the tests more than it
gives back. The V100 path was checked as far as it can be without one: torch 2.10.0 (requirements-volta.txt)
requires triton 3.6.0, torch's check accepts capability 7.0, and the ptxas triton 3.6.0 ships (CUDA 12.8)
assembles sm_70 code; the first compiled steps on a real V100 are the remaining proof. ``on`` compiles wherever torch can (the CPU too, through its C++
backend); ``off`` never does. When a compile fails in the first step the training says so once and runs the
blocks uncompiled (``blocks.BlockRunner.give_up_compiling``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompileDecision:
    compile: bool
    reason: str


def decide_compile(choice: str, cuda: bool, capability: tuple[int, int] | None, triton_ok: bool) -> CompileDecision:
    """``choice``: auto|on|off; ``cuda``: training on a CUDA GPU; ``triton_ok``: torch's Triton check passed."""
    if choice == "off":
        return CompileDecision(False, "--compile off")
    if choice == "on":
        if cuda and not triton_ok:
            return CompileDecision(False, f"--compile on, but torch has no Triton backend for this GPU "
                                          f"(sm_{_arch(capability)}): running the blocks uncompiled")
        return CompileDecision(True, "--compile on" + ("" if cuda else " (CPU: torch's C++ backend)"))
    if choice != "auto":
        raise ValueError(f"--compile must be auto, on or off, got {choice!r}")
    if not cuda:
        return CompileDecision(False, "--compile auto: off on the CPU (compiling costs a small run more than it gives)")
    if not triton_ok:
        return CompileDecision(False, f"--compile auto: torch cannot compile for this GPU (sm_{_arch(capability)}, "
                                      "no Triton backend): running the blocks uncompiled")
    return CompileDecision(True, f"--compile auto: each DiT block compiled for sm_{_arch(capability)} "
                                 "(the first steps take longer while it compiles)")


def _arch(capability) -> str:
    return "?" if not capability else f"{capability[0]}{capability[1]}"
