// Checks shared by the paged decode kernels (paged_attention.cpp, mla_attention.cpp): the
// block tables and lengths they read through, so a bad table is an error naming the entry,
// never a wild read.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace servelm_cpu {

// block_tables [>= B, max_blocks] int64, seq_lens [B] int64, every block a sequence reads
// inside a pool of num_slots slots in blocks of block_size. op names the kernel in errors.
inline void check_paged_tables(const char* op, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, int64_t num_seqs, int64_t num_slots,
                               int64_t block_size) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  seq_lens.is_contiguous() && seq_lens.numel() == num_seqs &&
                  block_tables.size(0) >= num_seqs,
              op, ": block_tables [>=B, max_blocks] and seq_lens [B] must be int64");
  TORCH_CHECK(block_size > 0 && num_slots % block_size == 0, op, ": bad block_size");
  const int64_t num_blocks = num_slots / block_size;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    TORCH_CHECK(lens[b] >= 1 && used <= block_tables.size(1), op, ": seq_lens[", b, "]=", lens[b],
                " outside 1..", block_tables.size(1) * block_size);
    const int64_t* row = block_tables.data_ptr<int64_t>() + b * block_tables.stride(0);
    for (int64_t j = 0; j < used; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, op, ": block_tables[", b, "][", j, "]=",
                  row[j], " outside the cache's ", num_blocks, " blocks");
  }
}

}  // namespace servelm_cpu
