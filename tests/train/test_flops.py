"""The device peak that MFU divides by: a known GPU's dense bf16 figure, the configured one first."""

import pytest
import torch

from megaloop.train.flops import device_peak_tflops


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0),
                                        ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 0.0)])
def test_known_gpus_peak(monkeypatch, name, peak):
    """Every H100 counted as the SXM part's 989 TFLOP/s: PCIe (756) and NVL (835) runs under-reported MFU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert device_peak_tflops(0.0) == peak
    assert device_peak_tflops(123.0) == 123.0


def test_no_gpu_no_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_peak_tflops(0.0) == 0.0
