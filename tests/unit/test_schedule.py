"""The schedule reader of jaxcolossal.aot.gpu_schedule on hand-written scheduled HLO: async pairs, the
matmuls between start and done, hosts crossed, and the timeline's exposed time."""

import pytest

from jaxcolossal.aot import gpu_schedule as schedule

HLO = """HloModule m, is_scheduled=true

%fused_dot (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %d = bf16[1024,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[1024,1024], g: f32[8192,1024]) -> f32[1024,1024] {
  %a = bf16[1024,1024]{1,0} parameter(0)
  %g = f32[8192,1024]{1,0} parameter(1)
  %ag = (bf16[128,1024]{1,0}, bf16[1024,1024]{1,0}) all-gather-start(%a), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %rs = ((f32[8192,1024]{1,0}), f32[1024,1024]{1,0}) reduce-scatter-start(%g), channel_id=2, replica_groups=[2,8]<=[16], dimensions={0}
  %m1 = bf16[1024,1024]{1,0} fusion(%a, %a), kind=kCustom, calls=%fused_dot
  %agd = bf16[1024,1024]{1,0} all-gather-done(%ag)
  %rsd = f32[1024,1024]{1,0} reduce-scatter-done(%rs)
  %ar = f32[1024,1024]{1,0} all-reduce(%rsd), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %out = f32[1024,1024]{1,0} add(%ar, %ar)
}
"""


def test_pairs_their_bytes_windows_and_hosts():
    pairs = {p.name: p for p in schedule.async_pairs(HLO, devices_per_host=8)}
    ag, rs, ar = pairs["ag"], pairs["rs"], pairs["ar"]
    assert (ag.kind, ag.group, ag.cross_host, ag.asynchronous) == ("all-gather", 8, False, True)
    assert ag.sent == 7 / 8 * 1024 * 1024 * 2  # its result, 2 MiB of bf16
    assert ag.flops_between == 2 * 1024**3 and ag.between == 2  # the reduce-scatter start and the fused matmul
    assert (rs.kind, rs.group, rs.cross_host) == ("reduce-scatter", 8, False)
    assert rs.sent == 7 * 1024 * 1024 * 4
    assert not ar.asynchronous and ar.sent == 2 * 7 / 8 * 1024 * 1024 * 4
    assert schedule.crosses_hosts("x = all-gather(y), replica_groups=[1,16]<=[16]", 8)
    assert schedule.crosses_hosts("x = all-gather(y), replica_groups=[8,2]<=[2,8]T(1,0)", 8)
    assert not schedule.crosses_hosts("x = all-gather(y), replica_groups=mesh['a'=2,'b'=8] {'b'}", 8)
    assert schedule.crosses_hosts("x = all-gather(y), replica_groups=mesh['a'=2,'b'=8] {'a'}", 8)


def test_one_collective_stream_and_the_stalls_it_causes():
    """Both transfers start before the matmul; the stream runs them one after the other, so the
    matmul hides the gather and part of the reduce-scatter; the all-reduce is all exposed."""
    peak, bw = 2 * 1024**3 / 1e-3, 1e9  # the matmul takes 1 ms; 1 GB/s
    e = schedule.exposure(HLO, peak, bw, bw)
    ag_t, rs_t, ar_t = 7 / 8 * 2**21 / bw, 7 * 2**22 / bw, 2 * 7 / 8 * 2**22 / bw
    k = e.by_kind
    assert k["all-gather"]["time_s"] == pytest.approx(ag_t) and k["all-gather"]["exposed_s"] == pytest.approx(ag_t - 1e-3)
    assert k["reduce-scatter"]["exposed_s"] == pytest.approx(rs_t)  # queued behind the gather, past the matmul
    assert k["all-reduce"]["exposed_s"] == pytest.approx(ar_t) and k["all-reduce"]["async"] == 0
    assert e.hidden_s == pytest.approx(1e-3)
    assert e.hidden_fraction == pytest.approx(1e-3 / (ag_t + rs_t + ar_t))


def test_custom_calls_are_counted_per_step():
    text = HLO.replace("%m1 = bf16[1024,1024]{1,0} fusion(%a, %a), kind=kCustom, calls=%fused_dot",
                       '%m1 = bf16[1024,1024]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"')
    assert schedule.custom_calls(text) == {"__gpu$xla.gpu.triton": 1}
