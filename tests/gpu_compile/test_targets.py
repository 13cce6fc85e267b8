"""The shipped GPU targets parse with the installed jaxlib, state what their datasheets say, and
give compile-only devices; bad fleet names are refused before anything compiles."""

import pytest

from jaxcolossal.aot import target
from jaxcolossal.aot.confirm import TARGET_OF
from jaxcolossal.aot.fleet import check_fleet
from jaxcolossal.aot.target import get_target
from jaxcolossal.config import ConfigError, load_config
from jaxcolossal.plan.devices import DEVICES

DATASHEET = {  # name: (SMs, HBM GiB rounded, HBM TB/s, bf16 dense TFLOP/s, compute capability)
    "h100": (132, 79, 3.35, 989, "9.0"),
    "h200": (132, 141, 4.8, 989, "9.0"),
    "b200": (148, 178, 8.0, 2250, "10.0"),
    "a100": (108, 79, 2.039, 312, "8.0"),
}


@pytest.mark.parametrize("name", sorted(target.TARGETS))
def test_each_target_parses_with_this_jaxlib_and_states_its_datasheet(name):
    t = target.get_target(name)
    devices = target.compile_only_devices(t, 2, 2)  # the plugin parses the file (it refuses unknown fields)
    assert len(devices) == 2 and devices[0].platform == "gpu"
    assert devices[0].device_kind == t.description
    sms, hbm, bw, peak, cc = DATASHEET[name]
    assert (t.sm_count, round(t.hbm_bytes / 2**30), round(t.hbm_bw / 1e12, 3), round(t.peak_bf16 / 1e12),
            t.compute_capability) == (sms, hbm, bw, peak, cc)
    assert t.cuda_runtime.startswith("12.") and t.cudnn.startswith("9.")


def test_a_fleet_spans_hosts_of_eight():
    devices = target.compile_only_devices("h200", 16)
    assert len(devices) == 16
    assert [d.process_index for d in devices] == [0] * 8 + [1] * 8
    assert target.parse_fleet("H200x16")[1] == 16 and target.parse_fleet("a100_80gb")[1] == 8
    assert target.topology(16, 8) == "1x2x8" and target.topology(4, 8) == "1x1x4"


@pytest.mark.parametrize("fleet, message", [
    ("h300x8", "unknown GPU target 'h300'; known: a100, b200, h100, h200"),
    ("h200 x 8", "expected NAMExCOUNT"),
    ("h200x0", "at least 1"),
])
def test_bad_fleet_names_are_refused(fleet, message):
    with pytest.raises(ValueError, match=message):
        target.parse_fleet(fleet)


def test_a_layout_that_does_not_fit_the_device_count_is_refused_before_compiling():
    cfg = load_config("configs/llama_tiny.yaml", ["parallel.data_parallel_size=4"])  # 4 x tp 2 = 8 devices
    with pytest.raises(ConfigError, match="16"):
        check_fleet(cfg, 16, 8)
    with pytest.raises(ConfigError, match="do not split into hosts of 8"):
        check_fleet(cfg, 12, 8)


def test_the_planners_devices_are_the_compilers_targets():
    """The planner's ``--device`` table and the GPU compiler's targets describe the same GPUs with
    the same HBM bytes and bf16 peak (the planner's 90% rule and ``--confirm``'s agree)."""
    for name, target_name in TARGET_OF.items():
        device, tgt = DEVICES[name], get_target(target_name)
        assert device.memory == tgt.hbm_bytes, name
        assert abs(device.peak - tgt.peak_bf16) / tgt.peak_bf16 < 0.001, name
