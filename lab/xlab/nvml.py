"""GPU utilisation over a time window, sampled by NVML in a background thread.

    with UtilSampler([0, 1]) as s:
        ...                               # the timed steps
    s.means                               # {0: 97.1, 1: 96.4}: mean % per CUDA device (NaN without NVML)
"""
from __future__ import annotations

import math
import threading


def nvml_reader(devices):
    """A function giving {device: utilisation %} of these CUDA devices (by PCI bus id), or None without NVML."""
    try:
        import pynvml
        from cupy.cuda import runtime
        pynvml.nvmlInit()
        handles = {d: pynvml.nvmlDeviceGetHandleByPciBusId(runtime.deviceGetPCIBusId(d)) for d in devices}
    except Exception:
        return None
    return lambda: {d: float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) for d, h in handles.items()}


class UtilSampler:
    """Reads `read()` every `interval` seconds between start() and stop(); `means` is the mean per device."""

    def __init__(self, devices, interval: float = 0.025, read=None):
        self.devices = list(devices)
        self.interval = interval
        self._read = read if read is not None else nvml_reader(self.devices)
        self.means = {}
        self._samples, self._stop, self._thread = [], threading.Event(), None

    def start(self) -> "UtilSampler":
        self._samples, self.means = [], {}
        if self._read is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, daemon=True, name="nvml-sampler")
            self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(self.interval):
            self._samples.append(self._read())

    def stop(self) -> dict:
        """Stop sampling; {device: mean %} over the window (NaN for every device without NVML)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            if not self._samples:            # a window shorter than one interval: read once
                self._samples.append(self._read())
        self.means = {d: sum(s[d] for s in self._samples) / len(self._samples) if self._samples else math.nan
                      for d in self.devices}
        return self.means

    __enter__ = start

    def __exit__(self, *exc):
        self.stop()
