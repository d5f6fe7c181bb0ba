"""Programs shared by the multi-output-fusion tests (pass, kernels on CPU and GPU, buffer assignment).

Only the standard library here: GPU test modules import this, and must be collectable with only
torch and pytest installed.
"""
# ruff: noqa: E501  (HLO text lines are long)

# An AdamW update of one parameter after fuse-elementwise: m' and v' are outputs of the step and
# read by the parameter update (producer-consumer), and all three read the gradient (siblings).
ADAMW = """HloModule m, num_partitions=1, mesh={dp=1}, is_partitioned=true

%fused_m (g0: f32[8,4], m0: f32[8,4]) -> f32[8,4] {
  %g0 = f32[8,4] parameter(0)
  %m0 = f32[8,4] parameter(1)
  %d0 = f32[8,4] subtract(%g0, %m0)
  %c0 = f32[] constant(0.1)
  %b0 = f32[8,4] broadcast(%c0), dimensions={}
  %s0 = f32[8,4] multiply(%d0, %b0)
  ROOT %mn = f32[8,4] add(%m0, %s0)
}

%fused_v (g1: f32[8,4], v1: f32[8,4]) -> f32[8,4] {
  %g1 = f32[8,4] parameter(0)
  %v1 = f32[8,4] parameter(1)
  %c1 = f32[] constant(0.999)
  %b1 = f32[8,4] broadcast(%c1), dimensions={}
  %a1 = f32[8,4] multiply(%v1, %b1)
  %q1 = f32[8,4] multiply(%g1, %g1)
  ROOT %vn = f32[8,4] add(%a1, %q1)
}

%fused_p (p2: f32[8,4], m2: f32[8,4], v2: f32[8,4]) -> f32[8,4] {
  %p2 = f32[8,4] parameter(0)
  %m2 = f32[8,4] parameter(1)
  %v2 = f32[8,4] parameter(2)
  %r2 = f32[8,4] exponential(%v2)
  %c2 = f32[] constant(1e-08)
  %b2 = f32[8,4] broadcast(%c2), dimensions={}
  %e2 = f32[8,4] add(%r2, %b2)
  %u2 = f32[8,4] divide(%m2, %e2)
  ROOT %pn = f32[8,4] subtract(%p2, %u2)
}

ENTRY %main (p: f32[8,4], g: f32[8,4], m: f32[8,4], v: f32[8,4]) -> (f32[8,4], f32[8,4], f32[8,4]) {
  %p = f32[8,4] parameter(0)
  %g = f32[8,4] parameter(1)
  %m = f32[8,4] parameter(2)
  %v = f32[8,4] parameter(3)
  %fm = f32[8,4] fusion(%g, %m), kind=kLoop, calls=%fused_m
  %fv = f32[8,4] fusion(%g, %v), kind=kLoop, calls=%fused_v
  %fp = f32[8,4] fusion(%p, %fm, %fv), kind=kLoop, calls=%fused_p
  ROOT %out = (f32[8,4], f32[8,4], f32[8,4]) tuple(%fp, %fm, %fv)
}
"""
