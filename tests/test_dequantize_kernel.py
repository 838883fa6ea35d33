"""The Triton kernel that dequantizes 8-bit kept keys and values (kernels.dequantize, CarnatorConfig.region_kv_triton):
the layouts it takes, its values against torch's multiply (on the CPU through Triton's interpreter; bit for bit on a
GPU), the fall back to torch where it cannot run, and the setting's validation."""
import os
import subprocess
import sys

import pytest
import torch

from carnator_engine.kept_kv import KeptKeysValues, dequantize_rows, quantize_rows
from carnator_engine.kernels import dequantize as kernel
from carnator_engine.pipeline import CarnatorConfig
from test_kept_kv import FakeMemory
from test_kept_kv_8bit import _token_major

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_it_takes_rows_whose_scales_follow_the_values_memory_order():
    pytest.importorskip("triton")
    values, scales = quantize_rows(_token_major())         # a [B, L, heads x D] projection seen as [B, heads, L, D]
    assert kernel.supports(values, scales)
    assert kernel.supports(*quantize_rows(torch.randn(2, 3, 9, 16)))              # and a contiguous one
    assert not kernel.supports(values, scales.contiguous())                     # its scales in another row order
    assert not kernel.supports(values.float(), scales)                          # not 8-bit values
    assert not kernel.supports(values[..., ::2], scales)                        # rows with gaps
    assert not kernel.supports(values, scales[..., :1, :].expand_as(scales))    # one scale seen many times


INTERPRETED = """
import torch
from carnator_engine.kept_kv import dequantize_rows, empty_in_layout, quantize_rows
from carnator_engine.kernels import dequantize as kernel
from test_kept_kv_8bit import _token_major
for dim in (16, 24):          # a power of two, and a width the kernel masks
    x = _token_major(tokens=37, dim=dim, seed=dim)
    values, scales = quantize_rows(x)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = empty_in_layout(values, dtype)
        assert kernel.dequantize_rows(values, scales, out)
        reference = dequantize_rows(values, scales, dtype)
        assert out.stride() == reference.stride()
        if dtype == torch.bfloat16:   # the interpreter truncates float32 to bfloat16 (a GPU rounds to nearest even)
            step = reference.float().abs() * 2 ** -7
            assert bool(((out.float() - reference.float()).abs() <= step).all()), dtype
        else:
            assert torch.equal(out, reference), dtype
print("same")
"""


def test_through_tritons_interpreter_it_computes_torchs_values():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "same" in run.stdout, run.stderr[-3000:]


def test_where_the_kernel_cannot_run_torch_dequantizes_and_the_log_says_so(monkeypatch, caplog):
    pytest.importorskip("triton")

    class Broken:
        def __getitem__(self, grid):
            def launch(*args):
                raise RuntimeError("no compiler for this GPU")
            return launch
    monkeypatch.setattr(kernel, "_kernel", lambda: Broken())
    monkeypatch.setattr(kernel, "_failed", [])
    values, scales = quantize_rows(_token_major())
    assert kernel.supports(values, scales)
    with caplog.at_level("WARNING", logger="carnator"):
        assert not kernel.dequantize_rows(values, scales, torch.empty_like(values, dtype=torch.float32))
    assert "no compiler for this GPU" in caplog.text and "torch dequantizes instead" in caplog.text
    assert not kernel.supports(values, scales)                    # once failed, never tried again in this process


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_a_gpu_it_equals_torch_bit_for_bit_and_a_hit_streams_through_it(dtype):
    pytest.importorskip("triton")
    x = _token_major(tokens=1000, heads=12, dim=128).to("cuda", dtype)
    values, scales = quantize_rows(x)
    assert kernel.supports(values, scales)
    fast = dequantize_rows(values, scales, dtype, kernel=True)
    assert torch.equal(fast, dequantize_rows(values, scales, dtype)) and fast.stride() == x.stride()
    fetched = []
    for on in (False, True):
        kept = KeptKeysValues(FakeMemory(reading=None), eight_bit=True, kernel=on)
        assert kept.capture((0, 0), x, -x) is None and kept.plan(0.1) is None
        fetched.append(kept.fetch((0, 0)))
    assert all(torch.equal(a, b) for a, b in zip(*fetched))


def test_region_kv_triton_is_validated_with_the_fix():
    with pytest.raises(ValueError, match="region_kv_triton must be True or False"):
        CarnatorConfig(region_kv_triton="on").validate(10)
