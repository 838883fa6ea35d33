"""The engine side of a generation: what a backbone reports while it denoises, and how it attends.

A runner (the engine's own Euler loop, or ComfyUI's samplers through wrappers) calls
`begin_step` before each model evaluation and `step_end` after it; a backbone adapter calls
`block_output` after each transformer block and routes its self-attention through
`self_attention`. Each optional part records or changes one thing, so a phase of the pipeline
builds the observer it needs (probe: signature; miss: checkpoints + connectivity; hit:
checkpoints + sparse attention).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


class CheckpointRecorder:
    """Keeps the latent *entering* each chosen step, on the CPU in fp16 (VRAM stays free).

    From a GPU the copy is queued on the stream into pinned memory and not waited for (a blocking copy would stall
    the sampler at every kept step: part of a miss's cost over plain sampling); `latents` waits for the copies."""

    def __init__(self, steps: frozenset):
        self.steps = steps
        self._latents: dict = {}
        self._pending = []          # CUDA events after copies not yet waited for

    @property
    def latents(self) -> dict:
        for event in self._pending:
            event.synchronize()
        self._pending.clear()
        return self._latents

    def record(self, step: int, x: torch.Tensor) -> None:
        if step not in self.steps:
            return
        half = x.detach().to(torch.float16)
        if not half.is_cuda:
            self._latents[step] = half.to("cpu")
            return
        host = torch.empty(half.shape, dtype=half.dtype, pin_memory=True)
        host.copy_(half, non_blocking=True)    # stream-ordered: later in-place writes to x come after it
        event = torch.cuda.Event()
        event.record()
        self._pending.append(event)
        self._latents[step] = host


@dataclass
class GenerationObserver:
    signature: Optional[object] = None      # signature.SignatureRecorder
    connectivity: Optional[object] = None   # connectivity.ConnectivityRecorder
    checkpoints: Optional[CheckpointRecorder] = None
    sparse: Optional[object] = None         # sparse_attention.BlockSparseAttention
    region: Optional[object] = None         # region.RegionTokens: a region-only resume's tokens
    step: int = -1
    steps_run: int = 0                      # sampler steps evaluated (a step cache may answer some itself)
    forwards: int = 0                       # diffusion model forwards, as runners that count them report
    step_cache_skipped: int = 0             # steps a step cache (EasyCache) answered without a forward
    last_denoised: Optional[torch.Tensor] = None

    def begin_step(self, step: int, x: torch.Tensor) -> None:
        self.step = step
        self.steps_run += 1
        if self.region is not None:
            self.region.begin_step(step)
        if self.checkpoints is not None:
            self.checkpoints.record(step, x)

    def forward(self) -> None:
        self.forwards += 1
        if self.region is not None:
            self.region.forward()

    def block_output(self, block_index: int, hidden: torch.Tensor) -> None:
        if self.signature is not None:
            self.signature.block_output(self.step, block_index, hidden)

    def self_attention(self, block_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       dense: AttentionFn = dense_attention, video_tokens: Optional[int] = None,
                       host_sdpa: bool = False) -> torch.Tensor:
        """q, k, v: [B, heads, L, D], tokens frame-major. Returns [B, heads, L, D]. With `video_tokens`, the
        attention is joint (HunyuanVideo): the first video_tokens are the video, the rest text; the signature
        and the connectivity read the video-video part, and sparse attention keeps the text rows and columns dense.
        `host_sdpa`: `dense` is torch's SDPA (no other kernel chosen), so a region step may run another exact one."""
        video_q, video_k = (q, k) if video_tokens is None else (q[:, :, :video_tokens], k[:, :, :video_tokens])
        if self.signature is not None:
            self.signature.self_attention(self.step, block_index, video_q, video_k)
        if self.connectivity is not None:
            self.connectivity.self_attention(self.step, block_index, video_q, video_k)
        if self.region is not None:
            if self.region.active:     # target queries over the kept keys: the cached plan is for whole-clip steps
                return self.region.attend(block_index, q, k, v, dense, host_sdpa)
            k, v = self.region.attention_inputs(block_index, q, k, v)
        if self.sparse is not None and block_index in self.sparse.connectivities:
            return self.sparse.attend(block_index, q, k, v, video_tokens=video_tokens)
        return dense(q, k, v)

    def step_end(self, step: int, x_next: torch.Tensor, denoised: torch.Tensor) -> None:
        self.last_denoised = denoised
        if self.signature is not None:
            self.signature.denoised(step, denoised)
