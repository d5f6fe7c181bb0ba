"""Kernel classification of benchmarks.gpu_kernels and the dispatch benchmark's kernel note."""

from benchmarks.dispatch import _kernel_note
from benchmarks.gpu_kernels import kind


def test_kernel_classes():
    assert kind("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x64x8") == "matmul"
    assert kind("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nn_align1>") == "matmul"
    assert kind("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "matmul"
    assert kind("fmha_cutlassF_f32_aligned_64x64_rf_sm80") == "matmul"
    assert kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "collective"
    assert kind("Memcpy PtoP (Device -> Device)") == "collective"
    assert kind("all_reduce_1_0_fusion_1") == "collective"  # XLA's own all-reduce kernel
    assert kind("gemm_fusion_dot_14") == "matmul"  # XLA's Triton GEMM
    assert kind("triton_softmax_22") == "other"
    assert kind("triton_per_fused_add_expand_native_layer_norm_view_0") == "other"
    assert kind("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") == "other"


def test_kernel_note_picks_the_busiest_device():
    devs = [{"device": 0, "kernels": 20, "busy_us": 80.0, "matmul_us": 40.0, "collective_us": 20.0, "other_us": 20.0},
            {"device": 1, "kernels": 20, "busy_us": 90.0, "matmul_us": 41.0, "collective_us": 29.0, "other_us": 20.0}]
    note = _kernel_note({"source": "spmd-graphs", "workload": "block", "devices": devs})
    assert note == ("spmd-graphs/block: GPU kernels per call on cuda:1: 20 kernels, busy 90.0 µs = GEMM/attention "
                    "41.0 + collectives 29.0 + other 20.0")
    assert "n/a" in _kernel_note({"source": "s", "workload": "w", "devices": "RuntimeError: no CUPTI"})


def test_kernel_note_flags_tf32_gemms():
    dev = {"device": 0, "kernels": 2, "busy_us": 20.0, "matmul_us": 10.0, "collective_us": 0.0, "other_us": 10.0}
    f32 = {**dev, "top": [["sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x64x8_ffma", 1.0, 10.0]]}
    tf32 = {**dev, "top": [["sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize64x128x32", 1.0, 10.0]]}
    assert "TF32" not in _kernel_note({"source": "jax", "workload": "mlp", "devices": [f32]})
    assert _kernel_note({"source": "jax", "workload": "mlp", "devices": [tf32]}).endswith("; TF32 GEMMs among them")
