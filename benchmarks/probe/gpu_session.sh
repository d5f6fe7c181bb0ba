export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 110 python3 -m benchmarks.train --model llama2-7b --layers 2 --rounds 3 --steps 3 --warmup 2 --variants compile,spmd --profile 30 > $OUT/train.log 2>&1
grep -E "^\| |round" $OUT/train.log
timeout 100 python3 -m benchmarks.decode --no-doc --layers 8 --batch 1 --new-tokens 64 --rounds 2 --warmup-rounds 3 --profile 30 --variants spmd torch.compile > $OUT/decode.log 2>&1
grep -A5 "┏" $OUT/decode.log
timeout 60 python3 -m pytest -m "gpu and not slow" -q -p no:cacheprovider tests/ir/test_custom_calls_attention.py tests/train/test_step_attention.py tests/runtime/test_kernels_fusion_gpu.py tests/runtime/test_weight_cache.py tests/generation > $OUT/gpu_tests.log 2>&1
tail -4 $OUT/gpu_tests.log
