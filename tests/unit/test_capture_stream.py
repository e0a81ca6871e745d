"""LoKA's CUDA-graph captures and their warm-ups run on one side stream per device
(``utils.capture.capture_stream``): PyTorch keeps a cuBLAS workspace per stream for the life of
the process, so a fresh stream per capture would keep one more allocated at every capture. The streams
themselves need CUDA; here a stand-in counts them, and the capture code is checked to ask for
the shared stream."""

from __future__ import annotations

import pytest
import torch

from loka_train.probe import measurement
from loka_train.runtime import graph_capture
from loka_train.utils import capture


class _FakeStream:
    made: list[int] = []

    def __init__(self, device: int) -> None:
        self.device = device
        _FakeStream.made.append(device)


@pytest.fixture
def fake_streams(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    _FakeStream.made = []
    monkeypatch.setattr(capture, "_capture_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    return _FakeStream.made


def test_one_capture_stream_per_device(fake_streams: list[int]) -> None:
    current = capture.capture_stream()  # the current device: 1
    assert capture.capture_stream() is current
    assert capture.capture_stream(torch.device("cuda")) is current  # no index: the current device
    assert capture.capture_stream("cuda:1") is current and capture.capture_stream(1) is current
    first = capture.capture_stream(torch.device("cuda", 0))
    assert first is not current and capture.capture_stream("cuda:0") is first and capture.capture_stream(0) is first
    assert fake_streams == [1, 0]


class _Asked(Exception):
    pass


def _ask(monkeypatch: pytest.MonkeyPatch, module: object) -> list[object]:
    asked: list[object] = []

    def stream(device: object = None) -> object:
        asked.append(device)
        raise _Asked

    monkeypatch.setattr(module, "capture_stream", stream)
    return asked


def test_the_dense_graphs_capture_on_the_shared_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _ask(monkeypatch, graph_capture)
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(_Asked):
        graph_capture.capture_cuda_graphs(lambda ps, x: lin(x), (torch.randn(2, 4),), tuple(lin.parameters()))
    assert asked == [None]


def test_the_probe_s_measurement_graphs_warm_up_on_the_shared_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _ask(monkeypatch, measurement)
    graphs = measurement.CudaGraphs(lambda role, *ops: (ops[0].sum(), ops[0].amax()), max_graphs=4)
    x = torch.randn(3, 5)
    with pytest.raises(_Asked):
        graphs._capture("forward", (x, x))
    assert asked == [x.device]
