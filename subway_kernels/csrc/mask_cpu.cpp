// The grammar's token mask on the CPU: disallowed tokens of some rows of the logits to -inf.
//
// xgrammar packs a row's allowed tokens as bits (bit b of int32 word w: token 32 w + b).
// Its own CPU kernel tests every bit; here a word with every bit set (all 32 allowed) is
// skipped and a word of zeros (none allowed: most of a JSON grammar's vocabulary) is one
// fill, so a step's mask costs about a pass over the masked rows.
#include <ATen/ATen.h>
#include <torch/types.h>  // not torch/extension.h: 2.5x faster to compile; bindings are in paged_decode_cpu.cpp
#include <ATen/Parallel.h>
#include <algorithm>
#include <limits>
#include <vector>

void apply_token_bitmask(torch::Tensor scores, torch::Tensor bitmask, std::vector<int64_t> rows) {
  TORCH_CHECK(scores.device().is_cpu() && bitmask.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == torch::kFloat32 &&
                  scores.is_contiguous(),
              "scores: a contiguous float32 [rows, vocab] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 &&
                  bitmask.is_contiguous(),
              "bitmask: a contiguous int32 [rows, words] tensor");
  const int64_t n = scores.size(0), vocab = scores.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "bitmask words do not cover the vocabulary");
  for (int64_t r : rows) {
    TORCH_CHECK(r >= 0 && r < n && r < bitmask.size(0), "a row outside scores or bitmask");
  }
  float* s = scores.data_ptr<float>();
  const uint32_t* bm = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t k = static_cast<int64_t>(rows.size());
  at::parallel_for(0, k, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = rows[i];
      float* row = s + r * vocab;
      const uint32_t* bits = bm + r * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = bits[w];
        if (word == 0xffffffffu) continue;
        float* out = row + w * 32;
        const int64_t len = std::min<int64_t>(32, vocab - w * 32);
        if (word == 0) {
          std::fill(out, out + len, ninf);
          continue;
        }
        for (int64_t b = 0; b < len; ++b) {  // branch-free: the compiler vectorises it
          out[b] = ((word >> b) & 1u) ? out[b] : ninf;
        }
      }
    }
  });
}
