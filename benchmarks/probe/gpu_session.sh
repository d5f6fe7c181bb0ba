export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 130 python3 -m benchmarks.decode --no-doc --layers 8 --batch 1 8 --new-tokens 64 --rounds 3 --warmup-rounds 3 --profile 25 --variants spmd torch.compile > $OUT/decode.log 2>&1
grep -A8 "┏" $OUT/decode.log
timeout 100 python3 -m benchmarks.one_gpu --out $OUT --rows llama2-2l-bf16-1x1,llama2-2l-bf16-1x128,minilm-bf16-8x128 --variants compile,compile-ro,spmd --rounds 3 --reps 10 > $OUT/onegpu.log 2>&1
grep -A8 "┏" $OUT/onegpu.log
timeout 100 python3 -m benchmarks.train --model llama2-7b --layers 2 --rounds 3 --steps 3 --warmup 2 --variants compile,spmd --profile 40 > $OUT/train.log 2>&1
grep -E "^\| |round" $OUT/train.log
timeout 150 python3 -m pytest -m "gpu and not slow" -q -p no:cacheprovider tests > $OUT/gpu_tests.log 2>&1
tail -5 $OUT/gpu_tests.log
