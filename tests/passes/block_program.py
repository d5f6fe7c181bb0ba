# ruff: noqa: E501  (golden HLO text lines are long)
"""The block workload of benchmarks/workloads.py as the passes after windowed-einsum see it.

Shared by the golden tests of merge-dots and fuse-attention (and checked against the pipeline's
actual output by both).
"""

# The block of benchmarks/workloads.py on 2 devices after spmd-partition, simplify, cse and windowed-einsum
# (simplify composed the transposes of k: K^T is one transpose of the reshaped projection).
BLOCK_2DEV_PARTITIONED = """\
HloModule block, num_partitions=2, mesh={tp=2}, is_partitioned=true

%add.f32 (add.f32.lhs: f32[], add.f32.rhs: f32[]) -> f32[] {
  %add.f32.lhs = f32[] parameter(0)
  %add.f32.rhs = f32[] parameter(1)
  ROOT %add.f32.out = f32[] add(%add.f32.lhs, %add.f32.rhs)
}

ENTRY %main (x: f32[128,512], wq: f32[512,256], wk: f32[512,256], wv: f32[512,256], wo: f32[256,512], w1: f32[512,1024], w2: f32[1024,512]) -> f32[128,512] {
  %x = f32[128,512] parameter(0), sharding={replicated}
  %wq = f32[512,256] parameter(1), sharding={devices=[1,2]<=[2]}
  %wk = f32[512,256] parameter(2), sharding={devices=[1,2]<=[2]}
  %wv = f32[512,256] parameter(3), sharding={devices=[1,2]<=[2]}
  %wo = f32[256,512] parameter(4), sharding={devices=[2,1]<=[2]}
  %w1 = f32[512,1024] parameter(5), sharding={devices=[1,2]<=[2]}
  %w2 = f32[1024,512] parameter(6), sharding={devices=[2,1]<=[2]}
  %layer_norm = f32[128,512] custom-call(%x), custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}, sharding={replicated}
  %matmul = f32[128,256] dot(%layer_norm, %wq), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,2]<=[2]}
  %reshape = f32[128,4,64] reshape(%matmul), sharding={devices=[1,2,1]<=[2]}
  %transpose = f32[4,128,64] transpose(%reshape), dimensions={1,0,2}, sharding={devices=[2,1,1]<=[2]}
  %matmul_1 = f32[128,256] dot(%layer_norm, %wk), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,2]<=[2]}
  %reshape_1 = f32[128,4,64] reshape(%matmul_1), sharding={devices=[1,2,1]<=[2]}
  %matmul_2 = f32[128,256] dot(%layer_norm, %wv), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,2]<=[2]}
  %reshape_2 = f32[128,4,64] reshape(%matmul_2), sharding={devices=[1,2,1]<=[2]}
  %transpose_2 = f32[4,128,64] transpose(%reshape_2), dimensions={1,0,2}, sharding={devices=[2,1,1]<=[2]}
  %transpose_3 = f32[4,64,128] transpose(%reshape_1), dimensions={1,2,0}, sharding={devices=[2,1,1]<=[2]}
  %matmul_3 = f32[4,128,128] dot(%transpose, %transpose_3), lhs_batch_dims={0}, rhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_contracting_dims={1}, sharding={devices=[2,1,1]<=[2]}
  %div = f32[] constant(8.0), sharding={replicated}
  %div.1 = f32[4,128,128] broadcast(%div), dimensions={}, sharding={devices=[2,1,1]<=[2]}
  %div.2 = f32[4,128,128] divide(%matmul_3, %div.1), sharding={devices=[2,1,1]<=[2]}
  %softmax = f32[4,128,128] custom-call(%div.2), custom_call_target="softmax", backend_config={"dim":2}, sharding={devices=[2,1,1]<=[2]}
  %matmul_4 = f32[4,128,64] dot(%softmax, %transpose_2), lhs_batch_dims={0}, rhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_contracting_dims={1}, sharding={devices=[2,1,1]<=[2]}
  %transpose_4 = f32[128,4,64] transpose(%matmul_4), dimensions={1,0,2}, sharding={devices=[1,2,1]<=[2]}
  %reshape_3 = f32[128,256] reshape(%transpose_4), sharding={devices=[1,2]<=[2]}
  %matmul_5 = f32[128,512] dot(%reshape_3, %wo), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  %all-reduce = f32[128,512] all-reduce(%matmul_5), to_apply=%add.f32, replica_groups={{0,1}}, sharding={replicated}
  %add = f32[128,512] add(%x, %all-reduce), sharding={replicated}
  %layer_norm_1 = f32[128,512] custom-call(%add), custom_call_target="layer-norm", backend_config={"normalized_ndim":1,"eps":1e-05}, sharding={replicated}
  %matmul_6 = f32[128,1024] dot(%layer_norm_1, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,2]<=[2]}
  %gelu = f32[128,1024] custom-call(%matmul_6), custom_call_target="gelu", backend_config={"approximate":"none"}, sharding={devices=[1,2]<=[2]}
  %matmul_7 = f32[128,512] dot(%gelu, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[1,1,2]<=[2] last_tile_dims={partial}}
  %all-reduce.1 = f32[128,512] all-reduce(%matmul_7), to_apply=%add.f32, replica_groups={{0,1}}, sharding={replicated}
  ROOT %add_1 = f32[128,512] add(%add, %all-reduce.1), sharding={replicated}
}
"""
