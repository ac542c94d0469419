"""The GPU ceilings behind the benchmarks' floors: the known ones by GPU name, a measurement otherwise."""
import pytest
import torch

from epmoe.bench import ceilings


def test_a_known_gpu_takes_its_measured_ceilings_and_another_is_measured(monkeypatch):
    names = {0: "NVIDIA H200", 1: "a GPU no table lists"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[device.index])
    measured = []

    def fake_measure(device):
        measured.append(device.index)
        return ceilings.Ceilings(bf16_tflops=1.0, fp8_tflops=2.0, copy_tbps=3.0, source="stub")
    monkeypatch.setattr(ceilings, "measure", fake_measure)
    monkeypatch.setattr(ceilings, "_measured", ceilings.functools.cache(ceilings._measured.__wrapped__))
    assert ceilings.device_ceilings(torch.device("cuda", 0)) == ceilings.H200
    other = ceilings.device_ceilings(torch.device("cuda", 1))
    assert (other.bf16_tflops, other.fp8_tflops, other.copy_tbps) == (1.0, 2.0, 3.0)
    assert ceilings.device_ceilings(torch.device("cuda", 1)) is other and measured == [1]  # once a process
    assert (ceilings.H200.tflops(False), ceilings.H200.tflops(True)) == (686.0, 1276.0)
    assert ceilings.device_name(torch.device("cuda", 1)) == "a GPU no table lists"
    assert ceilings.device_name(torch.device("cpu")) == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_the_command_needs_a_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        ceilings.main([])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_measured_ceilings_match_the_known_ones_of_this_gpu():
    """The probes measure plausible numbers (Hopper-class: hundreds of TFLOP/s, TB/s); on a GPU `KNOWN`
    lists by `measure`, within 10% of its entry, so that the committed ceilings hold on the machines that
    run the tests."""
    dev = torch.device("cuda", torch.cuda.current_device())
    got = ceilings.measure(dev)
    assert got.bf16_tflops > 50 and got.fp8_tflops > got.bf16_tflops and got.copy_tbps > 0.5, got
    known = ceilings.KNOWN.get(torch.cuda.get_device_name(dev))
    if known is not None and known.by_measure:
        for field in ("bf16_tflops", "fp8_tflops", "copy_tbps"):
            assert getattr(got, field) == pytest.approx(getattr(known, field), rel=0.10), (field, got, known)
